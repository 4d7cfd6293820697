"""Wake-ups: telling workers that jobs became available, and when it is told.

A NOTIFY on ``sql.NOTIFY_CHANNEL`` (payload: a queue) wakes that queue's
producers in every listening worker; producers also poll every
``POLL_INTERVAL``, so a wake-up is a hint, never the only way a job is found.
Who sends it depends on who owns the transaction that made the job available:

* The caller's (``awa.enqueue``, ``enqueue_many``, ``Workflow.enqueue``, the
  operator controls): ``announce`` NOTIFYs inside it, so its commit wakes the
  workers and its rollback wakes none.
* The engine's own (a worker's outcome batch with its follow-ups and promoted
  dependents, an atomic handler's outcome, maintenance's promotions, the
  callback endpoint): no NOTIFY inside. PostgreSQL commits the transactions
  that NOTIFY one at a time: ``PreCommit_Notify`` takes a database-wide lock
  (``pg_locks``: locktype ``object``, classid ``pg_database``) and holds it
  through the commit's WAL flush, so those commits cannot share a flush (no
  group commit), and a worker's every batch queued behind every other
  notifying commit. Inside ``after_commit(alias, outbox)``, ``announce`` only
  notes the queues with ``transaction.on_commit`` (a rolled-back savepoint's
  are dropped with it). Once committed they are posted to the worker's
  ``Outbox``: its own producers are woken at once, in-process, and the
  listener thread NOTIFYs the other workers from its own connection, in
  transactions that commit without waiting for their WAL flush
  (``synchronous_commit = off``), one statement for everything posted in the
  last ``SEND_EVERY`` seconds. Without an outbox (a web process's callback
  endpoint), or before a listener took it, the queues are NOTIFYed at once
  in such a transaction of their own (``notify_now``).

A crash between the commit and that NOTIFY loses only the hint: the jobs are
committed ``available`` and found at the next poll. An asynchronous commit
lost with the server only loses a notification, which no one waits for once
the server is gone.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import psycopg
from django.db import DatabaseError, InterfaceError, transaction

from . import db, sql

logger = logging.getLogger(__name__)

# The least time between two NOTIFY statements of one worker's listener: what
# is posted meanwhile goes in the next one. Other workers hear of a follow-up at
# most this much later; this worker's producers are woken at the commit.
SEND_EVERY = 0.005

_scope = threading.local()


@contextmanager
def after_commit(alias: str, outbox: Outbox | None = None) -> Iterator[None]:
    """Within: an engine-owned transaction on ``alias``. ``announce`` NOTIFYs nothing
    inside it; the queues it names are posted to ``outbox`` (or NOTIFYed by
    ``notify_now``) once it commits, and dropped if it rolls back."""
    previous = getattr(_scope, "current", None)
    _scope.current = (alias, outbox)
    try:
        yield
    finally:
        _scope.current = previous


def deferring(alias: str) -> bool:
    """Whether ``announce`` on ``alias`` waits for the commit (inside ``after_commit``)."""
    current = getattr(_scope, "current", None)
    return current is not None and current[0] == alias


def announce(alias: str, queues: Iterable[str], cursor: Any = None) -> None:
    """Jobs became available on ``queues`` in the current transaction on ``alias``:
    wake those queues' workers when it commits.

    Inside ``after_commit``: after the commit, through the outbox. Otherwise by a
    NOTIFY inside the transaction, on ``cursor`` (a cursor of that connection)
    or a new one.
    """
    names = sorted(set(queues))
    if not names:
        return
    current = getattr(_scope, "current", None)
    if current is not None and current[0] == alias:
        transaction.on_commit(partial(_committed, alias, current[1], names), using=alias)
        return
    if cursor is not None:
        cursor.execute(sql.NOTIFY_QUEUES, {"queues": names})
        return
    with db.cursor(alias) as own:
        own.execute(sql.NOTIFY_QUEUES, {"queues": names})


def _committed(alias: str, outbox: Outbox | None, queues: list[str]) -> None:
    if outbox is not None:
        outbox.post(queues)
    else:
        notify_now(alias, queues)


SEND_ERRORS = (DatabaseError, InterfaceError, psycopg.Error)


def notify_now(alias: str, queues: Iterable[str]) -> None:
    """NOTIFY ``queues`` now, on ``alias``'s connection, in a transaction of their own
    that does not wait for its WAL flush (run it outside any transaction). A
    failure is logged: the workers' poll still finds the jobs."""
    names = sorted(set(queues))
    if not names:
        return
    try:
        with db.cursor(alias) as cursor:
            cursor.execute(sql.NOTIFY_QUEUES_AFTER, {"queues": names})
    except SEND_ERRORS as exc:
        logger.warning("could not wake the workers of queues %s (%s)", names, exc)


class Outbox:
    """A worker's wake-ups waiting to be NOTIFYed to the other workers.

    Any thread ``post``s after a commit; the listener, once it ``attach``es,
    watches ``fileno()`` and sends what it ``take``s. Until a listener
    attaches, ``post`` sends at once itself (``notify_now``).
    """

    def __init__(self, alias: str, wake: Callable[[set[str]], None]) -> None:
        self.alias = alias
        self._wake = wake  # this process's producers
        self._lock = threading.Lock()
        self._queues: set[str] = set()
        self._signalled = False
        self._pair: tuple[socket.socket, socket.socket] | None = None

    def post(self, queues: Iterable[str], others: Iterable[str] | None = None) -> None:
        """Jobs became available on ``queues`` (committed): wake this process's
        producers of them now, and the other workers of ``others`` (default:
        ``queues``) by NOTIFY."""
        woken = set(queues)
        if woken:
            self._wake(woken)
        told = woken if others is None else set(others)
        if not told:
            return
        with self._lock:
            pair = self._pair
            if pair is not None:
                self._queues |= told
                signal, self._signalled = not self._signalled, True
        if pair is None:
            notify_now(self.alias, told)
        elif signal:
            with contextlib.suppress(OSError):  # full: the sender is signalled already
                pair[1].send(b"\0")

    def attach(self) -> int:
        """The sender (the listener) takes over sending: the descriptor that becomes
        readable when there is something to ``take``."""
        with self._lock:
            if self._pair is None:
                reader, writer = socket.socketpair()
                reader.setblocking(False)
                writer.setblocking(False)
                self._pair = (reader, writer)
            return self._pair[0].fileno()

    def take(self) -> list[str]:
        """What was posted and not sent yet (then forgotten), in name order."""
        with self._lock:
            if self._pair is not None:
                # Emptied before the flag is cleared: a post's byte written after
                # this is read by the sender's next wait, never lost here.
                with contextlib.suppress(OSError):  # nothing (more) to read
                    while self._pair[0].recv(256):
                        pass
            queues, self._queues = self._queues, set()
            self._signalled = False
        return sorted(queues)

    def put_back(self, queues: Iterable[str]) -> None:
        """Queues a failed send did not tell: sent with the next."""
        with self._lock:
            self._queues.update(queues)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queues)

    def close(self) -> None:
        with self._lock:
            pair, self._pair = self._pair, None
        if pair is not None:
            for end in pair:
                end.close()
