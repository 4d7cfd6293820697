"""What a worker's services share: the ``WorkerState``, one per worker process.

The services (``producer``, ``handlers``, ``completer``, ``listener``,
``heartbeat``, ``maintenance.MaintenanceService``) each run in threads of
their own and meet only here: the queues' runners, the attempts claimed and
not yet finished, the results waiting for the completer, and the events that
stop them. ``process.Worker`` makes the state and starts the services.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue as queue_module
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import psycopg
from django.db import DatabaseError, InterfaceError, connections

from .conf import AwaSettings, awa_settings
from .dashboard import Tally
from .db import ConnectionNeed, connection_need, one_line
from .logs import log_context, set_worker
from .otel import count_written
from .wakeups import Outbox

__all__ = ["DB_ERRORS", "QueueRunner", "WorkerState", "log_context", "reset_connection"]

if TYPE_CHECKING:
    from .execute import Attempt, AttemptResult
    from .models import JobRow

logger = logging.getLogger(__name__)

DB_ERRORS = (DatabaseError, InterfaceError, psycopg.Error)


def reset_connection() -> None:
    """Close this thread's connections after a database error; the next use reconnects."""
    with contextlib.suppress(Exception):
        connections.close_all()


class SharedConcurrency:
    """``AWA["WORKER_CONCURRENCY"]``: one cap on the places all of a process's queues
    hold (running, or claimed and waiting), shared by weight (Awa ADR-011).

    Each queue keeps its ``min`` places however busy the others are; the rest
    (the cap less every ``min``) is shared: a queue may borrow all of it while
    no other queue wants more, and while several do, each gets at most its
    ``weight``'s share. Running jobs are never taken back: shares even out as
    they finish. Guarded by one lock; queues waiting for a place wait on it.
    """

    def __init__(self, cap: int, mins: dict[str, int], weights: dict[str, int]) -> None:
        self.cap = cap
        self.mins = mins
        self.weights = weights
        self.held = dict.fromkeys(mins, 0)
        self.wanting: set[str] = set()  # queues whose last claim filled, or that wait for room
        self.freed = threading.Condition()

    def over(self, name: str) -> int:
        return max(0, self.held[name] - self.mins[name])

    def grant(self, name: str, want: int) -> int:
        """How many of ``want`` places queue ``name`` may take now (the caller holds ``freed``)."""
        own = max(0, self.mins[name] - self.held[name])
        free = self.cap - sum(self.held.values())
        shared = self.cap - sum(self.mins.values())
        # Places past the minimums this queue may hold: all the shared ones while
        # no other queue wants more, else its weight's share of them.
        others = self.wanting - {name}
        if others:
            weights = self.weights[name] + sum(self.weights[q] for q in others)
            fair = shared * self.weights[name] // weights
            # The share rounds down; a queue below it by less than one place
            # still gets one when the pool has it, so no share is stranded.
            fair = max(fair, 1 if shared and self.over(name) == 0 else 0)
        else:
            fair = shared
        # Never past the shared places in all: every queue's minimum stays free for it.
        spare = shared - sum(self.over(q) for q in self.held)
        borrow = max(0, min(fair - self.over(name), spare, free - own))
        return max(0, min(want, own + borrow, free))

    def take(self, name: str, want: int, timeout: float) -> int:
        """Take up to ``want`` places for queue ``name``, waiting up to ``timeout`` for one."""
        with self.freed:
            granted = self.grant(name, want)
            if not granted:
                self.wanting.add(name)
                self.freed.wait(timeout)
                granted = self.grant(name, want)
            self.held[name] += granted
            return granted

    def give(self, name: str, n: int) -> None:
        if n:
            with self.freed:
                self.held[name] -= n
                self.freed.notify_all()

    def busy(self, name: str, wanting: bool) -> None:
        """Queue ``name``'s last claim took all it asked for (it wants more) or not."""
        with self.freed:
            if wanting:
                self.wanting.add(name)
            else:
                self.wanting.discard(name)


