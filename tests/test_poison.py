"""Poison outcomes with real worker processes: one bad job never holds back the others.

A handler's error, cancel reason or progress may hold text PostgreSQL
cannot store (NUL, lone surrogates), or a delay past what a timestamp
holds. Such an outcome is stored escaped or capped; should one still fail
to be written, the completer records it as a failed attempt and writes the
rest of its batch. A row another session holds locked is skipped and
written later, alone.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

import django_awa as awa
from django_awa.completer import Completer
from django_awa.execute import Attempt, AttemptResult
from django_awa.models import Job, JobState, PendingFollowup
from django_awa.state import WorkerState
from tests.conftest import make_job, wait_for, wait_for_state
from tests.testapp.jobs import Act, Noop, Poison

pytestmark = pytest.mark.django_db(transaction=True)

DAY = dt.timedelta(days=1)


def states(ids: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for state in Job.objects.filter(id__in=ids).values_list("state", flat=True):
        counts[state] = counts.get(state, 0) + 1
    return counts


def all_completed(ids: list[int]) -> bool:
    return states(ids) == {"completed": len(ids)}


def followup_notes(job_id: int) -> list[str]:
    return [
        job.args["note"] for job in Job.objects.filter(kind="echo", args__n=job_id).order_by("id")
    ]


@pytest.mark.parametrize(
    ("action", "expected_state", "stored"),
    [
        ("nul_error", (JobState.RETRYABLE, JobState.FAILED), "bad \\x00 byte"),
        ("surrogate_error", (JobState.RETRYABLE, JobState.FAILED), "bad \\udc80"),
        ("nul_cancel", (JobState.CANCELLED,), "reason \\x00"),
        ("nul_progress", (JobState.COMPLETED,), None),
        ("huge_retry", (JobState.RETRYABLE,), None),
        ("huge_snooze", (JobState.SCHEDULED,), None),
    ],
)
def test_a_poison_outcome_is_stored_and_the_jobs_after_it_complete(
    start_worker: Any, action: str, expected_state: tuple[str, ...], stored: str | None
) -> None:
    worker = start_worker("--queue", "default=1")
    bad = awa.enqueue(Poison(action=action)).id
    after = awa.enqueue_many([Act(action="ok") for _ in range(50)])

    wait_for(
        lambda: all_completed(after),
        timeout=20,
        message=lambda: f"the 50 jobs after it: {states(after)}\n{worker.output()[-3000:]}",
    )
    job = wait_for_state(bad, expected_state)
    if stored is not None:
        assert stored in job.errors[0]["error"], job.errors
        # Its follow-up got the same, storable text.
        assert any(stored in note for note in followup_notes(bad)), followup_notes(bad)
    if action == "nul_progress":
        assert job.progress["message"] == "msg \\x00"
        assert job.progress["metadata"] == {"note": "\\udc80"}
    if action in ("huge_retry", "huge_snooze"):
        # Capped at a day (SPEC §5), not "timestamp out of range".
        assert timezone.now() + DAY - dt.timedelta(minutes=1) < job.run_at
        assert job.run_at <= timezone.now() + DAY


def _result(job: Job, **fields: Any) -> AttemptResult:
    claimed = Job.objects.get(id=job.id)
    return AttemptResult(job=claimed, **fields)


def test_the_completer_isolates_a_member_it_cannot_store_and_writes_the_rest() -> None:
    running = [
        make_job(state="running", attempt=1, run_lease=1, heartbeat_at=timezone.now())
        for _ in range(7)
    ]
    # A result built past every check: a delay no timestamp holds.
    bad = _result(running[3], state=JobState.RETRYABLE, delay=1e13, error="x")
    batch = [
        bad if job is running[3] else _result(job, state=JobState.COMPLETED) for job in running
    ]
    state = WorkerState.create({"default": 1})
    for result in batch:
        state.running[result.job.id] = Attempt(job=result.job, alias="default")

    Completer(state).write_batch(batch)

    rows = {job.id: job for job in Job.objects.filter(id__in=[j.id for j in running])}
    bad_row = rows.pop(running[3].id)
    assert {row.state for row in rows.values()} == {JobState.COMPLETED}
    assert bad_row.state == JobState.RETRYABLE
    assert "could not be stored" in bad_row.errors[-1]["error"]
    assert "DataError" in bad_row.errors[-1]["error"], bad_row.errors


def test_a_row_locked_by_another_session_does_not_hold_back_the_others(
    start_worker: Any,
) -> None:
    worker = start_worker("--queue", "default=4")
    held = awa.enqueue(Act(action="sleep", seconds=0.5)).id
    wait_for_state(held, JobState.RUNNING)
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params) as other:
        # An operator's session locks the running job, as SELECT ... FOR UPDATE
        # in a shell or a long admin transaction would, and keeps it for a while.
        other.execute("SELECT id FROM awa_job WHERE id = %s FOR UPDATE", [held])
        wait_for(
            lambda: "wait for a row lock" in worker.output(),
            message=lambda: f"the locked job's outcome was never put aside:\n{worker.output()}",
        )
        after = awa.enqueue_many([Act(action="ok") for _ in range(200)])
        wait_for(
            lambda: all_completed(after),
            timeout=15,
            message=lambda: f"jobs after the locked one: {states(after)}",
        )
        assert Job.objects.get(id=held).state == JobState.RUNNING
        other.rollback()
    wait_for_state(held, JobState.COMPLETED, timeout=10)


# jsonb PostgreSQL stores but Python cannot read back: an integer of more digits
# than int() takes, nesting deeper than the recursion limit. awa.enqueue refuses
# both; SQL, or a producer in another language, writes them.
HUGE_INT = """('{"action": "ok", "tag": ' || repeat('9', 5000) || '}')::jsonb"""
DEEP = """('{"deep": ' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb"""


def test_a_row_python_cannot_read_fails_alone_and_the_jobs_claimed_with_it_complete(
    start_worker: Any, admin_client: Any
) -> None:
    ids = awa.enqueue_many([Noop(n=i) for i in range(40)])
    bad_args, deep_args, bad_metadata = ids[5], ids[17], ids[30]
    # One with follow-ups too: its on_retried follow-up cannot decode the args either,
    # and is kept pending, its snapshot saying why.
    with_followups = awa.enqueue(Act(action="ok")).id
    with connection.cursor() as cursor:
        for job_id, column, value in (
            (bad_args, "args", HUGE_INT),
            (deep_args, "args", DEEP),
            (bad_metadata, "metadata", DEEP),
            (
                bad_metadata,
                "tags",
                """('[' || repeat('[', 5000) || repeat(']', 5000) || ']')::jsonb""",
            ),
            (with_followups, "args", HUGE_INT),
        ):
            # Constants of this module, not input.
            cursor.execute(f"UPDATE awa_job SET {column} = {value} WHERE id = %s", [job_id])  # noqa: S608

    worker = start_worker("--queue", "bulk=4", "--queue", "default")
    others = [i for i in ids if i not in (bad_args, deep_args)]
    wait_for(
        lambda: all_completed(others),
        timeout=20,
        message=lambda: f"the jobs claimed with them: {states(others)}\n{worker.output()[-3000:]}",
    )
    expected = ((bad_args, "ValueError: Exceeds the limit"), (deep_args, "RecursionError"))
    for job_id, error in expected:
        job = wait_for_state(job_id, JobState.FAILED)
        assert len(job.errors) == 1, job.errors  # failed for good, not retried
        assert "the stored args cannot be read" in job.errors[0]["error"], job.errors
        assert error in job.errors[0]["error"], job.errors
    wait_for_state(with_followups, (JobState.RETRYABLE, JobState.AVAILABLE, JobState.FAILED))
    pending = PendingFollowup.objects.get(job_id=with_followups)
    assert "the stored args cannot be read" in pending.last_error
    assert "Python cannot read" in pending.snapshot["args"]
    # The rows keep what they held; the ORM and the admin read them without raising.
    with connection.cursor() as cursor:
        cursor.execute("SELECT length(args::text) FROM awa_job WHERE id = %s", [bad_args])
        assert cursor.fetchone()[0] > 5000
    rows = {job.id: job for job in Job.objects.filter(id__in=ids)}
    assert not rows[bad_args].args
    assert "Python cannot read" in repr(rows[bad_args].args)
    assert not rows[bad_metadata].metadata and list(rows[bad_metadata].tags) == []
    assert admin_client.get("/admin/django_awa/job/").status_code == 200
    assert admin_client.get(f"/admin/django_awa/job/{bad_metadata}/change/").status_code == 200
    page = admin_client.get(f"/admin/django_awa/job/{bad_args}/change/")
    assert page.status_code == 200
    assert "9" * 200 in page.content.decode()  # the stored text, shown as it is
    assert worker.stop() == 0
