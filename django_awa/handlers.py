"""Handler threads: as many per queue as its concurrency, running the attempts claimed.

Each takes attempts from its queue's inbox, runs them (``execute``) and puts
the result on the state's results queue for the completer; an ``atomic=True``
handler's attempt is finalized in its own transaction here instead. The main
thread keeps the pool at full strength (``HandlerPool.tend``): a handler still
running ``stuck_grace`` after its attempt was lost (cancelled, or rescued
past its deadline) is abandoned and its thread replaced, at most
``concurrency`` abandoned threads per queue.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
from dataclasses import dataclass

from django.db import connections

from .completer import notify_freed
from .execute import (
    Attempt,
    AttemptResult,
    from_exception,
    resolve_handler,
    run_attempt,
)
from .finalize import run_atomic_attempt
from .kinds import JobArgs, WorkerSpec
from .models import Job
from .state import DB_ERRORS, QueueRunner, WorkerState, log_context, reset_connection

logger = logging.getLogger(__name__)

# A handler whose attempt was lost has max(2 * HEARTBEAT_INTERVAL, this) seconds,
# from when the worker learns of it, to return before its thread is replaced.
STUCK_GRACE_MIN = 5.0

_thread = threading.local()


def close_broken_connections() -> None:
    """Close this thread's connections that a handler left unusable.

    Not ``close_old_connections()``: with the default CONN_MAX_AGE of 0 it
    would reconnect after every job. It runs after every job, so it keeps the
    thread's connection objects at hand: ``connections.all()`` goes through
    asgiref's ``Local`` for each alias, which costs more than the rest of a
    quick job's bookkeeping.
    """
    wrappers = getattr(_thread, "connections", None)
    if wrappers is None:
        wrappers = _thread.connections = [connections[alias] for alias in connections]
    for conn in wrappers:
        if conn.errors_occurred and conn.connection is not None and not conn.is_usable():
            conn.close()


def _deadline_seconds(job: Job) -> float | None:
    """The attempt's deadline as a duration, both ends read on the database clock at claim."""
    if job.deadline_at is None or job.attempted_at is None:
        return None
    return (job.deadline_at - job.attempted_at).total_seconds()


@dataclass(slots=True, eq=False)
class HandlerThread:
    """One handler thread of a queue and the attempt it runs.

    ``attempt`` and the fields after it are guarded by ``WorkerState.running_lock``.
    """

    runner: QueueRunner
    name: str
    thread: threading.Thread | None = None
    attempt: Attempt | None = None  # the attempt whose handler runs now
    started: float = 0.0  # time.monotonic() when that handler started
    lost_at: float | None = None  # when the main thread first saw the attempt lost
    overrun_logged: bool = False  # its run past the deadline was logged
    bound_logged: bool = False  # that it could not be replaced (the bound) was logged
    abandoned: bool = False  # replaced: it exits when its handler returns