# How long the start rate of a queue's handlers is counted over before it is
# taken (QueueRunner.observe_start); a prefetch bounded by it follows a change
# in the process's pace within a few periods.
START_RATE_PERIOD = 0.25
# How often a handler thread waiting at its queue's ``RunGate`` looks whether its
# attempt was given up meanwhile (cancelled, or given back unstarted), seconds.
RUN_GATE_POLL = 0.05


class RunGate:
    """How many of a queue's handlers may run at once in this process: ``limit``.

    A ``global_concurrency`` queue's process runs at most as many handlers as
    it holds usable slots (``slots.py``, which sets ``limit``), but it claims
    ahead like an unlimited queue: a claimed job waits in the inbox, then at
    this gate, until a handler of the queue returns. The limit counts
    handlers running (``active``): a handler thread enters just before the
    handler begins and leaves when it returns. ``None``: no limit (any other
    queue); ``active`` is counted all the same, so a limit set at runtime
    sees the handlers already running.

    Without a limit, entering and leaving take no lock: ``running`` holds an
    entry per handler running, and a deque's ``append`` and ``pop`` are atomic.
    A handler is counted before it looks at ``limit``, and ``lower`` sets
    ``limit`` before it counts, so either ``lower`` counts the handler or the
    handler sees the limit and waits for room under the lock. Under a limit, a
    handler on its way to the lock is counted for an instant; a waiter that saw
    it looks again at the next wake-up, at most ``RUN_GATE_POLL`` later.
    """

    __slots__ = ("cond", "limit", "running")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.limit: int | None = None
        self.running: deque[None] = deque()

    @property
    def active(self) -> int:
        return len(self.running)

    def enter_unlimited(self) -> bool:
        """Without a limit, count the caller's handler as running and say True; else
        False, without counting it (it must ``enter``)."""
        self.running.append(None)
        if self.limit is None:
            return True
        self.running.pop()
        return False

    def enter(
        self, given_up: Callable[[], bool], before_wait: Callable[[], object] | None = None
    ) -> bool:
        """Wait for room and count the caller's handler as running; False, without
        entering, once ``given_up()`` (its attempt will not run: it was cancelled,
        or given back at shutdown or when the process's slots went).
        ``before_wait``: called once, outside the lock, if there is no room at once.
        A caller on the hot path tries ``enter_unlimited`` first."""
        running = self.running
        with self.cond:
            while self.limit is not None and len(running) >= self.limit:
                if given_up():
                    self.cond.notify()  # a wake-up it took goes on to another waiter
                    return False
                if before_wait is not None:
                    self.cond.release()
                    try:
                        before_wait()
                    finally:
                        self.cond.acquire()
                    before_wait = None
                    continue  # room may have come meanwhile
                self.cond.wait(RUN_GATE_POLL)
            running.append(None)
            return True

    def leave(self) -> None:
        """A handler returned: one waiting thread may start its own."""
        self.running.pop()
        if self.limit is not None:
            # A limit set since this handler began, unseen here, leaves its
            # waiters to their RUN_GATE_POLL.
            with self.cond:
                self.cond.notify()

    def lower(self, limit: int) -> int:
        """Lower the limit to at most ``limit``; how many handlers run now (they only
        fall from here until the limit is raised: none enters beyond it)."""
        with self.cond:
            self.limit = limit if self.limit is None else min(self.limit, limit)
            return len(self.running)

    def set_limit(self, limit: int | None) -> None:
        with self.cond:
            self.limit = limit
            self.cond.notify_all()

    def wake(self) -> None:
        """Make waiting threads look again whether their attempt was given up."""
        with self.cond:
            self.cond.notify_all()


