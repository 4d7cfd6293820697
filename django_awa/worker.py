"""The worker process: claim loops, handler threads, the completer, heartbeats.

Threads, each with its own database connection:

* one producer per queue claims jobs while the queue has room and sleeps on
  a wake-up event (LISTEN/NOTIFY) or the poll interval;
* handler threads, as many per queue as its concurrency, run handlers. While
  handlers are quick, the producer claims ahead what they will start within
  ``PREFETCH_WINDOW``, so they never wait for a claim's round trip; slow
  handlers get no prefetch. The main thread keeps the pool at full strength:
  a handler still running ``stuck_grace`` after its attempt was lost
  (cancelled, or rescued past its deadline) is abandoned and its thread
  replaced, at most ``concurrency`` abandoned threads per queue (see
  ``_tend_handlers``);
* the completer writes results in batches (``finalize``);
* the listener holds a LISTEN connection and wakes producers;
* the lifecycle thread heartbeats running attempts and stores progress;
* the maintenance thread competes for leadership and runs maintenance.

SIGTERM/SIGINT stop claiming and give back at once the prefetched jobs no
handler started (no attempt used); running attempts get ``SHUTDOWN_TIMEOUT``
to finish; what is left is given back as an interrupted attempt (``available``
again, or ``failed`` on the last attempt, with its follow-ups) before exit.
A second signal skips the wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_module
import selectors
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg
from django.db import DatabaseError, InterfaceError, connections

from . import db, sql
from .claim import claim
from .conf import AwaSettings, awa_settings
from .execute import (
    Attempt,
    AttemptResult,
    errored,
    from_exception,
    resolve_handler,
    run_atomic_attempt,
    run_attempt,
    write_progress,
)
from .finalize import finalize
from .kinds import JobArgs, WorkerSpec
from .models import Job, JobState

logger = logging.getLogger(__name__)

NOTIFY_CHANNEL = "awa_job"
CANCEL_CHANNEL = "awa_cancel"
_DB_ERRORS = (DatabaseError, InterfaceError, psycopg.Error)
# How long a busy queue's producer may wait for more room to claim together.
GATHER_SECONDS = 0.005
# Most results the completer writes in one transaction. With follow-ups each
# batch pays a BEGIN, a savepoint, a COPY, a NOTIFY and a COMMIT: 1,000
# drained jobs with follow-ups about 7% faster than 500 here.
FINALIZE_BATCH_SIZE = 1000
# Seconds before writing again an outcome whose row another session held locked.
LOCKED_RETRY = 0.5
INTERRUPTED = "interrupted: the worker shut down before the attempt finished"
# A handler whose attempt was lost has max(2 * HEARTBEAT_INTERVAL, this) seconds,
# from when the worker learns of it, to return before its thread is replaced.
STUCK_GRACE_MIN = 5.0
_WAKE = 0  # not a signal: stop() wakes the main thread with it


def log_context(job: Job, worker: str = "") -> dict[str, Any]:
    return {
        "job_id": job.id,
        "kind": job.kind,
        "queue": job.queue,
        "attempt": job.attempt,
        "worker": worker,
    }


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


def listen_params(alias: str) -> dict[str, Any]:
    """libpq parameters of Django connection ``alias``, for a dedicated psycopg connection."""
    params = connections[alias].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "pool"):
        params.pop(key, None)
    return params


class Backoff:
    """Exponential backoff for reconnecting: 0.1 s doubling to 5 s."""

    def __init__(self) -> None:
        self.delay = 0.1

    def reset(self) -> None:
        self.delay = 0.1

    def wait(self, stop: threading.Event) -> None:
        stop.wait(self.delay)
        self.delay = min(self.delay * 2, 5.0)


@dataclass(slots=True)
class QueueRunner:
    name: str
    concurrency: int
    inbox: queue_module.SimpleQueue[Attempt | None]
    wake: threading.Event
    room: threading.Condition = field(default_factory=threading.Condition)
    held: int = 0  # claimed and not finished: running, or prefetched and waiting
    run_time: float | None = None  # moving average of handler run time, seconds

    def prefetch(self, window: float | None, most: int) -> int:
        """How many jobs beyond ``concurrency`` to hold: what starts within ``window``.

        At most two claims' worth: handlers work through one batch while the
        next claim is under way. With one, they ran dry during each claim.
        """
        if not window or self.run_time is None:
            return 0
        return min(2 * most, int(self.concurrency * window / max(self.run_time, 1e-6)))

    def observe(self, seconds: float) -> None:
        previous = self.run_time
        self.run_time = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def finished(self) -> None:
        with self.room:
            self.held -= 1
            self.room.notify()


@dataclass(slots=True, eq=False)
class HandlerThread:
    """One handler thread of a queue and the attempt it runs.

    ``attempt`` and the fields after it are guarded by ``Worker.running_lock``.
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


