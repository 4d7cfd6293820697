"""Handler threads: as many per queue as its concurrency, running the attempts claimed.

Each takes attempts from its queue's inbox, runs them (``execute``) and puts
the result on the state's results queue for the completer; an ``atomic=True``
handler's attempt is finalized in its own transaction here instead. The main
thread keeps the pool at full strength (``HandlerPool.tend``): a handler still
running ``stuck_grace`` after its attempt was lost (cancelled, or rescued
past its deadline, or timed out) is abandoned and its thread replaced, at most
``concurrency`` abandoned threads per queue.

A kind's ``timeout`` is applied by ``tend`` too, for sync and async handlers
alike: past it the attempt is recorded as a failed one ("timed out") and
marked cancelled, so an async handler is cancelled and a sync handler's
``is_cancelled()`` says so; whatever the handler returns later is stale.
``async def`` handlers run on one event loop thread per worker process
(``awa-asyncio``, started when the first one comes); the handler thread that
took the attempt waits for it, so it holds its place on the queue as a sync
handler does.

With Django's pool on the worker's database, a handler thread keeps its
pooled connection from one job to the next while its queue's inbox holds
work and no thread waits for one of the pool's connections; it gives it back
when it goes idle. When the queues' concurrency exceeds what the pool can
serve, a ``ConnectionGate`` lets only that many handler threads whose last
job used the pool take a job at once: the others sleep, rather than each
holding a claimed job while it queues for a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_module
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import connections

from . import db, wakeups
from .completer import notify_freed, release_held_leases
from .execute import (
    Attempt,
    AttemptResult,
    describe,
    from_exception,
    left_open,
    resolve_handler,
    run_attempt,
    timed_out,
    unstarted,
)
from .finalize import run_atomic_attempt
from .kinds import JobArgs, WorkerSpec, registry
from .logs import job_logging
from .models import JobRow
from .otel import instrumentation
from .producer import RATED_START_WITHIN
from .state import DB_ERRORS, QueueRunner, WorkerState, log_context, reset_connection

logger = logging.getLogger(__name__)

# A handler whose attempt was lost has max(2 * HEARTBEAT_INTERVAL, this) seconds,
# from when the worker learns of it, to return before its thread is replaced.
STUCK_GRACE_MIN = 5.0

# Of the worker's pool, handler threads behind the gate leave this many connections
# to the engine threads on every job's path: the completer's write, a producer's claim.
ENGINE_RESERVE = 2
# How often a thread waiting at the gate looks whether the worker halted, seconds.
GATE_HALT_POLL = 0.5
# A handler thread's connection unused this long is checked before its next job
# (close_dead_connections), seconds.
IDLE_CHECK_AFTER = 1.0
# At shutdown, how long async handlers still running get to end once cancelled,
# seconds, before the event loop stops (the process's threads get 3 s in all).
LOOP_GRACE = 1.0


class _ThreadState(threading.local):
    """A thread's own: its connection objects, and what the checks around its jobs keep.

    The class's values are a new thread's: each job reads them as plain
    attributes (a thread's first read finds the class's), with no ``getattr``.
    """

    connections: list[tuple[Any, bool]] | None = None  # _thread_connections()
    outages = 0  # db.outage_count when the thread last looked (close_dead_connections)
    last_job_at = 0.0  # time.monotonic() after its last job (job_done)
    handler_thread = False  # a handler thread's: outside any transaction between jobs
    pooled = False  # its last job held a pooled connection (release_connections)


_thread = _ThreadState()


def _thread_connections() -> list[tuple[Any, bool]]:
    """This thread's Django connections, each with whether its alias has Django's pool."""
    wrappers = _thread.connections
    if wrappers is None:
        wrappers = _thread.connections = [
            (connections[alias], db.is_pooled(connections[alias])) for alias in connections
        ]
        _thread.outages = db.outage_count
    return wrappers


def close_dead_connections() -> None:
    """Before a job: close this thread's connections that are most likely dead.

    All of them if the worker saw an outage since the thread's last job: its
    other threads found the database gone meanwhile. One unused for
    ``IDLE_CHECK_AFTER`` seconds or more if it no longer reaches a writable
    server (one round trip): servers and poolers close idle connections
    (``idle_session_timeout``, PgBouncer's ``client_idle_timeout``), and after a
    failover one may be left on a standby. Finding out by running the job
    would cost the job an attempt. Under load, two comparisons and nothing
    more.
    """
    wrappers = _thread_connections()
    if _thread.outages != db.outage_count:
        _thread.outages = db.outage_count
        for conn, _pooled in wrappers:
            with contextlib.suppress(Exception):
                conn.close()
        return
    if time.monotonic() - _thread.last_job_at < IDLE_CHECK_AFTER:
        return
    for conn, _pooled in wrappers:
        # Outside a transaction only: a test's (run_once) is not the worker's to close.
        if conn.connection is not None and not conn.in_atomic_block and not _writable(conn):
            conn.close()


def job_done() -> None:
    """After a job: when this thread's connections were last used (``close_dead_connections``)."""
    _thread.last_job_at = time.monotonic()


def _writable(conn: Any) -> bool:
    """Whether ``conn`` still reaches a server that takes writes (False when broken)."""
    try:
        return db.is_writable(conn)
    except Exception:  # noqa: BLE001 - a broken connection: close it
        return False


def transaction_marks() -> list[tuple[int, bool]]:
    """Where this thread's connections stand before a handler runs: each one's depth
    of atomic blocks, and its autocommit (what connecting gives, if not connected).

    Only where a handler may start inside a transaction (``run_once``, called
    in a test's); a handler thread's connections are outside any between jobs.
    """
    return [
        (
            len(conn.atomic_blocks),
            conn.autocommit if conn.connection is not None else conn.settings_dict["AUTOCOMMIT"],
        )
        for conn, _pooled in _thread_connections()
    ]


def discard_open_transactions(marks: list[tuple[int, bool]] | None) -> list[str]:
    """After a handler: close this thread's connections it left inside a transaction.

    ``marks``: ``transaction_marks()`` from before the handler ran; None in a
    handler thread, whose connections were outside any transaction. An atomic
    block entered and never exited, or autocommit turned off, would hold the
    transaction open into the thread's next jobs: their writes would join it,
    never to commit, and its row locks would keep outcomes from being written.
    Closing the connection has the server roll that transaction back; the
    alias gets a new connection object, the old one still being marked as
    inside the block. Returns the aliases discarded. Every job pays this
    check: attribute reads, no query.
    """
    left = []
    for index, (conn, pooled) in enumerate(_thread_connections()):
        if conn.connection is None:
            continue
        # Between a handler thread's jobs: no atomic block, autocommit as configured.
        depth, autocommit = (0, conn.settings_dict["AUTOCOMMIT"]) if marks is None else marks[index]
        if len(conn.atomic_blocks) <= depth and (conn.autocommit or not autocommit):
            continue
        left.append(conn.alias)
        with contextlib.suppress(Exception):
            if pooled:
                # Back to Django's pool (its _close: putconn), which rolls back the
                # transaction as it takes the connection: closed here it would be lost
                # to the pool for good.
                conn._close()
            else:
                conn.connection.close()
        del connections[conn.alias]
    if left:
        _thread.connections = None  # the thread's connection objects, found again
    return left


def release_connections(keep: bool = False) -> bool:
    """After a job: put back this thread's pooled connections, close those a handler broke.

    A connection of an alias with Django's pool (``OPTIONS["pool"]``) goes
    back to the pool, so a handler thread holds one only while it works:
    many handler threads share a few connections. With ``keep`` (the thread
    is about to take its next job) it stays with the thread unless another
    thread waits for one of that pool's connections: a checkout costs a
    round trip (Django's health check) and, when the pool is short, a
    hand-over between threads, for every job. Any other connection stays
    open for the thread's next job, unless the handler left it unusable.
    Not ``close_old_connections()``: with the default CONN_MAX_AGE of 0 it
    would reconnect after every job. It runs after every job, so it keeps the
    thread's connection objects at hand: ``connections.all()`` goes through
    asgiref's ``Local`` for each alias, which costs more than the rest of a
    quick job's bookkeeping.

    Returns whether the thread held a pooled connection, kept or not.
    """
    held = False
    for conn, pooled in _thread_connections():
        if conn.connection is None:
            continue
        if conn.errors_occurred:
            # Also a connection that went read-only: after a failover it may
            # be on a standby, where every later job's writes would fail.
            usable = _writable(conn) if conn.vendor == "postgresql" else conn.is_usable()
            if not usable:
                conn.close()
                continue
            conn.errors_occurred = False
        if pooled and not conn.in_atomic_block:
            held = True
            if not keep or db.pool_wanted(conn):
                conn.close()
    return held


class ConnectionGate:
    """How many handler threads may work on the worker's pool at once: what it can serve.

    Django's pool of ``max_size`` connections serves ``max_size`` handler
    threads at best, less the engine threads' share (``ENGINE_RESERVE``).
    Past that, each job's handler would queue for a connection holding its
    claimed job, and every job would cost a hand-over between threads. A
    handler thread whose last job used the pool takes a slot before its next
    job (``enter``), keeps it while it has work, and gives it back
    (``leave``) when its job used no pooled connection or a thread of another
    queue waits for a slot. A thread whose last job did not use the pool
    takes jobs without a slot, and so do the threads of a queue whose last
    finished job used none (``note``): handlers that use no database are not
    held to the pool's size, once a job has shown it.
    """

    def __init__(self, slots: int, halt: threading.Event) -> None:
        self.slots = slots
        self.free = slots
        self.halt = halt
        self.cond = threading.Condition(threading.Lock())
        self.waiting: dict[str, int] = {}  # threads waiting for a slot, per queue
        self.waiting_total = 0
        self.unpooled: dict[str, bool] = {}  # the queue's last job used no pooled connection

    def enter(self, queue: str) -> bool:
        """Take a slot for a thread of ``queue``, waiting for one.

        False (no slot) once the worker halts, or when the queue's last
        finished job used no pooled connection: the thread goes on without.
        """
        with self.cond:
            if self.free <= 0:
                self.waiting[queue] = self.waiting.get(queue, 0) + 1
                self.waiting_total += 1
                try:
                    while self.free <= 0:
                        if self.halt.is_set() or self.unpooled.get(queue):
                            return False
                        self.cond.wait(GATE_HALT_POLL)
                finally:
                    self.waiting[queue] -= 1
                    self.waiting_total -= 1
            self.free -= 1
            return True

    def leave(self) -> None:
        """Give a slot back; one waiting thread takes it."""
        with self.cond:
            self.free += 1
            self.cond.notify()

    def note(self, queue: str, pooled: bool) -> None:
        """Whether the job a thread of ``queue`` just finished used a pooled connection.

        When it used none after one that did, the queue's threads waiting for a
        slot go on without one.
        """
        unpooled = not pooled
        if self.unpooled.get(queue) != unpooled:
            self.unpooled[queue] = unpooled
            if unpooled:
                with self.cond:
                    self.cond.notify_all()

    def wanted_elsewhere(self, queue: str) -> bool:
        """Whether a thread of another queue than ``queue`` waits for a slot (read unlocked)."""
        return self.waiting_total > self.waiting.get(queue, 0)


def connection_gate(state: WorkerState) -> ConnectionGate | None:
    """The gate of a worker whose queues' concurrency exceeds what its pool can serve."""
    pool_max = state.need.pool_max
    if pool_max is None:
        return None
    slots = max(1, pool_max - ENGINE_RESERVE)
    if state.need.handlers <= slots:
        return None
    return ConnectionGate(slots, state.halt)


def _deadline_seconds(job: JobRow) -> float | None:
    """The attempt's deadline as a duration, both ends read on the database clock at claim.

    The claim sets ``heartbeat_at`` and ``deadline_at`` from the same ``now()``
    (``attempted_at`` waits for the handler to begin, see MARK_STARTED).
    """
    if job.deadline_at is None or job.heartbeat_at is None:
        return None
    return (job.deadline_at - job.heartbeat_at).total_seconds()


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
    timed_out: bool = False  # its attempt passed the kind's timeout and was given up
    bound_logged: bool = False  # that it could not be replaced (the bound) was logged
    abandoned: bool = False  # replaced: it exits when its handler returns
    # Its last job used a pooled connection, so it takes a slot of the gate before
    # its next; assumed of a new thread, so a first burst does not outrun the pool.
    on_pool: bool = True
    gated: bool = False  # its attempt's handler counts in its queue's RunGate


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
        # The event loop of async handlers, started with the first one (event_loop()).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_lock = threading.Lock()
        self.gate = connection_gate(state)

    def start(self) -> None:
        """Start every queue's handler threads, ``concurrency`` of each."""
        for runner in self.state.queues.values():
            for _ in range(runner.concurrency):
                self.spawn(runner)
        if self.gate is not None:
            need = self.state.need
            logger.info(
                "Django's pool of database %r (max_size %s) serves %s handler threads at once "
                "(%s kept for the engine): of the %s handler threads, those whose last job "
                "used the pool take turns",
                need.alias, need.pool_max, self.gate.slots, ENGINE_RESERVE, need.handlers,
            )  # fmt: skip

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
        It keeps its pooled connection from one job to the next while the
        inbox holds work (see ``release_connections``), and takes a slot of the
        gate, if the worker has one, before a job when its last job used the pool.
        """
        runner = handler.runner
        inbox = runner.inbox
        gate = self.gate
        slot = False
        _thread.handler_thread = True  # its connections are outside any transaction between jobs
        try:
            while not handler.abandoned:
                if gate is not None and handler.on_pool and not slot:
                    release_connections()  # none held while it waits for a slot
                    slot = gate.enter(runner.name)
                try:
                    attempt = inbox.get_nowait()
                except queue_module.Empty:
                    release_connections()  # idle: its pooled connection serves others meanwhile
                    attempt = inbox.get()
                if attempt is None:
                    break
                self.execute(handler, attempt)
                if gate is None:
                    continue
                handler.on_pool = _thread.pooled
                gate.note(runner.name, handler.on_pool)
                if slot and (not handler.on_pool or gate.wanted_elsewhere(runner.name)):
                    release_connections()
                    gate.leave()
                    slot = False
        finally:
            if gate is not None and slot:
                release_connections()
                gate.leave()
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
        release_connections()
        return True

    def withdrawn(self, attempt: Attempt) -> bool:
        """Given back before it started (at shutdown, or with its process's slots):
        the job may be claimed again meanwhile, its new attempt waiting under the
        same id."""
        job_id = attempt.job.id
        return job_id not in self.waiting or self.running.get(job_id) is not attempt

    def execute(self, handler: HandlerThread, attempt: Attempt) -> None:
        """Run one claimed attempt; its place on the queue is freed however it ends.

        Freed once: by this thread, or when it was abandoned by ``tend``. The
        handler begins only within the queue's ``RunGate`` (its process's usable
        slots of a ``global_concurrency``); the attempt waits there, still not
        started, until it may, or until it is given up.
        """
        runner = handler.runner
        gate = runner.gate
        # A thread waiting at the gate holds no pooled connection meanwhile.
        entered = gate.enter_unlimited() or gate.enter(
            lambda: self.withdrawn(attempt) or attempt.cancelled.is_set(), release_connections
        )
        try:
            with self.running_lock:
                if self.withdrawn(attempt):
                    return
                self.waiting.discard(attempt.job.id)
                now = time.monotonic()
                late = attempt.start_by is not None and now > attempt.start_by
                if not late:
                    handler.attempt = attempt
                    handler.gated = entered
                    # Claimed until now; from here its handler runs (attempted_at).
                    handler.started = attempt.started = now
                    runner.observe_start(now - attempt.claimed, now, drained=runner.inbox.empty())
                    handler.lost_at = None
                    handler.overrun_logged = handler.bound_logged = handler.timed_out = False
            if late:
                self._give_back_late(attempt)
                return
            if attempt.cancelled.is_set():
                # Cancelled or rescued while it waited: the row is no longer this attempt's.
                self.forget(attempt.job)
                return
            started = time.perf_counter()
            self._run(attempt)
            if not handler.abandoned:
                runner.observe(time.perf_counter() - started)
        finally:
            # Its handler is done: the outcome carries its start (MARK_STARTED would
            # only lock the row the completer is about to write).
            attempt.started_written = True
            with self.running_lock:
                attempt.returned = True
                handler.attempt = None
                handler.gated = False
                abandoned = handler.abandoned
                if abandoned and entered:
                    runner.stuck -= 1
                if abandoned:  # its key's lease is no longer kept; freed below
                    # Its outcome, if the completer has not read it yet, frees the
                    # key itself; one being written keeps it, and the completer
                    # frees it once written, finding the attempt gone from kept
                    # (Completer.free_returned_keys).
                    self.state.kept.pop((attempt.job.id, attempt.job.run_lease), None)
                    if attempt.timed_out is not None:
                        attempt.timed_out.keeps_lease = False
            # An abandoned handler kept its place in the gate (see abandon): it
            # leaves it only now that it really returned.
            if entered:
                runner.gate.leave()
            if not abandoned:
                runner.finished()
            elif entered:
                with runner.room:
                    runner.room.notify()  # its producer may claim for the place it freed
            if attempt.cancelled.is_set():
                self.release_held_lease(attempt)

    def release_held_lease(self, attempt: Attempt) -> None:
        """The handler of a lost attempt returned (or never began): free its key's place.

        A cancel or a rescue keeps the lease of an attempt of a kind with
        ``awa.Limit(concurrency=...)`` while its handler may still run
        (``sql._released``), as does the outcome of a timed-out attempt whose
        thread was abandoned (``abandon``); the heartbeat renews it until now.
        An outcome written for a lost attempt deletes it too; this covers those
        that write none (never begun, an ``atomic=True`` one rolled back as
        stale) and the abandoned ones. Should it fail, the place frees once the
        lease's ``held_until`` passes.
        """
        if attempt.sequenced or attempt.job.kind in registry.leased_kinds():
            release_held_leases(self.state, [attempt])

    def release_kept_leases(self) -> None:
        """At exit: free the key's places kept for abandoned handlers that still run.

        Their threads end with the process, so their keys' next jobs need not
        wait for the leases to run out (``STALE_AFTER``). Best effort: should
        it fail, or the process die first, they run out as a dead worker's do.
        """
        with self.running_lock:
            kept = list(self.state.kept.values())
            self.state.kept.clear()
        if not kept or not release_held_leases(self.state, kept):
            return
        logger.info(
            "freed the key's places kept for the abandoned handlers of job(s) %s, which end "
            "with the worker", ", ".join(str(a.job.id) for a in kept),
        )  # fmt: skip

    def _give_back_late(self, attempt: Attempt) -> None:
        """Give back, unstarted, a job claimed under a rate whose handler could not start
        within ``producer.RATED_START_WITHIN`` of its claim: started now, it might be
        one start too many in a window (the claim counted it at its stamp). It is
        ``available`` again at once, its attempt unused; the completer writes it."""
        job = attempt.job
        logger.info(
            "queue %s: gave back job %s unstarted: no handler could start it within %.2fs "
            "of its claim under a rate limit",
            job.queue, job.id, RATED_START_WITHIN, extra=log_context(job, self.state.name),
        )  # fmt: skip
        self.results.put(unstarted(job))

    def _run(self, attempt: Attempt) -> None:
        """Run the attempt; whatever happens, its result goes to the completer (or is written).

        Records logged meanwhile in this thread are about the attempt's job
        (``logs.JobContextFilter``).
        """
        close_dead_connections()
        tracing = instrumentation()  # None without the otel extra
        with job_logging(attempt.job, self.state.name):
            if tracing is None:
                self._run_logged(attempt)
                return
            # Tracing that fails costs the attempt its span, never its run (nor
            # the handler thread).
            try:
                traced = attempt.traced = tracing.start(attempt.job, self.state.name)
            except Exception:
                logger.exception("could not start job %s's span; it runs untraced", attempt.job.id)
                self._run_logged(attempt)
                return
            try:
                result = self._run_logged(attempt)
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    tracing.finish(traced, None, exc)
                raise
            try:
                # Past its timeout, the attempt's outcome is the one written for it;
                # lost meanwhile (cancelled, rescued), the handler's result is ignored.
                if attempt.gave_up is not None:
                    tracing.finish(traced, attempt.gave_up)
                else:
                    tracing.finish(traced, result, lost=attempt.cancelled.is_set())
            except Exception:
                logger.exception("could not end job %s's span", attempt.job.id)

    def _run_logged(self, attempt: Attempt) -> AttemptResult | None:
        """Run it; the result handed on or written (None: a stale atomic attempt)."""
        result: AttemptResult | None
        marks = None if _thread.handler_thread else transaction_marks()
        try:
            resolved = resolve_handler(attempt.job)
            if isinstance(resolved, AttemptResult):
                self._put(attempt, resolved)
                return resolved
            spec, args = resolved
            attempt.timeout = spec.timeout  # tend() applies it from now on
            attempt.holds_key = spec.limit is not None and spec.limit.concurrency is not None
            if spec.atomic:
                return self._run_atomic(attempt, spec, args, marks)
            loop = self.event_loop() if spec.is_async else None
            result = run_attempt(attempt, self._mark_progress, resolved, self.state.need, loop=loop)
            if left := discard_open_transactions(marks):
                result = self._left_open(attempt, left)
            self._put(attempt, result)
            return result
        except BaseException as exc:  # no signal reaches a handler thread
            # Whatever reaches here came from running the job (the handler
            # boundary catches the handler's own errors): record it, so the job
            # never stays running unseen until its heartbeat goes stale.
            logger.exception(
                "worker error running job %s kind=%s attempt=%s",
                attempt.job.id, attempt.job.kind, attempt.job.attempt,
                extra=log_context(attempt.job, self.state.name),
            )  # fmt: skip
            result = from_exception(attempt.job, exc, during="worker error", need=self.state.need)
            self._put(attempt, result)
            return result
        finally:
            # Kept for the thread's next job, if it has one; run() gives it back when idle.
            _thread.pooled = release_connections(keep=True)
            job_done()

    def _left_open(self, attempt: Attempt, aliases: list[str]) -> AttemptResult:
        job = attempt.job
        logger.error(
            "job %s kind=%s left a transaction open on %s: rolled back, connection closed",
            job.id, job.kind, ", ".join(aliases), extra=log_context(job, self.state.name),
        )  # fmt: skip
        result = left_open(job, aliases)
        result.progress = attempt.progress
        return result

    def _put(self, attempt: Attempt, result: AttemptResult) -> None:
        """Hand ``result`` to the completer, with when its handler began.

        An attempt that passed its timeout holding its kind's key (``time_out``)
        is written as timed out whatever its handler returned.
        """
        if attempt.timed_out is not None:
            result = attempt.timed_out
            result.progress = attempt.progress
        result.started = attempt.started
        self.results.put(result)

    def _run_atomic(
        self,
        attempt: Attempt,
        spec: WorkerSpec,
        args: JobArgs,
        marks: list[tuple[int, bool]] | None,
    ) -> AttemptResult | None:
        try:
            # The handler's transaction is the engine's: its follow-ups' queues
            # are woken after it commits (wakeups.py), not by a NOTIFY inside it.
            with wakeups.after_commit(attempt.alias, self.state.outbox):
                written = run_atomic_attempt(attempt, spec, args)
            if left := discard_open_transactions(marks):
                # The handler's block swallowed the worker's: nothing was committed.
                result = self._left_open(attempt, left)
                self._put(attempt, result)
                return result
            if written is not None:
                notify_freed(self.state, [written])
                self.state.count_outcomes([written], self.state.running)
            else:
                # Stale: cancelled or rescued, perhaps before the worker heard of it.
                # Lost all the same: a key's place kept for it goes now (execute).
                attempt.cancelled.set()
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
            result = from_exception(
                attempt.job, exc, during="could not be finalized", need=self.state.need
            )
            self._put(attempt, result)
            return result
        self.forget(attempt.job)
        return written

    @staticmethod
    def _mark_progress(attempt: Attempt) -> None:
        """Progress is stored by the heartbeat thread, which polls the dirty flag."""

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The worker's event loop for async handlers, its thread started on first use."""
        with self.loop_lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                self.state.start(lambda: _run_loop(loop), "awa-asyncio")
                self.loop = loop
            return self.loop

    def in_handlers(self) -> set[threading.Thread]:
        """The handler threads whose handler runs now (abandoned ones too): at the end of
        the drain, not waited for (their attempts were given back; they end with the
        process)."""
        with self.state.running_lock:
            return {
                handler.thread
                for handler in (*self.handlers, *self.abandoned)
                if handler.thread is not None and handler.attempt is not None
            }

    def stop_loop(self) -> None:
        """Stop the event loop thread (at shutdown), once the handlers still on it are done.

        Their attempts were given back: each is cancelled now (its handler sees
        ``CancelledError``, its ``except`` and ``finally`` run) rather than left
        to its supervisor's next look at the attempt, which a stopped loop would
        never take. The loop stops when they are done, or after ``LOOP_GRACE``
        seconds for a handler that goes on regardless.
        """
        with self.loop_lock:
            loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its thread is gone, the loop closed
                asyncio.run_coroutine_threadsafe(_cancel_and_stop(loop), loop)

    # -- the main thread's ---------------------------------------------------------

    def tend(self) -> None:
        """Keep every queue's handler threads at full strength (main thread, twice a second).

        A handler may ignore cancellation and its deadline. Once its attempt is
        lost (cancelled, or rescued by maintenance for a stale heartbeat or a
        passed deadline: the heartbeat thread sets ``attempt.cancelled``) and it
        has not returned within ``stuck_grace``, its thread is abandoned and a
        new one takes its place on the queue. The abandoned thread exits when
        its handler returns; its late result changes nothing (guarded by
        run_lease). Until then its handler still counts in the queue's
        ``RunGate``: a ``global_concurrency`` place is not freed by abandoning.
        At most ``concurrency`` abandoned threads per queue are alive at once:
        past that the stuck thread keeps its place, logged at ERROR. A handler
        thread that died is replaced too.
        """
        if self.state.stopping.is_set():
            return
        now = time.monotonic()
        overdue: list[tuple[HandlerThread, Attempt, float]] = []
        expired: list[tuple[HandlerThread, Attempt, float]] = []
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
                elif (
                    attempt.timeout is not None
                    and not handler.timed_out
                    and now - handler.started > attempt.timeout
                ):
                    handler.timed_out = True
                    expired.append((handler, attempt, now - handler.started))
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
        for handler, attempt, ran in expired:
            self.time_out(handler, attempt, ran)
        for handler, attempt in stuck:
            self.abandon(handler, attempt, now)
        for handler in dead:
            logger.error("handler thread %s died; starting another", handler.name)
            self.spawn(handler.runner)

    def time_out(self, handler: HandlerThread, attempt: Attempt, ran: float) -> None:
        """Give up an attempt past its kind's timeout: record it failed, tell the handler.

        The cancelled flag cancels an async handler and makes a sync one's
        ``is_cancelled()`` true. The thread keeps its place on the queue until
        the handler returns, unless it stays stuck past ``stuck_grace``: then
        the rule for lost attempts replaces it, within its bound.

        An attempt of a kind with ``awa.Limit(concurrency=...)`` holds a place
        of its key in the database until its outcome is written: written now,
        the next job of the key would start beside a handler that still runs.
        Its outcome is written when the handler returns instead (``_put``), or
        when its thread is abandoned (``abandon``): the row stays ``running``,
        heartbeated, meanwhile.
        """
        job = attempt.job
        timeout = attempt.timeout or 0.0
        result = attempt.gave_up = timed_out(job, timeout, ran)
        result.open_span = attempt.traced  # ended when this outcome is written
        if attempt.holds_key:
            attempt.timed_out = result
        attempt.cancelled.set()
        if not attempt.holds_key:
            self.results.put(result)
        logger.warning(
            "job %s kind=%s attempt=%s timed out after %.1fs (its timeout is %gs) in thread "
            "%s; recorded as a failed attempt%s, the handler's result will be ignored",
            job.id, job.kind, job.attempt, ran, timeout, handler.name,
            " once the handler returns (its key's place is held until then)"
            if attempt.holds_key else "",
            extra=log_context(job, self.state.name),
        )  # fmt: skip

    def abandon(self, handler: HandlerThread, attempt: Attempt, now: float) -> None:
        """Give ``handler``'s place on its queue to a new thread, within the bound.

        Of a kind with ``awa.Limit(concurrency=...)``, the attempt's key's lease
        stays held while the handler runs (``WorkerState.kept``): a timed-out
        attempt is written now, keeping it (``AttemptResult.keeps_lease``).
        """
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
                # It stays counted in its queue's gate until its handler returns
                # (execute): a global_concurrency place is not given to the next
                # job while a handler that cannot be stopped still runs.
                if handler.gated:
                    runner.stuck += 1
                self.handlers.remove(handler)
                self.abandoned.append(handler)
                # No longer held: not heartbeated, not waited for or given back at shutdown.
                if self.running.get(job.id) is attempt:
                    del self.running[job.id]
                # Its key's place stays taken while the handler really runs: the
                # heartbeat renews the lease until it returns (execute frees it
                # then), the worker frees it at exit (release_kept_leases).
                if attempt.holds_key or attempt.sequenced:
                    self.state.kept[job.id, job.run_lease] = attempt
                if attempt.timed_out is not None:
                    # Its timed-out outcome, written now, keeps that lease (held
                    # until the handler returns), so the key's next job waits. Set
                    # under the lock that execute clears it under once the handler
                    # returned: set after, it would keep a key no handler holds.
                    attempt.timed_out.keeps_lease = True
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
        if attempt.timed_out is not None:
            self._put(attempt, attempt.timed_out)
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


async def _cancel_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every other task on ``loop``, wait up to ``LOOP_GRACE`` for them, stop it."""
    try:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=LOOP_GRACE)
    finally:
        loop.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The body of the ``awa-asyncio`` thread: the loop runs until ``stop_loop``.

    A task re-raises ``SystemExit`` and ``KeyboardInterrupt`` out of the loop.
    A handler's own come to its thread instead (``execute.call_handler``); one
    from a task a handler started is logged, and the loop goes on for the
    other handlers on it.
    """
    asyncio.set_event_loop(loop)
    try:
        while True:
            try:
                loop.run_forever()
                return
            except (SystemExit, KeyboardInterrupt) as exc:
                logger.error(
                    "a task on the worker's event loop raised %s; the loop goes on", describe(exc)
                )
    finally:
        loop.close()
