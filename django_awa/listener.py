"""The listener: a LISTEN connection that wakes producers and tells handlers of cancels.

``NOTIFY awa_job, '<queue>'`` (sent by an enqueue's transaction as it
commits, and by maintenance as it makes jobs due) wakes that queue's
producer; ``NOTIFY awa_cancel, '<job id>'`` (``awa.cancel``) sets the running
attempt's cancelled flag. The connection is psycopg's own, on
``AWA["DIRECT_DATABASE"]``: a transaction-pooling pgbouncer does not keep
LISTEN. Without one the worker runs no listener and polls.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
from typing import Any

import psycopg
from django.db import connections

from . import db, sql
from .state import WorkerState

logger = logging.getLogger(__name__)


def listen_params(alias: str) -> dict[str, Any]:
    """libpq parameters of Django connection ``alias``, for a dedicated psycopg connection."""
    params = connections[alias].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold", "pool"):
        params.pop(key, None)
    return params


class Listener:
    """LISTEN/NOTIFY: ``run`` is the thread body; ``run_once`` handles one wait's notifications."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.conn: psycopg.Connection[Any] | None = None
        self._selector: selectors.BaseSelector | None = None
        self._listened = False  # once: a reconnect is said by the outage's lines

    def run(self) -> None:
        """Listen until halted, reconnecting with a backoff when the connection is lost."""
        halt = self.state.halt
        direct = self.state.conf.direct_database or self.state.alias
        reconnect = db.Reconnect("listener", direct, halt)
        while not halt.is_set():
            try:
                self.connect()
                reconnect.succeeded()
                while not halt.is_set():
                    self.run_once(1.0)
            except psycopg.Error as exc:
                if halt.is_set():
                    return
                self.close()
                reconnect.failed(exc)
            finally:
                self.close()

    def connect(self) -> tuple[psycopg.Connection[Any], selectors.BaseSelector]:
        """Open the LISTEN connection, then wake every queue: what was enqueued meanwhile."""
        self.close()
        direct = self.state.conf.direct_database or self.state.alias
        conn = psycopg.connect(**listen_params(direct), autocommit=True)
        try:
            conn.execute(sql.LISTEN_JOBS)
            conn.execute(sql.LISTEN_CANCELS)
            selector = selectors.DefaultSelector()
            selector.register(conn.fileno(), selectors.EVENT_READ)
        except BaseException:
            conn.close()
            raise
        self.conn, self._selector = conn, selector
        # Anything enqueued while we were not listening: look now.
        self.state.wake()
        logger.log(
            logging.DEBUG if self._listened else logging.INFO,
            "awa worker %s listening for new jobs and cancels (database %r)",
            self.state.name,
            direct,
        )
        self._listened = True
        return conn, selector

    def close(self) -> None:
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    def run_once(self, timeout: float = 0.0) -> int:
        """Wait up to ``timeout`` seconds for notifications and act on them; return how many.

        Connects first if not connected. A quiet wait sends ``SELECT 1``, to
        notice a dead connection (raised as ``psycopg.Error``).
        """
        conn, selector = self.conn, self._selector
        if conn is None or selector is None:
            conn, selector = self.connect()
        if not selector.select(timeout=timeout):
            conn.execute(sql.LISTENER_PING)
            return 0
        count = 0
        for notify in conn.notifies(timeout=0, stop_after=0):
            self.on_notify(notify.channel, notify.payload)
            count += 1
        return count

    def on_notify(self, channel: str, payload: str) -> None:
        if channel == sql.NOTIFY_CHANNEL:
            runner = self.state.queues.get(payload)
            if runner is not None:
                runner.wake.set()
        elif channel == sql.CANCEL_CHANNEL:
            with contextlib.suppress(ValueError):
                attempt = self.state.running.get(int(payload))
                if attempt is not None:
                    attempt.cancelled.set()
