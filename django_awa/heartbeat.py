"""Heartbeats and progress of the attempts a worker runs.

Four times a second the heartbeat thread stores the progress handlers set
(``JobContext.set_progress`` only marks it), and every
``HEARTBEAT_INTERVAL`` it renews ``heartbeat_at`` of every running attempt,
guarded by run_lease. An attempt whose row no longer matches (cancelled,
rescued or finalized meanwhile) gets its cancelled flag set, so its handler
learns the attempt was lost and the handler pool may replace a stuck thread.
"""

from __future__ import annotations

import logging
import time

from . import db, sql
from .execute import Attempt, write_progress
from .state import DB_ERRORS, WorkerState, reset_connection

logger = logging.getLogger(__name__)

# Seconds between two passes: how long progress may wait to be stored.
PROGRESS_INTERVAL = 0.25


class Heartbeat:
    """``run`` is the thread body; ``run_once`` stores progress and heartbeats once."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.last_beat = time.monotonic()

    def run(self) -> None:
        state = self.state
        self.last_beat = time.monotonic()
        reconnect = db.Reconnect("heartbeat", state.alias, state.halt)
        while not state.halt.wait(PROGRESS_INTERVAL):
            try:
                self.run_once(due_only=True)
                reconnect.succeeded()
            except DB_ERRORS as exc:
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
        write_progress(attempts)
        if not due_only or time.monotonic() - self.last_beat >= state.conf.heartbeat_interval:
            self.last_beat = time.monotonic()
            self.heartbeat(attempts)

    def heartbeat(self, attempts: list[Attempt]) -> None:
        if not attempts:
            return
        with db.cursor(self.state.alias) as cursor:
            cursor.execute(
                sql.HEARTBEAT,
                {
                    "id": [a.job.id for a in attempts],
                    "run_lease": [a.job.run_lease for a in attempts],
                },
            )
            alive = {row[0] for row in cursor.fetchall()}
        running = self.state.running
        for attempt in attempts:
            if attempt.job.id not in alive and running.get(attempt.job.id) is attempt:
                # Cancelled, rescued or finalized meanwhile: tell the handler.
                attempt.cancelled.set()
