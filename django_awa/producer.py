"""The producer: one per queue, claiming jobs while the queue has room.

It sleeps on the queue's wake-up event (set by the listener on NOTIFY, by
maintenance when it makes jobs due, at shutdown) or for the poll interval.
While handlers are quick it claims ahead what they will start within
``PREFETCH_WINDOW``, so they never wait for a claim's round trip; slow
handlers get no prefetch. Claimed attempts go to the queue's inbox, where its
handler threads (``handlers.py``) take them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from django.db import connections

from . import db, sql
from .conf import awa_settings
from .execute import Attempt
from .kinds import registry
from .models import Job, jobs_from_rows
from .state import DB_ERRORS, QueueRunner, WorkerState, log_context

logger = logging.getLogger(__name__)

# How long a busy queue's producer may wait for more room to claim together.
GATHER_SECONDS = 0.005


def claim(queue: str, limit: int, alias: str) -> list[Job]:
    """Claim up to ``limit`` runnable jobs of ``queue``, in priority, run_at, id order.

    Each claimed row is ``running`` with a new ``run_lease``: the attempt's
    guard for every later write. Commits at once (autocommit): a claim must be
    visible to other workers' SKIP LOCKED and to maintenance.
    """
    conf = awa_settings()
    with db.cursor(alias) as cursor:
        cursor.execute(
            sql.CLAIM,
            {
                "queue": queue,
                "limit": limit,
                "deadlines": registry.deadlines_json(),
                "default_deadline": conf.default_deadline,
            },
        )
        rows = cursor.fetchall()
    jobs = jobs_from_rows(rows, alias)
    jobs.sort(key=lambda j: (j.priority, j.run_at, j.id))
    return jobs


class SharedConnection:
    """One Django connection that the producers of a worker's queues take turns on.

    Without a pool, each producer would keep a connection of its own for one
    statement now and then. A claim is one short autocommit statement, so
    they share one: each claim, and each reconnect after an error, holds
    ``lock``. Not for the other threads: the heartbeat must not wait behind
    anything (a late heartbeat gets attempts rescued), nor the completer.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.lock = threading.Lock()
        self.wrapper: Any = None  # the shared DatabaseWrapper, made by the first producer
        self.users = 0

    def enter(self) -> None:
        """Make the shared connection this thread's connection of the alias."""
        with self.lock:
            if self.wrapper is None:
                self.wrapper = connections.create_connection(self.alias)
            self.wrapper.inc_thread_sharing()
            self.users += 1
        connections[self.alias] = self.wrapper

    def leave(self) -> None:
        """Give this thread a connection of its own again (unopened); the last one out
        closes the shared one."""
        connections[self.alias] = connections.create_connection(self.alias)
        with self.lock:
            self.users -= 1
            if self.users == 0:
                with contextlib.suppress(Exception):
                    self.wrapper.close()
            self.wrapper.dec_thread_sharing()


class Producer:
    """The claim loop of one queue (``run``, a thread body); ``run_once`` claims one batch.

    With ``shared``, it claims on the connection the worker's producers share.
    """

    def __init__(
        self, state: WorkerState, runner: QueueRunner, shared: SharedConnection | None = None
    ) -> None:
        self.state = state
        self.runner = runner
        self.shared = shared
        self.busy = False  # the last claim took all it asked for: more jobs are waiting

    def _turn(self) -> contextlib.AbstractContextManager[Any]:
        """Hold the shared connection (a no-op without one)."""
        return self.shared.lock if self.shared is not None else contextlib.nullcontext()

    def run(self) -> None:
        if self.shared is None:
            self._run()
            return
        self.shared.enter()
        try:
            self._run()
        finally:
            self.shared.leave()

    def _run(self) -> None:
        state, runner = self.state, self.runner
        reconnect = db.Reconnect(f"producer of queue {runner.name}", state.alias, state.stopping)
        while not state.stopping.is_set():
            if state.results.qsize() > state.backlog_limit:
                state.stopping.wait(0.01)
                continue
            try:
                jobs = self.run_once()
                db.release(state.alias)  # pooled: held only for the claim
            except DB_ERRORS as exc:
                reconnect.failed(exc, closing=self._turn())
                continue
            if jobs is None:
                continue  # no room yet
            reconnect.succeeded()
            if not self.busy:
                runner.wake.wait(state.conf.poll_interval)

    def run_once(self) -> list[Job] | None:
        """Claim one batch, as much as the queue has room for, and put it in the inbox.

        Returns the jobs claimed, or ``None`` when the queue had no room
        within half a second. A database error is raised, the room given back.
        """
        state, runner = self.state, self.runner
        want = self.reserve(self.busy)
        if not want:
            return None
        runner.wake.clear()
        try:
            with self._turn():
                jobs = claim(runner.name, want, state.alias)
        except BaseException:
            self.unreserve(want)
            raise
        self.busy = len(jobs) == want
        self.unreserve(want - len(jobs))
        debug = logger.isEnabledFor(logging.DEBUG)
        alias, running, waiting, lock, inbox = (
            state.alias, state.running, state.waiting, state.running_lock, runner.inbox
        )  # fmt: skip
        for job in jobs:
            attempt = Attempt(job=job, alias=alias)
            with lock:
                running[job.id] = attempt
                waiting.add(job.id)
            if debug:
                logger.debug("claimed job %s kind=%s attempt=%s", job.id, job.kind,
                             job.attempt, extra=log_context(job, state.name))  # fmt: skip
            inbox.put(attempt)
        return jobs

    def reserve(self, busy: bool) -> int:
        """Wait for room on the queue and reserve it; return how many jobs to claim.

        Room is the concurrency plus the prefetch. While a queue is busy,
        handlers make room one job at a time: claiming at the first free place
        would mean one claim statement (and one commit) per job. Waiting up to
        ``GATHER_SECONDS`` for half the room keeps batches large; an idle queue
        (not busy) claims at once, so pickup latency does not suffer.
        """
        runner = self.runner
        most = self.state.conf.claim_batch_size
        capacity = runner.concurrency + runner.prefetch(self.state.conf.prefetch_window, most)
        with runner.room:
            if runner.held >= capacity and not runner.room.wait(0.5):
                return 0
            if busy:
                runner.room.wait_for(
                    lambda: capacity - runner.held >= min(most, capacity) // 2, GATHER_SECONDS
                )
            want = max(0, min(most, capacity - runner.held))
            runner.held += want
        return want

    def unreserve(self, n: int) -> None:
        """Give back ``n`` reserved places the claim did not fill."""
        if n:
            runner = self.runner
            with runner.room:
                runner.held -= n
                runner.room.notify()
