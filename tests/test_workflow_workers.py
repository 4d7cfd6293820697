"""Workflows in real ``awa_worker`` processes: fan-in and fan-out on several
workers, and a dependency whose worker is SIGKILLed."""

from __future__ import annotations

import os

import pytest
from django.db import connection
from django.db.models import Count

import django_awa as awa
from django_awa.models import Job, JobState
from tests.conftest import connect_to, wait_for, wait_for_state
from tests.testapp.jobs import Node
from tests.testapp.models import Ledger

pytestmark = pytest.mark.django_db(transaction=True)

# Timings for workers that must not rescue anyone on a loaded machine.
CALM = {"AWA_TEST_STALE_AFTER": "60"}


def _value(query: str, *params: object) -> object:
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return cursor.fetchone()[0]


@pytest.mark.parametrize(
    ("size", "per_worker", "timeout"),
    [
        pytest.param(1000, 4, 120, id="1000"),
        pytest.param(10_000, 8, 600, marks=pytest.mark.slow, id="10000"),
    ],
)
@pytest.mark.slow
def test_a_fan_in_on_three_workers_runs_its_callback_once_after_all(
    start_worker, size, per_worker, timeout
):
    flow = awa.Workflow("fan-in")
    members = [flow.add(Node(name=f"m{i}")) for i in range(size)]
    callback = flow.add(Node(name="callback"), after=members)
    jobs = flow.enqueue()
    # No rescue on a loaded machine: every member runs exactly once.
    for _ in range(3):
        start_worker("--queue", f"flow={per_worker}", env=CALM)
    done = wait_for_state(jobs[-1].id, JobState.COMPLETED, timeout=timeout)
    assert Ledger.objects.filter(job_id=callback.job.id).count() == 1
    assert Ledger.objects.filter(job_id__in=[j.id for j in jobs[:-1]]).count() == size
    assert _value("SELECT count(*) FROM awa_worker") == 3  # all three alive throughout
    # It started after the last member finished, by the database clock.
    last_member = _value(
        "SELECT max(finalized_at) FROM awa_job WHERE id = ANY(%s)", [j.id for j in jobs[:-1]]
    )
    assert done.attempted_at >= last_member
    assert done.result["after"] == [{"name": f"m{i}", "after": []} for i in range(size)]


def test_a_fan_out_on_two_workers(start_worker):
    root = awa.enqueue(Node(name="root"))
    leaves = awa.enqueue_many(
        [awa.EnqueueRequest(Node(name=f"leaf{i}"), after=[root]) for i in range(300)]
    )
    start_worker("--queue", "flow=4", env=CALM)
    start_worker("--queue", "flow=4", env=CALM)
    wait_for(
        lambda: Job.objects.filter(id__in=leaves, state=JobState.COMPLETED).count() == 300,
        timeout=60,
        message=lambda: str(Job.objects.filter(id__in=leaves).values_list("state", flat=True)),
    )
    root_done = Job.objects.get(id=root.id).finalized_at
    assert _value("SELECT min(attempted_at) FROM awa_job WHERE id = ANY(%s)", leaves) >= root_done
    assert Ledger.objects.filter(job_id__in=leaves).count() == 300


@pytest.mark.slow
def test_a_fan_out_of_ten_thousand_on_three_workers_runs_each_once_after_its_root(start_worker):
    flow = awa.Workflow("fan-out")
    root = flow.add(Node(name="root"))
    leaves = [flow.add(Node(name=f"leaf{i}"), after=[root]) for i in range(10_000)]
    flow.enqueue()
    ids = [leaf.job.id for leaf in leaves]
    for _ in range(3):
        start_worker("--queue", "flow=8", env=CALM)
    wait_for(
        lambda: Job.objects.filter(id__in=ids, state=JobState.COMPLETED).count() == 10_000,
        timeout=600,
        message=lambda: str(Job.objects.filter(id__in=ids).values("state").annotate(n=Count("id"))),
    )
    root_done = Job.objects.get(id=root.job.id).finalized_at
    assert _value("SELECT min(attempted_at) FROM awa_job WHERE id = ANY(%s)", ids) >= root_done
    assert Ledger.objects.filter(job_id__in=ids).count() == 10_000
    assert _value("SELECT count(*) FROM awa_worker") == 3