@dataclass(slots=True)
class QueueRunner:
    """One queue of the worker: the producer fills ``inbox``, its handler threads empty it."""

    name: str
    concurrency: int
    inbox: queue_module.SimpleQueue[Attempt | None] = field(
        default_factory=queue_module.SimpleQueue
    )
    wake: threading.Event = field(default_factory=threading.Event)  # claim now
    room: threading.Condition = field(default_factory=threading.Condition)
    held: int = 0  # claimed and not finished: running, or prefetched and waiting
    # Abandoned handler threads (handlers.HandlerPool.abandon) whose handler still
    # runs: out of ``held``, still counted in ``gate`` (guarded by running_lock).
    stuck: int = 0
    # While the producer waits for room (``wait_for_room``): ``held`` at or below
    # which a finished job wakes it; None while it does not wait.
    wake_at_held: int | None = None
    run_time: float | None = None  # moving average of handler run time, seconds
    inbox_wait: float | None = None  # moving average of claim-to-start time, seconds
    start_rate: float | None = None  # attempts begun per second, in the last period measured
    starts: int = 0  # attempts begun since starts_since (time.monotonic())
    drained: bool = False  # since starts_since, a handler took the inbox's last attempt
    starts_since: float = field(default_factory=time.monotonic)
    # Claims under fleet-wide limits (its producer keeps this). Until the producer
    # has read the queue's limits they are not known, so the completer hands no
    # sequence member on into it (a hand-on claims outside the limited claim).
    limited: bool = True
    limits_changed: bool = False  # set_queue_limits changed them: read them again now
    wake_fleet: bool = False  # claimed under the queue's lock: room it frees wakes every worker
    shared: SharedConcurrency | None = None  # AWA["WORKER_CONCURRENCY"], when set
    gate: RunGate = field(default_factory=RunGate)  # handlers running at once, when limited

    def prefetch(self, window: float | None, most: int) -> int:
        """How many jobs beyond ``concurrency`` to hold: what starts within ``window``.

        Under a ``RunGate`` limit (``global_concurrency``) only that many
        handlers start them: ``min(concurrency, gate.limit)`` stands for
        ``concurrency`` below.

        At most two claims' worth: handlers work through one batch while the
        next claim is under way. With one, they ran dry during each claim.

        The handlers' run time promises a start rate (``concurrency / run_time``)
        that a process short of CPU does not reach: 1 ms handlers promise 10,000
        starts a second on ten threads, and a process sharing its interpreter
        lock (or two cores) with others starts a fraction of that. Once claimed
        jobs wait in the inbox more than a quarter of ``window`` on average, the
        prefetch is at most what the handlers did start in ``window`` at their
        measured rate (at least ``concurrency``): a few claims' worth, never
        thousands of ``running`` rows no handler has begun. Held to it, jobs
        wait about half the window, so the bound stays on while the pace does
        not change; a quicker pace raises it with the measured rate.
        """
        if not window or self.run_time is None:
            return 0
        # Under a gate (global_concurrency) only its limit of handlers start them.
        limit = self.gate.limit
        places = self.concurrency if limit is None else min(self.concurrency, limit)
        ahead = min(2 * most, int(places * window / max(self.run_time, 1e-6)))
        if self.start_rate is not None and self.inbox_wait and self.inbox_wait > window / 4:
            ahead = min(ahead, max(places, int(self.start_rate * window)))
        return ahead

    def observe(self, seconds: float) -> None:
        previous = self.run_time
        self.run_time = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def observe_start(self, waited: float, now: float, *, drained: bool = False) -> None:
        """A handler began an attempt claimed ``waited`` seconds ago; ``drained``: it
        took the last one in the inbox.

        Keeps a moving average of the inbox wait, and the start rate over the
        last ``START_RATE_PERIOD``. A period's rate says how fast the handlers
        go only if they always had a job waiting: one in which the inbox ran
        dry measured the claims instead (bounding the prefetch by it would
        starve the handlers further), and one that spans more than twice the
        period held an idle gap; neither is taken, and the first lifts the
        bound. Handler threads call it holding the worker's ``running_lock``.
        """
        previous = self.inbox_wait
        self.inbox_wait = waited if previous is None else 0.8 * previous + 0.2 * waited
        self.starts += 1
        self.drained = self.drained or drained
        elapsed = now - self.starts_since
        if elapsed >= START_RATE_PERIOD:
            if self.drained:
                self.start_rate = None
            elif elapsed <= 2 * START_RATE_PERIOD:
                self.start_rate = self.starts / elapsed
            self.starts, self.starts_since, self.drained = 0, now, False

    def take_places(self, want: int) -> int:
        """Reserve up to ``want`` of the queue's free places now, without waiting (a
        sequence's hand-on, ``completer.reserve_hand_on``); how many it got. Within
        the concurrency alone: a handed-on member starts at once, it is no prefetch."""
        with self.room:
            taken = max(0, min(want, self.concurrency - self.held))
            self.held += taken
        if self.shared is not None and taken:
            granted = self.shared.take(self.name, taken, 0.0)
            self.give_places(taken - granted, shared=False)
            taken = granted
        return taken

    def give_places(self, n: int, *, shared: bool = True) -> None:
        """Give back ``n`` places ``take_places`` reserved and no job filled."""
        if n:
            with self.room:
                self.held -= n
                self.room.notify()
            if shared and self.shared is not None:
                self.shared.give(self.name, n)

    def wait_for_room(self, at_most: int, timeout: float) -> bool:
        """Wait, holding ``room``, until the queue holds at most ``at_most`` jobs or
        ``timeout`` seconds passed; whether it got there (``Producer.reserve``).

        Only the job that takes ``held`` there wakes it (``finished``), not every
        finished job while the handlers make room for a batch, each waking it to
        find the queue still short.
        """
        self.wake_at_held = at_most
        try:
            return self.room.wait_for(lambda: self.held <= at_most, timeout)
        finally:
            self.wake_at_held = None

    def finished(self) -> None:
        """A held job's place is free again (its handler is done, or it was given up)."""
        with self.room:
            self.held -= 1
            wake_at = self.wake_at_held
            if wake_at is not None and self.held <= wake_at:
                self.room.notify()
        if self.shared is not None:
            self.shared.give(self.name, 1)


