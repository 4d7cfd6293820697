"""Slot leases: how a ``global_concurrency`` queue's N places are shared by the fleet.

The places are rows of ``awa_queue_slot`` numbered 1..N, unique per queue
(``sql.TAKE_SLOTS``). Each worker process's producer of the queue holds some of
them and its handlers run at most that many at once: the queue's ``RunGate``
(``state.py``), whose limit ``Slots.rebalance`` sets, lets a handler begin only
while fewer run. The producer claims with the plain ``sql.CLAIM``, its usable
slots and a prefetch (``PREFETCH_WINDOW``), so a slot's next job is claimed
before its handler returns and starts at once: no advisory lock and no count of
running rows per claim, no claim's round trip between two jobs of a slot. A
process left without a usable slot gives back the jobs it claimed ahead
(``Producer.give_back_waiting``: ``available`` again, their attempt unused).

Shares (``Slots.rebalance``, about once per poll interval, more often while a
producer holds less than its share): each process keeps a fair share,
``ceil(N / live workers serving the queue)`` (at most its own concurrency),
and borrows free slots beyond it while its queue is busy. Borrowed slots go
back when the process's queue is idle, and, when the fleet holds every slot,
as soon as they are not in use, so a process below its share gets them; a
process that gave slots back borrows none for a poll interval, so the others
(rebalancing every ``SHORT_RETRY`` while they want slots) get them first.
The gate is lowered before a slot goes, and a slot goes only while no
handler of the process needs it: the process keeps at least as many as its
handlers running.

Crashes: a lease lasts while its worker's row in ``awa_worker`` is live. A
SIGKILLed worker stops renewing it; once it is ``STALE_AFTER`` old (when its
attempts are rescued) its slots are free to take (``sql.FREE_STALE_SLOTS``).
A worker that stops deletes its slots with its row (``sql.DEREGISTER_WORKER``).

What the limit counts: attempts whose handler runs. A job claimed ahead is
``running`` in the database while it waits in its process for a slot (at most
``PREFETCH_WINDOW`` of work per process), and an attempt's row stays
``running`` until its outcome commits, a few milliseconds after its handler
returned and the next job of that slot began: the database may show more
than N running rows of the queue at an instant; never more than N handlers run.
A handler abandoned by ``HandlerPool.tend`` (stuck past its timeout or its
attempt's loss) is one of them until it returns: it stays in the gate, its
process keeps the slot, and claims nothing to wait for it (``runner.stuck``).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from . import db, sql
from .state import RunGate

logger = logging.getLogger(__name__)

# How often a producer that holds less than its fair share (or less than it
# could use, while slots are free) tries to take more: seconds.
SHORT_RETRY = 0.1


@dataclass(slots=True)
class Slots:
    """The slots of one queue held by this worker process (its producer's thread only)."""

    queue: str
    worker: uuid.UUID
    alias: str
    stale_after: float
    held: list[int] = field(default_factory=list)  # slot numbers, ascending
    usable: int = 0  # how many handlers may run now (the gate's limit): held slots <= N
    short: bool = False  # the last rebalance left it below what it wanted
    checked: float = 0.0  # time.monotonic() of the last rebalance
    interval: float = 1.0  # the poll interval: how long slots it lent stay lent
    lent_until: float = 0.0  # time.monotonic() until which it borrows none back

    def due(self, interval: float) -> bool:
        """Whether a rebalance is due: ``interval`` passed, or ``SHORT_RETRY`` while short."""
        since = time.monotonic() - self.checked
        return since >= interval or (self.short and since >= SHORT_RETRY)

    def rebalance(self, conc: int, concurrency: int, gate: RunGate, *, busy: bool) -> int:
        """Take or give back slots of a queue limited to ``conc``; return ``usable``.

        ``concurrency``: the process's places on the queue; ``gate``: its
        handlers running (``RunGate``), whose limit this sets to ``usable``;
        ``busy``: its last claim took all it asked for. The gate is lowered
        before any slot goes, and only slots no running handler covers go.
        """
        now = time.monotonic()
        self.checked = now
        params = {
            "queue": self.queue,
            "worker": self.worker,
            "conc": conc,
            "stale_after": self.stale_after,
        }
        with db.cursor(self.alias) as cursor:
            cursor.execute(sql.FREE_STALE_SLOTS, params)
            cursor.execute(sql.SLOT_STATE, params)
            row = cursor.fetchone()
        mine, leased, over, live = row if row else ([], 0, False, 0)
        self.held = sorted(mine)
        fair = min(concurrency, math.ceil(conc / max(1, live)))
        target = concurrency if busy else max(fair, 0)
        if now < self.lent_until:
            # It lent slots lately: it borrows none back before the others could take them.
            target = min(target, max(fair, len(self.held)))
        # Slots above the limit (it was lowered) go back first, then what is
        # beyond the target, then borrowed ones while the fleet holds every slot.
        keep = target
        if over:
            keep = min(keep, sum(1 for s in self.held if s <= conc))
        elif busy and leased >= conc:
            keep = min(keep, fair)
        # No handler starts beyond what is kept from here on; those running keep
        # their slots until they return.
        running = gate.lower(min(keep, sum(1 for s in self.held if s <= conc)))
        spare = [s for s in reversed(self.held) if s > conc] + [
            s for s in reversed(self.held) if s <= conc
        ]
        give = spare[: max(0, len(self.held) - max(keep, running))]
        if give:
            self.held = sorted(set(self.held) - set(give))
            with db.cursor(self.alias) as cursor:
                cursor.execute(sql.GIVE_SLOTS, {**params, "slots": sorted(give)})
            if len(self.held) < concurrency:
                self.lent_until = now + self.interval
        wanted = target - len(self.held)
        taken: list[int] = []
        if wanted > 0 and not over and not give:
            with db.cursor(self.alias) as cursor:
                cursor.execute(sql.TAKE_SLOTS, {**params, "want": wanted})
                taken = [r[0] for r in cursor.fetchall()]
            self.held = sorted(self.held + taken)
        # Slots still to give back are held but not used: the handlers using them
        # finish, and the next rebalance (soon: ``short``) gives them back.
        valid = sum(1 for s in self.held if s <= conc)
        self.usable = min(valid, keep)
        gate.set_limit(self.usable)
        # Soon again while its queue is busy and it holds less than its share (none
        # at all, say: its producer then waits no longer than this for room; not
        # while idle: a fleet of more processes than places would poll for them all
        # the time), or while it has slots to give back.
        self.short = (busy and len(self.held) < fair) or len(self.held) > keep
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "queue %s: holds slots %s of %s (fair share %s; took %s, gave back %s)",
                self.queue, self.held, conc, fair, taken, sorted(give),
            )  # fmt: skip
        return self.usable

    def give_back_all(self) -> None:
        """Give back every slot (the queue is no longer limited); none may be in use."""
        if self.held:
            with db.cursor(self.alias) as cursor:
                cursor.execute(
                    sql.GIVE_SLOTS, {"queue": self.queue, "worker": self.worker, "slots": self.held}
                )
        self.held, self.usable, self.short = [], 0, False
        self.lent_until = 0.0
