"""Heartbeats, start times and progress of the attempts a worker runs.

Four times a second the heartbeat thread stores the progress handlers set
(``JobContext.set_progress`` only marks it) and when the handlers that have
run ``MARK_STARTED_AFTER`` began (``attempted_at``: a claimed job's row keeps
it NULL until then, so a job prefetched into the worker's inbox does not look
like one whose handler runs; quicker attempts get theirs from finalize), and every
``HEARTBEAT_INTERVAL`` it renews ``heartbeat_at`` of the running attempts
not claimed or beaten in the last ``fresh_for`` seconds (under a burst, most
were claimed moments ago and their rows are about to be finalized), guarded
by run_lease, and the worker's row in the registry (``fleet.py``).
An attempt whose row no longer matches (cancelled, rescued or finalized
meanwhile) gets its cancelled flag set, so its handler learns the attempt was
lost and the handler pool may replace a stuck thread.
While its passes fail (its connection dropped and the server refuses it
another), the worker's producers claim nothing (``state.ClaimPause``).
"""

from __future__ import annotations

import logging
import threading
import time

from . import db, fleet, sql
from .conf import AwaSettings
from .execute import Attempt, attempt_keys, write_progress
from .kinds import registry
from .state import DB_ERRORS, WorkerState, reset_connection

logger = logging.getLogger(__name__)

# Seconds between two passes: how long progress may wait to be stored.
PROGRESS_INTERVAL = 0.25
# A handler running this long gets its start stored while it runs; one that
# returns sooner has it stored with its outcome, one write instead of two.
MARK_STARTED_AFTER = 0.1
# The longest the heartbeat waits between two tries while the database is
# unavailable (the other threads wait up to db.RECONNECT_MOST): the worker
# claims nothing until a heartbeat goes through (state.ClaimPause), so once the
# database is back its claims should not wait out a long backoff.
RECONNECT_MOST = 1.0


def fresh_for(conf: AwaSettings) -> float:
    """How recent a heartbeat may be and still not be written again (seconds).

    A row claimed or beaten this recently is left alone by the next pass; the
    pass after writes it, so a running attempt's ``heartbeat_at`` is at most
    ``fresh_for + HEARTBEAT_INTERVAL`` old, which stays under ``STALE_AFTER``
    (the settings check ``STALE_AFTER > HEARTBEAT_INTERVAL``).
    """
    return min(conf.heartbeat_interval, (conf.stale_after - conf.heartbeat_interval) / 2)


class Heartbeat:
    """``run`` is the thread body; ``run_once`` stores progress and heartbeats once."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.last_beat = time.monotonic()
        # Set once the thread holds its connection (db.hold_connection): the
        # worker starts its handlers only then, so none takes the server's last slot.
        self.connected = threading.Event()

    def run(self) -> None:
        state = self.state
        reconnect = db.Reconnect("heartbeat", state.alias, state.halt, most=RECONNECT_MOST)
        db.hold_connection(reconnect)
        self.connected.set()
        self.last_beat = time.monotonic()
        pause = state.claim_pause
        while not state.halt.wait(PROGRESS_INTERVAL):
            began = time.monotonic()
            try:
                self.run_once(due_only=True)
                db.release(state.alias)  # pooled: held only during a pass
                reconnect.succeeded()
                pause.went_through()
            except DB_ERRORS as exc:
                # The heartbeat is due again at the next pass, after the backoff
                # rather than a HEARTBEAT_INTERVAL on, so the pass that goes
                # through has reached the database: only then do claims resume.
                self.last_beat = float("-inf")
                pause.failed(began, exc)
                reconnect.failed(exc)
            except Exception:
                # Never let this thread die: without heartbeats every running
                # job of this worker would be rescued and run again.
                logger.exception("heartbeat or progress write failed")
                reset_connection()

    def run_once(self, *, due_only: bool = False) -> None:
        """Store dirty progress, then heartbeat every running attempt.

        With ``due_only``, the heartbeat waits until ``HEARTBEAT_INTERVAL``
        has passed since the last one.
        """
        state = self.state
        with state.running_lock:
            attempts = list(state.running.values())
            kept = list(state.kept.values())
        write_progress(attempts)
        self.mark_started(attempts)
        if not due_only or time.monotonic() - self.last_beat >= state.conf.heartbeat_interval:
            self.last_beat = time.monotonic()
            self.heartbeat(attempts)
            self.renew_held_leases(attempts + kept)
            fleet.beat(state)  # the worker's own row, with the jobs it runs
            state.tally.flush(state.alias, state.name)  # outcomes, for the dashboard

    def mark_started(self, attempts: list[Attempt]) -> None:
        """Store when the handlers running ``MARK_STARTED_AFTER`` or longer began."""
        now = time.monotonic()
        begun = [
            a
            for a in attempts
            if a.started is not None
            and not a.started_written
            and now - a.started >= MARK_STARTED_AFTER
        ]
        if not begun:
            return
        with db.cursor(self.state.alias) as cursor:
            cursor.execute(
                sql.MARK_STARTED,
                {
                    **attempt_keys(begun),
                    "started_ago": db.float_array(now - (a.started or now) for a in begun),
                    "waited": db.float_array((a.started or now) - a.claimed for a in begun),
                },
            )
            written = {row[0] for row in cursor.fetchall()}
        for attempt in begun:
            # Written, or no longer this attempt's row (finalized, lost): either
            # way not asked again. A row locked meanwhile is asked next pass.
            if attempt.job.id in written or attempt.cancelled.is_set():
                attempt.started_written = True

    def heartbeat(self, attempts: list[Attempt]) -> None:
        if not attempts:
            return
        with db.cursor(self.state.alias) as cursor:
            cursor.execute(
                sql.HEARTBEAT,
                {
                    "id": [a.job.id for a in attempts],
                    "run_lease": [a.job.run_lease for a in attempts],
                    "fresh": fresh_for(self.state.conf),
                },
            )
            alive = {row[0] for row in cursor.fetchall()}
        running = self.state.running
        for attempt in attempts:
            if attempt.job.id not in alive and running.get(attempt.job.id) is attempt:
                # Cancelled, rescued or finalized meanwhile: tell the handler.
                attempt.cancelled.set()

    def renew_held_leases(self, attempts: list[Attempt]) -> None:
        """Keep the key's place of lost attempts whose handler still runs.

        A cancel or a rescue of an attempt of a kind with
        ``awa.Limit(concurrency=...)`` keeps its lease for ``STALE_AFTER``
        (``sql._released``) while its handler may still run here, as does the
        outcome of a timed-out one whose thread was abandoned; renewed each
        heartbeat until the handler returns (``HandlerPool.execute`` deletes
        it then), an abandoned thread's too (``WorkerState.kept``). Nothing to
        do, and no statement, for any other. A cancelled sequence member's key
        is kept alike (``sql.SEQUENCE_HOLD_KIND``).
        """
        leased = registry.leased_kinds()
        lost = [
            a for a in attempts if a.cancelled.is_set() and (a.job.kind in leased or a.sequenced)
        ]
        if not lost:
            return
        with db.cursor(self.state.alias) as cursor:
            cursor.execute(
                sql.RENEW_HELD_LEASES,
                {**attempt_keys(lost), "stale_after": self.state.conf.stale_after},
            )
