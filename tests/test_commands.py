"""The operator commands awa_jobs, awa_queues, awa_schedules: output and exit codes."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

import django_awa as awa
from django_awa import db
from django_awa.models import Job, JobState, PeriodicSchedule, Queue
from django_awa.schedules import schedules
from tests.conftest import ROOT, make_job
from tests.testapp.jobs import Act, Node

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Tidy(awa.JobArgs):
    room: str = "hall"


def run(*args: str) -> tuple[str, int]:
    """call_command: (stdout, exit code), as a script would see them."""
    out = io.StringIO()
    try:
        call_command(*args, stdout=out, stderr=io.StringIO())
    except CommandError as exc:
        return out.getvalue(), exc.returncode
    return out.getvalue(), 0


def shell(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a real process on the test database."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "AWA_TEST_DB_NAME": connection.settings_dict["NAME"],
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def failed(**fields: Any) -> Job:
    now = timezone.now()
    return make_job(
        state=JobState.FAILED, attempt=3, max_attempts=3, finalized_at=now, attempted_at=now,
        errors=[{"attempt": 3, "at": now.isoformat(), "error": "ValueError: card declined",
                 "traceback": ""}],
        **fields,
    )  # fmt: skip


# -- awa_jobs ------------------------------------------------------------------------


def test_list_filters_and_shows_a_readable_table_or_json():
    bad = failed(queue="billing", kind="charge")
    make_job(queue="billing", kind="charge")
    make_job(queue="email", kind="mail")
    out, code = run("awa_jobs", "list", "--queue", "billing", "--state", "failed")
    assert code == 0
    header, rule, *rows = out.splitlines()
    assert header.split() == [
        "id", "kind", "queue", "state", "attempt", "run_at", "finalized_at", "last_error",
    ]  # fmt: skip
    assert set(rule) <= {"-", " "}
    assert len(rows) == 1 and rows[0].split()[:5] == [
        str(bad.id),
        "charge",
        "billing",
        "failed",
        "3/3",
    ]
    assert rows[0].endswith("ValueError: card declined")

    out, code = run("awa_jobs", "list", "--queue", "billing", "--json")
    assert code == 0
    listed = json.loads(out)
    assert [j["queue"] for j in listed] == ["billing", "billing"]
    assert listed[1]["last_error"] == "ValueError: card declined"


def test_list_marks_a_cut_and_nothing_matched_is_exit_1():
    for _ in range(3):
        make_job(kind="mail")
    out, code = run("awa_jobs", "list", "--kind", "mail", "--limit", "2")
    assert code == 0 and out.splitlines()[-1] == "(the newest 2; --limit for more)"
    out, code = run("awa_jobs", "list", "--kind", "nope")
    assert (out, code) == ("", 1)
    out, code = run("awa_jobs", "list", "--kind", "nope", "--json")
    assert (json.loads(out), code) == ([], 1)


def test_show_one_job_and_a_missing_one():
    job = failed(args={"order": 42})
    out, code = run("awa_jobs", "show", str(job.id), "--json")
    assert code == 0
    shown = json.loads(out)
    assert (
        shown["args"] == {"order": 42}
        and shown["errors"][0]["error"] == "ValueError: card declined"
    )
    out, code = run("awa_jobs", "show", str(job.id))
    assert code == 0 and "error: attempt 3" in out and "ValueError: card declined" in out
    assert run("awa_jobs", "show", "999999999")[1] == 1


def test_show_gives_the_result_and_workflow_and_json_values_as_json():
    workflow = uuid.uuid4()
    now = timezone.now()
    job = make_job(
        state=JobState.COMPLETED, attempt=1, finalized_at=now, attempted_at=now,
        args={"order": 42, "gift": True, "note": None}, result={"sent": True, "to": None},
        workflow_id=workflow,
    )  # fmt: skip
    out, code = run("awa_jobs", "show", str(job.id))
    assert code == 0
    # In the order PostgreSQL's jsonb keeps the keys: shortest first.
    assert '         args: {"gift": true, "note": null, "order": 42}' in out
    assert '       result: {"to": null, "sent": true}' in out
    assert f"  workflow_id: {workflow}" in out
    shown = json.loads(run("awa_jobs", "show", str(job.id), "--json")[0])
    assert shown["result"] == {"sent": True, "to": None} and shown["workflow_id"] == str(workflow)


def test_show_prints_json_values_in_the_letters_they_were_written_in():
    job = make_job(args={"city": "Zürich", "greeting": "こんにちは"}, tags=["café"])
    out, code = run("awa_jobs", "show", str(job.id))
    assert code == 0
    assert '"city": "Zürich"' in out and '"greeting": "こんにちは"' in out
    assert '         tags: ["café"]' in out


def test_retry_cancel_and_discard_by_id_and_by_filter():
    one, _ = failed(queue="billing"), failed(queue="billing")
    other = failed(queue="email")
    running = make_job(queue="billing", state=JobState.AVAILABLE)

    out, code = run("awa_jobs", "retry", "--queue", "billing", "--json")
    assert code == 0
    assert json.loads(out) == {
        "operation": "retry",
        "matched": 2,
        "retried": 2,
        "dependents": 0,
        "unchanged": 0,
        "failed": [],
        "batches": 1,
        "longest_batch_seconds": json.loads(out)["longest_batch_seconds"],
    }
    assert (
        Job.objects.get(id=one.id).state == "available"
        and Job.objects.get(id=other.id).state == "failed"
    )

    out, code = run("awa_jobs", "cancel", str(running.id), "--reason", "no longer needed")
    assert code == 0 and out.startswith(f"cancelled 1 job(s): {running.id}")
    cancelled = Job.objects.get(id=running.id)
    assert cancelled.state == "cancelled" and cancelled.errors[-1]["error"].endswith(
        "no longer needed"
    )

    # A job whose state does not allow it, and an id that names none: exit 1.
    out, code = run("awa_jobs", "retry", str(other.id), str(one.id), "999999999", "--json")
    assert code == 1
    assert json.loads(out) == {
        "retried": [other.id], "dependents": 0, "unchanged": [one.id], "not_found": [999999999],
        "failed": [],
    }  # fmt: skip

    out, code = run("awa_jobs", "discard", "--queue", "email")
    assert code == 2 and Job.objects.filter(id=other.id).exists()  # needs --yes
    out, code = run("awa_jobs", "discard", "--queue", "email", "--yes")
    assert code == 0 and out.startswith("discarded 1 of 1 matching job(s)")
    assert not Job.objects.filter(id=other.id).exists()
    assert run("awa_jobs", "retry", "--queue", "email")[1] == 1  # nothing left to match


def test_a_cancel_reason_postgresql_cannot_hold_is_kept_escaped_as_a_handlers_is():
    by_filter = [awa.enqueue(Act(action="ok")) for _ in range(2)]
    # A real process: a Latin-1 terminal's "café" reaches Python as "caf\udce9".
    done = shell("awa_jobs", "cancel", "--kind", "act", "--reason", "caf\udce9 closed")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cancelled 2 of 2 matching job(s)")
    by_id = awa.enqueue(Act(action="ok"))
    out, code = run("awa_jobs", "cancel", str(by_id.id), "--reason", "caf\udce9 closed")
    assert (code, out) == (0, f"cancelled 1 job(s): {by_id.id}\n")
    api = awa.enqueue(Act(action="ok"))
    awa.cancel(api.id, "nul\x00here")
    for job, reason in [
        *[(j, "caf\\udce9 closed") for j in [*by_filter, by_id]],
        (api, "nul\\x00here"),
    ]:
        row = Job.objects.get(id=job.id)
        assert row.state == JobState.CANCELLED
        assert row.errors[-1]["error"] == f"cancelled: {reason}"
        (followup,) = Job.objects.followups_of(job.id)
        assert followup.args["note"] == f"cancelled:{reason}"


def _chain(queue: str) -> list[Job]:
    """a <- b <- c in ``queue`` (each requires the one before to complete)."""
    flow = awa.Workflow(queue)
    a = flow.add(awa.EnqueueRequest(Node(name="a"), queue=queue), name="a")
    b = flow.add(awa.EnqueueRequest(Node(name="b"), queue=queue), after=[a], name="b")
    flow.add(awa.EnqueueRequest(Node(name="c"), queue=queue), after=[b], name="c")
    return flow.enqueue()


def test_awa_jobs_counts_the_dependents_its_cancel_retry_and_discard_moved() -> None:
    by_filter, by_id, discarded = _chain("flow_one"), _chain("flow_two"), _chain("flow_three")

    # By filter: the head only (its dependents are blocked, not matched by --state
    # available), its dependents cancelled by the cascade and counted apart.
    out, code = run("awa_jobs", "cancel", "--queue", "flow_one", "--state", "available", "--json")
    assert code == 0
    document = json.loads(out)
    assert (document["cancelled"], document["dependents"]) == (1, 2)
    assert {Job.objects.get(id=j.id).state for j in by_filter} == {"cancelled"}

    out, code = run("awa_jobs", "cancel", str(by_id[0].id))
    assert code == 0 and "cancelled 2 dependent job(s) too" in out
    assert {Job.objects.get(id=j.id).state for j in by_id} == {"cancelled"}
    out, _ = run("awa_jobs", "retry", str(by_id[0].id), "--json")
    assert json.loads(out)["dependents"] == 2

    out, code = run("awa_jobs", "discard", str(discarded[0].id), "--yes", "--json")
    assert code == 0 and json.loads(out) == {
        "discarded": [discarded[0].id], "dependents": 2, "unchanged": [], "not_found": [],
        "failed": [],
    }  # fmt: skip
    assert {Job.objects.get(id=j.id).state for j in discarded[1:]} == {"cancelled"}


@pytest.mark.parametrize(
    "args",
    [
        ("awa_jobs",),
        ("awa_jobs", "frobnicate"),
        ("awa_jobs", "retry"),
        ("awa_jobs", "retry", "12", "--queue", "x"),
        ("awa_jobs", "list", "--state", "sleeping"),
        ("awa_jobs", "list", "--limit", "0"),
        ("awa_jobs", "show", "twelve"),
        # A kind PostgreSQL cannot compare: bytes a Latin-1 terminal sent, a NUL.
        ("awa_jobs", "list", "--kind", "caf\udce9"),
        ("awa_jobs", "cancel", "--kind", "a\x00b"),
        ("awa_queues", "pause", "bad queue name"),
        ("awa_schedules", "trigger"),
    ],
)
def test_usage_errors_are_exit_2(args: tuple[str, ...]):
    assert run(*args)[1] == 2


@pytest.mark.parametrize(
    "args",
    [
        ("awa_worker", "--queue", "emails/eu=3"),
        ("awa_jobs", "list", "--queue", "emails/eu"),
        ("awa_queues", "pause", "emails/eu"),
    ],
)
def test_a_refused_queue_name_is_told_what_a_queue_name_may_hold(args: tuple[str, ...]):
    with pytest.raises(CommandError) as raised:
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    assert raised.value.returncode == 2
    assert "'emails/eu': 1 to 128 letters, digits and _ . : -" in str(raised.value)


def test_real_processes_get_the_same_exit_codes_and_output():
    job = failed(queue="billing")
    listed = shell("awa_jobs", "list", "--queue", "billing", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [j["id"] for j in json.loads(listed.stdout)] == [job.id]
    missing = shell("awa_jobs", "show", "999999999")
    assert missing.returncode == 1 and "no job with id 999999999" in missing.stderr
    wrong = shell("awa_jobs", "list", "--state", "sleeping")
    assert wrong.returncode == 2 and "unknown state 'sleeping'" in wrong.stderr
    unknown = shell("awa_jobs", "frobnicate")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_djangos_own_options_may_follow_the_subcommand_as_the_readme_writes_them():
    job = failed(queue="billing")
    retried = shell("awa_jobs", "retry", "--state", "failed", "-v", "2")
    assert retried.returncode == 0, retried.stderr
    assert "retried 1 of 1 matching job(s)" in retried.stdout and "1/1" in retried.stderr
    assert Job.objects.get(id=job.id).state == JobState.AVAILABLE
    stats = shell("awa_queues", "stats", "--no-color", "--settings", "tests.settings")
    assert stats.returncode == 0, stats.stderr
    missing = shell("awa_schedules", "pause", "nightly", "--traceback")
    assert missing.returncode == 1 and "Traceback" in missing.stderr, missing.stderr
    assert "no periodic schedule named 'nightly'" in missing.stderr


def test_a_djangos_option_before_the_subcommand_stands_unless_given_after_it_too():
    def progress(*args: str) -> str:
        failed(queue="billing")
        err = io.StringIO()
        call_command("awa_jobs", *args, stdout=io.StringIO(), stderr=err)
        return err.getvalue()

    assert "1/1" in progress("-v", "2", "retry", "--state", "failed")
    assert "1/1" not in progress("-v", "2", "retry", "--state", "failed", "-v", "1")
    assert "1/1" not in progress("retry", "--state", "failed")  # Django's default, 1


# -- awa_queues ----------------------------------------------------------------------


def test_queue_stats_pause_and_resume():
    # AWA["QUEUES"]'s queue is known before it has a job, as /metrics and the admin
    # list it (it was left out: "nothing", exit 1).
    out, code = run("awa_queues", "stats", "--json")
    assert code == 0 and json.loads(out) == {
        "default": {**json.loads(out)["default"], "available": 0, "paused": False}
    }
    make_job(queue="billing")
    failed(queue="billing")
    out, code = run("awa_queues", "pause", "billing")
    assert (out.strip(), code) == ("queue billing paused", 0)
    assert Queue.objects.get(name="billing").paused
    out, code = run("awa_queues", "stats")
    assert code == 0
    header, _, row, configured = out.splitlines()
    assert header.split()[:2] == ["queue", "paused"] and configured.split()[0] == "default"
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert cells == {**cells, "queue": "billing", "paused": "yes", "available": "1", "failed": "1"}
    stats = json.loads(run("awa_queues", "stats", "--json")[0])
    assert stats["billing"]["paused"] is True and stats["billing"]["available"] == 1
    assert json.loads(run("awa_queues", "resume", "billing", "--json")[0]) == {
        "queue": "billing", "paused": False,
    }  # fmt: skip
    assert not Queue.objects.get(name="billing").paused


# -- awa_schedules -------------------------------------------------------------------


@pytest.fixture
def tidy_schedule():
    awa.periodic("tidy-nightly", "0 3 * * *", Tidy(room="attic"), queue="chores")
    yield
    schedules.pop("tidy-nightly", None)


def test_schedules_list_pause_resume_trigger_and_a_removed_one(tidy_schedule):
    PeriodicSchedule.objects.create(
        name="gone", cron="* * * * *", kind="old_kind",
        last_fire_at=timezone.now() - dt.timedelta(hours=1),
    )  # fmt: skip
    out, code = run("awa_schedules", "list", "--json")
    assert code == 0
    by_name = {e["name"]: e for e in json.loads(out)}
    assert by_name["tidy-nightly"]["status"] == "new" and by_name["tidy-nightly"]["kind"] == "tidy"
    assert by_name["gone"]["status"] == "removed" and by_name["gone"]["next_fire_at"] is None

    assert (
        run("awa_schedules", "pause", "tidy-nightly")[0].strip() == "schedule tidy-nightly: paused"
    )
    assert PeriodicSchedule.objects.get(name="tidy-nightly").paused
    out, code = run("awa_schedules", "trigger", "tidy-nightly", "--json")
    assert code == 0
    job = Job.objects.get(id=json.loads(out)["job_id"])
    assert (job.kind, job.queue, job.args) == ("tidy", "chores", {"room": "attic"})
    assert job.metadata["awa_periodic"]["name"] == "tidy-nightly"
    assert job.metadata["awa_periodic"]["triggered"] is True
    assert (
        run("awa_schedules", "resume", "tidy-nightly")[0].strip() == "schedule tidy-nightly: active"
    )

    out, code = run("awa_schedules", "list")
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert lines["gone"][1] == "removed" and lines["tidy-nightly"][1] == "active"

    assert run("awa_schedules", "trigger", "gone")[1] == 1  # removed from code: nothing to fire
    assert run("awa_schedules", "pause", "nonesuch")[1] == 1
    assert run("awa_schedules", "pause", "gone")[1] == 0


@pytest.fixture
def last_migration_unapplied():
    """django-awa's last migration not recorded as applied: a database not migrated yet."""
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'django_awa' "
            "AND name = '0018_lease_held_until' RETURNING applied"
        )
        (applied,) = cursor.fetchone()
    yield "0018_lease_held_until"
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) "
            "VALUES ('django_awa', '0018_lease_held_until', %s)",
            [applied],
        )


