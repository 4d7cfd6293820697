"""Parked sequence members (SPEC 12): the hand-off and its safety net.

A claim of a queue with sequence members parks the members that must wait for
an earlier one (``sql.CLAIM_SEQUENCED``): they stay ``available``, but no claim
reads them again. The transaction that finishes a member restores the next one
of its key (``hand_off``, called by ``finalize``), so it is claimable the moment
that commits; the completer then wakes its queue (``completer.notify_freed``).
``awa.cancel`` and a callback's resolution hand on too (``after_finishing``). A
member finished another way (discarded by rescue, cancelled by its dependency,
deleted) leaves the next one to maintenance (``restore_parked``), within one
maintenance interval.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from . import db, sql
from .execute import AttemptResult
from .models import Job, JobState

logger = logging.getLogger(__name__)

SEQUENCE_KEY = "awa_sequence"


def finished_keys(results: Iterable[AttemptResult]) -> list[str]:
    """The sequence keys of the members ``results`` finish (completed, failed, cancelled)."""
    keys = {
        key
        for result in results
        if result.job.metadata  # most jobs have none: one test each
        and (key := result.job.metadata.get(SEQUENCE_KEY)) is not None
        and result.state in JobState.FINAL
    }
    return sorted(keys)


def hand_off(keys: list[str], alias: str) -> list[str]:
    """Restore the first unfinished member of each of ``keys`` if it is parked.

    Call inside the transaction that finished the members before them, after
    their outcome is written: the restored members become claimable when it
    commits. Returns the queues of the members restored.
    """
    if not keys:
        return []
    with db.cursor(alias) as cursor:
        cursor.execute(sql.HAND_OFF, {"keys": keys})
        return [row[0] for row in cursor.fetchall()]


def after_finishing(rows: Iterable[Job], alias: str) -> None:
    """``hand_off`` for callers that finish jobs themselves (``awa.cancel``, a
    callback's resolution), inside their transaction; the queues of the members
    restored are NOTIFYed at its commit."""
    keys = sorted(
        {
            key
            for row in rows
            if row.state in JobState.FINAL
            and row.metadata
            and (key := row.metadata.get(SEQUENCE_KEY)) is not None
        }
    )
    queues = hand_off(keys, alias)
    if queues:
        with db.cursor(alias) as cursor:
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": sorted(set(queues))})


def restore_parked(alias: str) -> set[str]:
    """Restore every parked member that is now first of its key; NOTIFY their queues.

    Maintenance's safety net for members finished outside ``finalize``. Run it
    inside a transaction: the NOTIFY is delivered at its commit.
    """
    with db.cursor(alias) as cursor:
        cursor.execute(sql.RESTORE_PARKED)
        queues = {row[0] for row in cursor.fetchall()}
        if queues:
            logger.info("restored parked sequence members on queue(s) %s", sorted(queues))
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": sorted(queues)})
    return queues
