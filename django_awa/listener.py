"""The listener: the worker's LISTEN/NOTIFY connection. It wakes producers, tells
handlers of cancels, and sends the worker's own wake-ups.

``NOTIFY awa_job, '<queue>'`` (sent by an enqueue's transaction as it
commits, and by other workers after their commits) wakes that queue's
producer; ``NOTIFY awa_cancel, '<job id>'`` (``awa.cancel``) sets the running
attempt's cancelled flag. What this worker's own commits made available is
posted to its outbox (``wakeups.Outbox``): the listener NOTIFYs it from this
connection, in transactions that do not wait for their WAL flush, at most
every ``wakeups.SEND_EVERY`` seconds, and ignores those notifications when
they come back (the worker woke its producers as it posted them). The
connection is psycopg's own, on ``AWA["DIRECT_DATABASE"]``: a
transaction-pooling pgbouncer does not keep LISTEN. Without one the worker
runs no listener and polls, and the outbox sends from the committing thread.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from typing import Any

import psycopg

from . import db, sql, wakeups
from .db import listen_params
from .state import WorkerState

logger = logging.getLogger(__name__)


class Listener:
    """LISTEN/NOTIFY: ``run`` is the thread body; ``run_once`` handles one wait's notifications."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.conn: psycopg.Connection[Any] | None = None
        self._selector: selectors.BaseSelector | None = None
        self._listened = False  # once: a reconnect is said by the outage's lines
        self._sent_at = 0.0  # monotonic time of the last NOTIFY sent from the outbox
        self._pid = 0  # this connection's backend: its own NOTIFYs come back to it

    def run(self) -> None:
        """Listen until halted, reconnecting with a backoff when the connection is lost."""
        halt = self.state.halt
        direct = self.state.direct or self.state.alias
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
        direct = self.state.direct or self.state.alias
        # Never prepared: nothing to gain on this connection's few statements, and
        # a transaction-mode pooler before it may not keep prepared statements.
        conn = psycopg.connect(**listen_params(direct), autocommit=True, prepare_threshold=None)
        try:
            conn.execute(sql.LISTEN_JOBS)
            conn.execute(sql.LISTEN_CANCELS)
            conn.execute(sql.LISTEN_LIMITS)
            selector = selectors.DefaultSelector()
            selector.register(conn.fileno(), selectors.EVENT_READ)
            selector.register(self.state.outbox.attach(), selectors.EVENT_READ, "outbox")
        except BaseException:
            conn.close()
            raise
        self.conn, self._selector, self._pid = conn, selector, conn.info.backend_pid
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
        """Wait up to ``timeout`` seconds for notifications and act on them; return how
        many (this worker's own, coming back, not counted). Send what the outbox holds.

        Connects first if not connected. A quiet wait sends ``SELECT 1``, to
        notice a dead connection (raised as ``psycopg.Error``).
        """
        conn, selector = self.conn, self._selector
        if conn is None or selector is None:
            conn, selector = self.connect()
        ready = selector.select(timeout=timeout)
        if not ready:
            conn.execute(sql.LISTENER_PING)
        if any(key.data == "outbox" for key, _ in ready) or self.state.outbox.pending():
            self.send(conn)
        # What arrived during the ping or the send waits in psycopg's backlog.
        count = 0
        for notify in conn.notifies(timeout=0, stop_after=0):
            if notify.pid == self._pid and notify.channel == sql.NOTIFY_CHANNEL:
                continue  # sent from the outbox: woken as posted
            self.on_notify(notify.channel, notify.payload)
            count += 1
        return count

    def send(self, conn: psycopg.Connection[Any]) -> None:
        """NOTIFY the queues posted to the outbox since the last send, in one statement,
        at most every ``wakeups.SEND_EVERY`` seconds. Raises ``psycopg.Error`` (the
        queues are kept for the next connection)."""
        wait = self._sent_at + wakeups.SEND_EVERY - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # what comes meanwhile goes in this one statement
        queues = self.state.outbox.take()
        if not queues:
            return
        try:
            conn.execute(sql.NOTIFY_QUEUES_AFTER, {"queues": queues})
        except BaseException:
            self.state.outbox.put_back(queues)
            raise
        self._sent_at = time.monotonic()

    def on_notify(self, channel: str, payload: str) -> None:
        if channel == sql.NOTIFY_CHANNEL:
            runner = self.state.queues.get(payload)
            if runner is not None:
                runner.wake.set()
        elif channel == sql.LIMITS_CHANNEL:
            runner = self.state.queues.get(payload)
            if runner is not None:
                runner.limits_changed = True
                runner.wake.set()
        elif channel == sql.CANCEL_CHANNEL:
            with contextlib.suppress(ValueError):
                attempt = self.state.running.get(int(payload))
                if attempt is not None:
                    attempt.cancelled.set()
