"""The admin dashboard: outcomes per minute, wait before start, oldest due job.

How the history is kept, without a counter row every finalize would lock:

1. Each worker counts the outcomes it writes in memory (``Tally.record``, in
   the completer and the atomic handler path): completed, failed (attempts
   exhausted), retried, and each started attempt's wait from due to start in
   a histogram (``WAIT_BOUNDS``).
2. Its heartbeat thread flushes them (``Tally.flush``): one insert-only row
   per queue into ``awa_stat_delta``, stamped with the database clock's
   minute. Maintenance's rescue records what it rescued the same way.
3. The maintenance leader, each maintenance interval, takes every delta row
   and adds it into ``awa_stat_minute`` (one row per queue and minute, the
   leader its only writer), stores each queue's oldest due job's age from the
   counts it already keeps (``awa_job_count``), and prunes minutes older than
   ``KEEP_SECONDS`` (``fold``, ``record_oldest_due_and_prune``).
4. The dashboard page and its JSON endpoint read only ``awa_stat_minute``
   (at most a row per queue and minute of the window) and ``awa_job_count``.

Outcomes written outside a worker (a callback resolving a job from a web
process, ``django_awa.testing.run_jobs``) are not counted.
"""

from __future__ import annotations

import json
import logging
import operator
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connections

from . import sql
from .models import JobCount, JobState, Queue

if TYPE_CHECKING:
    from .execute import Attempt, AttemptResult

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the wait histogram's buckets; one more bucket
# takes everything above the last.
WAIT_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    900.0, 3600.0,
)  # fmt: skip
BUCKETS = len(WAIT_BOUNDS) + 1
# The rollup keeps a day and an hour of minutes; the day chart reads a day.
KEEP_SECONDS = 25 * 3600
# Delta rows the leader folds per transaction, and transactions per pass at most:
# a pass is bounded however long no leader ran.
FOLD_BATCH = 5000
FOLD_ROUNDS = 20
# The two windows the dashboard draws: (seconds shown, seconds per point).
WINDOWS: dict[str, tuple[int, int]] = {"hour": (3600, 60), "day": (86400, 900)}


def _bucket(seconds: float) -> int:
    """The histogram bucket of a wait: the first whose upper bound it does not pass."""
    return bisect_left(WAIT_BOUNDS, seconds)


def _hist(value: Any) -> list[int]:
    """A histogram read by a raw cursor: Django's connection hands jsonb over as text."""
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, list) else []


def _add_hist(into: list[int], other: list[int]) -> None:
    if len(other) == len(into):
        into[:] = map(operator.add, into, other)
    else:  # a histogram of another length (none, or another release's): what fits
        for index, count in enumerate(other[: len(into)]):
            into[index] += count


@dataclass(slots=True)
class Counts:
    """One queue's outcomes in one stretch of time."""

    completed: int = 0
    failed: int = 0
    retried: int = 0
    wait: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def add(self, other: Counts) -> None:
        self.completed += other.completed
        self.failed += other.failed
        self.retried += other.retried
        _add_hist(self.wait, other.wait)

    def __bool__(self) -> bool:
        return bool(self.completed or self.failed or self.retried or any(self.wait))


def _count_outcome(entry: Counts, state: str) -> None:
    """Count outcome ``state`` (completed, failed, retried; others are not counted)."""
    if state == JobState.COMPLETED:
        entry.completed += 1
    elif state == JobState.FAILED:
        entry.failed += 1
    elif state == JobState.RETRYABLE:
        entry.retried += 1