# The least time the heartbeat's passes fail in a row before claims pause: a
# connection dropped alone is opened again by the next pass, within
# RECONNECT_FIRST and a PROGRESS_INTERVAL (about 0.35 s).
CLAIM_PAUSE_LEAST = 1.0
# How often a producer whose claims pause looks whether they resume, seconds.
CLAIM_PAUSE_POLL = 0.05


class ClaimPause:
    """The worker claims no job while its heartbeat cannot reach the database.

    A job claimed then gets no heartbeat: maintenance rescues it after
    ``STALE_AFTER`` while it runs here, and it runs twice. Such a heartbeat
    thread lost its connection (a server restart, ``pg_terminate_backend``, a
    pooler) and the server refuses it another (a role's or a database's
    ``CONNECTION LIMIT`` or ``max_connections`` reached, by this worker's
    handler threads or other clients; Django's pool with none free), while the
    producers' connections still work. Once its passes have failed in a row
    for ``after`` seconds (a ``HEARTBEAT_INTERVAL``, at least
    ``CLAIM_PAUSE_LEAST``, at most a quarter of ``STALE_AFTER``: a single
    dropped connection, opened again by the next pass, pauses nothing), the
    producers (``holds``) and the completer's hand-on of sequences claim
    nothing until a pass goes through. Jobs already claimed run on.

    ``failing_since`` (``time.monotonic()`` when the failing passes began;
    ``inf`` while they go through) is written by the heartbeat thread alone
    and read without a lock before every claim; ``lock`` orders the WARNING
    that claims pause, logged once by the first producer to find them paused,
    with the INFO that they resume.
    """

    def __init__(self, conf: AwaSettings) -> None:
        self.after = min(max(CLAIM_PAUSE_LEAST, conf.heartbeat_interval), conf.stale_after / 4)
        self.stale_after = conf.stale_after
        self.failing_since = math.inf
        self.error = ""  # the failing heartbeat's last error, for the WARNING
        self.paused = False  # the WARNING was logged; the INFO is due at the resume
        self.lock = threading.Lock()

    def holds(self) -> bool:
        """Whether claims pause now: the heartbeat's passes failed for ``after`` seconds."""
        failing = time.monotonic() - self.failing_since  # -inf while they go through
        if failing <= self.after:
            return False
        if not self.paused:
            with self.lock:
                if self.paused or self.failing_since == math.inf:
                    return True  # logged by another producer; or resumed meanwhile
                self.paused = True
            logger.warning(
                "django-awa: the heartbeat has not reached the database for %.1fs (%s): "
                "this worker claims no jobs until it does, since a job claimed now would "
                "get no heartbeat and be rescued after STALE_AFTER (%.0fs) to run a second "
                "time; the jobs it runs keep running",
                failing, self.error, self.stale_after,
            )  # fmt: skip
        return True

    def failed(self, began: float, exc: BaseException) -> None:
        """A heartbeat pass begun at ``began`` raised a database error."""
        self.error = one_line(exc)
        if self.failing_since == math.inf:
            self.failing_since = began

    def went_through(self) -> None:
        """A heartbeat pass went through: claims resume. A comparison while none failed."""
        if self.failing_since == math.inf:
            return
        with self.lock:
            failed_for = time.monotonic() - self.failing_since
            self.failing_since = math.inf
            paused, self.paused = self.paused, False
        if paused:
            logger.info(
                "django-awa: the heartbeat reached the database again after %.1fs; "
                "this worker claims jobs again",
                failed_for,
            )


