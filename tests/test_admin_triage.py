"""Operator triage in the admin job list (issue 21, item 3): the last error of each job."""

from __future__ import annotations

import datetime as dt
import html
import os
import re
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_awa as awa
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState, Worker
from tests.conftest import make_job
from tests.test_admin import (  # noqa: F401 (fixtures)
    JOBS_URL,
    QUEUES_URL,
    browser,
    change_url,
    login,
    submit,
    superuser,
)
from tests.testapp.jobs import Act

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
pytestmark = pytest.mark.django_db(transaction=True)


def test_the_failed_list_shows_each_jobs_last_error_without_reading_the_errors_column(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
    client: Any,
):
    now = timezone.now().isoformat()
    failed = make_job(
        state=JobState.FAILED, attempt=2, max_attempts=2, finalized_at=timezone.now(),
        errors=[
            {"attempt": 1, "at": now, "error": "TimeoutError: bank slow", "traceback": "x" * 5000},
            {"attempt": 2, "at": now, "error": "ValueError: card  declined\\n", "traceback": "t"},
        ],
    )  # fmt: skip
    fine = make_job()
    page = login(superuser)
    page.goto(f"{JOBS_URL}?state=failed")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    assert rows.locator("td.field-last_error").inner_text() == "ValueError: card declined\\n"
    page.goto(JOBS_URL)
    row = page.locator("#result_list tbody tr", has=page.locator(f'a:text-is("{fine.id}")'))
    assert row.locator("td.field-last_error").inner_text() == "-"  # no error

    client.force_login(superuser)
    with CaptureQueriesContext(connection) as queries:
        assert client.get(f"{JOBS_URL}?state=failed").status_code == 200
    listing = [q["sql"] for q in queries if "LIMIT" in q["sql"] and "awa_job" in q["sql"]]
    assert listing and all('"awa_job"."errors",' not in q for q in listing), listing
    assert failed.id


DEAD_LETTERS_URL = "/admin/django_awa/deadletter/"


def _failed(queue: str, kind: str, error: str, n: int = 1) -> list[Any]:
    now = timezone.now()
    errors = [
        {"attempt": 1, "at": now.isoformat(), "error": "first try", "traceback": ""},
        {"attempt": 3, "at": now.isoformat(), "error": error, "traceback": "tb"},
    ]
    fields = {"state": JobState.FAILED, "attempt": 3, "max_attempts": 3, "finalized_at": now}
    return [make_job(queue=queue, kind=kind, errors=errors, **fields) for _ in range(n)]


def test_dead_letters_group_failed_jobs_link_to_them_and_retry_or_purge_a_group(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
    settings: Any,
):
    settings.AWA = {**settings.AWA, "FAILED_RETENTION": 3 * 86400}
    boom = _failed("default", "act", "ValueError: boom\n  at line 3", n=3)
    boom += _failed("default", "act", "ValueError: boom")  # the same first line: one group
    slow = _failed("default", "act", "TimeoutError: slow")
    keyed = _failed("echo", "echo", "KeyError: 'x'", n=2)
    make_job(state=JobState.COMPLETED, finalized_at=timezone.now())  # not a dead letter
    page = login(superuser)
    page.goto("/admin/")
    submit(page, page.get_by_role("link", name="Dead letters (failed jobs)").first)
    assert "3 days after they failed" in page.locator("#awa-retention").inner_text()
    rows = page.locator("#awa-dead-letters tbody tr")
    assert rows.count() == 3
    first = rows.nth(0)
    assert first.locator("td.error").inner_text() == "ValueError: boom"
    assert first.locator("td.count").inner_text() == "4"
    assert rows.nth(1).locator("td.count").inner_text() == "2"  # echo: most jobs first

    submit(page, first.locator("td.count a"))  # the job list, filtered to the group
    listed = page.locator("#result_list tbody tr")
    assert listed.count() == 4
    ids = {int(t) for t in listed.locator("th.field-id a, td.field-id a").all_inner_texts()}
    assert ids == {job.id for job in boom}
    assert slow[0].id not in ids

    page.goto(DEAD_LETTERS_URL)
    group = page.locator("#awa-dead-letters tbody tr", has_text="ValueError: boom")
    submit(page, group.get_by_role("button", name="Retry all"))
    assert "Retried 4 failed job(s)" in page.locator(".messagelist").inner_text()
    for job in boom:
        job.refresh_from_db()
        assert job.state == JobState.AVAILABLE and job.attempt == 0
    slow[0].refresh_from_db()
    assert slow[0].state == JobState.FAILED  # another group: untouched

    group = page.locator("#awa-dead-letters tbody tr", has_text="KeyError")
    group.get_by_role("button", name="Purge all").click()  # not sent: "delete them" is unticked
    assert Job.objects.filter(id__in=[j.id for j in keyed]).count() == 2
    group.get_by_label("delete them").check()
    submit(page, group.get_by_role("button", name="Purge all"))
    assert "Purged 2 failed job(s)" in page.locator(".messagelist").inner_text()
    assert not Job.objects.filter(id__in=[j.id for j in keyed]).exists()
    assert page.locator("#awa-dead-letters tbody tr").count() == 1  # only the slow one left