class Tally:
    """A worker's outcome counts per queue since its last flush (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, Counts] = {}

    def _entry(self, queue: str) -> Counts:
        entry = self._counts.get(queue)
        if entry is None:
            entry = self._counts[queue] = Counts()
        return entry

    def count(self, queue: str, state: str, wait: float | None = None) -> None:
        """Count one outcome ``state`` on ``queue``, and a started attempt's ``wait``."""
        with self._lock:
            self._add(queue, state, wait)

    def _add(self, queue: str, state: str, wait: float | None) -> None:
        entry = self._entry(queue)
        _count_outcome(entry, state)
        if wait is not None:
            entry.wait[_bucket(wait)] += 1

    def record(
        self, results: Iterable[AttemptResult], running: Mapping[int, Attempt] | None = None
    ) -> None:
        """Count the written ``results``; ``running``: the worker's attempts, for inbox waits.

        The wait of an attempt is from its job's due time (``run_at``) to its
        handler's start: the claim stamps ``heartbeat_at`` with the database
        clock, and the time the job then spent in the worker's inbox is
        measured on the monotonic clock. A snooze is no outcome.
        """
        # The completer's thread runs this for every result: kept to plain
        # attribute reads and one bisect: about 2 us a result at load 18.
        running = running or {}
        bounds = WAIT_BOUNDS
        queue, entry = "", None
        with self._lock:
            for result in results:
                job = result.job
                if entry is None or job.queue != queue:
                    queue = job.queue
                    entry = self._entry(queue)
                if not result.snoozed:
                    _count_outcome(entry, result.state)
                started = result.started
                claimed_at, due = job.heartbeat_at, job.run_at
                if started is None or claimed_at is None or due is None:
                    continue
                wait = (claimed_at - due).total_seconds()
                attempt = running.get(job.id)
                if attempt is not None and started > attempt.claimed:
                    wait += started - attempt.claimed
                entry.wait[bisect_left(bounds, wait) if wait > 0 else 0] += 1

    def take(self) -> dict[str, Counts]:
        """Everything counted so far, leaving the tally empty."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return {queue: c for queue, c in counts.items() if c}

    def give_back(self, counts: Mapping[str, Counts]) -> None:
        """Put counts a failed flush could not store back, for the next flush."""
        with self._lock:
            for queue, entry in counts.items():
                self._entry(queue).add(entry)

    def flush(self, alias: str, worker: str) -> int:
        """Insert the counts as ``awa_stat_delta`` rows (one per queue); returns how many.

        On a database error the counts are kept for the next flush and the
        error raised.
        """
        counts = self.take()
        if not counts:
            return 0
        queues = sorted(counts)
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    sql.FLUSH_TALLY,
                    {
                        "worker": worker,
                        "queue": queues,
                        "completed": [counts[q].completed for q in queues],
                        "failed": [counts[q].failed for q in queues],
                        "retried": [counts[q].retried for q in queues],
                        "wait": [json.dumps(counts[q].wait) for q in queues],
                    },
                )
        except Exception:
            self.give_back(counts)
            raise
        return len(queues)


def fold(alias: str, limit: int) -> int:
    """Fold up to ``limit`` flushed deltas into ``awa_stat_minute``; returns how many
    were taken.

    The maintenance leader's duty, inside its fenced transaction: it is the
    rollup's only writer, so reading the rows it adds to and writing the
    sums back races with no one.
    """
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.TAKE_STAT_DELTAS, {"limit": limit})
        taken = cursor.fetchall()
        sums: dict[tuple[str, datetime], Counts] = {}
        for queue, minute, completed, failed, retried, wait in taken:
            entry = sums.setdefault((queue, minute), Counts())
            entry.add(Counts(completed, failed, retried, _hist(wait)))
        if sums:
            keys = sorted(sums)
            cursor.execute(
                sql.READ_STAT_MINUTES,
                {"queue": [k[0] for k in keys], "minute": [k[1] for k in keys]},
            )
            for queue, minute, completed, failed, retried, wait in cursor.fetchall():
                sums[(queue, minute)].add(Counts(completed, failed, retried, _hist(wait)))
            cursor.execute(
                sql.WRITE_STAT_MINUTES,
                {
                    "queue": [k[0] for k in keys],
                    "minute": [k[1] for k in keys],
                    "completed": [sums[k].completed for k in keys],
                    "failed": [sums[k].failed for k in keys],
                    "retried": [sums[k].retried for k in keys],
                    "wait": [json.dumps(sums[k].wait) for k in keys],
                },
            )
    return len(taken)


def record_oldest_due_and_prune(alias: str) -> None:
    """Store each queue's oldest due job's age in this minute's rollup row (from the
    leader's ``awa_job_count``), and delete minutes older than ``KEEP_SECONDS``."""
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.RECORD_OLDEST_DUE)
        cursor.execute(sql.PRUNE_STAT_MINUTES, {"keep": KEEP_SECONDS})


