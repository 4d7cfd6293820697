"""Maintenance, run by the one worker holding the leader lock.

Duties: promote due scheduled and retryable jobs and move finished rows into
``awa_job_done`` (every tick), and every ``MAINTENANCE_INTERVAL``: rescue
stale, overdue and timed-out jobs, insert pending follow-ups, age priorities,
fire periodic jobs, forget dead workers, count jobs for the metrics, roll up
the dashboard's outcome counts, prune finished rows, and every ten minutes
rebuild ``awa_job``'s indexes a drained backlog left large.
Each duty is a method tests can call directly; ``run_once()`` runs them all.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models.functions import Now

from . import dashboard, db, fleet, sequences, sql, wakeups
from .callbacks import EARLY_KEY, apply_early, prune_receipts
from .codec import MAX_ERROR_CHARS, escape_text
from .conf import MAX_RETENTION, AwaSettings, awa_settings
from .dependencies import after_outcomes, planned_by_index, settle
from .followups import (
    FollowupError,
    Outcome,
    Rescued,
    RescueReason,
    dispatch,
    followup_registry,
    send_signal,
)
from .kinds import registry
from .logs import log_context
from .models import Job, JobState, PendingFollowup, jobs_from_rows
from .pending import keep_pending, restore
from .schedules import fire_due
from .state import DB_ERRORS, WorkerState

logger = logging.getLogger(__name__)

BATCH = 1000
PRUNE_EVERY = 60.0
# awa_job_done_current is renamed once its oldest row is this fraction of
# COMPLETED_RETENTION old: a completed job is dropped with its segment between
# the retention and (1 + this) times it after it finished...
SEGMENT_SPAN = 0.25
# ...and once it is this many seconds old at least. Each rename makes a table
# (with its indexes, trigger and types) and each drop removes one: about 280
# catalog rows left for VACUUM and 66 kB of catalog a time. With a short
# retention (under 40 minutes, or 0 and the few rows still read kept) a segment
# renamed at every pass, once a minute, would leave 1,440 of those a day, which
# with autovacuum off stay for good.
MIN_SEGMENT_AGE = 600.0
# A retention of None keeps rows for ever: kept rows of such a state are kept
# for longer than any allowed retention.
KEEP_ALWAYS = 2 * MAX_RETENTION
# Finished rows moved per statement, and statements per tick at most: a tick
# moves up to 100,000 rows, more than a worker here finishes in a second.
ARCHIVE_BATCH = 5000
ARCHIVE_ROUNDS = 20
# A tick reads only the rows finished since the last pass that moved all it
# found, less ARCHIVE_MARGIN seconds: an outcome's transaction stamps
# finalized_at when it begins and commits a little later. Every
# ARCHIVE_SWEEP_EVERY seconds a pass reads every finished row, for outcomes
# whose transaction ran longer than the margin (an atomic handler, a callback
# resolved inside a long transaction).
ARCHIVE_MARGIN = 60.0
ARCHIVE_SWEEP_EVERY = 60.0
# awa_job's indexes are checked every REINDEX_EVERY seconds (Maintenance.reindex),
# and one is rebuilt once it is larger than REINDEX_MIN_BYTES and than
# REINDEX_FACTOR times what the table's live rows need at REINDEX_ENTRY_BYTES
# an entry (more than any of them takes: the widest key, the dead-letter
# index's first line of an error, is at most 200 characters, and few rows have one).
REINDEX_EVERY = 600.0
REINDEX_MIN_BYTES = 32 * 2**20
REINDEX_ENTRY_BYTES = 100
REINDEX_FACTOR = 4
# The names REINDEX ... CONCURRENTLY gives the index it builds and the one it
# retires, after the index's own: one stopped midway (its connection lost,
# the server restarted) leaves such an index behind, invalid.
REINDEX_LEFTOVER = re.compile(r"(.+)_cc(?:new|old)\d*")


class LeadershipLost(Exception):
    """Another worker took the maintenance lease while this one stood still."""


class Maintenance:
    """The maintenance duties, and the lease that says who runs them.

    ``holder`` names the worker competing for leadership (``try_lead``);
    every write of a leader is then fenced by the lease (``_transaction``).
    Without one (tests, ``run_once`` from a shell) the duties run unfenced.
    """

    def __init__(
        self,
        alias: str | None = None,
        conf: AwaSettings | None = None,
        *,
        holder: str | None = None,
        outbox: wakeups.Outbox | None = None,
    ) -> None:
        self.conf = conf or awa_settings()
        self.alias = alias or self.conf.database
        self.holder = holder
        self.outbox = outbox  # a worker's: its wake-ups after the commit
        self.term: int | None = None  # the lease's term while this worker leads
        self._seeded = False
        self._last_full = 0.0
        self._last_prune = 0.0
        self._archived_since: datetime | None = None  # see archive()
        self._last_sweep = 0.0
        self._last_reindex = float("-inf")
        self._reindexing: threading.Thread | None = None  # see reindex()

    # -- leadership --------------------------------------------------------------

    @property
    def lease_seconds(self) -> float:
        """How long a lease lasts unrenewed: a leader that stops for longer loses it.

        ``STALE_AFTER``, the time after which a worker that stopped
        heartbeating its jobs is taken for dead.
        """
        return self.conf.stale_after

    def _lease_params(self) -> dict[str, Any]:
        return {
            "name": sql.LEASE_NAME,
            "holder": self.holder,
            "term": self.term,
            "ttl": self.lease_seconds,
            "idle_ms": str(int(self.lease_seconds * 1000)),
        }

    def try_lead(self) -> bool:
        """Take the maintenance lease if it ran out; True while this worker leads.

        A leader whose lease no one took meanwhile (a connection blip) keeps
        it and its term.
        """
        if self.holder is None:
            raise RuntimeError("Maintenance(holder=...) is needed to compete for leadership")
        if self.term is None and not db.is_writable(connections[self.alias]):
            # Only a primary may lead: after a failover a connection can land
            # on a standby or a demoted node.
            raise db.ServerNotWritable(
                f"database {self.alias!r}: the server reached takes no writes (a standby?); "
                "not competing for the maintenance lease"
            )
        with connections[self.alias].cursor() as cursor:
            if not self._seeded:
                cursor.execute(sql.SEED_LEASE, {"name": sql.LEASE_NAME})
                self._seeded = True
            if self.term is not None:
                cursor.execute(sql.RENEW_LEASE, self._lease_params())
                if cursor.fetchone() is not None:
                    return True
            cursor.execute(sql.TAKE_LEASE, self._lease_params())
            row = cursor.fetchone()
        if row is None:
            self.term = None
            return False
        self.term = row[0]
        # What a previous term of leadership remembered may be stale now.
        self._archived_since = None
        self._last_full = self._last_prune = self._last_sweep = 0.0
        return True

    def resign(self) -> None:
        """Hand the lease back (at shutdown), so another worker leads at once."""
        if self.term is None:
            return
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.RELEASE_LEASE, self._lease_params())
        self.term = None

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """A transaction for a duty's writes, fenced by the lease while this worker leads.

        Raises ``LeadershipLost`` (writing nothing) when another worker holds
        the lease now. The queues a duty makes jobs available in are woken after
        the commit (``wakeups.after_commit``, through ``outbox`` when set).
        """
        deferred = wakeups.after_commit(self.alias, self.outbox)
        if self.holder is None:  # not competing: run unfenced
            with deferred, transaction.atomic(using=self.alias):
                yield
            return
        if self.term is None:
            raise LeadershipLost("this worker does not hold the maintenance lease")
        with deferred, transaction.atomic(using=self.alias):
            with connections[self.alias].cursor() as cursor:
                cursor.execute(sql.RENEW_LEASE, self._lease_params())
                if cursor.fetchone() is None:
                    self.term = None
                    raise LeadershipLost(
                        "another worker took the maintenance lease while this one "
                        f"stood still for over {self.lease_seconds:.0f}s"
                    )
            yield

    def warn_without_autovacuum(self) -> None:
        """Log a warning if autovacuum will not visit awa_job.

        Every claim and outcome leaves a dead row version behind. The
        migration tunes autovacuum to visit awa_job at 1% dead rows; with
        autovacuum off only ``vacuum`` (unless turned off) reclaims them.
        """
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.AUTOVACUUM_STATE)
            server, table, _, _ = cursor.fetchone()
        if not (server and table):
            where = "on this PostgreSQL server" if not server else "for the awa_job table"
            if self.conf.vacuum_without_autovacuum:
                logger.warning(
                    "autovacuum is off %s: the maintenance leader will VACUUM awa_job itself "
                    "as its dead row versions pile up; turn autovacuum on to leave it that work",
                    where,
                )
            else:
                logger.warning(
                    "autovacuum is off %s and AWA['VACUUM_WITHOUT_AUTOVACUUM'] is False: "
                    "nothing reclaims awa_job's dead row versions, so claims slow down as they "
                    "pile up; turn it on, or VACUUM awa_job regularly",
                    where,
                )

    def tick(self, wake: Callable[[set[str]], None] | None = None) -> None:
        """One leader tick: promotion always, the other duties when their interval passed.

        Each duty fails alone: its error is logged under its name and the
        duties after it still run. A lost connection or lost leadership ends
        the tick (raised).
        """
        woken = self._duty("promote", self.promote) or set()
        self._duty("archive", self.archive)
        now = time.monotonic()
        if now - self._last_full >= self.conf.maintenance_interval:
            self._last_full = now
            woken |= self._duty("rescue", self.rescue) or set()
            self._duty("replay_pending", self.replay_pending)
            self._duty("apply_early_callbacks", self.apply_early_callbacks)
            self._duty("age_priorities", self.age_priorities)
            self._duty("fire_periodic", self.fire_periodic)
            self._duty("prune_workers", self.prune_workers)
            self._duty("count_jobs", self.count_jobs)
            if self.conf.vacuum_without_autovacuum:
                self._duty("vacuum", self.vacuum)
            if self.conf.reindex_bloated and now - self._last_reindex >= REINDEX_EVERY:
                self._last_reindex = now
                self._duty("reindex", lambda: self.reindex(wait=False))
            self._duty("roll_up_stats", self.roll_up_stats)
            self._duty("prune_attempt_starts", self.prune_attempt_starts)
            woken |= self._duty("restore_parked", self.restore_parked) or set()
            if now - self._last_prune >= PRUNE_EVERY:
                self._last_prune = now
                self._duty("prune", self.prune)
                self._duty("settle_orphans", self.settle_orphans)
        if wake and woken:
            wake(woken)

    def _duty[T](self, name: str, duty: Callable[[], T]) -> T | None:
        try:
            return duty()
        except LeadershipLost:
            raise
        except DatabaseError as exc:
            if db.is_transient(exc):
                raise
            logger.exception("maintenance duty %s failed: %s", name, exc)
        except Exception as exc:
            logger.exception("maintenance duty %s failed: %s", name, exc)
        return None

    def run_once(self, now: datetime | None = None) -> None:
        """Every duty once (for tests and shells).

        ``now`` is the moment periodic fires and pending follow-up retries are
        judged by: the database clock's unless given.
        """
        if now is None:
            now = self.database_now()
        self.promote()
        self.rescue()
        self.archive()
        self.replay_pending(now)
        self.apply_early_callbacks()
        self.age_priorities()
        self.fire_periodic(now)
        self.prune_workers()
        self.count_jobs()
        self.roll_up_stats()
        self.prune()
        self.prune_attempt_starts()
        self.restore_parked()
        self.settle_orphans()
        if self.conf.reindex_bloated:
            self.reindex()

    # -- duties ------------------------------------------------------------------------

    def database_now(self) -> datetime:
        """The database clock: what due times are judged by when no now is given."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.DATABASE_NOW)
            now: datetime = cursor.fetchone()[0]
        return now

    def promote(self) -> set[str]:
        """Make due scheduled and retryable jobs available; wake their queues."""
        queues: set[str] = set()
        while True:
            with self._transaction(), connections[self.alias].cursor() as cursor:
                cursor.execute(sql.PROMOTE_DUE, {"limit": BATCH})
                promoted = [row[0] for row in cursor.fetchall()]
                wakeups.announce(self.alias, promoted, cursor)
            queues.update(promoted)
            if len(promoted) < BATCH:
                return queues

    def archive(self) -> int:
        """Move finished rows from ``awa_job`` into ``awa_job_done``; returns how many.

        ``awa_job`` then holds live jobs (and finished ones that hold a unique
        key), so new jobs land in the pages VACUUM emptied rather than among
        millions of finished rows. Queries on ``awa_job`` still see the moved
        rows: ``awa_job_done`` inherits from it (migration 0003). Between
        sweeps, only rows finished since the last complete pass are read.
        """
        started = time.monotonic()
        sweep = self._archived_since is None or started - self._last_sweep >= ARCHIVE_SWEEP_EVERY
        total = 0
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.ARCHIVE_WATERMARK, {"margin": ARCHIVE_MARGIN})
            watermark = cursor.fetchone()[0]
        for _ in range(ARCHIVE_ROUNDS):
            with self._transaction(), connections[self.alias].cursor() as cursor:
                if sweep:
                    cursor.execute(sql.ARCHIVE_FINISHED, {"limit": ARCHIVE_BATCH})
                else:
                    cursor.execute(
                        sql.ARCHIVE_SINCE, {"limit": ARCHIVE_BATCH, "since": self._archived_since}
                    )
                moved = cursor.rowcount
            total += moved
            if moved < ARCHIVE_BATCH:  # all it found: the next pass may start later
                self._archived_since = watermark
                if sweep:
                    self._last_sweep = started
                break
        if total:
            logger.debug("moved %s finished job(s) to awa_job_done", total)
        return total

    def rescue(self) -> set[str]:
        """Take back stale, overdue and timed-out jobs; then insert their follow-ups.

        The rescue commits first, together with a pending follow-up row per
        rescued job that has ``on_rescued`` follow-ups; the follow-ups are
        inserted afterwards, each pending row in its own transaction.
        """
        pending_ids: list[int] = []
        queues: set[str] = set()
        with self._transaction():
            with connections[self.alias].cursor() as cursor:
                cursor.execute(sql.RESCUE, {"stale_after": self.conf.stale_after, "limit": BATCH})
                rescued = cursor.fetchall()
            jobs = jobs_from_rows([row[1:] for row in rescued], self.alias)
            for row, job in zip(rescued, jobs, strict=True):
                reason = RescueReason(row[0])
                queues.add(job.queue)
                logger.debug(
                    "rescued job %s kind=%s attempt=%s (%s): now %s",
                    job.id,
                    job.kind,
                    job.attempt,
                    reason.value,
                    job.state,
                    extra=log_context(job),
                )
                context = Rescued(reason=reason)
                if followup_registry.has(Outcome.RESCUED, job.kind):
                    pending_ids.append(keep_pending(job, context, self.alias).id)
                send_signal(job, context, self.alias)
            # A job failed for good by the rescue settles its dependents in
            # the rescue's transaction; one made retryable is no outcome yet.
            after_outcomes(jobs, self.alias)
            if jobs:  # counted for the dashboard, committed with the rescue
                tally = dashboard.Tally()
                for job in jobs:
                    tally.count(job.queue, job.state)
                tally.flush(self.alias, f"maintenance:{self.holder or 'run_once'}")
        if rescued:
            reasons = Counter(row[0] for row in rescued)
            logger.warning(
                "rescued %s job(s) (%s): %s%s",
                len(rescued),
                ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in reasons.items()),
                ", ".join(str(row[1]) for row in rescued[:20]),
                " ..." if len(rescued) > 20 else "",
            )
        for pending_id in pending_ids:
            self.replay_one(pending_id)
        # Per-key leases no running attempt holds (sql.FREE_STALE_LEASES): a
        # claim would take their slots over anyway; this keeps the table small.
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.FREE_STALE_LEASES, {"limit": BATCH})
            if cursor.rowcount:
                logger.debug("freed %s stale limit lease(s)", cursor.rowcount)
        return queues

    def apply_early_callbacks(self) -> int:
        """Apply the early callback answers still kept on parked jobs; returns how many.

        An answer that came while its job's handler ran was accepted (200) and is
        applied when the job parks; if its follow-ups failed then, the job waits
        with the answer kept, and its sender, told it was accepted, will not send
        it again. It is tried again here every interval until it applies, or the
        callback times out and the rescue takes the job.
        """
        applied = 0
        with self._transaction():
            parked = list(
                Job.objects.using(self.alias)
                .select_for_update(skip_locked=True)
                .filter(state=JobState.WAITING_EXTERNAL, metadata__has_key=EARLY_KEY)
                .order_by("id")[:BATCH]
            )
            for row in parked:
                if apply_early(row, self.alias) is not None:
                    applied += 1
        if applied:
            logger.info("applied %s early callback answer(s) kept on parked jobs", applied)
        return applied

    def replay_pending(self, now: datetime | None = None) -> int:
        """Insert the pending follow-ups due at ``now`` (default: the database clock's);
        returns how many were inserted."""
        due = list(
            PendingFollowup.objects.using(self.alias)
            .filter(next_attempt_at__lte=Now() if now is None else now)
            .order_by("next_attempt_at", "id")
            .values_list("id", flat=True)[:BATCH]
        )
        return sum(1 for pending_id in due if self.replay_one(pending_id, now))

    def replay_one(self, pending_id: int, now: datetime | None = None) -> bool:
        """Insert one pending row's follow-ups and delete it, in one transaction.

        On failure the row stays, with its error and a backed-off retry time
        counted from ``now`` (default: the database clock's).
        """
        try:
            with self._transaction():
                pending = self._locked_pending(pending_id)
                if pending is None:
                    return False
                job, context = restore(pending, self.alias)
                ids = dispatch(job, context, self.alias)
                pending.delete()
        except (FollowupError, DatabaseError) as exc:
            if not self._drop_orphan(pending_id, exc):
                self._postpone(pending_id, exc, now)
            return False
        logger.info(
            "inserted %s follow-up(s) of job %s kind=%s outcome=%s",
            len(ids),
            job.id,
            job.kind,
            context.outcome.value,
        )
        return True

    def _locked_pending(self, pending_id: int) -> PendingFollowup | None:
        """The pending row, locked in the caller's transaction; None if gone or locked."""
        return (
            PendingFollowup.objects.using(self.alias)
            .select_for_update(skip_locked=True)
            .filter(id=pending_id)
            .first()
        )

    def _drop_orphan(self, pending_id: int, exc: Exception) -> bool:
        """Delete the pending row if its job no longer exists; whether it did.

        Its follow-ups are tried once more after the job is deleted (an admin
        discard, retention): they are owed by an outcome that committed and may
        still insert. A failure then is dropped, not retried: one that hangs on
        the job (``after=[job]``, a read of its row) could never succeed.
        """
        with self._transaction():
            pending = self._locked_pending(pending_id)
            if pending is None or Job.objects.using(self.alias).filter(id=pending.job_id).exists():
                return False
            pending.delete()
        logger.warning(
            "pending follow-ups %s (%s of job %s kind=%s) dropped: job %s no longer exists "
            "(deleted), and they failed again (try %s): %s",
            pending_id,
            pending.outcome,
            pending.job_id,
            pending.kind,
            pending.job_id,
            pending.attempts + 1,
            exc,
        )
        return True

    def _postpone(self, pending_id: int, exc: Exception, now: datetime | None) -> None:
        """Count the failed try and schedule the next one after the backoff."""
        error = escape_text(str(exc), MAX_ERROR_CHARS)
        with self._transaction(), connections[self.alias].cursor() as cursor:
            cursor.execute(sql.POSTPONE_PENDING, {"id": pending_id, "now": now, "error": error})
            row = cursor.fetchone()
        if row is None:  # inserted meanwhile, or discarded
            return
        tries, outcome, job_id, delay = row
        logger.warning(
            "pending follow-ups %s (%s of job %s) failed again (try %s): %s; next try in %.0fs",
            pending_id,
            outcome,
            job_id,
            tries,
            exc,
            delay,
        )

    def age_priorities(self) -> None:
        interval = self.conf.priority_aging_interval
        if interval is None:
            return
        with self._transaction(), connections[self.alias].cursor() as cursor:
            cursor.execute(sql.AGE_PRIORITIES, {"interval": interval, "limit": BATCH})

    def fire_periodic(self, now: datetime | None = None) -> None:
        """Enqueue the periodic jobs due at ``now`` (default: the database clock's;
        see ``schedules.py``).

        Only in ``AWA["DATABASE"]``: the schedules of ``jobs.py`` are the
        project's, not a database's, and the leader of each database firing them
        (``awa_worker --database`` of another alias) would enqueue each fire
        once per database.
        """
        if self.alias != self.conf.database:
            return
        # One transaction: each schedule fires under its row lock, in a savepoint.
        with self._transaction():
            fire_due(self.alias, self.database_now() if now is None else now)

    def prune_workers(self) -> int:
        """Delete the registry rows of workers unseen for ``STALE_AFTER``; returns how many."""
        with self._transaction():
            pruned = fleet.prune(self.alias, self.conf.stale_after)
        if pruned:
            logger.info("forgot %s worker(s) unseen for %.0fs", pruned, self.conf.stale_after)
        return pruned

    def count_jobs(self) -> None:
        """Count the jobs of ``awa_job`` per queue and state into ``awa_job_count``.

        What ``<prefix>/metrics`` reports: one count per maintenance interval by
        the leader, however many scrapers ask. Finished rows already moved to
        ``awa_job_done`` are not counted (the metrics estimate them from the
        catalog).
        """
        with self._transaction(), connections[self.alias].cursor() as cursor:
            cursor.execute(sql.CLEAR_JOB_COUNTS)
            cursor.execute(sql.COUNT_JOBS)

    def vacuum(self) -> bool:
        """VACUUM ``awa_job`` when autovacuum will not and its dead rows passed autovacuum's
        threshold for it; returns whether it ran.

        Every enqueue, claim and outcome leaves a dead row version in
        ``awa_job``. Left there, they fill the claim index's first pages, which
        every claim reads, and keep the planner's size of the table (its
        cached plans) at what it was before they piled up: on a server with
        autovacuum off, a worker enqueued into at 5,000 jobs/s fell to 150
        jobs/s within four minutes. VACUUM clears them and updates the table's
        size, and plans made for the old one are made again. With autovacuum
        on for the table (the default, tuned by migration 0001) it does
        nothing. ``AWA["VACUUM_WITHOUT_AUTOVACUUM"] = False`` turns it off. Nor
        inside a transaction (a tick called in ``atomic()``), where VACUUM cannot run.
        """
        if connections[self.alias].in_atomic_block:
            return False
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.AUTOVACUUM_STATE)
            server, table, due, dead = cursor.fetchone()
            if (server and table) or not due:
                return False
            started = time.monotonic()
            only = cursor.connection.info.server_version >= 180000
            cursor.execute(sql.VACUUM_ONLY_JOBS if only else sql.VACUUM_JOBS)
        logger.debug(
            "vacuumed awa_job (autovacuum is off for it): %s dead row versions, %.2fs",
            dead, time.monotonic() - started,
        )  # fmt: skip
        return True

    def reindex(self, *, wait: bool = True) -> list[str]:
        """Rebuild the indexes of ``awa_job`` that grew far past its rows; returns their names.

        A backlog of millions of jobs, once drained, leaves ``awa_job``'s
        indexes as large as they grew: VACUUM frees their pages for reuse but
        never gives them back, and every VACUUM of the table (autovacuum's, or
        the leader's) reads each index whole. After 5,000,000 jobs had gone
        through ``awa_job`` (``benchmarks/growth.py``'s table), it held 1.2 GB
        of indexes and no row, and a VACUUM after 20,000 more jobs took 0.12 to
        0.27 s, against 0.003 to 0.011 s with the indexes rebuilt.

        An index larger than ``REINDEX_MIN_BYTES`` and than ``REINDEX_FACTOR``
        times what the live rows need is rebuilt with ``REINDEX INDEX
        CONCURRENTLY``, which blocks no read or write of the table. An invalid
        index such a rebuild stopped midway left behind (``<name>_ccnew`` or
        ``_ccold``) is dropped first, with ``DROP INDEX CONCURRENTLY``: inserts
        would go on writing into it. Both wait for the transactions that began
        before them: with ``wait`` False (the leader's tick) they run in a
        thread of their own, on its own connection, so a long transaction
        elsewhere holds up no other duty, and a check finds nothing to do while
        that thread runs; with ``wait``, here, raising what the server raised.
        Nothing inside a transaction (a tick called in ``atomic()``), where
        neither statement can run. ``AWA["REINDEX_BLOATED"] = False`` turns
        the check off.
        """
        if connections[self.alias].in_atomic_block:
            return []
        if self._reindexing is not None and self._reindexing.is_alive():
            return []
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.JOB_INDEXES)
            indexes = cursor.fetchall()
        names = {name for name, _, _, _ in indexes}
        leftovers = [
            name
            for name, valid, _, _ in indexes
            if not valid
            and (rebuilt := REINDEX_LEFTOVER.fullmatch(name))
            and rebuilt.group(1) in names
        ]
        bloated = [
            name
            for name, valid, size, live in indexes
            if valid and size > max(REINDEX_MIN_BYTES, REINDEX_FACTOR * REINDEX_ENTRY_BYTES * live)
        ]
        if not leftovers and not bloated:
            return []
        quote = connections[self.alias].ops.quote_name
        statements = [f"DROP INDEX CONCURRENTLY IF EXISTS {quote(n)}" for n in leftovers]
        statements += [f"REINDEX INDEX CONCURRENTLY {quote(n)}" for n in bloated]
        sizes = {name: size for name, _, size, _ in indexes}
        logger.info(
            "rebuilding awa_job's indexes that outgrew its %d live rows: %s%s",
            indexes[0][3],  # the same on every row
            ", ".join(f"{n} ({sizes[n] / 2**20:.0f} MB)" for n in bloated) or "none",
            f"; dropping what an interrupted rebuild left: {', '.join(leftovers)}"
            if leftovers
            else "",
        )
        if wait:
            self._rebuild(statements)
        else:
            self._reindexing = threading.Thread(
                target=self._rebuild_in_thread, args=(statements,), name="awa-reindex", daemon=True
            )
            self._reindexing.start()
        return leftovers + bloated

    def _rebuild(self, statements: list[str]) -> None:
        started = time.monotonic()
        with connections[self.alias].cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
        logger.info("awa_job's indexes rebuilt in %.1fs", time.monotonic() - started)

    def _rebuild_in_thread(self, statements: list[str]) -> None:
        try:
            self._rebuild(statements)
        except DatabaseError as exc:  # a lost connection, a cancel: the next check goes on
            logger.warning(
                "rebuilding awa_job's indexes stopped: %s; the next check, in %.0f minutes, "
                "drops what it left and tries again",
                exc,
                REINDEX_EVERY / 60,
            )
        except Exception as exc:
            logger.exception("rebuilding awa_job's indexes failed: %s", exc)
        finally:
            connections.close_all()  # this thread's own

    def roll_up_stats(self) -> int:
        """Fold the outcome counts workers flushed into the dashboard's per-minute rollup,
        record each queue's oldest due job, prune old minutes (``dashboard.py``);
        returns how many flushed rows were taken."""
        total = 0
        for _ in range(dashboard.FOLD_ROUNDS):
            with self._transaction():
                taken = dashboard.fold(self.alias, dashboard.FOLD_BATCH)
            total += taken
            if taken < dashboard.FOLD_BATCH:
                break
        with self._transaction():
            dashboard.record_oldest_due_and_prune(self.alias)
        return total

    def prune_attempt_starts(self) -> int:
        """Forget attempt starts no rate window reads any more (``awa_attempt_start``)."""
        periods = [60.0]  # the admin's achieved rate looks back a minute
        periods += [q.rate_limit.period for q in self.conf.queues.values() if q.rate_limit]
        periods += [
            rate.period
            for spec in registry.workers.values()
            if spec.limit is not None and (rate := spec.limit.parsed_rate) is not None
        ]
        total = 0
        for _ in range(100):
            with self._transaction(), connections[self.alias].cursor() as cursor:
                cursor.execute(
                    sql.PRUNE_ATTEMPT_STARTS, {"keep": max(periods) + 1.0, "limit": ARCHIVE_BATCH}
                )
                deleted = cursor.rowcount
            total += deleted
            if deleted < ARCHIVE_BATCH:
                break
        return total

    def restore_parked(self) -> set[str]:
        """Restore the parked sequence members whose turn came outside finalize (a
        member before them cancelled, discarded by rescue, deleted); returns their queues."""
        with self._transaction():
            return sequences.restore_parked(self.alias)

    def settle_orphans(self) -> int:
        """Settle blocked jobs one of whose dependencies no longer exists; returns how
        many left ``blocked``.

        The safety net of the deletion rule (``dependencies.deleting``): a row
        deleted where no settling ran (raw SQL) leaves its dependents waiting
        for it. Judged now as the rule says: cancelled for a
        ``requires="completed"`` edge, promoted once the rest is met for
        ``requires="finished"``. In id order, a batch per transaction; a job
        still blocked (it waits for others too) is passed over.
        """
        after, changed = 0, 0
        while True:
            with (
                self._transaction(),
                db.cursor(self.alias) as cursor,
                planned_by_index(cursor),
            ):
                cursor.execute(sql.ORPHANED_BLOCKED, {"after": after, "limit": BATCH})
                examined = cursor.fetchall()
                found = [job_id for job_id, orphaned in examined if orphaned]
                if found:
                    settle(found, self.alias)
                    cursor.execute(sql.STILL_BLOCKED, {"ids": found})
                    row = cursor.fetchone()
                    changed += len(found) - (row[0] if row else 0)
            if len(examined) < BATCH:
                break
            after = examined[-1][0]
        if changed:
            logger.warning(
                "%s blocked job(s) waited for a dependency deleted without settling them; "
                "settled now (cancelled, or promoted for requires='finished')",
                changed,
            )
        return changed

    def prune(self) -> int:
        """Delete finished rows past retention: completed jobs' segments whole
        (``rotate_finished``), the other rows in batches; returns how many."""
        # Segments first: the rows a dropped one keeps (others depend on them) are
        # in awa_job_done then, pruned below with their dependents settled. Its
        # failure (logged) leaves the row-by-row pruning to go on.
        total = self._duty("rotate_finished", self.rotate_finished) or 0
        for states, retention in (
            ([JobState.COMPLETED], self.conf.completed_retention),
            ([JobState.FAILED, JobState.CANCELLED], self.conf.failed_retention),
        ):
            if retention is None:
                continue
            for _ in range(100):
                with self._transaction(), connections[self.alias].cursor() as cursor:
                    cursor.execute(
                        sql.PRUNE_FINISHED,
                        {"states": states, "retention": retention, "limit": BATCH},
                    )
                    deleted = cursor.fetchone()[0]
                total += deleted
                if deleted < BATCH:
                    break
        with self._transaction():
            prune_receipts(self.alias)
        if total:
            logger.info("pruned %s finished job(s)", total)
        return total

    def rotate_finished(self) -> int:
        """Drop the finished segments past retention, whole; start a new current one
        when due. Returns how many jobs went with the dropped segments.

        Completed jobs are written into ``awa_job_done_current`` (migration 0016). Once
        its oldest row is ``SEGMENT_SPAN`` of ``COMPLETED_RETENTION`` old, and
        ``MIN_SEGMENT_AGE`` at least, it is renamed ``awa_job_done_<timestamp>`` and a
        new one takes its place; no row enters a renamed segment after that. Once a
        renamed segment's newest completed row is past retention, the rows that must
        stay (others depend on them, or they are within their retention) are copied into
        ``awa_job_done``, the others' dependency edges deleted, and the table dropped,
        in one transaction. A lock not had within a second
        (``sql.SEGMENT_LOCK_TIMEOUT``) leaves it for the next pass.
        """
        retention = self.conf.completed_retention
        if retention is None:
            return 0
        failed = self.conf.failed_retention
        keep = (retention, KEEP_ALWAYS if failed is None else failed)
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.FINISHED_SEGMENTS)
            segments = [row[0] for row in cursor.fetchall()]
            cursor.execute(sql.CURRENT_SEGMENT_AGE)
            age = cursor.fetchone()[0]
        name = "awa_job_done_" + time.strftime("%Y%m%d_%H%M%S", time.gmtime())
        due = age is not None and age >= max(SEGMENT_SPAN * retention, MIN_SEGMENT_AGE)
        if due and name not in segments:  # not renamed in this same second

            def rotate(cursor: Any) -> bool:
                cursor.execute(sql.ROTATE_SEGMENT.format(segment=self._quoted(name)))
                cursor.execute(sql.NEW_CURRENT_SEGMENT)
                return True

            if self._under_segment_lock(sql.CURRENT_SEGMENT, rotate):
                logger.info(
                    "finished jobs: %s renamed %s, a new one started", sql.CURRENT_SEGMENT, name
                )
                segments.append(name)  # dropped below if all of it is past retention
        return sum(self._drop_segment(segment, *keep) for segment in segments)

    def _drop_segment(self, name: str, retention: float, failed: float) -> int:
        """Drop segment ``name`` if its newest completed row is past ``retention``,
        keeping the rows that must stay; how many jobs went with it."""
        segment = self._quoted(name)
        with connections[self.alias].cursor() as cursor:
            cursor.execute(sql.SEGMENT_NEWEST.format(segment=segment))
            newest = cursor.fetchone()[0]
            if newest is not None and newest < retention:
                return 0
            cursor.execute(sql.SEGMENT_ROWS.format(segment=segment))
            rows = int(cursor.fetchone()[0])

        def drop(cursor: Any) -> int:
            cursor.execute(sql.LOCK_SEGMENT.format(segment=segment))
            cursor.execute(
                sql.KEEP_FROM_SEGMENT.format(segment=segment),
                {"completed": retention, "failed": failed},
            )
            kept: int = cursor.rowcount
            cursor.execute(sql.SEGMENT_EDGES.format(segment=segment))
            cursor.execute(sql.DROP_SEGMENT.format(segment=segment))
            return kept

        kept = self._under_segment_lock(name, drop)
        if kept is None:
            return 0
        logger.info(
            "finished jobs: dropped %s (%s job(s); %s kept in awa_job_done)",
            name,
            rows - kept,
            kept,
        )
        return rows - kept

    def _under_segment_lock[T](self, name: str, work: Callable[[Any], T]) -> T | None:
        """``work(cursor)`` in a duty's transaction whose locks wait at most
        ``sql.SEGMENT_LOCK_TIMEOUT``; None (rolled back, segment ``name`` left for
        the next pass) if a lock was not had in time."""
        try:
            with self._transaction(), connections[self.alias].cursor() as cursor:
                cursor.execute(sql.SEGMENT_LOCK_TIMEOUT)
                return work(cursor)
        except DatabaseError as exc:
            if not db.is_lock_timeout(exc):
                raise
            logger.info("finished jobs: %s is in use; left for the next pass", name)
            return None

    def _quoted(self, name: str) -> str:
        return connections[self.alias].ops.quote_name(name)


