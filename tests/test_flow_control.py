"""Flow control (SPEC 12): queue rate limits and global concurrency, kind limits
per key, sequences, runtime changes, pausing.

The worker tests run three real ``awa_worker`` processes; every handler run
records a ``FlowRun`` row (its attempt's start, the handler's start and end),
and the assertions are SQL over those rows: that the limit held at every
instant, and that runs did overlap where the limits allow it (so a serial
implementation fails them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import logging
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

import django_awa as awa
from django_awa import conf, producer, sql
from django_awa.completer import reserve_hand_on, start_handed_on
from django_awa.execute import (
    Attempt,
    AttemptResult,
    completed,
    errored,
    failed_terminally,
    from_value,
    unstarted,
)
from django_awa.finalize import finalize
from django_awa.followups import WAITING_FOR_CALLBACK
from django_awa.kinds import registry
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState, LimitLease, Queue
from django_awa.sequences import HandOn, hand_off
from django_awa.state import SharedConcurrency, WorkerState
from tests.conftest import WorkerProcess, generic_plan, wait_for, wait_for_state
from tests.testapp.jobs import (
    CappedSpan,
    DeadlineKeyedSpan,
    KeyedSpan,
    PairedSpan,
    RatedSpan,
    SequencedSpan,
    Span,
    TimedKeyedSpan,
    TimedSpan,
)
from tests.testapp.models import FlowRun

FLOW_ENV = {"AWA_TEST_FLOW_QUEUES": "1"}


def _scalar(statement: str, params: Any = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()[0]


# The most runs (matched by the WHERE clause) between their {begin} and their end
# at one instant: a sweep over the begins (+1) and the ends (-1), ends first at a tie.
_SWEEP = """
SELECT coalesce(max(held), 0) FROM (
    SELECT sum(d) OVER (ORDER BY at, d ROWS UNBOUNDED PRECEDING) AS held
    FROM (SELECT {begin} AS at, 1 AS d FROM testapp_flowrun WHERE {where}
          UNION ALL
          SELECT ended_at, -1 FROM testapp_flowrun WHERE {where}) AS edges
) AS sweep
"""

# The most runs that overlapped at one instant.
MAX_OVERLAP = _SWEEP.replace("{begin}", "started_at")


def max_overlap(where: str = "true", params: Any = None) -> int:
    return _scalar(MAX_OVERLAP.format(where=where), (params or []) * 2)


# The most attempts that started in any window of %s seconds (each window
# begins at a start: the busiest window does), by the {at} column of {table}
# (default the FlowRun's claim stamp).
MAX_STARTS_IN_WINDOW = """
SELECT coalesce(max(n), 0) FROM (
    SELECT (SELECT count(*) FROM {table} AS b
            WHERE {where_b} AND b.{at} >= a.{at}
              AND b.{at} < a.{at} + make_interval(secs => %s)) AS n
    FROM {table} AS a WHERE {where_a}
) AS w
"""


def max_starts_in_window(
    seconds: float,
    where: str = "true",
    params: Any = None,
    *,
    at: str = "attempted_at",
    table: str = "testapp_flowrun",
) -> int:
    statement = MAX_STARTS_IN_WINDOW.format(
        where_a=where.replace("{t}", "a"), where_b=where.replace("{t}", "b"), at=at, table=table
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


def claim_limited(limits: producer.QueueLimits, limit: int = 10) -> list[Job] | None:
    """``producer.claim_limited`` on the default database: the jobs it started."""
    claimed = producer.claim_limited(limits, limit, "default")
    return None if claimed is None else claimed.jobs


def start_three(start_worker: Callable[..., WorkerProcess], queue: str, **env: str) -> list[Any]:
    """Three workers of ``queue``, each up (listening) before the test enqueues: on a
    loaded machine the first would otherwise run a short drain alone."""
    workers = [start_worker("--queue", queue, env={**FLOW_ENV, **env}) for _ in range(3)]
    wait_for(
        lambda: all("listening for new jobs" in worker.output() for worker in workers),
        timeout=30,
        message="the three workers did not all start",
    )
    return workers


# ==== In-process: the limited claim =============================================


@pytest.mark.django_db(transaction=True)
def test_held_back_jobs_stay_available_without_using_an_attempt() -> None:
    awa.set_queue_limits("inproc", global_concurrency=2)
    ids = awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="inproc") for i in range(5)])
    limits = producer.queue_limits("inproc", "default")
    assert limits.limited and limits.global_concurrency == 2
    first = claim_limited(limits) or []
    assert [j.id for j in first] == ids[:2]
    assert claim_limited(limits) == []
    held = Job.objects.filter(id__in=ids[2:])
    assert {(j.state, j.attempt) for j in held} == {(JobState.AVAILABLE, 0)}
    # A finished attempt frees its slot for the next in claim order.
    Job.objects.filter(id=ids[0]).update(state=JobState.COMPLETED)
    assert [j.id for j in claim_limited(limits) or []] == [ids[2]]


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
    for worker in workers:
        assert worker.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_rate_limit_holds_for_handler_starts_not_only_claims(start_worker, workers: int) -> None:
    """A rate limit counts where a user's call happens: the handler's start.

    The claim stamps its starts, but a claimed job's handler begins a little
    later, by a delay that varies: a burst claimed late in one window could
    start beside the next window's (up to 2N in one). No sliding second may
    hold more than 20 handler starts, read from the jobs' ``attempted_at`` (the
    handler's start on the database clock) and from the handlers' own clock.
    """
    awa.set_queue_limits("rated", rate_limit="20/s")  # 20 per claim window, 10 s of them
    procs = [start_worker("--queue", "rated", env=FLOW_ENV) for _ in range(workers)]
    wait_for(
        lambda: all("listening for new jobs" in proc.output() for proc in procs),
        timeout=30,
        message="the workers did not all start",
    )
    count = 200
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.0), queue="rated") for i in range(count)]
    )
    all_finished("span", count, timeout=90)
    jobs = Job.objects.filter(kind="span")
    assert jobs.filter(state=JobState.COMPLETED).count() == count
    # None ran twice (a job given back unstarted runs once, later).
    assert FlowRun.objects.count() == FlowRun.objects.values("job_id").distinct().count() == count
    started = {job.id: job.attempted_at for job in jobs}
    for run in FlowRun.objects.all():
        # attempted_at is the handler's start, not the claim's stamp (the row's
        # heartbeat_at as the handler found it). It is written later, as the
        # database's clock less the time the worker measured since the start: the
        # moments between that measure and the statement (more on a loaded machine)
        # keep it from matching the handler's own clock exactly.
        assert started[run.job_id] not in (None, run.attempted_at), run.job_id
        gap = abs((started[run.job_id] - run.started_at).total_seconds())
        assert gap < 0.25, (run.job_id, started[run.job_id], run.started_at)
    by_row = max_starts_in_window(1.0, "{t}.kind = 'span'", table="awa_job")
    by_handler = max_starts_in_window(1.0, at="started_at")
    assert max(by_row, by_handler) <= 20, (
        f"{by_row} handler starts by attempted_at, {by_handler} by the handlers' clock, within"
        " one second; the limit is 20/s"
    )
    # The window filled: the rate is used, not merely kept.
    assert by_row >= 16, f"the busiest second had only {by_row} starts of 20 allowed"
    first, last = min(started.values()), max(started.values())
    # 200 starts at 20 per sliding second: at least 9 seconds; near 11 (20 per 1.1 s).
    assert dt.timedelta(seconds=9) <= last - first < dt.timedelta(seconds=14), last - first
    for proc in procs:
        assert proc.stop() == 0


# How a limited claim statement begins (its text as the server shows it is cut short).
CLAIM_STAMP = "WITH t AS MATERIALIZED (SELECT clock_timestamp() AS now)"


def _waiting_for_a_lock(text: str) -> int:
    """How many sessions wait for a lock in a statement whose text holds ``text``."""
    return _scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND strpos(query, %s) > 0",
        [text],
    )


@pytest.mark.slow
def test_a_workers_first_rated_claim_gives_back_nothing_for_the_time_before_its_stamp(
    start_worker,
) -> None:
    """The server's time before a rated claim stamps its starts (a first claim plans
    its statement; here it waits for a lock the test holds) is not the handlers'
    to start in: the claim's jobs all run, none given back unstarted."""
    ids = awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.0), queue="rated") for i in range(10)]
    )
    slow = psycopg.connect(**connection.get_connection_params() | {"autocommit": False})
    try:
        # The claim statement cannot be planned while the log of starts is locked.
        slow.execute("LOCK TABLE awa_attempt_start IN ACCESS EXCLUSIVE MODE")
        worker = start_worker("--queue", "rated", env=FLOW_ENV)
        wait_for(lambda: _waiting_for_a_lock(CLAIM_STAMP), 30, worker.output)
        time.sleep(3 * producer.RATED_START_WITHIN)  # the claim's start, held back
        slow.commit()
    finally:
        slow.close()
    all_finished("span", 10)
    assert "gave back job" not in worker.output(), worker.output()
    assert sorted(FlowRun.objects.values_list("job_id", flat=True)) == ids
    # Its 10 starts came in one claim, within the second the rate allows them in.
    assert max_starts_in_window(1.0, "{t}.queue = %s", ["rated"]) == 10
    assert worker.stop() == 0


@pytest.mark.slow
def test_global_concurrency_holds_across_three_workers(start_worker) -> None:
    run_global_concurrency(start_worker)


@pytest.mark.slow
def test_a_global_concurrency_lowered_in_a_rolling_deploy_holds_the_larger_then_the_new(
    start_worker,
) -> None:
    # Mid-deploy: a worker with the settings before (glob: 4 places) beside one
    # deployed with 2. The fleet runs at most the larger limit, the new worker taking
    # no place while one above its limit is held; once the old worker stopped, 2.
    old = start_worker("--queue", "glob", env=FLOW_ENV)
    new = start_worker("--queue", "glob", env={"AWA_TEST_FLOW_QUEUES": "glob_lowered"})
    wait_for(
        lambda: all("listening for new jobs" in w.output() for w in (old, new)),
        timeout=30,
        message="the two workers did not both start",
    )
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i, seconds=0.1), queue="glob") for i in range(30)])
    all_finished("span", 30, timeout=90)
    overlap = max_overlap("queue = %s", ["glob"])
    assert overlap <= 4, f"{overlap} runs of queue glob overlapped; the larger limit is 4"
    assert overlap >= 3, f"at most {overlap} ran at once: the old worker's 4 places went unused"
    assert old.stop() == 0
    stopped = timezone.now()
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.1), queue="glob") for i in range(30, 50)]
    )
    all_finished("span", 50, timeout=90)
    after = "queue = %s AND started_at >= %s"
    overlap = max_overlap(after, ["glob", stopped])
    assert overlap <= 2, f"{overlap} runs overlapped with only the lowered limit, 2, deployed"
    assert overlap == 2, "the new worker did not use its 2 places once the old one stopped"
    assert new.stop() == 0


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_timed_out_attempt_keeps_its_key_until_its_handler_returns(start_worker) -> None:
    # A sync handler cannot be stopped at its timeout: while it still runs, its key's
    # place stays taken, or the next job of the key would run beside it.
    start_three(start_worker, "timedkey=4")
    awa.enqueue_many(
        [TimedKeyedSpan(key="k", n=i, first_seconds=2.5, seconds=0.05) for i in range(3)]
    )
    all_finished("timed_keyed_span", 3, timeout=90)
    assert overlaps_within_key("timed_keyed_span") == 0
    for job in Job.objects.filter(kind="timed_keyed_span"):
        # Each first attempt was still recorded as timed out, and retried.
        assert job.state == JobState.COMPLETED and job.attempt == 2, (job.state, job.attempt)
        assert "timed out" in job.errors[0]["error"], job.errors


@pytest.mark.slow
def test_kind_rate_limit_per_key(start_worker) -> None:
    start_three(start_worker, "keyrate=4")
    awa.enqueue_many([RatedSpan(key=k, n=i, seconds=0.0) for i in range(10) for k in "ab"])
    all_finished("rated_span", 20, timeout=30)
    for key in "ab":
        busiest = max_starts_in_window(1.0, "{t}.key = %s", [key])
        assert busiest <= 4, f"key {key}: {busiest} starts within a second; the limit is 4/s"
    # Per key, not per kind: both keys used their 4 in the same second.
    assert max_starts_in_window(1.0, "true") >= 6


# ==== Kind concurrency limits kept by per-key leases (sql.CLAIM_KEYED) ============


def _leases() -> list[tuple[str, str, int, int, int]]:
    """Every lease: (kind, key, slot, job_id, run_lease), in (kind, key, slot) order."""
    return list(
        LimitLease.objects.order_by("kind", "key", "slot").values_list(
            "kind", "key", "slot", "job_id", "run_lease"
        )
    )


def _claim_keyed(
    limits: producer.QueueLimits, limit: int = 10, scan: int | None = None
) -> list[int]:
    claimed = producer.claim_keyed(limits, limit, "default", scan=scan)
    assert claimed is not None, "the queue's lock was held"
    return [job.id for job in claimed]


def _claim_keyed_unlocked(
    limits: producer.QueueLimits, limit: int = 10, scan: int | None = None
) -> list[int]:
    """CLAIM_KEYED without the queue's lock: the unique lease index alone must keep
    its keys (the lock only spares claims that would meet there)."""
    params = {"queue": limits.queue, "kinds": limits.kinds, "limit": limit,
              "scan": scan or limit + producer.KEYED_SCAN_EXTRA}  # fmt: skip
    return [job.id for job in producer._run_claim(sql.CLAIM_KEYED, params, "default")]


def _claimer(
    claimed: dict[str, Any],
    name: str,
    claim: Callable[[], Any],
    hold: threading.Event | None = None,
) -> tuple[threading.Thread, threading.Event]:
    """A thread running ``claim()`` on its own connection, its result in ``claimed[name]``.
    With ``hold``, in a transaction kept open (its row locks, leases and the queue's
    lock held) until ``hold`` is set; the event returned is set once it claimed."""
    claimed_now = threading.Event()

    def run() -> None:
        try:
            with transaction.atomic() if hold else contextlib.nullcontext():
                claimed[name] = claim()
                claimed_now.set()
                if hold:
                    hold.wait(10)
        finally:
            connection.close()

    return threading.Thread(target=run), claimed_now


