"""The producer: one per queue, claiming jobs while the queue has room.

It sleeps on the queue's wake-up event (set by the listener on NOTIFY, by
maintenance when it makes jobs due, at shutdown) or for the poll interval.
While handlers are quick it claims ahead what they will start within
``PREFETCH_WINDOW``, so they never wait for a claim's round trip; slow
handlers get no prefetch. Claimed attempts go to the queue's inbox, where its
handler threads (``handlers.py``) take them.

A queue claimed under its lock (SPEC 12: a rate limit, kind rate limits) claims
without prefetch (a job claimed ahead would count as started while it waits).
Per-key leases allow it: a job claimed ahead holds its own key's place, which
only its own handler would use. A ``global_concurrency`` is kept by slot
leases (``slots.py``): the process runs at most as many of the queue's handlers
as it holds usable slots (the queue's ``RunGate``), and claims those and a
prefetch, with ``sql.CLAIM_UNFLUSHED`` (the plain claim, committed without
waiting for its WAL flush). Kinds whose
``awa.Limit`` is a concurrency limit only (per key with ``by``) are kept by
per-key leases taken in the claim statement itself (``sql.CLAIM_KEYED``, after
the queue's lock, which its claimers try rather than wait for). A
``rate_limit``, or kinds with an ``awa.Limit(rate=...)``, claim with
``sql.CLAIM_LIMITED`` after ``sql.LOCK_LIMITS``; every other queue keeps
``sql.CLAIM``. Which one applies is read again once per poll interval, so
limits set at runtime reach every worker within one. Meanwhile some workers
claim a queue under its lock and others with leases alone; the locked claim
takes the same per-key leases for kinds with a concurrency limit, so the two
agree on every key at every instant.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections, transaction

from . import db, sql, wakeups
from .conf import AwaSettings, Rate, awa_settings
from .execute import Attempt, unstarted
from .finalize import finalize
from .kinds import registry
from .models import ClaimedJob, claimed_jobs
from .slots import SHORT_RETRY, Slots
from .state import CLAIM_PAUSE_POLL, DB_ERRORS, QueueRunner, WorkerState, log_context

logger = logging.getLogger(__name__)

# How long a busy queue's producer may wait for more room to claim together.
GATHER_SECONDS = 0.005
# The most candidates a limited claim of a queue with kind limits ranks (4x the
# batch, at least 100, at most this); a saturated key's rows are passed over
# before they count, so this bounds the work, not who gets a turn.
LIMITED_SCAN = 2000
# How many candidates a keyed claim (sql.CLAIM_KEYED) reads and locks beyond the
# jobs it asks for: room for a few of a key beyond its limit, not so many that
# the rows it locks and leaves are what the other claimers wanted (twice the
# batch measured no better in flow_control.py's keyed drain).
KEYED_SCAN_EXTRA = 16
# How long a keyed claim that took less than it asked for keeps its claimer
# from claiming again, once woken, as a multiple of the time it took
# (``Producer.claim_gap``). Such a claim reads past the available rows of
# every key at its limit, and every outcome batch of the fleet wakes every
# worker's claimer: in flow_control.py's keyed drain, claims read them all
# over again for the few keys each batch freed (most of PostgreSQL's CPU).
# Waiting as long as the reading took lets more keys free for the next one,
# and spends at most half of the claimer's time reading; a quick claim (few
# rows passed over) is hardly held back. A claimer woken later than that (a
# job enqueued on an idle queue) claims at once.
KEYED_CLAIM_GAP_RATIO = 1.0
# The most candidates a claim of a queue with sequence members reads (the free
# ones claimed, the others parked): the first claim of a long sequence parks
# this many of its waiting members, the next ones the rest.
SEQUENCED_SCAN = 500
# How long a limited claimer that found its queue's lock held waits for a
# wake-up before it tries again (LOCK_LIMITS: it does not queue for the lock).
LOCKED_RETRY = 0.02
# Shortest wait between claims of a rate-limited queue that took less than it
# asked for: a slot of the window frees every period / N seconds.
RATE_TICK = 0.01
# How long after its claim's stamp a job claimed under a rate may still start its
# handler, in seconds. The claim stamps the starts it counts, but a handler
# begins a little later (the claim's commit, the hand-off to a handler thread:
# a few ms, tens on a loaded machine), by a delay that varies: a burst claimed
# at the end of one window could start beside the next window's, up to 2N in
# one. So the claim counts each rate's window over its period and this, and a
# job not started by then is given back unstarted (``HandlerPool.execute``):
# every handler starts within this of its stamp, and no window of the period
# holds more than N handler starts. The price: at most N starts per period and
# this (N per 1.1 s for "N/s", per 60.1 s for "N/m"). What came before the
# stamp is not counted (``_stamped_after``): a worker's first claim, which opens
# its connection and plans the statement (tens of ms), gives none back for it.
RATED_START_WITHIN = 0.1


@dataclass(frozen=True, slots=True)
class LockedClaim:
    """What one claim under the queue's lock started."""

    jobs: list[ClaimedJob]  # in claim order
    # A time.monotonic() no later than the claim's stamp (``_stamped_after``).
    stamped_after: float


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """A queue's limits as a claim applies them: settings, overridden at runtime."""

    queue: str
    global_concurrency: int | None
    rate_limit: Rate | None
    kinds: str  # registry.limits_json(queue)
    sequenced: bool = False  # a kind on the queue declares sequence=
    concurrency_only: bool = False  # every kind limit on the queue is a concurrency limit

    @property
    def limited(self) -> bool:
        return (
            self.global_concurrency is not None or self.rate_limit is not None or self.kinds != "{}"
        )

    @property
    def leased(self) -> bool:
        """Its ``global_concurrency`` is kept by slot leases (``slots.py``)."""
        return self.global_concurrency is not None

    @property
    def keyed(self) -> bool:
        """Its only limits but a ``global_concurrency`` are its kinds' concurrency limits:
        kept by per-key leases in the claim itself (``sql.CLAIM_KEYED``), no lock."""
        return self.rate_limit is None and self.kinds != "{}" and self.concurrency_only

    @property
    def locked(self) -> bool:
        """It claims with ``sql.CLAIM_LIMITED`` under the queue's lock (a rate, kind rate
        limits), which logs each start in ``awa_attempt_start``."""
        return self.rate_limit is not None or (self.kinds != "{}" and not self.keyed)

    @property
    def gated(self) -> bool:
        """Its claim itself holds jobs back, under the lock or by key leases: room
        freed anywhere wakes every worker's claimers, and a claim that took
        nothing may say which limit held the jobs (``why_held_back``)."""
        return self.locked or self.keyed

    @property
    def rate_wait(self) -> float | None:
        """How soon a claim that was held back by a rate should try again."""
        periods = [self.rate_limit.period / self.rate_limit.count] if self.rate_limit else []
        for entry in json.loads(self.kinds).values():
            if "rn" in entry:
                periods.append(entry["rs"] / entry["rn"])
        return max(RATE_TICK, min(periods)) if periods else None

    def lock_keys(self) -> list[str]:
        # One lock per queue: a limited kind's jobs run on its declared queue only.
        return [f"q:{self.queue}"]

    def params(self, limit: int, scan: int, *, leased: bool = False) -> dict[str, Any]:
        """The parameters of ``sql.CLAIM_LIMITED`` (and ``HELD_BACK``) but the deadlines.

        The settings' limits go in; ``awa_queue.limits`` overrides them in the
        statement itself, so a change made at runtime applies to the next claim.
        With ``leased`` the claimer's slot leases keep the global concurrency:
        the statement leaves it out.
        """
        rate = self.rate_limit
        return {
            "queue": self.queue,
            "scope": f"q:{self.queue}",
            "kinds": self.kinds,
            "q_conc": self.global_concurrency,
            "leased": leased,
            "q_rate_count": None if rate is None else rate.count,
            "q_rate_period": None if rate is None else rate.period,
            "limit": limit,
            "scan": scan,
            "start_within": RATED_START_WITHIN,
        }


def queue_limits(queue: str, alias: str, conf: AwaSettings | None = None) -> QueueLimits:
    """``queue``'s limits now: ``AWA["QUEUES"]``, then what ``set_queue_limits`` stored."""
    conf = conf or awa_settings()
    configured = conf.queues.get(queue)
    concurrency = configured.global_concurrency if configured else None
    rate = configured.rate_limit if configured else None
    row = db.fetch_one(alias, sql.QUEUE_LIMITS, {"queue": queue})
    stored: Any = row[0] if row else None  # jsonb: text on the libpq fast path
    runtime: dict[str, Any] = (json.loads(stored) if isinstance(stored, str) else stored) or {}
    if "global_concurrency" in runtime:
        concurrency = runtime["global_concurrency"]
    if "rate_limit" in runtime:
        text = runtime["rate_limit"]
        rate = (
            None
            if text is None
            else Rate(count=runtime["rate_count"], period=runtime["rate_period"], text=text)
        )
    kinds = registry.limits_json(queue)
    return QueueLimits(
        queue=queue,
        global_concurrency=concurrency,
        rate_limit=rate,
        kinds=kinds,
        concurrency_only=all("rn" not in entry for entry in json.loads(kinds).values()),
        sequenced=any(spec.sequence and spec.queue == queue for spec in registry.workers.values()),
    )


def claim(queue: str, limit: int, alias: str, *, unflushed: bool = False) -> list[ClaimedJob]:
    """Claim up to ``limit`` runnable jobs of ``queue``, in priority, run_at, id order.

    Each claimed row is ``running`` with a new ``run_lease``: the attempt's
    guard for every later write. Commits at once (autocommit): a claim must be
    visible to other workers' SKIP LOCKED and to maintenance. ``unflushed``
    (a queue kept by slot leases): without waiting for the commit's WAL flush
    (``sql.CLAIM_UNFLUSHED``).
    """
    statement = sql.CLAIM_UNFLUSHED if unflushed else sql.CLAIM
    return _run_claim(statement, {"queue": queue, "limit": limit}, alias)


def _run_claim(statement: str, params: dict[str, Any], alias: str) -> list[ClaimedJob]:
    """Run a claim statement (autocommit) with ``params`` and the kinds' deadlines;
    the jobs it started, in claim order."""
    return _in_claim_order(claimed_jobs(_claim_rows(statement, params, alias)))


def _claim_rows(statement: str, params: dict[str, Any], alias: str) -> list[Any]:
    """The rows a claim statement started, as fetched (``claimed_jobs`` makes them jobs)."""
    params["deadlines"] = registry.deadlines_json()
    params["default_deadline"] = awa_settings().default_deadline
    with db.cursor(alias) as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall()


# The order a claim's jobs start in, as its statement picked them.
_CLAIM_ORDER = operator.attrgetter("priority", "run_at", "id")


def _in_claim_order(jobs: list[ClaimedJob]) -> list[ClaimedJob]:
    """``jobs`` sorted as their handlers start them: priority, run_at, id."""
    jobs.sort(key=_CLAIM_ORDER)
    return jobs


def claim_sequenced(queue: str, limit: int, alias: str) -> list[ClaimedJob]:
    """``claim`` for a queue that holds sequence members: the same jobs, and the
    members passed over because an earlier member is unfinished are parked
    (``sql.CLAIM_SEQUENCED``), so the next claims of the queue do not read them
    again. One statement, committed at once."""
    params = {"queue": queue, "limit": limit, "scan": max(SEQUENCED_SCAN, 4 * limit)}
    return _run_claim(sql.CLAIM_SEQUENCED, params, alias)


def claim_limited(
    limits: QueueLimits, limit: int, alias: str, *, leased: bool = False
) -> LockedClaim | None:
    """Claim up to ``limit`` jobs of a limited queue, as many as its limits allow now.

    One transaction: the advisory lock of the queue (``sql.LOCK_LIMITS``), then
    the one claim statement, whose snapshot sees every attempt the previous
    lock holder started. Commits before returning. Returns the jobs it started
    and from when their handlers' bound runs (``LockedClaim``); ``None``, claiming
    nothing, when another claimer holds the lock: it is claiming what is free.
    With ``leased``, the caller's slot leases keep the global concurrency
    (``limit`` is within its free slots) and the statement counts only the rest.
    """
    # Without kind limits every candidate fits (the sequence check is made in the
    # scan): the batch itself is enough. With them, a key's second job does not.
    scan = limit if limits.kinds == "{}" else min(LIMITED_SCAN, max(100, 4 * limit))
    params = limits.params(limit, scan, leased=leased)
    return _claim_under_lock(limits, sql.CLAIM_LIMITED, params, alias)


def _claim_under_lock(
    limits: QueueLimits, statement: str, params: dict[str, Any], alias: str
) -> LockedClaim | None:
    """One transaction: try the queue's advisory lock (``sql.LOCK_LIMITS``), then run
    the claim ``statement``, whose snapshot sees every attempt and lease the
    previous holder took. ``None``, claiming nothing, when another claimer holds
    the lock. The rows become jobs after the commit, so the lock is held for the
    statement alone."""
    with transaction.atomic(using=alias):
        with db.cursor(alias) as cursor:
            asked = time.monotonic()  # the connection is open: its set-up is not counted
            cursor.execute(sql.LOCK_LIMITS, {"keys": limits.lock_keys()})
            locked = cursor.fetchone()
        if not (locked and locked[0]):
            return None
        sent = time.monotonic()
        rows = _claim_rows(statement, params, alias)
        answered = time.monotonic()
    jobs = _in_claim_order(claimed_jobs(rows))
    # The claim stamps its attempts' heartbeat_at with its clock (t.now).
    stamp = jobs[0].heartbeat_at if jobs else None
    return LockedClaim(jobs, _stamped_after(asked, locked[1], sent, answered, stamp))


def _stamped_after(
    asked: float, locked_at: datetime, sent: float, answered: float, stamp: datetime | None
) -> float:
    """A ``time.monotonic()`` no later than a locked claim's ``stamp``, as late as known.

    The claim statement was ``sent`` before the server stamped it (its
    ``clock_timestamp()`` once planned): that bound leaves out what came before
    (a new connection's set-up, the lock's round trip). The server's time before
    the stamp is most of a worker's first claim (planning a statement its
    connection never planned, reading the catalog for it), and is left out too:
    ``asked`` (before LOCK_LIMITS was sent) and the time from LOCK_LIMITS's clock
    (``locked_at``) to the stamp, both read on the database's one clock. Never
    more than ``answered - asked``: the stamp came before the answer, whatever a
    step of the database's clock says meanwhile.
    """
    if stamp is None:
        return sent
    on_server = (stamp - locked_at).total_seconds()
    return max(sent, asked + min(on_server, answered - asked))


def claim_keyed(
    limits: QueueLimits, limit: int, alias: str, *, scan: int | None = None
) -> list[ClaimedJob] | None:
    """Claim up to ``limit`` jobs of a queue whose only kind limits are concurrency
    limits, each attempt of a limited kind taking a lease of its key
    (``sql.CLAIM_KEYED``). A job whose key is full stays available, its attempt unused.

    One transaction, as ``claim_limited``: the queue's advisory lock
    (``sql.LOCK_LIMITS``, tried, never waited for), then the claim, whose snapshot
    sees every lease the previous holder took. Returns ``None``, claiming
    nothing, when another claimer holds the lock. Unserialized, two claimers met
    on the same keys: one skipped the rows the other held locked and went on to
    the next rows of the same keys (jobs of many keys arrive interleaved), whose
    leases the other was taking, and claimed nothing after waiting for its
    commit; in flow_control.py's keyed drain the lock took it from 14,400-15,200
    to 16,300-18,400 jobs/s. Claimers of other queues never meet it.

    ``scan``: how many candidates it reads and locks (default ``limit`` and
    ``KEYED_SCAN_EXTRA``).
    """
    if scan is None:
        scan = min(LIMITED_SCAN, limit + KEYED_SCAN_EXTRA)
    params = {"queue": limits.queue, "kinds": limits.kinds, "limit": limit, "scan": scan}
    claimed = _claim_under_lock(limits, sql.CLAIM_KEYED, params, alias)
    return None if claimed is None else claimed.jobs


