"""Claiming: several runnable jobs of one queue per statement."""

from __future__ import annotations

from . import db, sql
from .conf import awa_settings
from .kinds import registry
from .models import Job, jobs_from_rows


def claim(queue: str, limit: int, alias: str) -> list[Job]:
    """Claim up to ``limit`` runnable jobs of ``queue``, in priority, run_at, id order.

    Each claimed row is ``running`` with a new ``run_lease``: the attempt's
    guard for every later write. Commits at once (autocommit): a claim must be
    visible to other workers' SKIP LOCKED and to maintenance.
    """
    conf = awa_settings()
    with db.cursor(alias) as cursor:
        cursor.execute(
            sql.CLAIM,
            {
                "queue": queue,
                "limit": limit,
                "deadlines": registry.deadlines_json(),
                "default_deadline": conf.default_deadline,
            },
        )
        rows = cursor.fetchall()
    jobs = jobs_from_rows(rows, alias)
    jobs.sort(key=lambda j: (j.priority, j.run_at, j.id))
    return jobs