@dataclass(eq=False)
class WorkerState:
    """The fields a worker's services share; ``running_lock`` guards ``running``,
    ``waiting`` and ``kept``.

    ``stopping`` stops claiming, ``halt`` stops everything now. ``results``
    takes every attempt's result for the completer (``None`` ends it).
    """

    alias: str
    conf: AwaSettings
    name: str  # host:pid, for logs and the maintenance lease
    queues: dict[str, QueueRunner]
    # The most connections this worker holds: told at start-up, and in the
    # error of an attempt whose handler the server refused a connection.
    need: ConnectionNeed
    # This process's row in the worker registry (fleet.py), and when it started.
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    stopping: threading.Event = field(default_factory=threading.Event)
    halt: threading.Event = field(default_factory=threading.Event)
    results: queue_module.SimpleQueue[AttemptResult | None] = field(
        default_factory=queue_module.SimpleQueue
    )
    running: dict[int, Attempt] = field(default_factory=dict)  # claimed, not finished
    waiting: set[int] = field(default_factory=set)  # claimed ids no handler has started yet
    # Lost attempts of kinds with awa.Limit(concurrency=...) whose handler thread
    # was abandoned and still runs, by (job id, run_lease): out of ``running``,
    # but their key's lease is kept for them, renewed by the heartbeat until the
    # handler returns (handlers.HandlerPool.abandon) and freed at exit.
    kept: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    running_lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)
    processed: int = 0  # attempts finished, for the log at exit
    # Outcomes counted since the last heartbeat, for the admin dashboard (dashboard.py).
    tally: Tally = field(default_factory=Tally)
    # Results waiting for the completer: past this, producers stop claiming,
    # so claimed-but-unrecorded jobs stay bounded when the database is slow.
    backlog_limit: int = 1000
    # This worker's wake-ups after its own commits (wakeups.py), sent by the listener.
    outbox: Outbox = field(init=False)
    # Whether producers claim: not while the heartbeat cannot write (ClaimPause).
    claim_pause: ClaimPause = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.alias, self.wake)
        self.claim_pause = ClaimPause(self.conf)

    def count_outcomes(
        self, written: list[AttemptResult], running: dict[int, Attempt] | None = None
    ) -> None:
        """Count the outcomes this worker wrote: for the dashboard (``tally``) and, with
        the otel extra, ``awa.jobs.finished``. ``running``: for the inbox waits."""
        self.tally.record(written, running)
        count_written(written)

    @property
    def direct(self) -> str | None:
        """The alias the listener LISTENs on; None: no listener, the worker polls.

        ``AWA["DIRECT_DATABASE"]`` reaches ``AWA["DATABASE"]``'s database. A worker
        on another alias (``awa_worker --database``) listens on its own: its jobs'
        NOTIFYs are sent there, and a cancel NOTIFYed in another database names a
        job id of that database's table, not one of this worker's jobs.
        """
        direct = self.conf.direct_database
        if direct is None or self.alias == self.conf.database:
            return direct
        return self.alias

    @classmethod
    def create(
        cls, queues: dict[str, int], *, alias: str | None = None, conf: AwaSettings | None = None
    ) -> WorkerState:
        """The state of a worker running ``queues`` (name: concurrency) on ``alias``."""
        conf = conf or awa_settings()
        alias = alias or conf.database
        runners = {name: QueueRunner(name=name, concurrency=n) for name, n in queues.items()}
        if conf.worker_concurrency is not None:
            configured = conf.queues
            shared = SharedConcurrency(
                conf.worker_concurrency,
                mins={
                    n: min(configured[n].min, r.concurrency) if n in configured else 0
                    for n, r in runners.items()
                },
                weights={n: configured[n].weight if n in configured else 1 for n in runners},
            )
            for runner in runners.values():
                runner.shared = shared
        return cls(
            alias=alias,
            conf=conf,
            name=f"{socket.gethostname()}:{os.getpid()}",
            queues=runners,
            need=connection_need(queues, alias, listener=conf.direct_database is not None),
            backlog_limit=max(1000, 2 * sum(queues.values())),
        )

    def forget(self, job: JobRow) -> None:
        """Stop tracking this attempt of ``job``: its outcome is written.

        Only this attempt: once its outcome is written (a snooze, say) the job
        may already be claimed again, and that attempt is tracked under the
        same id.
        """
        self.forget_all((job,))

    def forget_all(self, jobs: Iterable[JobRow]) -> None:
        """``forget`` each of ``jobs``, under one hold of ``running_lock`` (a written batch:
        a hold per job contended with the handler threads for every job)."""
        running = self.running
        with self.running_lock:
            for job in jobs:
                tracked = running.get(job.id)
                if tracked is not None and tracked.job.run_lease == job.run_lease:
                    del running[job.id]
                self.processed += 1

    def withdraw_waiting(self, queue: str | None = None) -> list[Attempt]:
        """Take the claimed attempts no handler has started (of ``queue``, default all):
        none of them will start now. The handler threads that take them from the
        inbox, or wait with them at the queue's ``RunGate``, find them gone."""
        running = self.running
        with self.running_lock:
            ids = [
                i for i in self.waiting
                if (a := running.get(i)) is None or queue is None or a.job.queue == queue
            ]  # fmt: skip
            withdrawn = [running.pop(i) for i in ids if i in running]
            self.waiting.difference_update(ids)
        for name, runner in self.queues.items():
            if queue is None or name == queue:
                runner.gate.wake()
        return withdrawn

    def wake(self, names: set[str] | None = None) -> None:
        """Make the producers of queues ``names`` (default: all) claim now."""
        for name, runner in self.queues.items():
            if names is None or name in names:
                runner.wake.set()

    def start(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Run ``target`` in a new daemon thread that closes its connections when it ends."""

        worker = self.name

        def run() -> None:
            set_worker(worker)  # this thread's records name its worker
            try:
                target()
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread
