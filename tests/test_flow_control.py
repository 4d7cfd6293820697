"""Flow control (SPEC 12): queue rate limits and global concurrency, kind limits
per key, sequences, runtime changes, pausing.

The worker tests run three real ``awa_worker`` processes; every handler run
records a ``FlowRun`` row (its attempt's start, the handler's start and end),
and the assertions are SQL over those rows: that the limit held at every
instant, and that runs did overlap where the limits allow it (so a serial
implementation fails them).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

import django_awa as awa
from django_awa import producer
from django_awa.models import Job, JobState
from tests.conftest import WorkerProcess, wait_for
from tests.testapp.jobs import CappedSpan, KeyedSpan, RatedSpan, SequencedSpan, Span
from tests.testapp.models import FlowRun

FLOW_ENV = {"AWA_TEST_FLOW_QUEUES": "1"}


def _scalar(statement: str, params: Any = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()[0]


# The most runs that overlapped at one instant: a sweep over the starts (+1)
# and ends (-1) of the runs matched by the WHERE clause, ends first at a tie.
MAX_OVERLAP = """
SELECT coalesce(max(running), 0) FROM (
    SELECT sum(d) OVER (ORDER BY at, d ROWS UNBOUNDED PRECEDING) AS running
    FROM (SELECT started_at AS at, 1 AS d FROM testapp_flowrun WHERE {where}
          UNION ALL
          SELECT ended_at, -1 FROM testapp_flowrun WHERE {where}) AS edges
) AS sweep
"""


def max_overlap(where: str = "true", params: Any = None) -> int:
    return _scalar(MAX_OVERLAP.format(where=where), (params or []) * 2)


# The most attempts that started in any window of %s seconds (each window
# begins at a start: the busiest window does).
MAX_STARTS_IN_WINDOW = """
SELECT coalesce(max(n), 0) FROM (
    SELECT (SELECT count(*) FROM testapp_flowrun AS b
            WHERE {where_b} AND b.attempted_at >= a.attempted_at
              AND b.attempted_at < a.attempted_at + make_interval(secs => %s)) AS n
    FROM testapp_flowrun AS a WHERE {where_a}
) AS w
"""


def max_starts_in_window(seconds: float, where: str = "true", params: Any = None) -> int:
    statement = MAX_STARTS_IN_WINDOW.format(
        where_a=where.replace("{t}", "a"), where_b=where.replace("{t}", "b")
    )
    return _scalar(statement, [*(params or []), seconds, *(params or [])])


def overlaps_within_key(kind: str) -> int:
    """Pairs of runs of one key whose handler runs overlapped."""
    return _scalar(
        """SELECT count(*) FROM testapp_flowrun AS a JOIN testapp_flowrun AS b
           ON a.kind = b.kind AND a.key = b.key AND a.id < b.id
          AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)
           WHERE a.kind = %s""",
        [kind],
    )


def all_finished(kind: str, count: int, timeout: float = 60) -> None:
    def done() -> bool:
        return Job.objects.filter(kind=kind, state__in=JobState.FINAL).count() >= count

    wait_for(
        done,
        timeout,
        lambda: (
            f"{kind}: states {list(Job.objects.filter(kind=kind).values_list('state', flat=True))}"
        ),
    )


def start_three(start_worker: Callable[..., WorkerProcess], queue: str, **env: str) -> list[Any]:
    return [start_worker("--queue", queue, env={**FLOW_ENV, **env}) for _ in range(3)]


# ==== In-process: the limited claim =============================================


@pytest.mark.django_db(transaction=True)
def test_held_back_jobs_stay_available_without_using_an_attempt() -> None:
    awa.set_queue_limits("inproc", global_concurrency=2)
    ids = awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="inproc") for i in range(5)])
    limits = producer.queue_limits("inproc", "default")
    assert limits.limited and limits.global_concurrency == 2
    first = producer.claim_limited(limits, 10, "default")
    assert [j.id for j in first] == ids[:2]
    assert producer.claim_limited(limits, 10, "default") == []
    held = Job.objects.filter(id__in=ids[2:])
    assert {(j.state, j.attempt) for j in held} == {(JobState.AVAILABLE, 0)}
    # A finished attempt frees its slot for the next in claim order.
    Job.objects.filter(id=ids[0]).update(state=JobState.COMPLETED)
    assert [j.id for j in producer.claim_limited(limits, 10, "default")] == [ids[2]]


# ==== Queue limits across three worker processes =================================


def run_global_concurrency(start_worker: Callable[..., WorkerProcess], **env: str) -> None:
    """AWA["QUEUES"]["glob"] = {"concurrency": 6, "global_concurrency": 4}, three workers."""
    workers = start_three(start_worker, "glob", **env)
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i, seconds=0.15), queue="glob") for i in range(36)])
    all_finished("span", 36, timeout=90)
    assert Job.objects.filter(kind="span", state=JobState.COMPLETED).count() == 36
    overlap = max_overlap("queue = %s", ["glob"])
    assert overlap <= 4, f"{overlap} runs of queue glob overlapped; global_concurrency is 4"
    # 18 places across the processes, 4 allowed: a serial claim would give 1.
    assert overlap >= 3, f"at most {overlap} ran at once: the fleet did not use its 4 slots"
    assert FlowRun.objects.values("pid").distinct().count() >= 2
    for worker in workers:
        assert worker.stop() == 0


def run_rate_limit(start_worker: Callable[..., WorkerProcess], **env: str) -> None:
    """AWA["QUEUES"]["rated"] = {"rate_limit": "10/s"}, three workers, quick jobs."""
    workers = start_three(start_worker, "rated", **env)
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i, seconds=0.0), queue="rated") for i in range(35)])
    all_finished("span", 35, timeout=60)
    busiest = max_starts_in_window(1.0, "{t}.queue = %s", ["rated"])
    assert busiest <= 10, f"{busiest} attempts of queue rated started within one second"
    # Quick handlers on 30 places: the window filled (not one start at a time).
    assert busiest >= 8, f"the busiest second had only {busiest} starts of 10 allowed"
    first, last = FlowRun.objects.order_by("attempted_at").values_list("attempted_at", flat=True)[
        :: FlowRun.objects.count() - 1
    ]
    # 35 starts at 10 per sliding second take at least three seconds.
    assert last - first >= dt.timedelta(seconds=3)
    # ...and the rate was used: not much more than the limit requires.
    assert last - first < dt.timedelta(seconds=6)
    for worker in workers:
        assert worker.stop() == 0


def test_global_concurrency_holds_across_three_workers(start_worker) -> None:
    run_global_concurrency(start_worker)


def test_rate_limit_holds_across_three_workers(start_worker) -> None:
    run_rate_limit(start_worker)


# ==== Kind limits ================================================================


def test_kind_limit_per_key_never_overlaps_one_key_and_runs_keys_in_parallel(
    start_worker,
) -> None:
    start_three(start_worker, "bykey=4")
    # Interleaved keys, the first key's jobs first: one busy key holds back no other.
    jobs = [KeyedSpan(key="busy", n=i, seconds=0.1) for i in range(8)]
    jobs += [KeyedSpan(key=f"k{i % 5}", n=i, seconds=0.1) for i in range(20)]
    awa.enqueue_many(jobs)
    all_finished("keyed_span", 28)
    assert overlaps_within_key("keyed_span") == 0
    assert max_overlap("kind = %s", ["keyed_span"]) >= 4  # keys ran side by side
    # The quiet keys did not wait for the busy key's backlog.
    busy_last = FlowRun.objects.filter(key="busy").order_by("-ended_at")[0].ended_at
    assert FlowRun.objects.filter(key="k1", started_at__lt=busy_last).exists()


def test_kind_concurrency_limit_holds_fleet_wide(start_worker) -> None:
    start_three(start_worker, "capped=4")
    awa.enqueue_many([CappedSpan(n=i, seconds=0.15) for i in range(16)])
    all_finished("capped_span", 16)
    assert max_overlap("kind = %s", ["capped_span"]) == 2


def test_kind_rate_limit_per_key(start_worker) -> None:
    start_three(start_worker, "keyrate=4")
    awa.enqueue_many([RatedSpan(key=k, n=i, seconds=0.0) for i in range(10) for k in "ab"])
    all_finished("rated_span", 20, timeout=30)
    for key in "ab":
        busiest = max_starts_in_window(1.0, "{t}.key = %s", [key])
        assert busiest <= 4, f"key {key}: {busiest} starts within a second; the limit is 4/s"
    # Per key, not per kind: both keys used their 4 in the same second.
    assert max_starts_in_window(1.0, "true") >= 6


# ==== Sequences ==================================================================


def test_sequence_runs_one_at_a_time_in_enqueue_order_and_keys_in_parallel(
    start_worker,
) -> None:
    start_three(start_worker, "seq=4")
    awa.enqueue_many([SequencedSpan(key=k, n=i, seconds=0.05) for i in range(8) for k in "xyz"])
    # One job for a per-job sequence key across kinds: EnqueueRequest(sequence=).
    all_finished("sequenced_span", 24)
    assert overlaps_within_key("sequenced_span") == 0
    out_of_order = _scalar(
        """SELECT count(*) FROM testapp_flowrun AS a JOIN testapp_flowrun AS b
           ON a.key = b.key AND a.n < b.n AND b.started_at < a.ended_at
           WHERE a.kind = 'sequenced_span'"""
    )
    assert out_of_order == 0, "a member started before the one enqueued before it ended"
    assert max_overlap("kind = %s", ["sequenced_span"]) >= 2  # the keys ran side by side