class Worker:
    """One worker process. ``run()`` blocks until stopped."""

    def __init__(
        self,
        queues: dict[str, int],
        *,
        alias: str | None = None,
        conf: AwaSettings | None = None,
        install_signal_handlers: bool = True,
        repeat_halts: bool = True,
    ) -> None:
        self.conf = conf or awa_settings()
        self.alias = alias or self.conf.database
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.install_signal_handlers = install_signal_handlers
        # Whether a second SIGTERM/SIGINT means "now". Not for --processes
        # children: they get each signal twice (from the terminal or service
        # manager, and from their supervisor), which sends SIGQUIT for "now".
        self.repeat_halts = repeat_halts
        # Signals received, for the main thread to act on (see _on_signal).
        self.signals: queue_module.SimpleQueue[int] = queue_module.SimpleQueue()
        self.stopping = threading.Event()  # stop claiming
        self.halt = threading.Event()  # stop everything now
        self.results: queue_module.SimpleQueue[AttemptResult | None] = queue_module.SimpleQueue()
        self.running: dict[int, Attempt] = {}
        self.waiting: set[int] = set()  # claimed ids no handler has started yet
        self.running_lock = threading.Lock()
        self.queues = {
            name: QueueRunner(
                name=name,
                concurrency=n,
                inbox=queue_module.SimpleQueue(),
                wake=threading.Event(),
            )
            for name, n in queues.items()
        }
        self.threads: list[threading.Thread] = []
        # Handler threads taking attempts from their queue's inbox, and those
        # abandoned in a handler that outlived its attempt (see _tend_handlers).
        self.handlers: list[HandlerThread] = []
        self.abandoned: list[HandlerThread] = []
        self.spawned: dict[str, int] = {}  # handler threads started per queue, for their names
        self.stuck_grace = max(2 * self.conf.heartbeat_interval, STUCK_GRACE_MIN)
        self.is_leader = False
        self.processed = 0
        # Results waiting for the completer: past this, producers stop claiming,
        # so claimed-but-unrecorded jobs stay bounded when the database is slow.
        self.backlog_limit = max(1000, 2 * sum(queues.values()))

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> None:
        if self.install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                signal.signal(signum, self._on_signal)
        settings_dict = connections[self.alias].settings_dict
        logger.info(
            "awa worker %s starting: queues %s; database %r (%s:%s/%s)",
            self.name,
            ", ".join(f"{q.name}={q.concurrency}" for q in self.queues.values()),
            self.alias,
            settings_dict.get("HOST") or "local socket",
            settings_dict.get("PORT") or 5432,
            settings_dict.get("NAME"),
        )
        if self.conf.direct_database is None:
            logger.info(
                "no direct database connection (AWA['DIRECT_DATABASE'] is None): polling "
                "every %.1fs instead of LISTEN",
                self.conf.poll_interval,
            )
        else:
            self._start(self._listen, "awa-listener")
        self._start(self._complete, "awa-completer")
        self._start(self._lifecycle, "awa-lifecycle")
        self._start(self._maintain, "awa-maintenance")
        for runner in self.queues.values():
            for _ in range(runner.concurrency):
                self._spawn_handler(runner)
        producers = [
            self._start(lambda r=runner: self._produce(r), f"awa-producer-{runner.name}")
            for runner in self.queues.values()
        ]
        try:
            while not self.stopping.is_set():
                self._take_signals(0.5)
                self._tend_handlers()
        finally:
            self._drain(producers)

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming; in-flight attempts may finish within SHUTDOWN_TIMEOUT.

        A second call, or ``now``, skips that wait: they are given back at once.
        """
        if now or self.stopping.is_set():
            self.halt.set()
        self.stopping.set()
        for runner in self.queues.values():
            runner.wake.set()
        self.signals.put(_WAKE)  # the main thread may be waiting for a signal

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a reentrant put: the handler runs in the main thread between
        # two bytecodes, maybe while it holds an Event's lock, maybe inside
        # this handler for the previous signal. Setting an Event here could
        # wait on a lock this very thread holds, for ever.
        self.signals.put(signum)

    def _take_signals(self, timeout: float) -> None:
        """Act on the signals received, waiting up to ``timeout`` for one (main thread)."""
        with contextlib.suppress(queue_module.Empty):
            signum = self.signals.get(timeout=timeout)
            while True:
                self._act_on(signum)
                signum = self.signals.get_nowait()

    def _act_on(self, signum: int) -> None:
        if signum == _WAKE:
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGQUIT or (self.stopping.is_set() and self.repeat_halts):
            logger.warning("%s: giving back in-flight jobs now", name)
            self.stop(now=True)
        elif not self.stopping.is_set():
            logger.info(
                "%s received: finishing in-flight jobs (up to %.0fs), claiming no more",
                name,
                self.conf.shutdown_timeout,
            )
            self.stop()

    def _start(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def _drain(self, producers: list[threading.Thread]) -> None:
        for thread in producers:
            thread.join()
        self._give_back(self._withdraw_waiting(), started=False)
        deadline = time.monotonic() + self.conf.shutdown_timeout
        while self.running and time.monotonic() < deadline and not self.halt.is_set():
            self._take_signals(0.05)
        self.results.put(None)  # the completer writes what it has, then exits
        completer = next(t for t in self.threads if t.name == "awa-completer")
        until = max(deadline, time.monotonic() + 5.0)
        while completer.is_alive() and time.monotonic() < until:
            completer.join(timeout=0.1)
            self._take_signals(0)
        with self.running_lock:
            unfinished = [a for a in self.running.values() if a.job.id not in self.waiting]
        self._give_back(unfinished + self._withdraw_waiting(), started=True)
        self.halt.set()
        for runner in self.queues.values():
            for _ in range(runner.concurrency):
                # Each handler thread closes its connections and exits. There are
                # ``concurrency`` of them: abandoned ones take nothing from the inbox.
                runner.inbox.put(None)
        # A thread still stuck in a handler (an abandoned one too) keeps its
        # connection until the process exits; they are daemon threads.
        until = time.monotonic() + 3.0
        for thread in self.threads:
            thread.join(timeout=max(0.0, until - time.monotonic()))
        logger.info("awa worker %s stopped after %s jobs", self.name, self.processed)

    def _withdraw_waiting(self) -> list[Attempt]:
        """Take the prefetched attempts no handler has started; none will start now."""
        with self.running_lock:
            withdrawn = [self.running.pop(i) for i in self.waiting if i in self.running]
            self.waiting.clear()
        return withdrawn

    def _give_back(self, attempts: list[Attempt], *, started: bool) -> None:
        """Write back attempts this worker will not finish, so others can run them.

        An attempt that never started leaves no trace: the job is available again
        and its next run keeps this attempt's number. One that was interrupted
        counts, as if its handler had raised: available again at once with an
        ``errors`` entry, or failed on its last attempt, with its follow-ups.
        """
        if not attempts:
            return
        for attempt in attempts:
            attempt.cancelled.set()
        results = [self._given_back(a.job, started) for a in attempts]
        try:
            written = finalize(results, self.alias)
            logger.warning(
                "gave back %s %s job(s) at shutdown: %s",
                len(written),
                "interrupted" if started else "prefetched",
                ", ".join(str(r.job.id) for r in written),
            )
        except _DB_ERRORS:
            logger.exception("could not give back unfinished jobs; maintenance will rescue them")
        finally:
            connections.close_all()

    @staticmethod
    def _given_back(job: Job, started: bool) -> AttemptResult:
        if not started:
            return AttemptResult(job=job, state=JobState.AVAILABLE, delay=0.0, snoozed=True)
        result = errored(job, INTERRUPTED)
        if result.state is JobState.RETRYABLE:
            result.state, result.delay = JobState.AVAILABLE, 0.0
        return result

    # -- producer: claim and submit ---------------------------------------------

    def _produce(self, runner: QueueRunner) -> None:
        backoff = Backoff()
        busy = False  # the last claim took all it asked for: more jobs are waiting
        while not self.stopping.is_set():
            if self.results.qsize() > self.backlog_limit:
                self.stopping.wait(0.01)
                continue
            want = self._reserve(runner, busy)
            if not want:
                continue
            runner.wake.clear()
            try:
                jobs = claim(runner.name, want, self.alias)
                backoff.reset()
            except _DB_ERRORS as exc:
                logger.warning("claim on queue %s failed (%s); reconnecting", runner.name, exc)
                self._reset_connection()
                self._unreserve(runner, want)
                backoff.wait(self.stopping)
                continue
            busy = len(jobs) == want
            self._unreserve(runner, want - len(jobs))
            debug = logger.isEnabledFor(logging.DEBUG)
            for job in jobs:
                attempt = Attempt(job=job, alias=self.alias)
                with self.running_lock:
                    self.running[job.id] = attempt
                    self.waiting.add(job.id)
                if debug:
                    logger.debug("claimed job %s kind=%s attempt=%s", job.id, job.kind,
                                 job.attempt, extra=log_context(job, self.name))  # fmt: skip
                runner.inbox.put(attempt)
            if not busy:
                runner.wake.wait(self.conf.poll_interval)

    def _reserve(self, runner: QueueRunner, busy: bool) -> int:
        """Wait for room on the queue and reserve it; return how many jobs to claim.

        Room is the concurrency plus the prefetch. While a queue is busy,
        handlers make room one job at a time: claiming at the first free place
        would mean one claim statement (and one commit) per job. Waiting up to
        ``GATHER_SECONDS`` for half the room keeps batches large; an idle queue
        (not busy) claims at once, so pickup latency does not suffer.
        """
        most = self.conf.claim_batch_size
        capacity = runner.concurrency + runner.prefetch(self.conf.prefetch_window, most)
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

    @staticmethod
    def _unreserve(runner: QueueRunner, n: int) -> None:
        if n:
            with runner.room:
                runner.held -= n
                runner.room.notify()

    # -- handler threads ----------------------------------------------------------

    def _spawn_handler(self, runner: QueueRunner) -> HandlerThread:
        """Start one more handler thread for ``runner``'s queue (main thread only)."""
        number = self.spawned.get(runner.name, 0)
        self.spawned[runner.name] = number + 1
        handler = HandlerThread(runner=runner, name=f"awa-{runner.name}_{number}")
        with self.running_lock:
            self.handlers.append(handler)
        handler.thread = self._start(lambda: self._handle(handler), handler.name)
        return handler

    def _handle(self, handler: HandlerThread) -> None:
        """A handler thread: run the queue's attempts until told to stop (``None``).

        An abandoned thread takes no other attempt: its place went to another.
        """
        inbox = handler.runner.inbox
        while not handler.abandoned and (attempt := inbox.get()) is not None:
            self._execute(handler, attempt)
        if handler.abandoned:
            logger.info(
                "abandoned handler thread %s returned after %.1fs; it exits",
                handler.name,
                time.monotonic() - handler.started,
            )

    def _execute(self, handler: HandlerThread, attempt: Attempt) -> None:
        """Run one claimed attempt; its place on the queue is freed however it ends.

        Freed once: by this thread, or when it was abandoned by ``_tend_handlers``.
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
                self._forget(attempt)
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
                extra=log_context(attempt.job, self.name),
            )  # fmt: skip
            self.results.put(from_exception(attempt.job, exc, during="worker error"))
        finally:
            close_broken_connections()

    def _run_atomic(self, attempt: Attempt, spec: WorkerSpec, args: JobArgs) -> None:
        try:
            run_atomic_attempt(attempt, spec, args)
        except _DB_ERRORS as exc:
            # The transaction rolled back, or its commit's acknowledgement was
            # lost: the completer records the attempt as failed. Its write is
            # guarded by run_lease and state, so after a commit that did land
            # it changes nothing.
            logger.exception(
                "atomic job %s kind=%s could not be finalized",
                attempt.job.id, attempt.job.kind, extra=log_context(attempt.job, self.name),
            )  # fmt: skip
            self._reset_connection()
            self.results.put(from_exception(attempt.job, exc, during="could not be finalized"))
            return
        self._forget(attempt)

    def _tend_handlers(self) -> None:
        """Keep every queue's handler threads at full strength (main thread, twice a second).

        A handler may ignore cancellation and its deadline. Once its attempt is
        lost (cancelled, or rescued by maintenance for a stale heartbeat or a
        passed deadline: the lifecycle thread sets ``attempt.cancelled``) and it
        has not returned within ``stuck_grace``, its thread is abandoned and a
        new one takes its place on the queue. The abandoned thread exits when
        its handler returns; its late result changes nothing (guarded by
        run_lease). At most ``concurrency`` abandoned threads per queue are
        alive at once: past that the stuck thread keeps its place, logged at
        ERROR. A handler thread that died is replaced too.
        """
        if self.stopping.is_set():
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
                extra=log_context(job, self.name),
            )  # fmt: skip
        for handler, attempt in stuck:
            self._abandon(handler, attempt, now)
        for handler in dead:
            logger.error("handler thread %s died; starting another", handler.name)
            self._spawn_handler(handler.runner)

    def _abandon(self, handler: HandlerThread, attempt: Attempt, now: float) -> None:
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
                    extra=log_context(job, self.name),
                )  # fmt: skip
            return
        replacement = self._spawn_handler(runner)
        runner.finished()  # its place on the queue goes to the replacement
        logger.warning(
            "handler thread %s is stuck in job %s kind=%s attempt=%s: its attempt was lost "
            "(cancelled or rescued) %.1fs ago and the handler, running for %.1fs, has not "
            "returned; abandoned (%s of at most %s on queue %s), %s takes its place",
            handler.name, job.id, job.kind, job.attempt, now - (handler.lost_at or now),
            now - handler.started, alive + 1, runner.concurrency, runner.name, replacement.name,
            extra=log_context(job, self.name),
        )  # fmt: skip

    @staticmethod
    def _mark_progress(attempt: Attempt) -> None:
        """Progress is stored by the lifecycle thread, which polls the dirty flag."""

    def _forget(self, attempt: Attempt) -> None:
        self._forget_job(attempt.job)

    def _forget_job(self, job: Job) -> None:
        """Stop tracking this attempt of ``job``.

        Only this attempt: once its outcome is written (a snooze, say) the job
        may already be claimed again, and that attempt is tracked under the
        same id.
        """
        with self.running_lock:
            tracked = self.running.get(job.id)
            if tracked is not None and tracked.job.run_lease == job.run_lease:
                del self.running[job.id]
            self.processed += 1

    @staticmethod
    def _reset_connection() -> None:
        with contextlib.suppress(Exception):
            connections.close_all()

    # -- completer: batched finalize --------------------------------------------

    def _complete(self) -> None:
        """The completer thread: write results in batches until told to stop (``None``).

        Results whose row another session holds locked are written again
        after ``LOCKED_RETRY`` seconds, on their own, while the rest go on.
        """
        done = False
        deferred: list[AttemptResult] = []  # left out: their row was locked
        retry_at = 0.0
        while not done:
            timeout = max(0.0, retry_at - time.monotonic()) if deferred else None
            batch, done = self._next_batch(timeout)
            if deferred and (done or time.monotonic() >= retry_at):
                batch.extend(deferred)
                deferred = []
            if not batch:
                continue
            self._write_batch(batch)
            for result in batch:
                if result.locked:
                    result.locked = False
                    deferred.append(result)
                else:
                    self._forget_job(result.job)
            if deferred:
                retry_at = time.monotonic() + LOCKED_RETRY
                logger.info(
                    "%s outcome(s) wait for a row lock another session holds (jobs %s); "
                    "writing them again in %.1fs",
                    len(deferred),
                    ", ".join(str(r.job.id) for r in deferred[:20]),
                    LOCKED_RETRY,
                )
        for result in deferred:
            logger.warning(
                "job %s: its outcome could not be written before shutdown (the row stays "
                "locked by another session); maintenance will rescue it",
                result.job.id,
                extra=log_context(result.job, self.name),
            )
            self._forget_job(result.job)

    def _next_batch(self, timeout: float | None) -> tuple[list[AttemptResult], bool]:
        """Up to ``FINALIZE_BATCH_SIZE`` results, waiting up to ``timeout`` for the first
        (``None``: for ever); and whether the stop marker was seen."""
        batch: list[AttemptResult] = []
        try:
            first = self.results.get(timeout=timeout)
        except queue_module.Empty:
            return batch, False
        if first is None:
            return batch, True
        batch.append(first)
        while len(batch) < FINALIZE_BATCH_SIZE:
            try:
                item = self.results.get_nowait()
            except queue_module.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _write_batch(self, batch: list[AttemptResult]) -> None:
        """Finalize ``batch``; a member that cannot be stored is recorded as a failed attempt.

        A lost connection (or another transient error) is waited out and the
        whole batch written again: finalize is guarded by run_lease, so
        writing it again after a lost commit acknowledgement changes nothing
        twice. Any other error is about what one member holds, so the batch
        is split in halves until the member that fails is alone, and the
        others commit.
        """
        backoff = Backoff()
        while True:
            try:
                finalize(batch, self.alias)
                return
            except Exception as exc:  # noqa: BLE001 - one bad outcome must not stop the completer
                if isinstance(exc, _DB_ERRORS) and db.is_transient(exc):
                    logger.warning("finalize failed (%s); retrying after reconnect", exc)
                    self._reset_connection()
                    if self.halt.is_set():
                        return
                    backoff.wait(self.halt)
                    continue
                self._reset_connection()
                error = exc
                break
        if len(batch) > 1:
            half = len(batch) // 2
            self._write_batch(batch[:half])
            self._write_batch(batch[half:])
        else:
            self._write_unstorable(batch[0], error)

    def _write_unstorable(self, result: AttemptResult, exc: Exception) -> None:
        """Record ``result``'s attempt as failed, naming why its outcome could not be written."""
        job = result.job
        error = (
            f"the attempt's outcome ({result.state}) could not be stored: "
            f"{type(exc).__name__}: {exc}"
        )
        logger.error(
            "job %s kind=%s attempt=%s: %s; recording a failed attempt instead",
            job.id, job.kind, job.attempt, error, extra=log_context(job, self.name),
        )  # fmt: skip
        fallback = errored(job, error, "".join(traceback.format_exception(exc)))
        try:
            finalize([fallback], self.alias)
        except Exception:  # the job's heartbeat stops, and rescue takes it back
            logger.exception(
                "job %s: not even the failed attempt could be recorded; it will be rescued",
                job.id,
                extra=log_context(job, self.name),
            )
            self._reset_connection()
        result.locked = fallback.locked

    # -- listener: LISTEN/NOTIFY -----------------------------------------------

    def _listen(self) -> None:
        backoff = Backoff()
        while not self.halt.is_set():
            try:
                direct = self.conf.direct_database or self.alias
                with psycopg.connect(**listen_params(direct), autocommit=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    conn.execute(f"LISTEN {CANCEL_CHANNEL}")
                    backoff.reset()
                    # Anything enqueued while we were not listening: look now.
                    for runner in self.queues.values():
                        runner.wake.set()
                    self._listen_loop(conn)
            except psycopg.Error as exc:
                if self.halt.is_set():
                    return
                logger.warning("LISTEN connection lost (%s); reconnecting", exc)
                backoff.wait(self.halt)

    def _listen_loop(self, conn: psycopg.Connection[Any]) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(conn.fileno(), selectors.EVENT_READ)
            while not self.halt.is_set():
                if not selector.select(timeout=1.0):
                    conn.execute("SELECT 1")  # notice a dead connection
                    continue
                for notify in conn.notifies(timeout=0, stop_after=0):
                    self._on_notify(notify.channel, notify.payload)

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == NOTIFY_CHANNEL:
            runner = self.queues.get(payload)
            if runner is not None:
                runner.wake.set()
        elif channel == CANCEL_CHANNEL:
            with contextlib.suppress(ValueError):
                attempt = self.running.get(int(payload))
                if attempt is not None:
                    attempt.cancelled.set()

    # -- lifecycle: heartbeats and progress ------------------------------------

    def _lifecycle(self) -> None:
        last_beat = time.monotonic()
        while not self.halt.wait(0.25):
            with self.running_lock:
                attempts = list(self.running.values())
            try:
                write_progress(attempts)
                if time.monotonic() - last_beat >= self.conf.heartbeat_interval:
                    last_beat = time.monotonic()
                    self._heartbeat(attempts)
            except _DB_ERRORS as exc:
                logger.warning("heartbeat failed (%s); reconnecting", exc)
                self._reset_connection()
            except Exception:
                # Never let this thread die: without heartbeats every running
                # job of this worker would be rescued and run again.
                logger.exception("heartbeat or progress write failed")
                self._reset_connection()

    def _heartbeat(self, attempts: list[Attempt]) -> None:
        if not attempts:
            return
        with db.cursor(self.alias) as cursor:
            cursor.execute(
                sql.HEARTBEAT,
                {
                    "id": [a.job.id for a in attempts],
                    "run_lease": [a.job.run_lease for a in attempts],
                },
            )
            alive = {row[0] for row in cursor.fetchall()}
        for attempt in attempts:
            if attempt.job.id not in alive and self.running.get(attempt.job.id) is attempt:
                # Cancelled, rescued or finalized meanwhile: tell the handler.
                attempt.cancelled.set()

    # -- maintenance leadership ------------------------------------------------

    def _maintain(self) -> None:
        """Compete for the maintenance lease each tick; run maintenance while holding it."""
        from .maintenance import LeadershipLost, Maintenance

        maintenance = Maintenance(self.alias, self.conf, holder=self.name)
        warned = False
        while not self.halt.is_set():
            try:
                if not self.is_leader:
                    self.is_leader = maintenance.try_lead()
                    if self.is_leader:
                        logger.info(
                            "worker %s is now the maintenance leader (term %s)",
                            self.name,
                            maintenance.term,
                        )
                    if self.is_leader and not warned:
                        warned = True
                        maintenance.warn_without_autovacuum()
                if self.is_leader:
                    maintenance.tick(wake=self._wake_queues)
            except LeadershipLost as exc:
                logger.warning("worker %s is no longer the maintenance leader: %s", self.name, exc)
                self.is_leader = False
            except _DB_ERRORS as exc:
                if self.is_leader:
                    logger.warning("maintenance leader lost its connection (%s)", exc)
                self.is_leader = False
                self._reset_connection()
            except Exception:
                logger.exception("maintenance failed")
            self.halt.wait(min(1.0, self.conf.maintenance_interval))
        if self.is_leader:
            with contextlib.suppress(*_DB_ERRORS):
                maintenance.resign()

    def _wake_queues(self, names: set[str]) -> None:
        for name in names:
            runner = self.queues.get(name)
            if runner is not None:
                runner.wake.set()
