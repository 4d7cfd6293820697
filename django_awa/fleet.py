"""The worker registry: every worker process's row in ``awa_worker``.

A worker registers as it starts (``beat``, from the main thread), renews its
row with each heartbeat (the heartbeat thread calls ``beat`` again) and
deletes it when it stops (``deregister``). A worker that died without
stopping leaves a row that is no longer renewed: ``live()`` leaves it out
once it is ``STALE_AFTER`` old, and the maintenance leader deletes it
(``prune``). The leader also stamps its own row after each tick
(``mark_maintained``), which ``<prefix>/health`` reads.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from datetime import timedelta

from django.db import connections
from django.db.models import QuerySet
from django.db.models.functions import Now

from . import __version__, sql
from .models import JobState, Worker
from .state import WorkerState


def running_ids(state: WorkerState) -> list[int]:
    """The jobs whose handlers run in this worker now: started, and not returned (an
    outcome waiting for the completer's batch is not counted: with it, a busy worker
    said it ran more jobs than its concurrency)."""
    with state.running_lock:
        waiting = state.waiting
        return sorted(
            job_id
            for job_id, attempt in state.running.items()
            if job_id not in waiting and not attempt.returned
        )


def beat(state: WorkerState) -> None:
    """Register this worker, or renew its row: last seen now, with the jobs it runs."""
    ids = running_ids(state)
    host, _, pid = state.name.rpartition(":")
    with connections[state.alias].cursor() as cursor:
        cursor.execute(
            sql.BEAT_WORKER,
            {
                "id": state.id,
                "name": state.name,
                "host": host or socket.gethostname(),
                "pid": int(pid),
                "queues": json.dumps({q.name: q.concurrency for q in state.queues.values()}),
                "concurrency": sum(q.concurrency for q in state.queues.values()),
                "version": __version__,
                "started_at": state.started_at,
                "running_ids": json.dumps(ids),
                "running": len(ids),
            },
        )


def deregister(state: WorkerState) -> None:
    """Delete this worker's row: it stopped."""
    with connections[state.alias].cursor() as cursor:
        cursor.execute(sql.DEREGISTER_WORKER, {"id": state.id})


def mark_maintained(state: WorkerState) -> None:
    """Record that this worker, as the maintenance leader, just ran a tick."""
    with connections[state.alias].cursor() as cursor:
        cursor.execute(sql.MARK_MAINTAINED, {"id": state.id})


def prune(alias: str, stale_after: float) -> int:
    """Delete the rows of workers unseen for ``stale_after`` seconds; returns how many."""
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.PRUNE_WORKERS, {"stale_after": stale_after})
        pruned: int = cursor.rowcount
    return pruned


def orphaned_queues(alias: str, named: Iterable[str], stale_after: float) -> list[tuple[str, int]]:
    """The queues whose jobs wait to run (``JobState.WAITING``), none of ``named``
    and run by no worker seen within ``stale_after`` seconds, each with the count
    of those jobs, by name."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            sql.ORPHANED_QUEUES,
            {
                "states": [str(s) for s in JobState.WAITING],
                "named": sorted(set(named)),
                "stale_after": stale_after,
            },
        )
        return [(queue, count) for queue, count in cursor.fetchall()]


def live(alias: str, stale_after: float) -> QuerySet[Worker]:
    """The workers seen within ``stale_after`` seconds (the database clock judges)."""
    return Worker.objects.using(alias).filter(
        last_seen_at__gte=Now() - timedelta(seconds=stale_after)
    )


def running_job(alias: str, stale_after: float, job_id: int) -> Worker | None:
    """The live worker whose handler runs job ``job_id``, as of its last heartbeat."""
    return live(alias, stale_after).filter(running_ids__contains=[job_id]).first()