@pytest.mark.django_db(transaction=True)
def test_a_keyed_claim_takes_a_lease_per_key_and_the_outcome_gives_it_back() -> None:
    ids = awa.enqueue_many([KeyedSpan(key=k, n=i) for i, k in enumerate("aabca")])
    limits = producer.queue_limits("bykey", "default")
    assert limits.keyed and not limits.locked  # no queue lock for concurrency-only limits
    claimed = producer.claim_keyed(limits, 10, "default")
    assert [j.id for j in claimed] == [ids[0], ids[2], ids[3]]
    assert _leases() == [
        ("keyed_span", '["a"]', 1, ids[0], 1),
        ("keyed_span", '["b"]', 1, ids[2], 1),
        ("keyed_span", '["c"]', 1, ids[3], 1),
    ]
    # Every key is full: nothing more, and the held-back jobs stay available, unused.
    assert _claim_keyed(limits) == []
    held = Job.objects.filter(id__in=[ids[1], ids[4]])
    assert {(j.state, j.attempt) for j in held} == {(JobState.AVAILABLE, 0)}
    # Key a's outcome gives its lease back in the statement that writes it.
    assert finalize([completed(claimed[0])], "default")
    assert [lease[1] for lease in _leases()] == ['["b"]', '["c"]']
    assert _claim_keyed(limits) == [ids[1]]


@pytest.mark.django_db(transaction=True)
def test_a_lease_key_is_the_json_text_jsonb_writes_for_the_values() -> None:
    # The key every claim and worker compares is the JSON array of the by= values as
    # jsonb writes it out: escapes, non-ASCII, an empty string, a nested value with
    # its keys in jsonb's order, and a missing field (null).
    ids = awa.enqueue_many([KeyedSpan(key=k) for k in ['say "hi" \\ é \u0001', "", "n", "m"]])
    with connection.cursor() as cursor:
        cursor.execute(
            """UPDATE awa_job SET args = jsonb_set(args, '{key}', '{"zz": [1, 2.50], "a": null}')
               WHERE id = %s""",
            [ids[2]],
        )
        cursor.execute("UPDATE awa_job SET args = args - 'key' WHERE id = %s", [ids[3]])
    written = {
        job_id: _scalar("SELECT jsonb_build_array(args -> 'key')::text FROM awa_job WHERE id = %s",
                        [job_id])
        for job_id in ids
    }  # fmt: skip
    claimed = producer.claim_keyed(producer.queue_limits("bykey", "default"), 10, "default")
    assert sorted(j.id for j in claimed) == ids
    assert {lease[3]: lease[1] for lease in _leases()} == written
    assert written[ids[1]] == '[""]' and written[ids[3]] == "[null]"
    assert written[ids[2]] == '[{"a": null, "zz": [1, 2.50]}]'


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("locked", [False, True])
def test_a_long_key_is_leased_as_its_digest_and_still_holds_one_at_a_time(locked: bool) -> None:
    # A by= value too long for the lease index (its entries hold at most 2,704 bytes):
    # the claim that wrote its lease failed, and with it every claim of the queue.
    # Its lease now keeps its digest, one per value, and the key holds as any other.
    long, other = secrets.token_hex(1500), secrets.token_hex(1500)  # incompressible
    ids = awa.enqueue_many(
        [KeyedSpan(key=long), KeyedSpan(key="short"), KeyedSpan(key=long), KeyedSpan(key=other)]
    )
    limits = producer.queue_limits("bykey", "default")
    if locked:  # under the queue's lock (a rate on the queue): CLAIM_LIMITED
        rate = conf.Rate(count=10_000, period=1.0, text="10000/s")
        rated = dataclasses.replace(limits, rate_limit=rate)

        def claim() -> list[int]:
            return sorted(job.id for job in claim_limited(rated) or [])
    else:

        def claim() -> list[int]:
            return sorted(_claim_keyed(limits))

    assert claim() == [ids[0], ids[1], ids[3]]
    keys = {job: key for _, key, _, job, _ in _leases()}
    assert keys[ids[1]] == '["short"]'
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", keys[ids[0]]) and keys[ids[3]] != keys[ids[0]]
    assert claim() == []  # the long key's second job waits for its first
    assert finalize([completed(Job.objects.get(id=ids[0]))], "default")
    assert claim() == [ids[2]]


@pytest.mark.django_db(transaction=True)
def test_a_held_back_keyed_claimer_waits_a_gap_before_claiming_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each claim of a keyed queue reads past every key at its limit; woken by every
    # outcome batch, a claimer that took less than it asked claims again only
    # KEYED_CLAIM_GAP_RATIO times as long as that claim took after it, so one
    # reading serves more freed keys. 1,000 jobs of one key: each claim passes
    # over them.
    awa.enqueue_many([KeyedSpan(key="a", n=i) for i in range(1000)])
    state = WorkerState.create({"bykey": 2, "flow": 2})
    keyed = producer.Producer(state, state.queues["bykey"])
    assert len(keyed.run_once() or []) == 1  # key a is at its limit: held back
    pause = producer.KEYED_CLAIM_GAP_RATIO * keyed.claim_took
    assert 0 < keyed.claim_gap() <= pause
    time.sleep(pause)
    assert keyed.claim_gap() == 0  # woken later than the gap: at once
    plain = producer.Producer(state, state.queues["flow"])
    assert plain.run_once() == [] and plain.claim_gap() == 0  # other queues: never

    # The claim loop keeps the gap however often it is woken.
    claims: list[tuple[float, float]] = []
    real = producer.claim_keyed

    def timed(*args: Any, **kwargs: Any) -> list[Job]:
        started = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            claims.append((started, time.monotonic()))

    monkeypatch.setattr(producer, "claim_keyed", timed)
    runner = state.queues["bykey"]

    def claim_loop() -> None:
        try:
            keyed.run()
        finally:
            connection.close()

    loop = threading.Thread(target=claim_loop)
    loop.start()
    try:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            runner.wake.set()
            time.sleep(0.001)
    finally:
        state.stopping.set()
        runner.wake.set()
        loop.join(5)
    assert len(claims) >= 3
    for (start, end), (after, _) in itertools.pairwise(claims):
        assert after - end >= 0.9 * producer.KEYED_CLAIM_GAP_RATIO * (end - start)


@pytest.mark.django_db(transaction=True)
def test_keyed_claimers_of_one_queue_take_turns_without_waiting() -> None:
    # Claimers of one keyed queue try its lock: one that finds it held claims
    # nothing at once, waiting on no lock; the next claim sees the leases taken.
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1), KeyedSpan(key="b")])
    limits = producer.queue_limits("bykey", "default")
    release = threading.Event()
    claimed: dict[str, Any] = {}
    one, holding = _claimer(
        claimed, "first", lambda: producer.claim_keyed(limits, 1, "default", scan=1), release
    )
    two, _ = _claimer(
        claimed,
        "second",
        lambda: (
            producer.claim_keyed(limits, 10, "default"),
            claim_limited(_rated(limits)),
        ),
    )
    one.start()
    try:
        assert holding.wait(10)
        two.start()
        two.join(5)
        assert not two.is_alive(), "a claimer waited on the claim under way"
    finally:
        release.set()
        one.join(10)
    assert [j.id for j in claimed["first"] or []] == [ids[0]]
    assert claimed["second"] == (None, None)  # keyed, and under a rate
    assert Job.objects.filter(state=JobState.RUNNING).count() == 1
    # Its lock gone, the next claim sees the first one's lease: key b alone.
    assert _claim_keyed(limits) == [ids[2]]


@pytest.mark.django_db(transaction=True)
def test_claimers_of_one_key_at_the_same_instant_start_one_and_other_keys_go_on() -> None:
    # The second claim runs without the queue's lock: the unique lease index alone
    # keeps key a to one attempt.
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1), KeyedSpan(key="b")])
    limits = producer.queue_limits("bykey", "default")
    release = threading.Event()
    claimed: dict[str, list[int]] = {}
    # Reading one candidate, the first locks a0 only (the others it reads it would
    # lock until it commits, and the second claimer skip).
    one, holding = _claimer(claimed, "first", lambda: _claim_keyed(limits, 1, scan=1), release)
    two, _ = _claimer(claimed, "second", lambda: _claim_keyed_unlocked(limits))
    one.start()
    try:
        assert holding.wait(10)
        two.start()
        # Its snapshot shows key a free (the first claim is not committed): it
        # inserts a's slot and waits on the first claimer's lease of it.
        wait_for(
            lambda: _scalar(
                """SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND wait_event_type = 'Lock'"""
            ),
            10,
            "the second claimer never waited on the first one's lease",
        )
    finally:
        release.set()
        one.join(10)
        two.join(10)
    assert claimed["first"] == [ids[0]]
    # The slot is held by an attempt newer than its snapshot: not taken over.
    assert claimed["second"] == [ids[2]]
    a1 = Job.objects.get(id=ids[1])
    assert (a1.state, a1.attempt) == (JobState.AVAILABLE, 0)
    assert Job.objects.filter(args__key="a", state=JobState.RUNNING).count() == 1


def _waiting_on_a_lock() -> int:
    return _scalar(
        """SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
           AND wait_event_type = 'Lock'"""
    )


@pytest.mark.parametrize("first", ["locked", "keyed"])
@pytest.mark.django_db(transaction=True)
def test_a_locked_and_a_keyed_claim_of_one_key_at_the_same_instant_start_one(first: str) -> None:
    # A rate set or cleared at runtime puts workers on both claim paths for up to a
    # poll interval (and a worker's settings may give the queue a rate the others'
    # lack): each path must see the attempts the other is starting this instant.
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1), KeyedSpan(key="b")])
    keyed = producer.queue_limits("bykey", "default")
    locked = _rated(keyed)
    release = threading.Event()
    claimed: dict[str, list[int]] = {}

    def claim(path: str, limit: int) -> list[int]:
        if path == "keyed":  # reading one candidate, it locks a0 alone
            # Without the queue's lock (with it, it would find the lock held and
            # claim nothing): the lease index alone keeps the key.
            return _claim_keyed_unlocked(keyed, limit, scan=limit)
        return [job.id for job in claim_limited(locked, limit) or []]

    one, holding = _claimer(claimed, "first", lambda: claim(first, 1), release)
    other = "keyed" if first == "locked" else "locked"
    two, _ = _claimer(claimed, "second", lambda: claim(other, 10))
    threads = [one, two]
    threads[0].start()
    try:
        assert holding.wait(10)
        threads[1].start()
        # The second's snapshot shows key a free and a0 available. Past the locked
        # a0, the keyed claimer finds a1 and inserts a's slot: it must wait on the
        # locked claim's lease of it. The locked claimer's first of key a is a0,
        # which it skips (locked): it goes on with b alone.
        wait_for(
            lambda: not threads[1].is_alive() or _waiting_on_a_lock(),
            10,
            "the second claimer neither finished nor waited",
        )
        if first == "locked":
            assert threads[1].is_alive(), "the keyed claim did not wait on the locked one's lease"
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert claimed["first"] == [ids[0]]
    assert claimed["second"] == [ids[2]]
    a1 = Job.objects.get(id=ids[1])
    assert (a1.state, a1.attempt) == (JobState.AVAILABLE, 0)
    assert Job.objects.filter(args__key="a", state=JobState.RUNNING).count() == 1
    assert [(key, slot, job) for _, key, slot, job, _ in _leases()] == [
        ('["a"]', 1, ids[0]), ('["b"]', 1, ids[2])]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_concurrency_two_per_key_uses_slots_one_and_two_and_a_lowered_limit_holds() -> None:
    a = awa.enqueue_many([PairedSpan(key="a", n=i) for i in range(4)])
    b = awa.enqueue_many([PairedSpan(key="b", n=9)])
    limits = producer.queue_limits("paired", "default")
    assert limits.keyed
    first = producer.claim_keyed(limits, 10, "default")
    assert [j.id for j in first] == [a[0], a[1], b[0]]
    assert [(key, slot) for _, key, slot, _, _ in _leases()] == [
        ('["a"]', 1), ('["a"]', 2), ('["b"]', 1)]  # fmt: skip
    assert _claim_keyed(limits) == []
    finalize([completed(first[0])], "default")  # a's slot 1 is free
    # The limit lowered to 1 (a deploy): a's attempt in slot 2 still counts.
    lowered = dataclasses.replace(
        limits, kinds=json.dumps({"paired_span": {"by": ["key"], "c": 1}})
    )
    assert _claim_keyed(lowered) == []
    finalize([completed(first[1])], "default")
    assert _claim_keyed(lowered) == [a[2]]
    assert [(key, slot) for _, key, slot, _, _ in _leases()] == [('["a"]', 1), ('["b"]', 1)]
    # Back to 2: slot 2 again.
    assert _claim_keyed(limits) == [a[3]]
    assert [slot for _, key, slot, _, _ in _leases() if key == '["a"]'] == [1, 2]


def _stale(job_id: int) -> None:
    """Make the job's heartbeat stale, as its worker's death leaves it."""
    Job.objects.filter(id=job_id).update(heartbeat_at=timezone.now() - dt.timedelta(hours=1))


def _rescue(job_id: int) -> None:
    _stale(job_id)
    with connection.cursor() as cursor:
        cursor.execute(sql.RESCUE, {"stale_after": 60, "limit": 100})
        assert [row[1] for row in cursor.fetchall()] == [job_id]


# Every way an attempt leaves running, and the state it leaves the job in.
OUTCOMES: dict[str, tuple[Callable[[Job], None], str]] = {
    "retry": (lambda job: finalize([errored(job, "boom")], "default"), JobState.RETRYABLE),
    "fail": (lambda job: finalize([failed_terminally(job, "boom")], "default"), JobState.FAILED),
    "snooze": (
        lambda job: finalize([from_value(Attempt(job, "default"), awa.Snooze(60))], "default"),
        JobState.SCHEDULED,
    ),
    "callback": (
        lambda job: finalize(
            [AttemptResult(job=job, state=JobState.WAITING_EXTERNAL, context=WAITING_FOR_CALLBACK)],
            "default",
        ),
        JobState.WAITING_EXTERNAL,
    ),
    "give_back": (lambda job: finalize([unstarted(job)], "default"), JobState.AVAILABLE),
    # Its worker dead (a stale heartbeat): no handler runs, the key is free at once
    # (test_a_cancel_or_rescue_keeps_the_key_of_a_handler_that_may_still_run).
    "cancel": (lambda job: (_stale(job.id), awa.cancel(job.id)), JobState.CANCELLED),
    # RESCUE itself (Maintenance.rescue then also sweeps stale leases).
    "rescue": (lambda job: _rescue(job.id), JobState.RETRYABLE),
}


def _rated(limits: producer.QueueLimits) -> producer.QueueLimits:
    """``limits`` with a queue rate too high to hold anything back: claimed under the
    queue's lock (CLAIM_LIMITED), as a worker whose settings give the queue a rate,
    or one that has not yet read a rate cleared at runtime, claims it."""
    rated = dataclasses.replace(limits, rate_limit=conf.Rate(count=10_000, period=1.0, text="x"))
    assert rated.locked and not rated.keyed
    return rated


def _claim_by(path: str, limits: producer.QueueLimits, limit: int = 10) -> list[Job]:
    """Claim with ``path``: "keyed" (CLAIM_KEYED) or "locked" (LOCK_LIMITS + CLAIM_LIMITED)."""
    if path == "keyed":
        return producer.claim_keyed(limits, limit, "default")
    return claim_limited(_rated(limits), limit) or []


@pytest.mark.parametrize("path", ["keyed", "locked"])
@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@pytest.mark.django_db(transaction=True)
def test_every_way_out_of_running_gives_the_key_back(outcome: str, path: str) -> None:
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1)])
    limits = producer.queue_limits("bykey", "default")
    # Whichever path claimed it, the attempt holds its key's lease.
    [job] = _claim_by(path, limits)
    assert job.id == ids[0] and [lease[3] for lease in _leases()] == [ids[0]]
    write, state = OUTCOMES[outcome]
    write(job)
    assert Job.objects.get(id=ids[0]).state == state
    assert _leases() == [], f"{outcome} left the lease of key a behind"
    assert [j.id for j in _claim_by(path, limits, 1)] == [ids[1]]


@pytest.mark.parametrize("path", ["keyed", "locked"])
@pytest.mark.parametrize("way", ["cancel", "rescue"])
@pytest.mark.django_db(transaction=True)
def test_a_cancel_or_rescue_keeps_the_key_of_a_handler_that_may_still_run(
    way: str, path: str
) -> None:
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1)])
    limits = producer.queue_limits("bykey", "default")
    [job] = _claim_by(path, limits)
    # Its heartbeat is fresh: its worker lives and its handler may go on, whatever
    # the row says now.
    if way == "cancel":
        awa.cancel(job.id)
    else:
        Job.objects.filter(id=job.id).update(deadline_at=timezone.now() - dt.timedelta(seconds=1))
        Maintenance().rescue()  # RESCUE, then the sweep of stale leases
    assert Job.objects.get(id=job.id).state != JobState.RUNNING
    [lease] = LimitLease.objects.all()
    assert (lease.job_id, lease.run_lease) == (job.id, job.run_lease)
    assert lease.held_until is not None
    assert _claim_by(path, limits) == []
    Maintenance().rescue()
    assert LimitLease.objects.count() == 1  # not swept: it is held
    # Its worker renews it while the handler runs; the handler returned: freed.
    with connection.cursor() as cursor:
        params = {"id": [job.id], "run_lease": [job.run_lease], "stale_after": 60}
        cursor.execute(sql.RENEW_HELD_LEASES, params)
        assert cursor.rowcount == 1
        cursor.execute(sql.RELEASE_HELD_LEASES, params)
    assert _leases() == []
    assert [j.id for j in _claim_by(path, limits)] == [ids[1]]


@pytest.mark.parametrize("path", ["keyed", "locked"])
@pytest.mark.django_db(transaction=True)
def test_an_outcome_written_for_an_abandoned_handler_keeps_its_key_until_released(
    path: str,
) -> None:
    # A timed-out attempt whose handler thread was abandoned (it still runs) is
    # written at once, but its key's place stays taken until the handler returns.
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1)])
    limits = producer.queue_limits("bykey", "default")
    [job] = _claim_by(path, limits)
    result = errored(job, "timed out")
    result.keeps_lease = True
    assert finalize([result], "default") == [result]
    assert Job.objects.get(id=job.id).state == JobState.RETRYABLE
    [lease] = LimitLease.objects.all()
    assert (lease.job_id, lease.run_lease) == (job.id, job.run_lease)
    assert lease.held_until is not None
    assert _claim_by(path, limits) == []
    # The handler returned: its worker frees the key (HandlerPool.execute).
    with connection.cursor() as cursor:
        cursor.execute(sql.RELEASE_HELD_LEASES, {"id": [job.id], "run_lease": [job.run_lease]})
    assert [j.id for j in _claim_by(path, limits)] == [ids[1]]


@pytest.mark.django_db(transaction=True)
def test_a_kept_lease_its_worker_no_longer_renews_frees_when_it_runs_out() -> None:
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="a", n=1)])
    limits = producer.queue_limits("bykey", "default")
    assert _claim_keyed(limits) == [ids[0]]
    awa.cancel(ids[0])
    assert _claim_keyed(limits) == []
    # Its worker died with the handler: nothing renews the lease, which runs out.
    LimitLease.objects.update(held_until=timezone.now() - dt.timedelta(seconds=1))
    assert _claim_keyed(limits) == [ids[1]]
    assert _leases() == [("keyed_span", '["a"]', 1, ids[1], 1)]
    assert LimitLease.objects.get().held_until is None


@pytest.mark.django_db(transaction=True)
def test_a_stale_lease_is_taken_over_by_a_claim_and_swept_by_maintenance() -> None:
    ids = awa.enqueue_many([KeyedSpan(key="a", n=0), KeyedSpan(key="b", n=1)])
    limits = producer.queue_limits("bykey", "default")
    assert _claim_keyed(limits) == ids
    # Both attempts leave running by writes that do not release (a direct UPDATE,
    # a delete): their leases are stale.
    Job.objects.filter(id=ids[0]).update(state=JobState.AVAILABLE)
    Job.objects.filter(id=ids[1]).delete()
    assert len(_leases()) == 2
    # Key a's slot is taken over by the next attempt of the job...
    assert _claim_keyed(limits) == [ids[0]]
    assert _leases()[0] == ("keyed_span", '["a"]', 1, ids[0], 2)
    # ...and key b's, which no claim wants, is swept; a held one stays.
    Maintenance().rescue()
    assert _leases() == [("keyed_span", '["a"]', 1, ids[0], 2)]


@pytest.mark.slow
def test_a_killed_workers_keys_free_when_its_jobs_are_rescued(start_worker) -> None:
    victim = start_worker("--queue", "bykey=4")
    # The first attempts hang: they hold keys a and b when their worker dies.
    awa.enqueue_many([KeyedSpan(key=k, n=0, first_seconds=60, seconds=0.05) for k in "ab"])
    wait_for(lambda: FlowRun.objects.count() == 2, 20)
    assert sorted(lease[1] for lease in _leases()) == ['["a"]', '["b"]']
    awa.enqueue_many([KeyedSpan(key=k, n=i, seconds=0.05) for i in (1, 2, 3) for k in "abc"])
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    start_worker("--queue", "bykey=4")
    start_worker("--queue", "bykey=4")
    all_finished("keyed_span", 11, timeout=60)
    assert Job.objects.filter(kind="keyed_span", state=JobState.COMPLETED).count() == 11
    for key in "ab":
        dead = Job.objects.get(kind="keyed_span", args__key=key, args__n=0)
        assert dead.attempt == 2 and dead.errors[0]["error"].startswith("rescued")
        rescued_at = dt.datetime.fromisoformat(dead.errors[0]["at"])
        # The key stayed held until the rescue, and was free after it.
        first_other = FlowRun.objects.filter(key=key, n__gte=1).order_by("started_at")[0]
        assert first_other.started_at >= rescued_at, f"key {key} ran before its rescue"
    assert _leases() == []
    finished = "kind = 'keyed_span' AND ended_at IS NOT NULL"
    assert max_overlap(finished + " AND key = 'a'") == 1
    assert max_overlap(finished) >= 2


@pytest.mark.slow
def test_a_cancelled_or_rescued_attempt_keeps_its_key_while_its_live_handler_runs(
    start_worker,
) -> None:
    # A sync handler that ignores is_cancelled() goes on after its attempt is
    # cancelled or rescued past its deadline; while its worker lives, its key's
    # place stays taken until it returns, or the next job of the key would run
    # beside it (a partner API allowing one call per account at a time, say).
    worker = start_worker("--queue", "bykey=4", "--queue", "deadkey=4")
    wait_for(lambda: "listening for new jobs" in worker.output(), 30)
    cancelled = awa.enqueue(KeyedSpan(key="c", n=0, seconds=3))
    # The first attempt runs 4.5 s, past its deadline of 2 s: rescued meanwhile.
    rescued = awa.enqueue(DeadlineKeyedSpan(key="d", n=0, first_seconds=4.5, seconds=0.05))
    wait_for(lambda: FlowRun.objects.filter(n=0).count() == 2, 20)
    awa.enqueue_many([KeyedSpan(key="c", n=i, seconds=0.05) for i in (1, 2)])
    awa.enqueue_many([DeadlineKeyedSpan(key="d", n=i, seconds=0.05) for i in (1, 2)])
    awa.cancel(cancelled.id)
    all_finished("keyed_span", 3)
    all_finished("deadline_keyed_span", 3)
    assert Job.objects.get(id=cancelled.id).state == JobState.CANCELLED
    job = Job.objects.get(id=rescued.id)
    assert job.state == JobState.COMPLETED and job.attempt == 2, (job.state, job.attempt)
    assert job.errors[0]["error"] == "rescued: deadline exceeded", job.errors
    # Both first handlers ran to their end (none was abandoned), and no other job
    # of their key ran beside them.
    assert FlowRun.objects.filter(n=0, ended_at__isnull=True).count() == 0
    assert_keys_waited_for_their_first_handlers(
        {"keyed_span": "its cancelled handler", "deadline_keyed_span": "its rescued one"}
    )


def assert_keys_waited_for_their_first_handlers(kinds: dict[str, str]) -> None:
    """Of each kind (one key each), no job ran beside the first one's handler, named
    by ``kinds``, and the next began when it returned, not once a kept lease ran out
    (``STALE_AFTER`` later); no lease is left."""
    for kind, handler in kinds.items():
        assert overlaps_within_key(kind) == 0, f"{kind}: its key ran beside {handler}"
        first, *others = FlowRun.objects.filter(kind=kind).order_by("started_at")
        gap = (others[0].started_at - first.ended_at).total_seconds()
        assert gap < 2, f"{kind}: the key's next job began {gap:.1f}s after the handler returned"
    wait_for(lambda: _leases() == [], 10)


@pytest.mark.slow
def test_an_abandoned_handler_keeps_its_key_until_it_really_returns(start_worker) -> None:
    # A sync handler that ignores is_cancelled() outlives the stuck grace (5 s) and
    # its thread is abandoned: its attempt's outcome is written (the cancel, the
    # timeout), but its key's place stays taken, renewed while the worker lives, until
    # the handler returns. Else the next job of the key runs beside it: freed at once
    # for a timed-out attempt, STALE_AFTER (3 s) after the abandonment for a cancelled
    # one.
    worker = start_worker("--queue", "bykey=4", "--queue", "timedkey=4")
    wait_for(lambda: "listening for new jobs" in worker.output(), 30)
    cancelled = awa.enqueue(KeyedSpan(key="c", n=0, first_seconds=11, seconds=0.05))
    timed = awa.enqueue(TimedKeyedSpan(key="t", n=0, first_seconds=10, seconds=0.05))
    wait_for(lambda: FlowRun.objects.filter(n=0).count() == 2, 20)
    awa.enqueue_many([KeyedSpan(key="c", n=i, seconds=0.05) for i in (1, 2)])
    awa.enqueue_many([TimedKeyedSpan(key="t", n=i, seconds=0.05) for i in (1, 2)])
    awa.cancel(cancelled.id)
    wait_for(lambda: worker.output().count("abandoned (") == 2, 20, worker.output)
    # The outcomes were written without waiting for the stuck handlers.
    assert FlowRun.objects.filter(n=0, attempt=1, ended_at__isnull=True).count() == 2
    assert Job.objects.get(id=cancelled.id).state == JobState.CANCELLED
    # The timed-out attempt's outcome goes through the completer, just after.
    errors = wait_for(lambda: Job.objects.get(id=timed.id).errors, 10)
    assert "timed out" in errors[0]["error"]
    all_finished("keyed_span", 3, timeout=40)
    all_finished("timed_keyed_span", 3, timeout=40)
    wait_for(lambda: not FlowRun.objects.filter(ended_at__isnull=True).exists(), 20)
    assert_keys_waited_for_their_first_handlers(
        {"keyed_span": "its abandoned handler", "timed_keyed_span": "its abandoned handler"}
    )
    assert worker.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("returns", ["while its outcome is written", "after"])
def test_an_abandoned_handler_frees_its_key_when_it_returns_whatever_its_outcome_is_doing(
    start_worker, returns: str
) -> None:
    """A timed-out handler that does not return is abandoned (its 1 s timeout and the
    stuck grace, 5 s): its outcome is written keeping its key's lease
    (sql.HOLD_LEASES), until the handler returns. The test holds the lease's row
    (HOLD_LEASES waits for it) and the job's (the outcome is left out, written again
    later), and lets the handler return meanwhile, or after: the key is held while the
    handler runs, and freed when it returns, not STALE_AFTER (30 s) later."""
    gate = 0x61770001  # the advisory lock the handler waits for
    params = connection.get_connection_params()
    holder = psycopg.connect(**params, autocommit=True)
    rows = psycopg.connect(**params, autocommit=False)
    lease = psycopg.connect(**params, autocommit=False)
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", [gate])
        worker = start_worker("--queue", "timedkey=2", env={"AWA_TEST_STALE_AFTER": "30"})
        wait_for(lambda: "listening for new jobs" in worker.output(), 30)
        first = awa.enqueue(TimedKeyedSpan(key="k", n=0, gate=gate, seconds=0.0))
        wait_for(lambda: FlowRun.objects.filter(job_id=first.id).exists(), 20)
        rows.execute("SELECT 1 FROM awa_job WHERE id = %s FOR UPDATE", [first.id])
        lease.execute("SELECT 1 FROM awa_limit_lease WHERE job_id = %s FOR UPDATE", [first.id])
        wait_for(lambda: _waiting_for_a_lock("SET held_until"), 20, worker.output)
        if returns != "after":
            holder.execute("SELECT pg_advisory_unlock(%s)", [gate])
            wait_for(lambda: "returned after" in worker.output(), 10, worker.output)
        lease.commit()
        wait_for(lambda: "wait for a row lock" in worker.output(), 10, worker.output)
        rows.commit()
        wait_for(lambda: Job.objects.get(id=first.id).errors, 10, worker.output)
        assert "timed out" in Job.objects.get(id=first.id).errors[0]["error"]
        if returns == "after":
            # Its handler still runs: its outcome, left out and written again, kept the key.
            assert LimitLease.objects.filter(job_id=first.id).exists(), "the key was freed"
        second = awa.enqueue(TimedKeyedSpan(key="k", n=1, seconds=0.0))
        if returns == "after":
            holder.execute("SELECT pg_advisory_unlock(%s)", [gate])
        wait_for_state(second.id, JobState.COMPLETED, timeout=10)
    finally:
        for conn in (holder, rows, lease):
            conn.close()
    assert overlaps_within_key("timed_keyed_span") == 0
    wait_for(lambda: _leases() == [], 10)
    assert worker.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigquit", "abandoned"])
def test_a_stopping_worker_frees_the_keys_its_lost_handlers_kept(start_worker, how: str) -> None:
    # A cancelled handler still runs when its worker stops: the process exit ends it,
    # so the key's place it kept is freed on the way out, not left to run out
    # (STALE_AFTER) while the key's other jobs wait.
    worker = start_worker("--queue", "bykey=4", env={"AWA_TEST_STALE_AFTER": "30"})
    wait_for(lambda: "listening for new jobs" in worker.output(), 30)
    job = awa.enqueue(KeyedSpan(key="c", n=0, first_seconds=60, seconds=0.05))
    wait_for(lambda: FlowRun.objects.filter(n=0).exists(), 20)
    awa.cancel(job.id)
    [lease] = LimitLease.objects.all()
    assert lease.held_until is not None  # kept: the handler runs on
    if how == "abandoned":
        wait_for(lambda: "abandoned (" in worker.output(), 20, worker.output)
    worker.signal(signal.SIGQUIT if how == "sigquit" else signal.SIGTERM)
    worker.wait(30)
    assert FlowRun.objects.get(n=0).ended_at is None  # the handler died with its process
    assert _leases() == [], "the stopped worker left its kept lease to run out"


def test_two_per_key_holds_across_three_workers_and_uses_both_slots(start_worker) -> None:
    start_three(start_worker, "paired=4")
    awa.enqueue_many([PairedSpan(key=k, n=i, seconds=0.1) for i in range(6) for k in "abc"])
    all_finished("paired_span", 18)
    for key in "abc":
        assert max_overlap("kind = 'paired_span' AND key = %s", [key]) <= 2
    assert max(max_overlap("kind = 'paired_span' AND key = %s", [k]) for k in "abc") == 2
    assert max_overlap("kind = 'paired_span'") >= 4  # keys ran side by side
    assert FlowRun.objects.filter(kind="paired_span").values("pid").distinct().count() >= 2
    assert _leases() == []


def assert_keys_never_overlapped_and_ran_side_by_side(count: int) -> None:
    assert overlaps_within_key("keyed_span") == 0, "two runs of one key overlapped"
    assert max_overlap("kind = 'keyed_span'") >= 3  # keys ran side by side
    assert FlowRun.objects.filter(kind="keyed_span").count() == count
    assert _leases() == []


@pytest.mark.slow
def test_workers_claiming_with_and_without_the_queue_lock_never_run_one_key_twice(
    start_worker,
) -> None:
    # One worker's settings give queue bykey a rate: it claims under the queue's
    # lock (CLAIM_LIMITED); the other two see no rate and claim with key leases
    # alone (CLAIM_KEYED), all three at once for the whole drain.
    rated = start_worker(
        "--queue", "bykey=4", env={**FLOW_ENV, "AWA_TEST_FLOW_QUEUES": "rated_bykey"}
    )
    workers = [rated] + [start_worker("--queue", "bykey=4", env=FLOW_ENV) for _ in range(2)]
    wait_for(
        lambda: all("listening for new jobs" in w.output() for w in workers),
        30,
        "the workers did not start",
    )
    awa.enqueue_many([KeyedSpan(key=f"k{i % 4}", n=i, seconds=0.02) for i in range(240)])
    all_finished("keyed_span", 240, timeout=90)
    assert_keys_never_overlapped_and_ran_side_by_side(240)
    # Both paths claimed: the locked one (which logs its starts) and the keyed ones.
    assert _scalar("SELECT count(*) FROM awa_attempt_start WHERE scope = 'q:bykey'") > 0
    assert FlowRun.objects.filter(pid=rated.pid).exists()
    assert FlowRun.objects.exclude(pid=rated.pid).exists()


@pytest.mark.slow
def test_a_rate_toggled_at_runtime_never_runs_one_key_twice(start_worker) -> None:
    # Each change reaches each worker within its own poll interval: meanwhile some
    # claim under the lock, others with key leases alone.
    start_three(start_worker, "bykey=4")
    awa.enqueue_many([KeyedSpan(key=f"k{i % 4}", n=i, seconds=0.02) for i in range(240)])
    rates = itertools.cycle(["1000/s", None])
    deadline = time.monotonic() + 90
    while Job.objects.filter(kind="keyed_span").exclude(state__in=JobState.FINAL).exists():
        assert time.monotonic() < deadline, "the drain did not finish"
        awa.set_queue_limits("bykey", rate_limit=next(rates))
        time.sleep(0.13)  # not a multiple of the 0.2 s poll interval
    assert_keys_never_overlapped_and_ran_side_by_side(240)
    assert _scalar("SELECT count(*) FROM awa_attempt_start WHERE scope = 'q:bykey'") > 0


def test_a_key_freed_wakes_the_waiting_workers_without_a_poll(start_worker) -> None:
    # 30 s poll intervals: only the wake-ups (in-process, and NOTIFY to the other
    # worker) can start each next job of the one key in time.
    for _ in range(2):
        start_worker("--queue", "bykey=2", env={"AWA_TEST_POLL_INTERVAL": "30"})
    awa.enqueue_many([KeyedSpan(key="one", n=i, seconds=0.05) for i in range(10)])
    all_finished("keyed_span", 10, timeout=20)
    assert overlaps_within_key("keyed_span") == 0


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


def _members(key: str) -> list[Job]:
    return list(Job.objects.filter(metadata__awa_sequence__endswith=f'["{key}"]').order_by("id"))


def _serving(queues: dict[str, int]) -> WorkerState:
    """A worker's state for ``queues``, each queue's limits read as its producer reads
    them before its first claim."""
    state = WorkerState.create(queues)
    for runner in state.queues.values():
        producer.Producer(state, runner).current_limits()
    return state


def _parked(job: Job) -> bool:
    return "awa_sequence_run_at" in job.metadata


@pytest.mark.django_db(transaction=True)
def test_waiting_members_are_parked_available_and_the_finishing_transaction_hands_on() -> None:
    awa.enqueue_many(
        [awa.EnqueueRequest(SequencedSpan(key="p", n=i), max_attempts=1) for i in range(4)]
    )
    awa.enqueue_many([SequencedSpan(key="q", n=i) for i in range(2)])
    enqueued = {job.id: job.run_at for job in Job.objects.all()}
    claimed = producer.claim_sequenced("seq", 10, "default")
    assert sorted(j.args["key"] for j in claimed) == ["p", "q"]  # each key's first only
    first, *rest = _members("p")
    assert first.state == JobState.RUNNING
    # Parked, and still what SPEC 12 says a held-back job is: available, no attempt.
    assert all(_parked(j) and j.state == JobState.AVAILABLE and j.attempt == 0 for j in rest), [
        (j.id, j.state, j.metadata, j.run_at) for j in Job.objects.order_by("id")
    ]
    assert producer.claim("seq", 10, "default") == []  # the plain claim passes them over too
    # The admin counts them as held back by their sequence, parked or not.
    assert producer.held_back(producer.queue_limits("seq", "default"), "default") == 4

    # The transaction that completes p's first member restores the second, and
    # only it: its run_at back as enqueued, claimable the moment that commits.
    assert finalize([completed(first)], "default")
    second, *waiting = _members("p")[1:]
    assert not _parked(second) and second.run_at == enqueued[second.id]
    assert all(_parked(j) for j in waiting)
    assert [j.id for j in producer.claim("seq", 10, "default")] == [second.id]

    # A member that fails for good hands on too; a retry would still hold it.
    assert finalize([errored(Job.objects.get(id=second.id), "boom")], "default")
    assert Job.objects.get(id=second.id).state == JobState.FAILED
    third = _members("p")[2]
    assert not _parked(third) and third.run_at == enqueued[third.id]


@pytest.mark.django_db(transaction=True)
def test_the_finishing_statement_claims_the_next_member_into_a_reserved_place() -> None:
    ids = awa.enqueue_many([SequencedSpan(key="h", n=i, seconds=0.0) for i in range(4)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    assert head.id == ids[0]
    state = _serving({"seq": 2})
    hand_on = reserve_hand_on(state, [completed(head)])
    assert hand_on is not None and hand_on.places == {"seq": 1}
    assert state.queues["seq"].held == 1  # the place is held while the outcome is written

    # Completions: one statement writes the outcome and claims the next member,
    # as a claim would (running, its first attempt, a new run_lease), unparked.
    assert finalize([completed(head)], "default", hand_on)
    second = Job.objects.get(id=ids[1])
    assert [j.id for j in hand_on.claimed] == [second.id]
    assert hand_on.places == {"seq": 0}
    assert second.state == JobState.RUNNING and second.attempt == 1
    assert second.run_lease == hand_on.claimed[0].run_lease == 1
    assert not _parked(second) and second.deadline_at is not None
    assert all(_parked(Job.objects.get(id=i)) for i in ids[2:])

    # Sent to the queue's handler threads once committed, tracked as a claim's.
    start_handed_on(state, hand_on)
    runner = state.queues["seq"]
    attempt = runner.inbox.get_nowait()
    assert attempt is not None and attempt.job.id == second.id
    assert second.id in state.running and second.id in state.waiting
    assert runner.held == 1

    # A retry keeps its place: the member retrying holds its sequence, the place
    # reserved for the next one is not used, and nothing is handed on.
    retry = reserve_hand_on(state, [errored(attempt.job, "boom")])
    assert retry is None  # a retry finishes nothing: no place is reserved
    hand_on = HandOn({"seq": 1})
    assert finalize([errored(attempt.job, "boom")], "default", hand_on)
    assert Job.objects.get(id=second.id).state == JobState.RETRYABLE
    assert hand_on.claimed == [] and hand_on.places == {"seq": 1}
    assert all(_parked(Job.objects.get(id=i)) for i in ids[2:])

    # Failing for good finishes it: the transaction that writes it claims the next
    # (sql.HAND_ON, the path of outcomes other than plain completions).
    Job.objects.filter(id=second.id).update(
        state=JobState.AVAILABLE, run_at=dt.datetime.now(dt.UTC)
    )
    (again,) = producer.claim_sequenced("seq", 10, "default")
    assert again.id == second.id and again.attempt == 2
    assert finalize([failed_terminally(again, "gave up")], "default", hand_on)
    assert Job.objects.get(id=second.id).state == JobState.FAILED
    third = Job.objects.get(id=ids[2])
    assert [j.id for j in hand_on.claimed] == [third.id]
    assert third.state == JobState.RUNNING and third.attempt == 1 and not _parked(third)
    assert _parked(Job.objects.get(id=ids[3]))


@pytest.mark.django_db(transaction=True)
def test_a_batch_of_completions_hands_each_of_its_sequences_on() -> None:
    # Members of several keys completed in one batch (sql.COMPLETE_HAND_ON, the
    # arrays): the next member of each key is claimed while the places last (keys
    # in order), the others restored; a member whose attempt went stale meanwhile
    # is not written and hands nothing on a second time.
    a = awa.enqueue_many([SequencedSpan(key="a", n=i) for i in range(3)])
    b = awa.enqueue_many([SequencedSpan(key="b", n=i) for i in range(3)])
    c = awa.enqueue_many([SequencedSpan(key="c", n=i) for i in range(2)])
    heads = {job.id: job for job in producer.claim_sequenced("seq", 10, "default")}
    assert sorted(heads) == sorted([a[0], b[0], c[0]])
    assert awa.cancel(c[0])  # its own hand-off restores c[1]
    hand_on = HandOn({"seq": 1})
    written = finalize([completed(heads[i]) for i in (a[0], b[0], c[0])], "default", hand_on)
    assert sorted(r.job.id for r in written) == sorted([a[0], b[0]])
    rows = Job.objects.in_bulk([*a, *b, *c])
    assert rows[a[0]].state == rows[b[0]].state == JobState.COMPLETED
    assert [j.id for j in hand_on.claimed] == [a[1]] and hand_on.places == {"seq": 0}
    assert rows[a[1]].state == JobState.RUNNING and rows[a[1]].attempt == 1
    assert not _parked(rows[a[1]]) and rows[a[1]].run_lease == hand_on.claimed[0].run_lease
    assert rows[b[1]].state == JobState.AVAILABLE and not _parked(rows[b[1]])
    assert rows[c[1]].state == JobState.AVAILABLE and not _parked(rows[c[1]])
    assert rows[c[0]].state == JobState.CANCELLED
    assert _parked(rows[a[2]]) and _parked(rows[b[2]])


@pytest.mark.django_db(transaction=True)
def test_the_prepared_hand_on_of_one_member_keeps_its_index_plan_when_planned_generically(
    settings,
) -> None:
    # A saturated sequence writes one member at a time with the prepared
    # sql.COMPLETE_HAND_ON_ONE, which PostgreSQL may plan once for any parameters.
    # That plan must read rows by primary key and the next member through
    # awa_job_sequence_idx, never every running row, whatever the table holds.
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args, state, heartbeat_at, deadline_at, metadata) "
            "SELECT 'echo', 'default', '{}', 'running', now(), now() + interval '1 hour', "
            "jsonb_build_object('awa_sequence', 'k' || (g %% 500)) FROM generate_series(1, %s) g",
            [20_000],
        )
        cursor.execute("ANALYZE awa_job")
    ids = awa.enqueue_many([SequencedSpan(key="p", n=i) for i in range(8)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    plan = generic_plan(
        sql.COMPLETE_HAND_ON_ONE,
        {
            "id": head.id,
            "run_lease": head.run_lease,
            "started_ago": 0.001,
            "key": head.metadata["awa_sequence"],
            "place": "seq",
            "deadlines": "{}",
            "default_deadline": 60.0,
        },
    )
    assert "Seq Scan on awa_job" not in plan, plan
    assert "awa_job_running_idx" not in plan, plan
    assert "awa_job_sequence_idx" in plan and "awa_job_pkey" in plan, plan

    # As a worker's completer runs it: prepared, seven members in a row, each
    # claiming the next; past the five custom plans PostgreSQL tries first, it
    # keeps the plan for any parameters (parsed and planned once).
    _hand_on_one_after_another(head, ids)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE %s AND statement LIKE %s",
            ["%done AS%", "%(VALUES (%"],
        )
        assert cursor.fetchall() == [(2, 5)]


@pytest.mark.django_db(transaction=True)
def test_the_hand_on_of_one_member_is_not_prepared_where_prepared_statements_are_off(
    settings,
) -> None:
    # Behind a pooler that cannot keep prepared statements (PgBouncer before 1.21,
    # transaction mode), AWA["PREPARED_STATEMENTS"] = False: it hands on all the same.
    settings.AWA = {**settings.AWA, "PREPARED_STATEMENTS": False}
    ids = awa.enqueue_many([SequencedSpan(key="u", n=i) for i in range(8)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    _hand_on_one_after_another(head, ids)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
                       ["%done AS%"])  # fmt: skip
        assert cursor.fetchone()[0] == 0


def _hand_on_one_after_another(head: Job, ids: list[int]) -> Job:
    """Complete ``head`` and each member it hands on, one at a time, as a saturated
    sequence's completer does; every member of ``ids`` must be claimed in turn."""
    state = _serving({"seq": 2})
    for next_id in ids[ids.index(head.id) + 1 :]:
        hand_on = reserve_hand_on(state, [completed(head)])
        assert hand_on is not None
        assert finalize([completed(head)], "default", hand_on)
        (claimed,) = hand_on.claimed
        assert claimed.id == next_id and claimed.state == JobState.RUNNING
        assert Job.objects.get(id=head.id).state == JobState.COMPLETED
        start_handed_on(state, hand_on)
        runner = state.queues["seq"]
        attempt = runner.inbox.get_nowait()
        assert attempt is not None and attempt.job.id == next_id
        runner.finished()  # as its handler does when the member returns
        head = claimed
    return head


@pytest.mark.django_db(transaction=True)
def test_a_next_member_is_restored_not_claimed_without_a_place_paused_or_not_due() -> None:
    ids = awa.enqueue_many([SequencedSpan(key="n", n=i) for i in range(3)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    # No place (the queue full, or not served here): restored, claimable by anyone.
    assert finalize([completed(head)], "default", HandOn({"other": 1}))
    second = Job.objects.get(id=ids[1])
    assert second.state == JobState.AVAILABLE and not _parked(second)
    (second,) = producer.claim_sequenced("seq", 10, "default")
    # Its queue paused: restored, not claimed.
    awa.pause_queue("seq")
    hand_on = HandOn({"seq": 1})
    assert finalize([completed(second)], "default", hand_on)
    assert hand_on.claimed == [] and hand_on.places == {"seq": 1}
    third = Job.objects.get(id=ids[2])
    assert third.state == JobState.AVAILABLE and not _parked(third)


@pytest.mark.django_db(transaction=True)
def test_no_member_is_handed_on_into_a_queue_under_any_limit() -> None:
    # A hand-on claims outside the limited claim and the slot leases: a queue
    # under a global_concurrency (kept by leases) or a rate gets no place for one.
    awa.enqueue_many([SequencedSpan(key="l", n=i) for i in range(2)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    state = WorkerState.create({"seq": 2})
    runner = state.queues["seq"]
    for limits in ({"global_concurrency": 5}, {"rate_limit": "100/s"}):
        awa.set_queue_limits("seq", reset=True, **limits)
        claimer = producer.Producer(state, runner)
        claimer.current_limits()
        assert runner.limited, limits
        assert reserve_hand_on(state, [completed(head)]) is None, limits
        assert runner.held == 0
    # Only the queue claimed under its lock wakes the fleet when room frees.
    assert runner.wake_fleet
    awa.set_queue_limits("seq", global_concurrency=5, rate_limit=None)
    claimer = producer.Producer(state, runner)
    claimer.current_limits()
    assert runner.limited and not runner.wake_fleet
    awa.set_queue_limits("seq", reset=True)
    claimer = producer.Producer(state, runner)
    claimer.current_limits()
    assert not runner.limited
    assert reserve_hand_on(state, [completed(head)]) is not None


@pytest.mark.django_db(transaction=True)
def test_no_member_is_handed_on_into_a_queue_whose_limits_the_worker_has_not_read() -> None:
    # A worker starting up: a sequence's member finishes before the producer of the
    # next member's queue has read that queue's limits (a rate, say). A hand-on
    # would claim there outside the limited claim, uncounted by the rate.
    awa.set_queue_limits("seq", rate_limit="1/h")
    awa.enqueue_many([SequencedSpan(key="u", n=i) for i in range(2)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    state = WorkerState.create({"seq": 2})
    assert reserve_hand_on(state, [completed(head)]) is None
    assert state.queues["seq"].held == 0
    # Read (here: no limit after all), the queue takes hand-ons.
    awa.set_queue_limits("seq", reset=True)
    producer.Producer(state, state.queues["seq"]).current_limits()
    assert reserve_hand_on(state, [completed(head)]) is not None


@pytest.mark.django_db(transaction=True)
def test_a_member_handed_on_while_the_worker_stops_is_given_back_unused() -> None:
    awa.enqueue_many([SequencedSpan(key="g", n=i) for i in range(3)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    state = _serving({"seq": 2})
    hand_on = reserve_hand_on(state, [completed(head)])
    assert hand_on is not None
    assert finalize([completed(head)], "default", hand_on)
    (claimed,) = hand_on.claimed
    state.stopping.set()  # between the commit and the hand-over: no handler will run it
    start_handed_on(state, hand_on)
    runner = state.queues["seq"]
    assert runner.inbox.empty() and not state.running and runner.held == 0
    row = Job.objects.get(id=claimed.id)
    # Available again at once, claimable by the next worker, its attempt unused: the
    # next claim runs it as attempt 1 again (as shutdown's give-back does).
    assert row.state == JobState.AVAILABLE and row.snoozed and not _parked(row)
    (again,) = producer.claim_sequenced("seq", 10, "default")
    assert again.id == claimed.id and again.attempt == 1
    # A stopping worker reserves no place at all.
    assert reserve_hand_on(state, [completed(head)]) is None


@pytest.mark.django_db(transaction=True)
def test_no_member_is_handed_on_while_the_heartbeat_cannot_reach_the_database() -> None:
    # A hand-on claims the next member: with the heartbeat failing (state.ClaimPause)
    # it would get no heartbeat, be rescued after STALE_AFTER and run twice.
    awa.enqueue_many([SequencedSpan(key="h", n=i) for i in range(2)])
    (head,) = producer.claim_sequenced("seq", 10, "default")
    state = _serving({"seq": 2})
    pause = state.claim_pause
    pause.failed(time.monotonic() - pause.after - 1, DatabaseError("refused"))
    assert reserve_hand_on(state, [completed(head)]) is None
    assert state.queues["seq"].held == 0
    pause.went_through()  # a heartbeat went through: claims, hand-ons too, resume
    assert reserve_hand_on(state, [completed(head)]) is not None


@pytest.mark.django_db(transaction=True)
def test_cancel_hands_on_and_maintenance_restores_a_member_whose_turn_came_otherwise() -> None:
    from django_awa.maintenance import Maintenance

    awa.enqueue_many([SequencedSpan(key="c", n=i) for i in range(4)])
    assert len(producer.claim_sequenced("seq", 10, "default")) == 1
    head, second, third, fourth = _members("c")
    assert _parked(second) and _parked(third) and _parked(fourth)
    awa.cancel(head.id)  # its transaction hands on, as finalize's does
    assert not _parked(Job.objects.get(id=second.id))
    assert _parked(Job.objects.get(id=third.id))
    # A member deleted (or discarded by rescue) hands on nothing: maintenance does.
    Job.objects.filter(id=second.id).delete()
    assert _parked(Job.objects.get(id=third.id))
    assert Maintenance().restore_parked() == {"seq"}
    assert not _parked(Job.objects.get(id=third.id))  # first unfinished now: restored
    assert _parked(Job.objects.get(id=fourth.id))
    # The cancelled head's handler may still run (a fresh heartbeat): its key waits.
    assert producer.claim("seq", 10, "default") == []
    with connection.cursor() as cursor:  # it returned (HandlerPool.release_held_lease)
        cursor.execute(sql.RELEASE_HELD_LEASES, {"id": [head.id], "run_lease": [1]})
    assert [j.id for j in producer.claim("seq", 10, "default")] == [third.id]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("claim", [producer.claim, producer.claim_sequenced, "hand_on"])
def test_a_cancelled_member_keeps_its_key_while_its_handler_may_still_run(claim) -> None:
    # A running member cancelled while its worker lives (its heartbeat is fresh):
    # its handler may go on, ignoring is_cancelled(), and the next member would run
    # beside it. Its key's place is kept, as a limited kind's is, until the handler
    # returns (its worker frees it) or its worker is gone (held_until runs out).
    first, second = awa.enqueue_many([SequencedSpan(key="k", n=0), SequencedSpan(key="k", n=1)])
    [job] = producer.claim("seq", 10, "default")
    assert job.id == first
    awa.cancel(first)

    def next_member() -> list[int]:
        if claim == "hand_on":  # the hand-on of another member of the key finishing
            key = job.metadata["awa_sequence"]
            _, claimed = hand_off([(key, "seq")], "default", HandOn({"seq": 1}))
            return [j.id for j in claimed]
        assert callable(claim)
        return [j.id for j in claim("seq", 10, "default")]

    [lease] = LimitLease.objects.all()
    assert (lease.kind, lease.job_id, lease.run_lease) == (sql.SEQUENCE_HOLD_KIND, first, 1)
    assert lease.held_until is not None
    assert next_member() == []
    Maintenance().rescue()
    assert LimitLease.objects.count() == 1  # not swept: it is held
    with connection.cursor() as cursor:
        params = {"id": [first], "run_lease": [1], "stale_after": 60}
        cursor.execute(sql.RENEW_HELD_LEASES, params)
        assert cursor.rowcount == 1
    # Its worker died with the handler: nothing renews the place, which runs out.
    LimitLease.objects.update(held_until=timezone.now() - dt.timedelta(seconds=1))
    assert next_member() == [second]
    Maintenance().rescue()
    assert LimitLease.objects.count() == 0  # swept once run out


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("claim", [producer.claim, producer.claim_sequenced])
def test_a_member_retried_while_a_later_one_runs_waits_for_it_then_goes_first(claim) -> None:
    # Member 0 is cancelled, so member 1 starts; retrying 0 puts it back in its place,
    # but member 1 already runs: 0 starts only once 1 has ended (one at a time), and
    # before 2, which has not started.
    def claimed() -> list[int]:
        return [job.id for job in claim("seq", 10, "default")]

    ids = awa.enqueue_many([SequencedSpan(key="rt", n=i, seconds=0.0) for i in range(3)])
    awa.cancel(ids[0])
    (running,) = producer.claim_sequenced("seq", 10, "default")
    assert running.id == ids[1]
    assert awa.retry(ids[0]).state == JobState.AVAILABLE
    assert claimed() == []  # not beside member 1, which runs
    assert finalize([completed(running)], "default")
    assert claimed() == [ids[0]]
    assert finalize([completed(Job.objects.get(id=ids[0]))], "default")
    assert claimed() == [ids[2]]


@pytest.mark.django_db(transaction=True)
def test_a_member_reopened_with_its_retried_dependency_waits_for_a_later_one_running() -> None:
    # The member is cancelled with its failed dependency, so the next one starts;
    # retrying the dependency reopens the member, which waits for the next one.
    dependency = awa.enqueue(Span(n=0))
    first = awa.enqueue(SequencedSpan(key="ro", n=0), after=[dependency])
    later = awa.enqueue(SequencedSpan(key="ro", n=1))
    (attempt,) = producer.claim("flow", 10, "default")
    assert finalize([failed_terminally(attempt, "boom")], "default")
    assert Job.objects.get(id=first.id).state == JobState.CANCELLED
    (running,) = producer.claim_sequenced("seq", 10, "default")
    assert running.id == later.id
    awa.retry(dependency.id)
    (attempt,) = producer.claim("flow", 10, "default")
    assert finalize([completed(attempt)], "default")
    assert Job.objects.get(id=first.id).state == JobState.AVAILABLE
    assert producer.claim_sequenced("seq", 10, "default") == []
    assert finalize([completed(running)], "default")
    assert [job.id for job in producer.claim("seq", 10, "default")] == [first.id]


@pytest.mark.slow
def test_a_long_sequence_hands_on_member_after_member_without_polls(start_worker) -> None:
    # A 30 s poll interval and a member enqueued before the workers start: every
    # member after the first is parked by the first claim, and only the hand-off
    # in each finishing transaction (with its wake-up) can start the next.
    awa.enqueue_many([SequencedSpan(key="long", n=i, seconds=0.0) for i in range(60)])
    started = time.monotonic()
    start_three(start_worker, "seq=4", AWA_TEST_POLL_INTERVAL="30")
    all_finished("sequenced_span", 60, timeout=30)
    assert time.monotonic() - started < 20
    assert [r.n for r in FlowRun.objects.order_by("started_at")] == list(range(60))
    assert overlaps_within_key("sequenced_span") == 0
    assert not Job.objects.filter(metadata__has_key="awa_sequence_run_at").exists()


def run_sequence_hand_on(start_worker: Callable[..., WorkerProcess], **env: str) -> None:
    """One worker, a 30 s poll: each member after the first is claimed by the
    statement that wrote its predecessor's outcome (its claim stamp is not
    after that transaction's start), so by this worker, without a poll, a
    NOTIFY or a claim of its own."""
    start_worker("--queue", "seq=4", env={**FLOW_ENV, "AWA_TEST_POLL_INTERVAL": "30", **env})
    awa.enqueue_many([SequencedSpan(key="on", n=i, seconds=0.0) for i in range(30)])
    all_finished("sequenced_span", 30, timeout=20)
    runs = list(FlowRun.objects.order_by("started_at"))
    assert [r.n for r in runs] == list(range(30))
    assert all(a.ended_at <= b.started_at for a, b in itertools.pairwise(runs))
    finished = dict(Job.objects.values_list("id", "finalized_at"))
    by_n = {r.n: r for r in runs}
    late = [
        n
        for n in range(1, 30)
        if by_n[n].attempted_at > finished[by_n[n - 1].job_id]  # claimed after the commit
    ]
    assert late == [], f"members claimed apart from their predecessor's outcome: {late}"
    assert len({r.pid for r in runs}) == 1


def test_the_worker_hands_each_member_on_in_the_transaction_that_finishes_the_one_before(
    start_worker,
) -> None:
    run_sequence_hand_on(start_worker)


@pytest.mark.slow
def test_a_worker_stopping_mid_sequence_leaves_no_member_claimed_or_running(start_worker) -> None:
    # Members hand on member after member; SIGTERM in the middle: the member running
    # finishes, and whatever was handed on for a handler that will not run is given
    # back available with its attempt unused. Nothing is left running, nothing ran
    # twice or out of order, and a new worker finishes the sequence.
    worker = start_worker("--queue", "seq=4", env=FLOW_ENV)
    awa.enqueue_many([SequencedSpan(key="stop", n=i, seconds=0.02) for i in range(200)])
    wait_for(lambda: FlowRun.objects.count() >= 20, 20)
    assert worker.stop() == 0
    assert not Job.objects.filter(state=JobState.RUNNING).exists()
    ran = set(FlowRun.objects.values_list("job_id", flat=True))
    unstarted = Job.objects.exclude(id__in=ran).exclude(state__in=JobState.FINAL)
    assert unstarted.exists()
    assert not unstarted.exclude(attempt=0, snoozed=False).exclude(attempt=1, snoozed=True)
    start_worker("--queue", "seq=4", env=FLOW_ENV)
    all_finished("sequenced_span", 200, timeout=60)
    runs = list(FlowRun.objects.order_by("started_at"))
    assert [r.n for r in runs] == list(range(200))  # each once, in order
    assert all(a.ended_at <= b.started_at for a, b in itertools.pairwise(runs))


@pytest.mark.slow
def test_a_cancelled_member_holds_its_sequence_until_its_handler_returns(start_worker) -> None:
    # A sync handler that ignores is_cancelled() runs on ~4 s after its running
    # member is cancelled, past STALE_AFTER (3 s; its worker renews its key's place
    # meanwhile): the next member of its key starts only once it returned (freed by
    # its worker then, not STALE_AFTER later), never beside it.
    worker = start_worker("--queue", "seq=4")
    wait_for(lambda: "listening for new jobs" in worker.output(), 30)
    head, *_ = awa.enqueue_many(
        [SequencedSpan(key="c", n=0, first_seconds=4.5, seconds=0.05)]
        + [SequencedSpan(key="c", n=i, seconds=0.05) for i in (1, 2)]
    )
    wait_for(lambda: FlowRun.objects.filter(n=0).exists(), 20)
    awa.cancel(head)
    all_finished("sequenced_span", 3)
    assert Job.objects.get(id=head).state == JobState.CANCELLED
    wait_for(lambda: not FlowRun.objects.filter(ended_at__isnull=True).exists(), 10)
    cancelled, *others = FlowRun.objects.order_by("started_at")
    assert [r.n for r in others] == [1, 2]
    assert cancelled.n == 0 and cancelled.ended_at is not None
    assert others[0].started_at >= cancelled.ended_at, (
        f"member 1 started {(cancelled.ended_at - others[0].started_at).total_seconds():.2f}s "
        "before the cancelled member's handler returned"
    )
    assert overlaps_within_key("sequenced_span") == 0
    gap = (others[0].started_at - cancelled.ended_at).total_seconds()
    assert gap < 2, f"member 1 began {gap:.1f}s after the cancelled handler returned"
    wait_for(lambda: _leases() == [], 10)
    assert worker.stop() == 0


@pytest.mark.slow
def test_a_cancelled_members_abandoned_handler_holds_its_sequence_until_it_returns(
    start_worker,
) -> None:
    # The cancelled handler outlives the stuck grace (5 s) and its thread is
    # abandoned and replaced: its key's place stays kept, renewed while it runs.
    worker = start_worker("--queue", "seq=4")
    wait_for(lambda: "listening for new jobs" in worker.output(), 30)
    head, following = awa.enqueue_many(
        [
            SequencedSpan(key="a", n=0, first_seconds=9, seconds=0.05),
            SequencedSpan(key="a", n=1, seconds=0.05),
        ]
    )
    wait_for(lambda: FlowRun.objects.filter(n=0).exists(), 20)
    awa.cancel(head)
    wait_for(lambda: "abandoned (" in worker.output(), 20, worker.output)
    wait_for_state(following, JobState.COMPLETED, 30)
    cancelled, run = FlowRun.objects.get(n=0), FlowRun.objects.get(n=1)
    assert cancelled.ended_at is not None and run.started_at >= cancelled.ended_at, (
        "member 1 ran beside the abandoned handler"
    )
    assert (run.started_at - cancelled.ended_at).total_seconds() < 2
    wait_for(lambda: _leases() == [], 10)
    assert worker.stop() == 0


@pytest.mark.slow
def test_a_cancelled_member_of_a_killed_worker_frees_its_sequence_within_stale_after(
    start_worker,
) -> None:
    # The cancelled member's handler would run a minute, but its worker is killed:
    # nothing renews its key's place, which frees within STALE_AFTER (3 s), and the
    # next member runs on another worker.
    victim = start_worker("--queue", "seq=4")
    wait_for(lambda: "listening for new jobs" in victim.output(), 30)
    head, following = awa.enqueue_many(
        [
            SequencedSpan(key="k", n=0, first_seconds=60, seconds=0.05),
            SequencedSpan(key="k", n=1, seconds=0.05),
        ]
    )
    wait_for(lambda: FlowRun.objects.filter(n=0).exists(), 20)
    awa.cancel(head)
    [lease] = LimitLease.objects.all()  # held for the handler that runs on
    assert (lease.kind, lease.job_id) == (sql.SEQUENCE_HOLD_KIND, head)
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    killed_at = timezone.now()
    start_worker("--queue", "seq=4")
    wait_for_state(following, JobState.COMPLETED, 30)
    run = FlowRun.objects.get(n=1)
    assert run.started_at >= lease.held_until, "member 1 ran while the place was held"
    assert (run.started_at - killed_at).total_seconds() < 10
    wait_for(lambda: _leases() == [], 20)


@pytest.mark.slow
def test_a_retrying_member_holds_its_sequence_until_it_finishes(start_worker) -> None:
    start_three(start_worker, "seq=4")
    awa.enqueue_many(
        [
            SequencedSpan(key="r", n=0, seconds=0.0),
            SequencedSpan(key="r", n=1, seconds=0.0, fail_until=1),  # retried after ~2 s
            SequencedSpan(key="r", n=2, seconds=0.0),
        ]
    )
    all_finished("sequenced_span", 3, timeout=30)
    runs = list(FlowRun.objects.order_by("started_at").values_list("n", "attempt"))
    assert runs == [(0, 1), (1, 1), (1, 2), (2, 1)]


def test_a_per_job_sequence_key_orders_jobs_of_different_kinds(start_worker) -> None:
    start_worker("--queue", "flow=4", "--queue", "capped=4", env=FLOW_ENV)
    awa.enqueue_many(
        [
            awa.EnqueueRequest(Span(key="s", n=0, seconds=0.3), sequence="account-1"),
            awa.EnqueueRequest(CappedSpan(key="s", n=1, seconds=0.0), sequence="account-1"),
            awa.EnqueueRequest(Span(key="s", n=2, seconds=0.0), sequence="account-1"),
        ]
    )
    wait_for(lambda: Job.objects.filter(state=JobState.COMPLETED).count() == 3, 20)
    runs = list(FlowRun.objects.order_by("started_at"))
    assert [r.n for r in runs] == [0, 1, 2]
    assert all(a.ended_at <= b.started_at for a, b in itertools.pairwise(runs))


def test_a_finishing_member_starts_the_next_without_waiting_for_a_poll(start_worker) -> None:
    # A 30 s poll interval: only the wake-up from the finishing job can start the next.
    start_worker("--queue", "seq=2", env={"AWA_TEST_POLL_INTERVAL": "30"})
    wait_for(lambda: FlowRun.objects.exists() or True)
    started = time.monotonic()
    awa.enqueue_many([SequencedSpan(key="w", n=i, seconds=0.0) for i in range(20)])
    all_finished("sequenced_span", 20, timeout=20)
    assert time.monotonic() - started < 10
    assert [r.n for r in FlowRun.objects.order_by("started_at")] == list(range(20))


@pytest.mark.django_db(transaction=True)
def test_claims_of_slot_leased_queues_commit_without_waiting_for_the_flush_and_only_they() -> None:
    # Slot leases (global_concurrency): their claims take the few places free at a
    # time, without prefetch, so their commit does not wait for its WAL flush
    # (synchronous_commit off, for the claim's own transaction only).
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="leased") for i in range(3)])
    awa.enqueue_many([KeyedSpan(key=f"k{i}", n=i) for i in range(2)])
    keyed = producer.queue_limits("bykey", "default")
    assert keyed.keyed

    def setting_in_claim(run: Callable[[], list[Job]]) -> tuple[int, str, str]:
        with transaction.atomic():  # to read the setting in the claim's transaction
            jobs = run()
            inside = _scalar("SHOW synchronous_commit")
        return len(jobs), inside, _scalar("SHOW synchronous_commit")

    # The session waits for flushes, whatever the server's default (the embedded
    # test server turns them off).
    _scalar("SELECT set_config('synchronous_commit', 'on', false)")
    try:
        unflushed = setting_in_claim(lambda: producer.claim("leased", 1, "default", unflushed=True))
        assert unflushed == (1, "off", "on")  # and the session's setting is untouched after
        # Every other claim waits for its flush, as every outcome does.
        keyed_claim = setting_in_claim(lambda: producer.claim_keyed(keyed, 1, "default"))
        assert keyed_claim == (1, "on", "on")
        assert setting_in_claim(lambda: producer.claim("leased", 1, "default")) == (1, "on", "on")
        claimed = producer.claim("leased", 1, "default")
        assert len(finalize([completed(j) for j in claimed], "default"))
        assert _scalar("SHOW synchronous_commit") == "on"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET synchronous_commit")


@pytest.mark.slow
def test_global_concurrency_holds_with_quick_handlers_and_uses_its_places(
    start_worker,
) -> None:
    # glob: 6 places per worker, global_concurrency 4 kept by slot leases. Quick
    # handlers (2 ms): places free and are claimed into hundreds of times a second,
    # each claim racing the other workers' slot rebalances.
    workers = start_three(start_worker, "glob")
    total = 240
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.002), queue="glob") for i in range(total)]
    )
    all_finished("span", total, timeout=90)
    overlap = max_overlap("queue = %s", ["glob"])
    assert overlap <= 4, f"{overlap} runs of queue glob overlapped; global_concurrency is 4"
    assert overlap >= 3, f"at most {overlap} ran at once: the fleet did not use its 4 slots"
    # Which processes ran them is not checked: a drain this short (a fraction of a
    # second) may be run by the first worker alone, borrowing every slot while the
    # others wait for their next rebalance; run_global_concurrency (150 ms
    # handlers) checks that the fleet shares the slots.
    # Every job ran once, to completion: none lost or run twice.
    assert FlowRun.objects.filter(queue="glob").count() == total
    assert not Job.objects.filter(queue="glob").exclude(state=JobState.COMPLETED).exists()
    for worker in workers:
        assert worker.stop() == 0


# The most attempts claimed and not finished at one instant (from the claims
# to the handlers' ends). Above the global concurrency only if jobs were
# claimed ahead of a free slot.
MAX_CLAIMED = _SWEEP.replace("{begin}", "attempted_at")


@pytest.mark.slow
def test_global_concurrency_claims_ahead_runs_within_its_slots_and_follows_a_lowered_limit(
    start_worker,
) -> None:
    # The limit counts handlers running: a process claims ahead of its slots (a
    # place's next job is at hand when its handler returns) but runs no more
    # handlers than its usable slots. Three processes of 6 places, 4 slots.
    awa.set_queue_limits("gated", global_concurrency=4)
    workers = [start_worker("--queue", "gated=6") for _ in range(3)]
    wait_for(
        lambda: all("listening for new jobs" in worker.output() for worker in workers),
        timeout=30,
        message="the three workers did not all start",
    )
    total = 400
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.01), queue="gated") for i in range(total)]
    )
    wait_for(lambda: FlowRun.objects.filter(ended_at__isnull=False).count() >= 120, 60)
    awa.set_queue_limits("gated", global_concurrency=2)
    lowered = timezone.now()
    all_finished("span", total, timeout=120)
    before = "queue = 'gated' AND started_at < %s"
    overlap = max_overlap("queue = 'gated'")
    assert overlap <= 4, f"{overlap} handlers of queue gated overlapped; global_concurrency is 4"
    assert max_overlap(before, [lowered]) >= 3, "the fleet did not use its 4 slots"
    # Claimed ahead: more attempts claimed and unfinished than the 4 slots at once.
    claimed = _scalar(MAX_CLAIMED.format(where=before), [lowered] * 2)
    assert claimed > 4, f"at most {claimed} attempts claimed at once: no job was claimed ahead"
    # Lowered to 2 at runtime: it holds once every worker has read it (a poll
    # interval, 0.2 s, and the rebalance after it) and the handlers then running
    # (10 ms) returned; the queue still runs.
    later = "queue = 'gated' AND ended_at >= %s"
    cutoff = lowered + dt.timedelta(seconds=1.0)
    assert FlowRun.objects.filter(queue="gated", ended_at__gte=cutoff).count() >= 20
    overlap = max_overlap(later, [cutoff])
    assert overlap <= 2, f"{overlap} handlers overlapped after global_concurrency fell to 2"
    assert overlap == 2, "the lowered limit's 2 slots were not both used"
    # Every job ran once, to completion; none was left claimed.
    assert FlowRun.objects.filter(queue="gated").count() == total
    assert not Job.objects.filter(queue="gated").exclude(state=JobState.COMPLETED).exists()
    for worker in workers:
        assert worker.stop() == 0


@pytest.mark.slow
def test_sigterm_gives_back_the_jobs_waiting_at_the_gate_unstarted(start_worker) -> None:
    # One slot, six places: the worker claims quick jobs ahead of its slot, and they
    # wait at its RunGate. SIGTERM: the running handler finishes, the waiting jobs go
    # back available with their attempt unused, and nothing is left running.
    awa.set_queue_limits("gated", global_concurrency=1)
    worker = start_worker("--queue", "gated=6")
    wait_for(lambda: "listening for new jobs" in worker.output(), 30, "the worker did not start")
    total = 300
    ids = awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.01), queue="gated") for i in range(total)]
    )
    # Its handlers' run time measured, it claims ahead: more than its one slot running.
    wait_for(lambda: FlowRun.objects.filter(ended_at__isnull=False).count() >= 50, 60)
    wait_for(
        lambda: Job.objects.filter(queue="gated", state=JobState.RUNNING).count() > 1,
        30,
        "the worker never claimed ahead of its slot",
    )
    assert worker.stop() == 0
    assert re.search(r"gave back [1-9]\d* prefetched job\(s\) at shutdown", worker.output()), (
        "no job waiting at the gate was given back"
    )
    jobs = Job.objects.filter(id__in=ids)
    assert not jobs.filter(state=JobState.RUNNING).exists(), "a job was left running"
    assert set(jobs.values_list("state", flat=True)) <= {JobState.COMPLETED, JobState.AVAILABLE}
    # Available: never claimed, or given back with the attempt it was claimed for
    # unused (snoozed: the next claim runs it under the same number).
    back = jobs.filter(state=JobState.AVAILABLE)
    assert not back.exclude(attempt=0, snoozed=False).exclude(attempt=1, snoozed=True)
    assert back.filter(attempt=1, snoozed=True).exists()
    # Every completed job ran once; none given back ever began; one at a time.
    runs = FlowRun.objects.filter(queue="gated")
    assert runs.count() == jobs.filter(state=JobState.COMPLETED).count()
    assert not runs.filter(job_id__in=back.values("id")).exists()
    # A new worker runs the rest, each once, as the first attempt.
    start_worker("--queue", "gated=6")
    all_finished("span", total, timeout=60)
    assert runs.count() == total and set(runs.values_list("attempt", flat=True)) == {1}
    assert max_overlap("queue = 'gated'") == 1


def test_a_finishing_attempt_frees_its_slot_for_waiting_workers_without_a_poll(
    start_worker,
) -> None:
    awa.set_queue_limits("wake", global_concurrency=1)
    # 30 s poll intervals: only the wake-ups (in-process, and NOTIFY to the other
    # worker) can start held-back jobs in time.
    for _ in range(2):
        start_worker("--queue", "wake=2", env={"AWA_TEST_POLL_INTERVAL": "30"})
    started = time.monotonic()
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i, seconds=0.05), queue="wake") for i in range(16)])
    all_finished("span", 16, timeout=20)
    assert time.monotonic() - started < 12
    assert max_overlap("queue = 'wake'") == 1


# ==== Crashes, runtime changes, pausing ===========================================


@pytest.mark.slow
def test_a_killed_workers_slots_return_when_its_jobs_are_rescued(start_worker) -> None:
    awa.set_queue_limits("crash", global_concurrency=2)
    victim = start_worker("--queue", "crash=4")
    # The first attempts hang; they are what the victim holds when it dies.
    awa.enqueue_many(
        [
            awa.EnqueueRequest(Span(n=i, first_seconds=60, seconds=0.05), queue="crash")
            for i in (0, 1)
        ]
    )
    wait_for(lambda: FlowRun.objects.count() == 2, 20)
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.05), queue="crash") for i in range(2, 8)]
    )
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    start_worker("--queue", "crash=4")
    start_worker("--queue", "crash=4")
    # Until rescue (STALE_AFTER is 3 s) the dead worker's two attempts hold both slots.
    time.sleep(1.5)
    assert FlowRun.objects.count() == 2
    assert Job.objects.filter(queue="crash", state=JobState.AVAILABLE, attempt=0).count() == 6
    wait_for(lambda: Job.objects.filter(queue="crash", state=JobState.COMPLETED).count() == 8, 40)
    rescued = Job.objects.filter(queue="crash", args__n__in=[0, 1])
    assert {j.attempt for j in rescued} == {2}
    assert max_overlap("queue = %s AND attempt = 1 AND n >= 2", ["crash"]) <= 2


@pytest.mark.slow
def test_an_abandoned_handler_keeps_its_global_concurrency_place_until_it_returns(
    start_worker,
) -> None:
    # A sync handler past its timeout cannot be stopped; after the stuck grace its
    # thread is abandoned and replaced, yet it still runs: it keeps its place
    # among the queue's global_concurrency until it returns (the limit protects
    # what the handlers call, a partner API allowing two calls at once, say).
    awa.set_queue_limits("timedglob", global_concurrency=2)
    workers = [start_worker("--queue", "timedglob=4") for _ in range(2)]
    # The first two first attempts run 8 s (timeout 1 s, abandoned about 5 s
    # later); the rest, and the retries, are quick.
    awa.enqueue_many(
        [TimedSpan(n=i, first_seconds=8 if i < 2 else 0, seconds=0.05) for i in range(6)]
    )
    all_finished("timed_span", 6, timeout=90)
    assert any("abandoned" in worker.output() for worker in workers), "no thread was abandoned"
    overlap = max_overlap("queue = %s", ["timedglob"])
    assert overlap <= 2, f"{overlap} handlers of queue timedglob ran at once; the limit is 2"
    assert Job.objects.filter(kind="timed_span", state=JobState.COMPLETED).count() == 6


@pytest.mark.slow
def test_limits_changed_at_runtime_reach_every_worker_within_a_poll_interval(
    start_worker,
) -> None:
    poll = 0.2  # tests.settings POLL_INTERVAL
    start_three(start_worker, "runtime=4")
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.3), queue="runtime") for i in range(24)]
    )
    # Unlimited: 12 places at once, once every worker is up.
    wait_for(lambda: FlowRun.objects.filter(ended_at__isnull=True).count() >= 6, 20)
    awa.set_queue_limits("runtime", global_concurrency=1)
    changed = _scalar("SELECT clock_timestamp()")
    all_finished("span", 24, timeout=60)
    assert max_overlap("queue = 'runtime' AND attempted_at < %s", [changed]) >= 6
    applied = changed + dt.timedelta(seconds=poll)
    # Every attempt that started a poll interval after the change started alone.
    crowded = _scalar(
        """SELECT count(*) FROM testapp_flowrun AS a JOIN testapp_flowrun AS b
           ON a.id <> b.id AND b.started_at <= a.started_at AND b.ended_at > a.started_at
           WHERE a.attempted_at > %s""",
        [applied],
    )
    assert crowded == 0, "an attempt started beside another after global_concurrency=1 applied"
    assert FlowRun.objects.filter(attempted_at__gt=applied).count() >= 5
    awa.set_queue_limits("runtime", global_concurrency=None)  # back to unlimited
    assert not producer.queue_limits("runtime", "default").limited


@pytest.mark.slow
def test_a_limit_lowered_at_runtime_applies_at_once_not_at_the_next_poll(start_worker) -> None:
    # A 30 s poll interval: only set_queue_limits' NOTIFY can bring the change in time.
    awa.set_queue_limits("runtime", global_concurrency=8)
    start_three(start_worker, "runtime=4", AWA_TEST_POLL_INTERVAL="30")
    total = 80
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=i, seconds=0.2), queue="runtime") for i in range(total)]
    )
    wait_for(lambda: FlowRun.objects.filter(ended_at__isnull=True).count() >= 6, 20)
    awa.set_queue_limits("runtime", global_concurrency=1)
    changed = _scalar("SELECT clock_timestamp()")
    # The handlers running then (0.2 s) return; a producer waiting for room looks
    # again within 0.5 s. At the old limit, the 80 jobs would be done in about 2 s.
    applied = changed + dt.timedelta(seconds=1.0)
    wait_for(lambda: FlowRun.objects.filter(attempted_at__gt=applied).count() >= 5, 30)
    crowded = _scalar(
        """SELECT count(*) FROM testapp_flowrun AS a JOIN testapp_flowrun AS b
           ON a.id <> b.id AND b.started_at <= a.started_at AND b.ended_at > a.started_at
           WHERE a.attempted_at > %s""",
        [applied],
    )
    assert crowded == 0, "an attempt started beside another a second after the limit fell to 1"
    assert max_overlap("queue = 'runtime' AND attempted_at < %s", [changed]) >= 6
    awa.set_queue_limits("runtime", reset=True)  # unlimited again: the rest drains
    all_finished("span", total, timeout=60)


@pytest.mark.slow
def test_pausing_stops_claims_on_every_worker_within_a_poll_interval(start_worker) -> None:
    poll = 0.2  # tests.settings POLL_INTERVAL
    start_three(start_worker, "flow=3")
    awa.enqueue_many([Span(n=i, seconds=0.02) for i in range(3000)])
    wait_for(lambda: FlowRun.objects.count() > 100, 30)
    awa.pause_queue("flow")
    paused_at = _scalar("SELECT clock_timestamp()")
    # Wait out one poll interval and then some, while the workers keep polling.
    time.sleep(poll * 5)
    last = _scalar("SELECT max(attempted_at) FROM awa_job WHERE queue = 'flow'")
    assert last <= paused_at + dt.timedelta(seconds=poll), (last, paused_at)
    waiting = Job.objects.filter(queue="flow", state=JobState.AVAILABLE).count()
    assert waiting > 0 and Job.objects.filter(queue="flow", state=JobState.RUNNING).count() == 0
    awa.resume_queue("flow")
    wait_for(
        lambda: Job.objects.filter(queue="flow", state=JobState.AVAILABLE).count() < waiting, 10
    )


# ==== Validation =================================================================


@pytest.mark.parametrize(
    ("queues", "extra", "key", "words"),
    [
        ({"q": {"rate_limit": "50/sec"}}, {}, "QUEUES", "['q']['rate_limit']"),
        ({"q": {"rate_limit": "0/s"}}, {}, "QUEUES", "at least one start"),
        ({"q": {"rate_limit": 50}}, {}, "QUEUES", '"N/s", "N/m" or "N/h"'),
        ({"q": {"global_concurrency": 0}}, {}, "QUEUES", "['q']['global_concurrency']"),
        ({"q": {"global_concurrency": True}}, {}, "QUEUES", "an integer from 1 to 10,000"),
        ({"q": {"global_concurrency": 2**31}}, {}, "QUEUES", "an integer from 1 to 10,000"),
        ({"q": {"rate_limit": "3000000000/s"}}, {}, "QUEUES", "at most 1,000,000 starts"),
        ({"q": {"concurrency": 10**12}}, {}, "QUEUES", "['q']['concurrency'] must be an"),
        ({"q": {"weight": -1}}, {}, "QUEUES", "['q']['weight']"),
        ({"q": {"min": -1}}, {}, "QUEUES", "['q']['min']"),
        ({"q": {"min": 5}}, {"WORKER_CONCURRENCY": 4}, "WORKER_CONCURRENCY", "more than"),
        (
            {"a": {"min": 3}, "b": {"min": 3}},
            {"WORKER_CONCURRENCY": 4},
            "WORKER_CONCURRENCY",
            "add up to 6",
        ),
        ({"q": {}}, {"WORKER_CONCURRENCY": 0}, "WORKER_CONCURRENCY", "positive integer"),
    ],
)
def test_a_wrong_flow_control_setting_is_a_check_error_naming_the_key(
    settings, queues, extra, key, words
) -> None:
    settings.AWA = {"QUEUES": queues, **extra}
    found = conf.problems()
    assert [k for k, _ in found] == [key], found
    assert words in found[0][1]
    with pytest.raises(awa.ConfigurationError, match=key):
        conf.awa_settings()


def test_queue_limits_in_the_settings_are_parsed(settings) -> None:
    settings.AWA = {"QUEUES": {"email": {"concurrency": 10, "rate_limit": "50/m",
                                         "global_concurrency": 20}}}  # fmt: skip
    email = conf.awa_settings().queues["email"]
    assert (email.rate_limit.count, email.rate_limit.period) == (50, 60.0)
    assert email.global_concurrency == 20 and email.concurrency == 10


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({}, "needs concurrency=, rate= or both"),
        ({"concurrency": 0}, "concurrency=) must be an integer from 1 to 10,000, got 0"),
        ({"concurrency": 2**40}, "concurrency=) must be an integer from 1 to 10,000"),
        ({"rate": "99999999999/s"}, "rate=) allows at most 1,000,000 starts per period"),
        ({"rate": "5 per second"}, "rate=) must be a rate"),
        ({"concurrency": 1, "by": ""}, "by=) takes a field name"),
        ({"concurrency": 1, "by": ["key"]}, "by=) takes a field name"),
        ({"concurrency": 1, "by": ("key", "n", "key")}, "by=) names field 'key' more than once"),
    ],
)
def test_a_bad_limit_is_refused_when_declared(options, words) -> None:
    with pytest.raises(awa.ValidationError, match=re.escape(words)):
        awa.Limit(**options)


def test_limit_and_sequence_fields_must_be_fields_of_the_args() -> None:
    with pytest.raises(awa.ValidationError, match=r"Span has no field 'account'.*fields: "):
        awa.worker(Span, limit=awa.Limit(concurrency=1, by="account"))
    with pytest.raises(awa.ValidationError, match=r"sequence=: Span has no field 'account'"):
        awa.worker(Span, sequence=("key", "account"))
    with pytest.raises(awa.ValidationError, match=r"sequence= names field 'key' more than once"):
        awa.worker(Span, sequence=("key", "key"))
    with pytest.raises(awa.ValidationError, match=r"limit must be an awa\.Limit"):
        awa.worker(Span, limit={"concurrency": 1})  # type: ignore[arg-type]
    assert registry.workers["span"].limit is None  # nothing was registered


@pytest.mark.django_db
def test_a_limited_kind_is_refused_on_another_queue_and_bad_sequence_keys() -> None:
    with pytest.raises(awa.ValidationError, match="holds on its queue 'bykey'"):
        awa.enqueue(KeyedSpan(key="a"), queue="default")
    with pytest.raises(awa.ValidationError, match="sequence must be a string of 1 to 255"):
        awa.enqueue_many([awa.EnqueueRequest(Span(), sequence="")])
    assert not Job.objects.exists()
    job = awa.enqueue(SequencedSpan(key="acct-7"))
    assert job.metadata["awa_sequence"] == 'sequenced_span:["acct-7"]'
    other = awa.enqueue_many([awa.EnqueueRequest(SequencedSpan(key="x"), sequence="mine")])
    assert Job.objects.get(id=other[0]).metadata == {"awa_sequence": "mine"}


@pytest.mark.django_db
def test_set_queue_limits_validates_and_keeps_what_it_is_not_given() -> None:
    with pytest.raises(awa.ValidationError, match=r"set_queue_limits\('q'\): rate_limit"):
        awa.set_queue_limits("q", rate_limit="fast")
    with pytest.raises(awa.ValidationError, match="global_concurrency must be an integer from"):
        awa.set_queue_limits("q", global_concurrency=-2)
    # Past the bounds a value would stall the queue rather than limit it.
    with pytest.raises(awa.ValidationError, match="from 1 to 10,000, or None, got 2147483648"):
        awa.set_queue_limits("q", global_concurrency=2**31)
    with pytest.raises(awa.ValidationError, match="at most 1,000,000 starts per period"):
        awa.set_queue_limits("q", rate_limit="2147483648/s")
    assert awa.set_queue_limits("q", rate_limit="1000000/s", global_concurrency=10_000) == {
        "rate_limit": "1000000/s", "rate_count": 1_000_000, "rate_period": 1.0,
        "global_concurrency": 10_000}  # fmt: skip
    awa.set_queue_limits("q", reset=True)
    with pytest.raises(awa.ValidationError, match="invalid queue name"):
        awa.set_queue_limits("no spaces")
    assert awa.set_queue_limits("q", rate_limit="5/s") == {
        "rate_limit": "5/s", "rate_count": 5, "rate_period": 1.0}  # fmt: skip
    stored = awa.set_queue_limits("q", global_concurrency=3)
    assert stored["rate_limit"] == "5/s" and stored["global_concurrency"] == 3
    assert awa.set_queue_limits("q", rate_limit=None) == {
        "rate_limit": None, "global_concurrency": 3}  # fmt: skip
    limits = producer.queue_limits("q", "default")
    assert limits.rate_limit is None and limits.global_concurrency == 3
    # reset takes True or False: "yes" (or "no", which is truthy) is refused, nothing written.
    for word in ("yes", "no"):
        with pytest.raises(
            awa.ValidationError,
            match=rf"set_queue_limits\('q'\): reset must be True or False, got '{word}'",
        ):
            awa.set_queue_limits("q", reset=word)  # type: ignore[arg-type]
    assert producer.queue_limits("q", "default").global_concurrency == 3
    assert awa.set_queue_limits("q", reset=True) == {}
    assert not producer.queue_limits("q", "default").limited


@pytest.mark.django_db
@pytest.mark.parametrize(
    "name", ["sp ace", "<b>", 'x"y\\z\nw', "ü日本", "", "q" * 129, "default\n"]
)
@pytest.mark.parametrize("operation", ["pause_queue", "resume_queue"])
def test_pause_and_resume_refuse_a_queue_name_enqueue_refuses(operation: str, name: str) -> None:
    with pytest.raises(awa.ValidationError, match="invalid queue name"):
        awa.enqueue(Span(), queue=name)
    with pytest.raises(awa.ValidationError, match=rf"{operation}: invalid queue name"):
        getattr(awa, operation)(name)
    assert not Queue.objects.exists()  # no phantom queue


@pytest.mark.django_db(transaction=True)
def test_a_claim_held_back_says_why_in_the_debug_log(caplog) -> None:
    from django_awa.state import WorkerState

    awa.set_queue_limits("why", rate_limit="1/h")
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="why") for i in range(3)])
    state = WorkerState.create({"why": 5})
    runner = state.queues["why"]
    with caplog.at_level(logging.DEBUG, logger="django_awa.producer"):
        assert len(producer.Producer(state, runner).run_once() or []) == 1
        assert producer.Producer(state, runner).run_once() == []
    assert "queue why: claimed nothing: 2 due job(s) held back" in caplog.text
    assert "rate_limit=1/h" in caplog.text
    assert runner.limited


@pytest.mark.django_db(transaction=True)
def test_a_global_concurrency_queue_claims_within_the_slots_its_worker_leased(caplog) -> None:
    from django_awa import fleet
    from django_awa.models import QueueSlot
    from django_awa.state import WorkerState

    awa.set_queue_limits("leased", global_concurrency=2)
    ids = awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="leased") for i in range(5)])
    state = WorkerState.create({"leased": 5})
    runner = state.queues["leased"]
    # Not registered in awa_worker: no slot is taken, nothing is claimed.
    assert producer.Producer(state, runner).run_once() is None
    assert not QueueSlot.objects.exists()
    fleet.beat(state)
    with caplog.at_level(logging.DEBUG, logger="django_awa.slots"):
        first = producer.Producer(state, runner).run_once()
    assert [j.id for j in first or []] == ids[:2]
    assert sorted(QueueSlot.objects.values_list("slot", flat=True)) == [1, 2]
    assert "queue leased: holds slots [1, 2] of 2" in caplog.text
    # Both slots in use: the next claim waits for room and takes nothing.
    assert producer.Producer(state, runner).run_once() is None
    held = Job.objects.filter(id__in=ids[2:])
    assert {(j.state, j.attempt) for j in held} == {(JobState.AVAILABLE, 0)}
    # Another worker serving the queue finds no slot free.
    other = WorkerState.create({"leased": 5})
    fleet.beat(other)
    theirs = other.queues["leased"]
    assert producer.Producer(other, theirs).run_once() is None
    # A handler returns. Two live workers: a fair share is one slot each, so the
    # first gives back the one no handler uses, and the other takes it.
    runner.finished()
    Job.objects.filter(id=ids[0]).update(state=JobState.COMPLETED)  # its outcome
    assert producer.Producer(state, runner).run_once() is None
    assert list(QueueSlot.objects.filter(worker_id=state.id).values_list("slot", flat=True)) == [1]
    assert [j.id for j in producer.Producer(other, theirs).run_once() or []] == [ids[2]]
    # The first worker stops (its handler done): its slot goes with its row; the
    # other one takes it.
    Job.objects.filter(id__in=ids[1:3]).update(state=JobState.COMPLETED)
    fleet.deregister(state)
    assert not QueueSlot.objects.filter(worker_id=state.id).exists()
    assert [j.id for j in producer.Producer(other, theirs).run_once() or []] == [ids[3]]
    assert QueueSlot.objects.filter(worker_id=other.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_process_left_without_a_usable_slot_gives_back_the_jobs_it_claimed_ahead() -> None:
    from django_awa import fleet
    from django_awa.handlers import HandlerPool
    from django_awa.models import QueueSlot

    awa.set_queue_limits("leased", global_concurrency=2)
    ids = awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="leased") for i in range(4)])
    state = WorkerState.create({"leased": 4})
    runner = state.queues["leased"]
    fleet.beat(state)
    claimer = producer.Producer(state, runner)
    runner.run_time = 0.001  # quick handlers: it claims ahead of its two slots
    assert sorted(j.id for j in claimer.run_once() or []) == ids
    assert runner.gate.limit == 2  # two of them may run at once
    assert Job.objects.filter(queue="leased", state=JobState.RUNNING).count() == 4
    # Another worker has both slots now (as after a rebalance): none is usable here.
    other = WorkerState.create({"leased": 4})
    fleet.beat(other)
    QueueSlot.objects.filter(queue="leased").update(worker_id=other.id)
    assert claimer.slots is not None
    claimer.slots.checked = 0.0  # the rebalance is due
    assert claimer.run_once() is None
    assert runner.gate.limit == 0
    # What it claimed and did not start is available again, its attempt unused.
    assert set(Job.objects.filter(id__in=ids).values_list("state", flat=True)) == {"available"}
    assert not state.running and not state.waiting
    # Their handler threads find them given up: nothing runs, their places free.
    pool = HandlerPool(state)
    assert all(pool.run_once(runner, timeout=1) for _ in ids)
    assert state.results.empty() and runner.held == 0 and runner.gate.active == 0
    assert not FlowRun.objects.exists()
    # The next claim runs them under the attempt number they had.
    assert {j.attempt for j in producer.claim("leased", 4, "default")} == {1}


# ==== The advisory lock ==========================================================


@pytest.mark.django_db(transaction=True)
def test_a_limited_claim_skips_while_another_holds_the_queue_lock_then_counts_its_starts() -> None:
    awa.set_queue_limits("race", global_concurrency=2)
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i), queue="race") for i in range(6)])
    limits = producer.queue_limits("race", "default")
    holding, release = threading.Event(), threading.Event()
    claimed: dict[str, list[Job] | None] = {}

    def first() -> None:
        try:
            with transaction.atomic():  # the claim's commit is held back
                claimed["first"] = claim_limited(limits)
                holding.set()
                release.wait(10)
        finally:
            connection.close()

    def second(name: str) -> None:
        try:
            claimed[name] = claim_limited(limits)
        finally:
            connection.close()

    one = threading.Thread(target=first)
    one.start()
    try:
        assert holding.wait(10)
        two = threading.Thread(target=second, args=("second",))
        two.start()
        two.join(5)
        # It does not queue behind the holder: it claims nothing (None) at once.
        # Without the lock it would count no running row (the first claim is not
        # committed) and take the locked ones' neighbours: four running.
        assert not two.is_alive(), "the second claimer waited for the lock"
        assert claimed["second"] is None
    finally:
        release.set()
        one.join(10)
    three = threading.Thread(target=second, args=("third",))
    three.start()
    three.join(10)
    assert len(claimed["first"] or []) == 2 and claimed["third"] == []
    assert Job.objects.filter(queue="race", state=JobState.RUNNING).count() == 2


# ==== Weighted sharing within a process ===========================================


def test_shared_concurrency_lends_idle_places_and_keeps_each_minimum() -> None:
    pool = SharedConcurrency(4, mins={"a": 1, "b": 1}, weights={"a": 1, "b": 1})
    assert pool.take("a", 4, 0) == 3  # its minimum and every shared place; b's minimum stays
    pool.busy("a", True)
    assert pool.take("b", 4, 0) == 1  # b's minimum, however busy a is
    assert pool.take("b", 1, 0.01) == 0  # the cap: 4
    pool.busy("b", True)
    pool.give("a", 2)  # a's borrowed jobs finished: now each gets its weight's share
    assert pool.take("b", 4, 0) == 1
    assert pool.take("a", 4, 0) == 1
    assert pool.held == {"a": 2, "b": 2}


def test_shared_concurrency_splits_by_weight_while_both_want_more() -> None:
    pool = SharedConcurrency(8, mins={"a": 0, "b": 0}, weights={"a": 3, "b": 1})
    pool.busy("a", True)
    pool.busy("b", True)
    assert pool.take("a", 8, 0) == 6
    assert pool.take("b", 8, 0) == 2
    pool.give("a", 6)
    pool.busy("b", False)  # b drained: a may borrow its share too
    assert pool.take("a", 8, 0) == 6  # b still holds 2


def test_worker_concurrency_caps_a_process_and_shares_it(start_worker) -> None:
    # WORKER_CONCURRENCY 4; queues wa and wb: concurrency 4, min 1, weight 1 each.
    start_worker("--queue", "wa=4", "--queue", "wb=4", env={"AWA_TEST_FLOW_QUEUES": "shared"})
    awa.enqueue_many([awa.EnqueueRequest(Span(n=i, seconds=0.3), queue="wa") for i in range(12)])
    wait_for(lambda: FlowRun.objects.filter(queue="wa").count() >= 3, 20)
    time.sleep(0.1)  # wa alone for a moment: a fourth start would show now
    alone_until = _scalar("SELECT clock_timestamp()")
    awa.enqueue_many(
        [awa.EnqueueRequest(Span(n=100 + i, seconds=0.3), queue="wb") for i in range(6)]
    )
    all_finished("span", 18, timeout=60)
    assert max_overlap() <= 4  # the process's cap, across both queues
    # Alone, wa borrowed wb's idle shared places (4 threads, 3 allowed: min 1 + 2 shared).
    assert max_overlap("queue = 'wa' AND started_at < %s", [alone_until]) == 3
    # wb got its places while wa had a backlog: both ran at once.
    assert (
        _scalar(
            """SELECT count(*) FROM testapp_flowrun AS a JOIN testapp_flowrun AS b
           ON a.queue = 'wa' AND b.queue = 'wb'
          AND tstzrange(a.started_at, a.ended_at) && tstzrange(b.started_at, b.ended_at)"""
        )
        > 0
    )
    assert max_overlap("queue = 'wb'") >= 2