class MaintenanceService:
    """A worker's maintenance thread: compete for the lease, run maintenance while leading.

    ``run`` is the thread body; ``run_once`` is one of its passes: try to lead
    (or renew), then one leader ``tick``.
    """

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.maintenance = Maintenance(
            state.alias, state.conf, holder=state.name, outbox=state.outbox
        )
        self.is_leader = False
        self._warned = False
        self.reconnect = db.Reconnect("maintenance", state.alias, state.halt)

    def run(self) -> None:
        halt = self.state.halt
        while not halt.is_set():
            self.run_once()
            db.release(self.state.alias)  # pooled: held only during a pass
            halt.wait(min(1.0, self.state.conf.maintenance_interval))
        if self.is_leader:
            self.is_leader = False  # another worker may lead from now on
            try:
                self.maintenance.resign()
            except DB_ERRORS as exc:
                logger.debug("could not hand the maintenance lease back (%s); it runs out", exc)

    def run_once(self) -> None:
        """Take or keep the lease; while leading, one tick. Errors are logged, not raised."""
        maintenance, name = self.maintenance, self.state.name
        try:
            if not self.is_leader:
                self.is_leader = maintenance.try_lead()
                if self.is_leader:
                    logger.info(
                        "worker %s is now the maintenance leader (term %s)", name, maintenance.term
                    )
                if self.is_leader and not self._warned:
                    self._warned = True
                    maintenance.warn_without_autovacuum()
            if self.is_leader:
                maintenance.tick(wake=self.wake_queues)
                fleet.mark_maintained(self.state)
            self.reconnect.succeeded()
        except LeadershipLost as exc:
            logger.warning("worker %s is no longer the maintenance leader: %s", name, exc)
            self.is_leader = False
        except DB_ERRORS as exc:
            if self.is_leader:
                logger.warning("worker %s stops leading maintenance until it reconnects", name)
            # Its term is kept: a leader whose lease no one took meanwhile
            # renews it on reconnecting (try_lead).
            self.is_leader = False
            self.reconnect.failed(exc)
        except Exception:
            logger.exception("maintenance failed")

    def wake_queues(self, names: set[str]) -> None:
        """Wake this worker's producers of queues ``names``: maintenance made jobs due there."""
        self.state.wake(names)