def percentile(hist: list[int], fraction: float) -> float | None:
    """The ``fraction`` quantile of a wait histogram, interpolated within its bucket
    (None: empty). Above the last bound it says the last bound."""
    total = sum(hist)
    if not total:
        return None
    rank = fraction * total
    seen = 0
    for index, count in enumerate(hist):
        if count and seen + count >= rank:
            if index >= len(WAIT_BOUNDS):
                return WAIT_BOUNDS[-1]
            low = WAIT_BOUNDS[index - 1] if index else 0.0
            high = WAIT_BOUNDS[index]
            return round(low + (high - low) * max(0.0, rank - seen) / count, 4)
        seen += count
    return WAIT_BOUNDS[-1]


@dataclass(slots=True)
class _Series:
    points: int
    counts: list[Counts] = field(init=False)
    oldest_due: list[float | None] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = [Counts() for _ in range(self.points)]
        self.oldest_due = [None] * self.points

    def add(self, index: int, counts: Counts, oldest_due: float | None) -> None:
        self.counts[index].add(counts)
        if oldest_due is not None:
            seen = self.oldest_due[index]
            self.oldest_due[index] = oldest_due if seen is None else max(seen, oldest_due)

    def as_json(self, per_minute: float) -> dict[str, Any]:
        def rate(value: int) -> float:
            return round(value / per_minute, 2)

        return {
            "completed": [rate(c.completed) for c in self.counts],
            "failed": [rate(c.failed) for c in self.counts],
            "retried": [rate(c.retried) for c in self.counts],
            "wait_p50": [percentile(c.wait, 0.5) for c in self.counts],
            "wait_p95": [percentile(c.wait, 0.95) for c in self.counts],
            "oldest_due": [None if v is None else round(v, 1) for v in self.oldest_due],
            "totals": {
                "completed": sum(c.completed for c in self.counts),
                "failed": sum(c.failed for c in self.counts),
                "retried": sum(c.retried for c in self.counts),
            },
        }


OVERALL = "*"


def snapshot(alias: str, window: str) -> dict[str, Any]:
    """The dashboard's data for ``window`` (``"hour"`` or ``"day"``), as JSON-ready values.

    ``series`` has one entry per queue and ``"*"`` for all queues together:
    per point, jobs completed, failed and retried per minute, the wait from
    due to start (p50, p95, seconds) and the oldest due job's age (seconds).
    ``current`` has each queue's oldest due job's age now, from the leader's
    last count. Raises ``ValueError`` for an unknown window.
    """
    if window not in WINDOWS:
        raise ValueError(f"unknown dashboard window {window!r}: use one of {sorted(WINDOWS)}")
    span, step = WINDOWS[window]
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.DASHBOARD_WINDOW, {"window": span})
        now, start = cursor.fetchone()
        cursor.execute(sql.DASHBOARD_MINUTES, {"start": start, "step": step})
        rows = cursor.fetchall()
    points = span // step
    series: dict[str, _Series] = {}
    for queue, index, completed, failed, retried, wait, oldest_due in rows:
        if not 0 <= index < points:
            continue
        if queue not in series:
            series[queue] = _Series(points)
        series[queue].add(index, Counts(completed, failed, retried, _hist(wait)), oldest_due)
    # All queues together: the queues' points added, not every minute again.
    overall = _Series(points)
    for each in series.values():
        for index in range(points):
            overall.add(index, each.counts[index], each.oldest_due[index])
    series[OVERALL] = overall
    current: dict[str, float] = {}
    for row in JobCount.objects.using(alias).filter(
        state=JobState.AVAILABLE, oldest_run_at__isnull=False
    ):
        if row.oldest_run_at is not None:
            current[row.queue] = max(0.0, (now - row.oldest_run_at).total_seconds())
    paused = set(Queue.objects.using(alias).filter(paused=True).values_list("name", flat=True))
    per_minute = step / 60
    return {
        "window": window,
        "now": now.isoformat(),
        "start": start.isoformat(),
        "step_seconds": step,
        "queues": sorted(q for q in series if q != OVERALL),
        "series": {name: s.as_json(per_minute) for name, s in series.items()},
        "current": {
            "oldest_due": {q: round(v, 1) for q, v in sorted(current.items())},
            "oldest_due_overall": round(max(current.values()), 1) if current else None,
            "paused": sorted(paused),
        },
        "generated_in_ms": None,
    }


def timed_snapshot(alias: str, window: str) -> dict[str, Any]:
    """``snapshot``, with how long it took on the server."""
    began = time.perf_counter()
    data = snapshot(alias, window)
    data["generated_in_ms"] = round((time.perf_counter() - began) * 1000, 1)
    return data