def test_dead_letter_retry_needs_change_job_and_purge_needs_delete_job(client: Any):
    jobs = _failed("default", "act", "ValueError: boom", n=2)
    form = {"queue": "default", "kind": "act", "error": "ValueError: boom"}
    user = User.objects.create_user("looker", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(user)
    page = client.get(DEAD_LETTERS_URL).content.decode()
    assert (
        "ValueError: boom" in page
        and 'value="Retry all"' not in page
        and 'value="Purge all"' not in page
    )
    assert client.post(DEAD_LETTERS_URL, {**form, "operation": "retry"}).status_code == 403
    assert client.post(DEAD_LETTERS_URL, {**form, "operation": "purge"}).status_code == 403

    user.user_permissions.add(Permission.objects.get(codename="change_job"))
    client.force_login(User.objects.get(id=user.id))
    page = client.get(DEAD_LETTERS_URL).content.decode()
    assert 'value="Retry all"' in page and 'value="Purge all"' not in page
    assert client.post(DEAD_LETTERS_URL, {**form, "operation": "purge"}).status_code == 403
    assert Job.objects.filter(id__in=[j.id for j in jobs]).count() == 2
    bad = client.post(DEAD_LETTERS_URL, {**form, "operation": "explode"})
    assert bad.status_code == 400 and b"retry or purge" in bad.content
    assert client.post(DEAD_LETTERS_URL, {"operation": "retry"}).status_code == 400
    assert client.post(DEAD_LETTERS_URL, {**form, "operation": "retry"}).status_code == 302
    assert set(Job.objects.filter(id__in=[j.id for j in jobs]).values_list("state", flat=True)) == {
        JobState.AVAILABLE
    }

    user.user_permissions.add(Permission.objects.get(codename="delete_job"))
    client.force_login(User.objects.get(id=user.id))
    again = _failed("default", "act", "ValueError: boom", n=3)
    unconfirmed = client.post(DEAD_LETTERS_URL, {**form, "operation": "purge"})
    assert unconfirmed.status_code == 400 and b"confirm" in unconfirmed.content
    assert Job.objects.filter(id__in=[j.id for j in again]).count() == 3
    purge = {**form, "operation": "purge", "confirm": "yes"}
    assert client.post(DEAD_LETTERS_URL, purge).status_code == 302
    assert not Job.objects.filter(id__in=[j.id for j in again]).exists()
    assert Job.objects.filter(id__in=[j.id for j in jobs]).count() == 2  # retried: not failed


def _posted_forms(page: str) -> list[dict[str, str]]:
    """The hidden fields of each form on ``page``, as a browser posts them: its HTML
    parser reads a "\r" (or "\r\n") in an attribute as "\n", and form submission
    sends every line break as "\r\n"."""
    forms = re.findall(r'<form method="post"[^>]*>(.*?)</form>', page, re.S)
    hidden = r'<input type="hidden" name="([^"]*)" value="([^"]*)"'
    return [
        {name: re.sub(r"\r\n?|\n", "\r\n", html.unescape(value)) for name, value in fields}
        for fields in (re.findall(hidden, form) for form in forms)
    ]


def test_dead_letter_retry_and_purge_all_find_a_group_whose_error_line_ends_in_cr(
    client: Any,
    superuser: Any,  # noqa: F811
):
    """An exception message with CRLF is cut at "\n", so its line ends in "\r"."""
    gateway = "upstream said 502 Bad Gateway\r\n<html><body>bad gateway</body></html>"
    retried = _failed("default", "act", gateway, n=2)
    client.force_login(superuser)
    retry, _ = _posted_forms(client.get(DEAD_LETTERS_URL).content.decode())
    assert retry["operation"] == "retry"
    response = client.post(DEAD_LETTERS_URL, retry, follow=True)
    assert "Retried 2 failed job(s)" in " ".join(map(str, response.context["messages"]))
    assert set(
        Job.objects.filter(id__in=[j.id for j in retried]).values_list("state", flat=True)
    ) == {JobState.AVAILABLE}

    purged = _failed("default", "act", gateway, n=3)
    _, purge = _posted_forms(client.get(DEAD_LETTERS_URL).content.decode())
    assert purge["operation"] == "purge"
    response = client.post(DEAD_LETTERS_URL, {**purge, "confirm": "yes"}, follow=True)
    assert "Purged 3 failed job(s)" in " ".join(map(str, response.context["messages"]))
    assert not Job.objects.filter(id__in=[j.id for j in purged]).exists()
    nul = client.post(DEAD_LETTERS_URL, {**retry, "error": "%00"})
    assert nul.status_code == 400 and b"NUL" in nul.content


def test_dead_letters_read_only_the_newest_failed_rows_through_the_finalized_index(
    client: Any,
    superuser: Any,  # noqa: F811
):
    _failed("default", "act", "ValueError: boom", n=5)
    client.force_login(superuser)
    with CaptureQueriesContext(connection) as queries:
        page = client.get(DEAD_LETTERS_URL).content.decode()
    assert "7 days after they failed" in page  # the default FAILED_RETENTION
    grouping = [q["sql"] for q in queries if "GROUP BY f.queue" in q["sql"]]
    assert len(grouping) == 1 and "LIMIT 10000" in grouping[0]
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # as with a million rows
        cursor.execute("EXPLAIN " + grouping[0])
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")
    assert "awa_job_finalized_idx" in plan or "finalized" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_the_job_page_shows_times_to_the_second_the_wait_the_run_and_a_stale_attempt(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    due = dt.datetime(2026, 3, 4, 10, 0, 5, tzinfo=dt.UTC)
    done = make_job(
        state=JobState.COMPLETED, attempt=1, run_at=due, created_at=due,
        attempted_at=due + dt.timedelta(seconds=42), finalized_at=due + dt.timedelta(seconds=47.5),
    )  # fmt: skip
    now = timezone.now()
    stale = make_job(
        state=JobState.RUNNING, attempt=1, run_at=now - dt.timedelta(minutes=20),
        attempted_at=now - dt.timedelta(minutes=16), heartbeat_at=now - dt.timedelta(minutes=15),
        deadline_at=now - dt.timedelta(minutes=1),
    )  # fmt: skip
    page = login(superuser)
    page.goto(change_url(done))

    def field(name: str) -> str:
        return page.locator(f".fieldBox.field-{name} .readonly").inner_text()

    assert field("run_at_s") == "2026-03-04 10:00:05 UTC"
    assert field("attempted_at_s") == "2026-03-04 10:00:47 UTC"
    assert field("waited") == "42s"
    assert field("ran") == "5.50s"

    page.goto(change_url(stale))
    assert "not held: deadline passed" in field("state_badge"), field("state_badge")
    assert field("waited") == "4m 00s"
    assert field("ran").startswith("16m ")
    page.goto(f"{JOBS_URL}?state__exact=running")
    row = page.locator("#result_list tbody tr")
    assert "not held" in row.locator("td.field-state_badge").inner_text()
    assert row.locator("td.field-run_at_short").inner_text() == (
        timezone.localtime(stale.run_at).strftime("%Y-%m-%d %H:%M:%S")
    )


def test_the_queue_page_shows_oldest_due_paused_since_live_workers_and_separators(
    login: Any,  # noqa: F811
    superuser: Any,  # noqa: F811
):
    Job.objects.bulk_create(
        [Job(kind="act", queue="bulk", args={}, state=JobState.COMPLETED) for _ in range(1234)]
    )
    make_job(queue="default", run_at=timezone.now() - dt.timedelta(minutes=5))
    Maintenance().count_jobs()  # what the oldest due age is read from
    awa.pause_queue("bulk")
    Worker.objects.create(
        id=uuid.uuid4(), name="h:1", host="h", pid=1, queues={"default": 4}, concurrency=4
    )
    page = login(superuser)
    page.goto(QUEUES_URL)
    default = page.locator('tr[data-queue="default"]')
    bulk = page.locator('tr[data-queue="bulk"]')
    assert bulk.locator('td[data-state="completed"]').inner_text() == "1,234"
    assert bulk.locator("td.total").inner_text() == "1,234"
    assert default.locator("td.status").inner_text() == "running"  # a live worker serves it
    assert bulk.locator("td.status .paused-since").inner_text().startswith("since 20")
    assert default.locator("td.oldest-due").inner_text().startswith("5m ")
    assert bulk.locator("td.oldest-due").inner_text() == "-"
    Worker.objects.update(last_seen_at=timezone.now() - dt.timedelta(minutes=5))
    page.reload()
    assert default.locator("td.status").inner_text() == "no live worker"


def test_a_group_retry_reopens_the_dependents_a_failure_cancelled_and_names_unique_conflicts(
    client: Any,
    superuser: Any,  # noqa: F811
):
    from django.db import transaction

    from django_awa.testing import run_jobs

    with transaction.atomic():
        flow = awa.Workflow("dead-letter-retry")
        first = flow.add(Act(action="terminal"))
        flow.add(Act(action="ok"), after=[first])
        first_job, then_job = flow.enqueue()
    run_jobs(queue="default")
    first_job.refresh_from_db()
    then_job.refresh_from_db()
    assert (first_job.state, then_job.state) == (JobState.FAILED, JobState.CANCELLED)
    error = first_job.errors[-1]["error"].split("\n")[0]
    # Two failed jobs with one unique key: the second cannot be retried while the
    # first holds it again, and the page says so; the rest of the group is retried.
    keyed = _failed("default", "act", error, n=2)
    Job.objects.filter(id__in=[j.id for j in keyed]).update(
        unique_key="k", unique_states=["available", "running", "scheduled", "retryable"]
    )
    client.force_login(superuser)
    form = {"queue": "default", "kind": "act", "error": error, "operation": "retry"}
    response = client.post(DEAD_LETTERS_URL, form, follow=True)
    text = response.content.decode()
    assert "Retried 2 failed job(s)" in text, text
    assert "unique key" in text
    first_job.refresh_from_db()
    then_job.refresh_from_db()
    assert first_job.state == JobState.AVAILABLE and first_job.attempt == 0
    assert then_job.state == JobState.BLOCKED  # waits for it again
    states = sorted(
        Job.objects.filter(id__in=[j.id for j in keyed]).values_list("state", flat=True)
    )
    assert states == [JobState.AVAILABLE, JobState.FAILED]