def held_back(limits: QueueLimits, alias: str) -> int:
    """How many of the queue's due jobs its limits or their sequences hold back now."""
    with db.cursor(alias) as cursor:
        if not limits.limited:
            cursor.execute(sql.HAS_SEQUENCED, {"queue": limits.queue})
            if not cursor.fetchone():
                return 0  # nothing holds a job of an unlimited queue back
        cursor.execute(sql.HELD_BACK, limits.params(1_000_000, 1_000_000))
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def why_held_back(limits: QueueLimits, alias: str) -> str:
    """Why a claim of ``limits.queue`` took nothing, in words (for the DEBUG log)."""
    params = limits.params(1_000_000, 1_000_000)
    with db.cursor(alias) as cursor:
        cursor.execute(sql.LIMITS_DIAGNOSIS, params)
        row = cursor.fetchone()
    room, due, candidates, fitting = row if row else (0, 0, 0, 0)
    if not due:
        return "no job is due"
    if not room:
        return (
            f"{due} due job(s) held back: the queue is paused or at its limit "
            f"(global_concurrency={limits.global_concurrency}, rate_limit="
            f"{limits.rate_limit.text if limits.rate_limit else None})"
        )
    if not fitting:
        return (
            f"{due} due job(s) held back by their kind's awa.Limit or their sequence "
            f"({candidates} not at a limit but waiting for the job before them, or locked)"
        )
    return f"{fitting} job(s) could start but were locked by another claimer"


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
        self.limits: QueueLimits | None = None  # read again every poll interval
        self.limits_read = 0.0  # time.monotonic() of that read
        self.held_back = False  # the last limited claim took less than it asked for
        self.sequenced = False  # a claim of this queue has met a sequence member
        self.skipped = False  # the last limited claim found the queue's lock held
        self.slots: Slots | None = None  # its process's slots of a global_concurrency queue
        self.claimed = 0.0  # time.monotonic() when the last claim returned
        self.claim_took = 0.0  # how long its last claim under the queue's lock took, seconds

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
        pause = state.claim_pause
        while not state.stopping.is_set():
            if state.results.qsize() > state.backlog_limit:
                state.stopping.wait(0.01)
                continue
            if pause.holds():  # the heartbeat cannot write: a job claimed would run twice
                state.stopping.wait(CLAIM_PAUSE_POLL)
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
                runner.wake.wait(self.idle_wait())
                gap = self.claim_gap()
                if gap:
                    state.stopping.wait(gap)

    def idle_wait(self) -> float:
        """How long to sleep when the last claim did not fill: the poll interval, less
        for a rate-limited queue held back (its window frees a slot every period / N)."""
        poll = self.state.conf.poll_interval
        if self.skipped:
            return min(poll, LOCKED_RETRY)
        rate_wait = self.limits.rate_wait if self.limits and self.held_back else None
        return poll if rate_wait is None else min(poll, rate_wait)

    def claim_gap(self) -> float:
        """How long to wait, once woken, before claiming again: after a keyed claim
        that took less than it asked for, what is left since it returned of
        ``KEYED_CLAIM_GAP_RATIO`` times the time it took; else nothing."""
        if not (self.held_back and self.limits is not None and self.limits.keyed):
            return 0.0
        pause = KEYED_CLAIM_GAP_RATIO * self.claim_took
        return max(0.0, pause - (time.monotonic() - self.claimed))

    def current_limits(self) -> QueueLimits:
        """The queue's limits, read again when a poll interval has passed since the last
        read, or at once when ``set_queue_limits`` changed them (``limits_changed``,
        set by the listener). A changed ``global_concurrency`` rebalances the slots
        at once too."""
        now = time.monotonic()
        runner = self.runner
        if (
            self.limits is None
            or runner.limits_changed
            or now - self.limits_read >= self.state.conf.poll_interval
        ):
            runner.limits_changed = False  # a change notified during the read reads again
            before = self.limits
            self.limits = queue_limits(runner.name, self.state.alias, self.state.conf)
            self.limits_read = now
            if (
                self.slots is not None
                and before is not None
                and before.global_concurrency != self.limits.global_concurrency
            ):
                self.slots.checked = float("-inf")  # due now (Slots.due)
            # Any limit keeps the completer from handing a sequence on into this
            # queue; only a queue claimed under its lock or with key leases has the
            # fleet's claimers woken when room frees (slot leases need no wake-up
            # from elsewhere).
            self.runner.limited = self.limits.limited
            self.runner.wake_fleet = self.limits.gated
        return self.limits

    def slot_room(self, limits: QueueLimits, reserved: int = 0) -> int | None:
        """How many more jobs the process's slots let it claim (``None``: no
        ``global_concurrency``), ``reserved`` of ``runner.held`` not claimed yet.

        Rebalances the slots when due (``Slots.due``); gives them all back once
        the queue is no longer limited. Called holding the shared connection.
        """
        runner, state = self.runner, self.state
        if limits.global_concurrency is None:
            if self.slots is not None:
                self.slots.give_back_all()
                self.slots = None
                runner.gate.set_limit(None)
            return None
        if self.slots is None:
            self.slots = Slots(runner.name, state.id, state.alias, state.conf.stale_after)
            self.slots.interval = state.conf.poll_interval
        if self.slots.due(state.conf.poll_interval):
            self.slots.rebalance(
                limits.global_concurrency, runner.concurrency, runner.gate, busy=self.busy
            )
        return max(0, self.slot_cap(limits) - (runner.held - reserved))

    def slot_cap(self, limits: QueueLimits) -> int:
        """The most jobs the process may hold of a queue kept by slot leases: as many
        as may run (its usable slots, within its concurrency) and the prefetch.

        The slots bound the handlers running (``RunGate``), not the jobs claimed:
        a job claimed ahead waits in the process, still unstarted, for one of
        them, so a place gets its next job without a claim's round trip between
        two. None claimed ahead under the queue's lock (a rate limit as well):
        the lock's claim counts its attempts as they are claimed.
        """
        usable = self.slots.usable if self.slots is not None else 0
        # An abandoned handler still running keeps its slot (it is counted in the
        # gate until it returns): no job is claimed to wait for that place.
        usable = max(0, usable - self.runner.stuck)
        if not usable:
            return 0
        if limits.locked:
            return min(usable, self.runner.concurrency)
        conf = self.state.conf
        ahead = self.runner.prefetch(conf.prefetch_window, conf.claim_batch_size)
        return min(usable, self.runner.concurrency) + ahead

    def give_back_waiting(self) -> int:
        """Give back the queue's claimed jobs no handler has started (its process has
        no usable slot now): ``available`` again at once, their attempt unused, as at
        shutdown. Their places are freed by the handler threads that take them from
        the inbox, or wait for them at the gate, and find them given up.
        Called holding the shared connection; how many it gave back. Should the
        write fail (raised), they stay ``running`` untracked until maintenance
        rescues them, as at shutdown.
        """
        state, name = self.state, self.runner.name
        attempts = state.withdraw_waiting(name)
        if not attempts:
            return 0
        for attempt in attempts:
            attempt.cancelled.set()
        with wakeups.after_commit(state.alias, state.outbox):
            finalize([unstarted(attempt.job) for attempt in attempts], state.alias)
        logger.info(
            "queue %s: gave back %s claimed job(s) no handler started (no usable slot): %s",
            name, len(attempts), ", ".join(str(a.job.id) for a in attempts),
        )  # fmt: skip
        return len(attempts)

    def run_once(self) -> list[ClaimedJob] | None:
        """Claim one batch, as much as the queue has room for, and put it in the inbox.

        Returns the jobs claimed, or ``None`` when the queue had no room
        within half a second. A database error is raised, the room given back.
        """
        state, runner = self.state, self.runner
        cap = None  # the most the process may hold: its usable slots and the prefetch
        if self.limits is None or self.limits.leased:
            with self._turn():
                limits = self.current_limits()
                if self.slot_room(limits) is not None:
                    cap = self.slot_cap(limits)
                    if not cap:
                        self.give_back_waiting()
        # No prefetch under the lock (a job claimed ahead would count as started
        # there), but under leases: a key claimed ahead holds its own place only, and
        # one claimed within slots waits for a slot in the process (``RunGate``).
        known = self.limits
        prefetch = known is None or not known.locked
        if cap == 0:
            # No usable slot: no room will come before a rebalance (soon while it
            # wants slots: Slots.short), so it does not wait for any.
            state.stopping.wait(SHORT_RETRY)
            return None
        want = self.reserve(self.busy, prefetch=prefetch, cap=cap)
        if not want:
            return None
        runner.wake.clear()
        try:
            with self._turn():
                # Read after the wait for room, which may have outlasted a poll interval.
                limits = self.current_limits()
                free = self.slot_room(limits, want)
                if free is not None and free < want:
                    self.unreserve(want - free)
                    want = free
                skipped = False
                start_by = None
                if not want:
                    jobs = []
                elif limits.gated:  # under the queue's lock, which another may hold
                    started = time.monotonic()
                    if limits.locked:
                        locked = claim_limited(limits, want, state.alias, leased=limits.leased)
                        taken = None if locked is None else locked.jobs
                        if locked is not None and taken:
                            # Its handlers start within RATED_START_WITHIN of its stamp,
                            # or not at all.
                            start_by = locked.stamped_after + RATED_START_WITHIN
                    else:
                        taken = claim_keyed(limits, want, state.alias)
                    self.claim_took = time.monotonic() - started
                    skipped = taken is None
                    jobs = taken or []
                elif limits.sequenced or self.sequenced:
                    jobs = claim_sequenced(runner.name, want, state.alias)
                else:
                    jobs = (
                        claim(runner.name, want, state.alias, unflushed=True)
                        if limits.leased
                        else claim(runner.name, want, state.alias)
                    )
                    # A member enqueued with EnqueueRequest(sequence=) on a queue
                    # whose kinds declare none: park its sequence's waiting members
                    # from now on.
                    self.sequenced = any(
                        job.metadata and "awa_sequence" in job.metadata for job in jobs
                    )
        except BaseException:
            self.unreserve(want)
            raise
        self.claimed = time.monotonic()
        self.busy = len(jobs) == want > 0 or (not want and self.busy)
        self.held_back = limits.gated and not self.busy
        self.skipped = skipped
        if runner.shared is not None:
            runner.shared.busy(runner.name, self.busy)
        self.unreserve(want - len(jobs))
        debug = logger.isEnabledFor(logging.DEBUG)
        if debug and skipped:
            logger.debug("queue %s: claimed nothing: another worker is claiming", runner.name)
        elif debug and not jobs:
            with self._turn():
                reason = why_held_back(limits, state.alias) if limits.gated else "none is due"
            logger.debug("queue %s: claimed nothing: %s", runner.name, reason)
        alias, running, waiting, lock, inbox = (
            state.alias, state.running, state.waiting, state.running_lock, runner.inbox
        )  # fmt: skip
        attempts = [Attempt(job=job, alias=alias, start_by=start_by) for job in jobs]
        # Every attempt of the batch is tracked (running, waiting) before the first
        # reaches a handler, under one hold of the lock the handler threads take for
        # each job: a hold per job contended with them for every job of the batch.
        with lock:
            for attempt in attempts:
                running[attempt.job.id] = attempt
                waiting.add(attempt.job.id)
        for attempt in attempts:
            if debug:
                job = attempt.job
                logger.debug("claimed job %s kind=%s attempt=%s", job.id, job.kind,
                             job.attempt, extra=log_context(job, state.name))  # fmt: skip
            inbox.put(attempt)
        return jobs

    def reserve(self, busy: bool, *, prefetch: bool = True, cap: int | None = None) -> int:
        """Wait for room on the queue and reserve it; return how many jobs to claim.

        Room is the concurrency plus the prefetch. While a queue is busy,
        handlers make room one job at a time: claiming at the first free place
        would mean one claim statement (and one commit) per job. Waiting up to
        ``GATHER_SECONDS`` for half the room keeps batches large; an idle queue
        (not busy) claims at once, so pickup latency does not suffer. Without
        ``prefetch`` (a queue claimed under its lock) room is the concurrency
        alone; ``cap`` bounds it further (what the process's slot leases allow,
        ``slot_cap``).
        """
        runner = self.runner
        most = self.state.conf.claim_batch_size
        ahead = runner.prefetch(self.state.conf.prefetch_window, most) if prefetch else 0
        capacity = runner.concurrency + ahead
        if cap is not None:
            capacity = min(capacity, cap)
        with runner.room:
            if runner.held >= capacity and not runner.wait_for_room(capacity - 1, 0.5):
                return 0
            if busy:
                runner.wait_for_room(capacity - min(most, capacity) // 2, GATHER_SECONDS)
            want = max(0, min(most, capacity - runner.held))
            runner.held += want
        if runner.shared is not None and want:
            # The process-wide cap: what the queue's minimum and weight allow of it.
            granted = runner.shared.take(runner.name, want, 0.5)
            with runner.room:
                runner.held -= want - granted
                runner.room.notify()
            want = granted
        return want

    def unreserve(self, n: int) -> None:
        """Give back ``n`` reserved places the claim did not fill."""
        if n:
            runner = self.runner
            with runner.room:
                runner.held -= n
                runner.room.notify()
            if runner.shared is not None:
                runner.shared.give(runner.name, n)