@pytest.mark.slow
def test_a_dependency_rescued_after_its_worker_was_killed_releases_its_dependent(start_worker):
    dep = awa.enqueue(Node(name="dep", action="sleep_first", seconds=60))
    after = awa.enqueue(Node(name="after"), after=[dep])
    first = start_worker("--queue", "flow=2")
    wait_for_state(dep.id, JobState.RUNNING, timeout=20)
    first.kill()  # SIGKILL: no outcome written, the heartbeat stops
    start_worker("--queue", "flow=2")
    done = wait_for_state(after.id, JobState.COMPLETED, timeout=60)
    dep_row = Job.objects.get(id=dep.id)
    # Rescued at least once (on a loaded machine a later attempt may be too).
    assert dep_row.state == JobState.COMPLETED and dep_row.attempt >= 2
    assert "rescued: stale heartbeat" in dep_row.errors[0]["error"]
    assert done.attempted_at >= dep_row.finalized_at
    assert Ledger.objects.filter(job_id=after.id).count() == 1


@pytest.mark.slow
def test_a_worker_killed_while_releasing_a_dependent_leaves_it_to_the_rerun(start_worker):
    """SIGKILL between a dependency's outcome and its dependents' release: the
    outcome's transaction, stopped on a dependent's row lock, dies with it; no
    dependent runs until the rescued dependency has run again and completed."""
    dep = awa.enqueue(Node(name="dep"))
    after = awa.enqueue(Node(name="after"), after=[dep])
    report = awa.enqueue(Node(name="report"), after=[dep], requires="finished")
    name = connection.settings_dict["NAME"]
    with connect_to(name) as holder, connect_to(name) as watcher:
        holder.execute("BEGIN")
        holder.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [report.id])
        timings = {"AWA_TEST_STALE_AFTER": "3", "AWA_TEST_HEARTBEAT_INTERVAL": "0.5"}
        first = start_worker("--queue", "flow=2", env=timings)

        def releasing() -> bool:
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            return bool(row and row[0])

        # The outcome is written, its transaction waits to release the dependents.
        wait_for(releasing, timeout=30, message=first.output)
        first.kill()
        holder.execute("ROLLBACK")
    assert Job.objects.get(id=dep.id).state == JobState.RUNNING
    start_worker("--queue", "flow=2", env=timings)
    wait_for_state(after.id, JobState.COMPLETED, timeout=60)
    wait_for_state(report.id, JobState.COMPLETED, timeout=60)
    dep_row = Job.objects.get(id=dep.id)
    assert dep_row.attempt >= 2 and "rescued: stale heartbeat" in dep_row.errors[0]["error"]
    for job in (after, report):
        assert Job.objects.get(id=job.id).attempted_at >= dep_row.finalized_at
        assert Ledger.objects.filter(job_id=job.id).count() == 1


@pytest.mark.slow
def test_a_short_crash_soak_of_random_dags_passes_its_sql_audit(tmp_path):
    """stress/workflow_soak.py, short: 15 random DAGs, workers SIGKILLed every 2 s."""
    from stress import workflow_soak

    os.environ["AWA_SOAK_LOGDIR"] = str(tmp_path)
    try:
        code = workflow_soak.main(
            ["--dags", "15", "--kill-every", "2", "--timeout", "180", "--seed", "19",
             "--database-url", os.environ["DATABASE_URL"]]
        )  # fmt: skip
    finally:
        os.environ.pop("AWA_SOAK_LOGDIR", None)
    assert code == 0
