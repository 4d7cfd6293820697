"""Parked sequence members (SPEC 12): the hand-off and its safety net.

A claim of a queue with sequence members parks the members that must wait for
an earlier one (``sql.CLAIM_SEQUENCED``): they stay ``available``, but no claim
reads them again. The transaction that finishes a member restores the next one
of its key (``hand_off``, called by ``finalize``), so it is claimable the moment
that commits; the completer then wakes its queue (``completer.notify_freed``). Where
the finishing worker reserved a place on the next member's queue (``HandOn``), that
transaction claims the next member for it instead (``sql.HAND_ON``,
``sql.COMPLETE_HAND_ON``, prepared ``sql.COMPLETE_HAND_ON_ONE`` for one member): the
completer hands it to a handler thread after the commit.
``awa.cancel`` and a callback's resolution hand on too (``after_finishing``). A
member finished another way (discarded by rescue, cancelled by its dependency,
deleted) leaves the next one to maintenance (``restore_parked``), within one
maintenance interval.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import db, sql, wakeups
from .conf import awa_settings
from .execute import AttemptResult
from .kinds import registry
from .models import JOB_ATTNAMES, ClaimedJob, Job, JobState, claimed_jobs

logger = logging.getLogger(__name__)

SEQUENCE_KEY = "awa_sequence"
# Where a job's columns are in a row of sql.J_JOB_COLUMNS.
ID_COLUMN = JOB_ATTNAMES.index("id")
QUEUE_COLUMN = JOB_ATTNAMES.index("queue")
HAS_DEPENDENTS_COLUMN = JOB_ATTNAMES.index("has_dependents")


def finished_keys(results: Iterable[AttemptResult]) -> list[tuple[str, str]]:
    """The sequence keys of the members ``results`` finish (completed, failed,
    cancelled), each with the queue of the member."""
    keys = {
        key: result.job.queue  # one queue a key: each key is handed on once
        for result in results
        if result.job.metadata  # most jobs have none: one test each
        and (key := result.job.metadata.get(SEQUENCE_KEY)) is not None
        and result.state in JobState.FINAL
    }
    return sorted(keys.items())


@dataclass(slots=True)
class HandOn:
    """Places a worker reserved for the next members of the sequences a batch finishes
    (queue: how many; one per finished member, on its queue), and the members
    ``finalize`` claimed into them."""

    places: dict[str, int]
    claimed: list[ClaimedJob] = field(default_factory=list)

    def took(self, claimed: list[ClaimedJob]) -> None:
        """``claimed`` (committed) fill places: add them, take their places off."""
        for job in claimed:
            self.places[job.queue] -= 1
        self.claimed.extend(claimed)


def places_of(keys: list[tuple[str, str]], hand_on: HandOn | None) -> list[str | None]:
    """For each of ``keys`` ((key, queue)), the queue of a place of ``hand_on`` its next
    member may be claimed into, or ``None``: one place per key, while they last."""
    free = dict(hand_on.places) if hand_on else {}
    places: list[str | None] = []
    for _, queue in keys:
        if free.get(queue, 0) > 0:
            free[queue] -= 1
            places.append(queue)
        else:
            places.append(None)
    return places


def hand_off(
    keys: list[tuple[str, str]], alias: str, hand_on: HandOn | None = None
) -> tuple[list[str], list[ClaimedJob]]:
    """Hand each sequence of ``keys`` ((key, queue of the member that finished)) on to
    its first unfinished member.

    Call inside the transaction that finished the members before them, after
    their outcome is written. With places in ``hand_on`` (a copy is used:
    the caller takes the claimed ones off once the transaction commits), a
    next member that is due on the queue of a place is claimed for this worker
    (``sql.HAND_ON``) and starts once this commits, without a claim. Every
    other next member is restored if it is parked, claimable when this
    commits. Returns the queues of the members restored and the members claimed.
    """
    if not keys:
        return [], []
    places = places_of(keys, hand_on)
    with db.cursor(alias) as cursor:
        if not any(places):
            cursor.execute(sql.HAND_OFF, {"keys": [key for key, _ in keys]})
            return [row[0] for row in cursor.fetchall()], []
        cursor.execute(
            sql.HAND_ON,
            {
                "keys": [key for key, _ in keys],
                "places": places,
                **claim_params(),
            },
        )
        rows = cursor.fetchall()
    claimed = claimed_jobs(row[1:] for row in rows if row[0])
    restored = [row[1 + QUEUE_COLUMN] for row in rows if not row[0]]
    return restored, claimed


def claim_params() -> dict[str, Any]:
    """The deadline parameters of a claim (``sql._CLAIM_SET``)."""
    return {
        "deadlines": registry.deadlines_json(),
        "default_deadline": awa_settings().default_deadline,
    }


def after_finishing(rows: Iterable[Job], alias: str) -> None:
    """``hand_off`` for callers that finish jobs themselves (``awa.cancel``, a
    callback's resolution), inside their transaction; the queues of the members
    restored are woken at its commit (``wakeups.announce``)."""
    keys = sorted(
        {
            key: row.queue
            for row in rows
            if row.state in JobState.FINAL
            and row.metadata
            and (key := row.metadata.get(SEQUENCE_KEY)) is not None
        }.items()
    )
    queues, _ = hand_off(keys, alias)
    wakeups.announce(alias, queues)


def restore_parked(alias: str) -> set[str]:
    """Restore every parked member that is now first of its key; wake their queues.

    Maintenance's safety net for members finished outside ``finalize``. Run it
    inside a transaction: the wake-up (``wakeups.announce``) comes at its commit.
    """
    with db.cursor(alias) as cursor:
        cursor.execute(sql.RESTORE_PARKED)
        queues = {row[0] for row in cursor.fetchall()}
        if queues:
            logger.info("restored parked sequence members on queue(s) %s", sorted(queues))
            wakeups.announce(alias, queues, cursor)
    return queues