def test_a_database_without_awas_migrations_is_named_not_a_traceback(last_migration_unapplied):
    # As a worker refuses to start there: the commands' statements failed on a missing
    # table or column (a 0.1 database, `migrate` not run yet) with a ProgrammingError.
    failed(kind="act")
    for args in (
        ("awa_jobs", "list"),
        ("awa_jobs", "retry", "--state", "failed"),
        ("awa_queues", "pause", "billing"),
        ("awa_schedules", "list"),
    ):
        done = shell(*args)
        assert done.returncode == 1, (args, done.stderr)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert (
            "django-awa's migrations are not applied to database 'default' "
            f"({db.database_address('default')}): {last_migration_unapplied} is missing; "
            "run `manage.py migrate django_awa` first"
        ) in done.stderr, (args, done.stderr)
    assert Job.objects.get().state == JobState.FAILED  # nothing written
    assert not Queue.objects.filter(name="billing", paused=True).exists()


def test_priority_says_reprioritize_in_its_messages():
    # "would priority 1 job(s)", "nothing to priority": the operation's name is no verb.
    make_job(queue="billing", kind="charge")
    out, code = run("awa_jobs", "priority", "--set", "1", "--queue", "billing", "--dry-run")
    assert (out.strip(), code) == (
        "would reprioritize 1 job(s) (those in states: blocked, scheduled, available, retryable)",
        0,
    )
    with pytest.raises(CommandError, match=r"^nothing to reprioritize$"):
        call_command(
            "awa_jobs", "priority", "--set", "1", "--queue", "nosuch", stdout=io.StringIO()
        )