class HandlerPool:
    """Every queue's handler threads: ``run(handler)`` is a thread's body.

    ``run_once(runner)`` runs one attempt of ``runner``'s inbox in the calling
    thread, for tests. ``spawn`` and ``tend`` belong to the main thread.
    """

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        # Bound once: the per-job path reads them without going through the state.
        self.results = state.results
        self.running = state.running
        self.waiting = state.waiting
        self.running_lock = state.running_lock
        self.forget = state.forget
        # Handler threads taking attempts from their queue's inbox, and those
        # abandoned in a handler that outlived its attempt (see tend).
        self.handlers: list[HandlerThread] = []
        self.abandoned: list[HandlerThread] = []
        self.spawned: dict[str, int] = {}  # handler threads started per queue, for their names
        self.stuck_grace = max(2 * state.conf.heartbeat_interval, STUCK_GRACE_MIN)

    def start(self) -> None:
        """Start every queue's handler threads, ``concurrency`` of each."""
        for runner in self.state.queues.values():
            for _ in range(runner.concurrency):
                self.spawn(runner)

    def spawn(self, runner: QueueRunner) -> HandlerThread:
        """Start one more handler thread for ``runner``'s queue (main thread only)."""
        number = self.spawned.get(runner.name, 0)
        self.spawned[runner.name] = number + 1
        handler = HandlerThread(runner=runner, name=f"awa-{runner.name}_{number}")
        with self.running_lock:
            self.handlers.append(handler)
        handler.thread = self.state.start(lambda: self.run(handler), handler.name)
        return handler

    def run(self, handler: HandlerThread) -> None:
        """A handler thread: run the queue's attempts until told to stop (``None``).

        An abandoned thread takes no other attempt: its place went to another.
        """
        inbox = handler.runner.inbox
        while not handler.abandoned and (attempt := inbox.get()) is not None:
            self.execute(handler, attempt)
        if handler.abandoned:
            logger.info(
                "abandoned handler thread %s returned after %.1fs; it exits",
                handler.name,
                time.monotonic() - handler.started,
            )

    def run_once(self, runner: QueueRunner, timeout: float | None = None) -> bool:
        """Run the next attempt of ``runner``'s inbox in this thread; False if none came.

        Waits up to ``timeout`` seconds for one (``None``: for ever).
        """
        try:
            attempt = runner.inbox.get(timeout=timeout)
        except queue_module.Empty:
            return False
        if attempt is None:
            return False
        handler = HandlerThread(runner=runner, name=threading.current_thread().name)
        self.execute(handler, attempt)
        return True

    def execute(self, handler: HandlerThread, attempt: Attempt) -> None:
        """Run one claimed attempt; its place on the queue is freed however it ends.

        Freed once: by this thread, or when it was abandoned by ``tend``.
        """
        runner = handler.runner
        try:
            with self.running_lock:
                if attempt.job.id not in self.waiting:
                    return  # given back at shutdown before it started
                self.waiting.discard(attempt.job.id)
                handler.attempt = attempt
                handler.started = time.monotonic()
                handler.lost_at = None
                handler.overrun_logged = handler.bound_logged = False
            if attempt.cancelled.is_set():
                # Cancelled or rescued while it waited: the row is no longer this attempt's.
                self.forget(attempt.job)
                return
            started = time.perf_counter()
            self._run(attempt)
            if not handler.abandoned:
                runner.observe(time.perf_counter() - started)
        finally:
            with self.running_lock:
                handler.attempt = None
                abandoned = handler.abandoned
            if not abandoned:
                runner.finished()

    def _run(self, attempt: Attempt) -> None:
        """Run the attempt; whatever happens, its result goes to the completer (or is written)."""
        try:
            resolved = resolve_handler(attempt.job)
            if isinstance(resolved, AttemptResult):
                self.results.put(resolved)
                return
            spec, args = resolved
            if spec.atomic:
                self._run_atomic(attempt, spec, args)
                return
            self.results.put(run_attempt(attempt, self._mark_progress, resolved))
        except BaseException as exc:  # no signal reaches a handler thread
            # Whatever reaches here came from running the job (the handler
            # boundary catches the handler's own errors): record it, so the job
            # never stays running unseen until its heartbeat goes stale.
            logger.exception(
                "worker error running job %s kind=%s attempt=%s",
                attempt.job.id, attempt.job.kind, attempt.job.attempt,
                extra=log_context(attempt.job, self.state.name),
            )  # fmt: skip
            self.results.put(from_exception(attempt.job, exc, during="worker error"))
        finally:
            close_broken_connections()

    def _run_atomic(self, attempt: Attempt, spec: WorkerSpec, args: JobArgs) -> None:
        try:
            result = run_atomic_attempt(attempt, spec, args)
            if result is not None:
                notify_freed(self.state, [result])
        except DB_ERRORS as exc:
            # The transaction rolled back, or its commit's acknowledgement was
            # lost: the completer records the attempt as failed. Its write is
            # guarded by run_lease and state, so after a commit that did land
            # it changes nothing.
            logger.exception(
                "atomic job %s kind=%s could not be finalized",
                attempt.job.id, attempt.job.kind, extra=log_context(attempt.job, self.state.name),
            )  # fmt: skip
            reset_connection()
            self.results.put(from_exception(attempt.job, exc, during="could not be finalized"))
            return
        self.forget(attempt.job)

    @staticmethod
    def _mark_progress(attempt: Attempt) -> None:
        """Progress is stored by the heartbeat thread, which polls the dirty flag."""

    # -- the main thread's ---------------------------------------------------------

    def tend(self) -> None:
        """Keep every queue's handler threads at full strength (main thread, twice a second).

        A handler may ignore cancellation and its deadline. Once its attempt is
        lost (cancelled, or rescued by maintenance for a stale heartbeat or a
        passed deadline: the heartbeat thread sets ``attempt.cancelled``) and it
        has not returned within ``stuck_grace``, its thread is abandoned and a
        new one takes its place on the queue. The abandoned thread exits when
        its handler returns; its late result changes nothing (guarded by
        run_lease). At most ``concurrency`` abandoned threads per queue are
        alive at once: past that the stuck thread keeps its place, logged at
        ERROR. A handler thread that died is replaced too.
        """
        if self.state.stopping.is_set():
            return
        now = time.monotonic()
        overdue: list[tuple[HandlerThread, Attempt, float]] = []
        stuck: list[tuple[HandlerThread, Attempt]] = []
        dead: list[HandlerThread] = []
        with self.running_lock:
            self.abandoned = [h for h in self.abandoned if h.thread and h.thread.is_alive()]
            for handler in self.handlers:
                attempt = handler.attempt
                if handler.thread is not None and not handler.thread.is_alive():
                    dead.append(handler)
                elif attempt is None:
                    continue
                elif attempt.cancelled.is_set() or self.running.get(attempt.job.id) is not attempt:
                    # Lost; or displaced by a newer attempt of its job, claimed
                    # here after a rescue the heartbeat had not seen yet.
                    attempt.cancelled.set()
                    if handler.lost_at is None:
                        handler.lost_at = now
                    elif now - handler.lost_at >= self.stuck_grace:
                        stuck.append((handler, attempt))
                elif not handler.overrun_logged:
                    deadline = _deadline_seconds(attempt.job)
                    if deadline is not None and now - handler.started > deadline:
                        handler.overrun_logged = True
                        overdue.append((handler, attempt, deadline))
            for handler in dead:
                self.handlers.remove(handler)
        for handler, attempt, deadline in overdue:
            job = attempt.job
            logger.warning(
                "job %s kind=%s attempt=%s has run %.1fs in thread %s, past its deadline of "
                "%.1fs; maintenance rescues it, and the thread is replaced if it does not return",
                job.id, job.kind, job.attempt, now - handler.started, handler.name, deadline,
                extra=log_context(job, self.state.name),
            )  # fmt: skip
        for handler, attempt in stuck:
            self.abandon(handler, attempt, now)
        for handler in dead:
            logger.error("handler thread %s died; starting another", handler.name)
            self.spawn(handler.runner)

    def abandon(self, handler: HandlerThread, attempt: Attempt, now: float) -> None:
        """Give ``handler``'s place on its queue to a new thread, within the bound."""
        runner = handler.runner
        job = attempt.job
        with self.running_lock:
            if handler.attempt is not attempt:
                return  # it returned meanwhile
            alive = sum(1 for h in self.abandoned if h.runner is runner)
            if alive >= runner.concurrency:
                log_bound, handler.bound_logged = not handler.bound_logged, True
            else:
                log_bound = False
                handler.abandoned = True
                self.handlers.remove(handler)
                self.abandoned.append(handler)
                # No longer held: not heartbeated, not waited for or given back at shutdown.
                if self.running.get(job.id) is attempt:
                    del self.running[job.id]
        if not handler.abandoned:
            if log_bound:
                logger.error(
                    "handler thread %s is stuck in job %s kind=%s: its attempt was lost %.1fs "
                    "ago and the handler has run %.1fs; queue %s already has %s abandoned "
                    "handler threads, the most it may (its concurrency), so this one keeps its "
                    "place and the queue runs short until a stuck handler returns",
                    handler.name, job.id, job.kind, now - (handler.lost_at or now),
                    now - handler.started, runner.name, alive,
                    extra=log_context(job, self.state.name),
                )  # fmt: skip
            return
        replacement = self.spawn(runner)
        runner.finished()  # its place on the queue goes to the replacement
        logger.warning(
            "handler thread %s is stuck in job %s kind=%s attempt=%s: its attempt was lost "
            "(cancelled or rescued) %.1fs ago and the handler, running for %.1fs, has not "
            "returned; abandoned (%s of at most %s on queue %s), %s takes its place",
            handler.name, job.id, job.kind, job.attempt, now - (handler.lost_at or now),
            now - handler.started, alive + 1, runner.concurrency, runner.name, replacement.name,
            extra=log_context(job, self.state.name),
        )  # fmt: skip
