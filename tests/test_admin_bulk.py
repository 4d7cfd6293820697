"""The admin's bulk operations over the list's filter (bulk_admin.py), in Chromium."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.db.models import Count
from django.urls import reverse

from django_awa.models import Job, JobState
from tests.conftest import make_job
from tests.test_admin import (  # noqa: F401 (fixtures)
    JOBS_URL,
    browser,
    failed_job,
    login,
    messages,
    submit,
    superuser,
    viewer,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

pytestmark = pytest.mark.django_db(transaction=True)


def bulk_url(operation: str, query: str = "") -> str:
    return reverse("admin:django_awa_job_bulk", args=[operation]) + (f"?{query}" if query else "")


def offered(page: Page) -> list[str]:
    return page.locator("#awa-bulk a.awa-bulk-link").all_inner_texts()


def insert_failed(count: int, queue: str) -> None:
    """``count`` failed jobs in one set-based statement."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job (kind, queue, args, state, attempt, max_attempts,
                                 finalized_at, attempted_at, errors)
            SELECT 'act', %s, '{"action": "ok"}', 'failed', 3, 3, now(), now(),
                   '[{"attempt": 3, "at": "x", "error": "ValueError: boom", "traceback": ""}]'
            FROM generate_series(1, %s)
            """,
            [queue, count],
        )


@pytest.mark.slow
def test_bulk_retry_over_a_filter_of_100000_failed_jobs(
    login: Callable[[User], Page],  # noqa: F811 (the fixtures of test_admin.py)
    superuser: User,  # noqa: F811
) -> None:
    insert_failed(100_000, "bulk")
    others = [failed_job(queue="other") for _ in range(3)]
    done = make_job(queue="bulk", state=JobState.COMPLETED, attempt=1)
    page = login(superuser)

    page.goto(f"{JOBS_URL}?state__exact=failed&queue=bulk")
    assert offered(page) == ["Retry…", "Cancel…", "Move to queue…", "Change priority…", "Discard…"]
    submit(page, page.locator("#awa-bulk").get_by_text("Retry…"))
    assert "100,000 jobs will be touched" in page.locator("#awa-bulk-count").inner_text()
    page.set_default_timeout(120_000)  # the request runs the 50 batches
    submit(page, page.locator("#awa-bulk-confirm"))
    page.set_default_timeout(10_000)
    assert "Retried 100,000 job(s) in 100 batch(es)." in messages(page)
    # Back on the list with the same filter: nothing failed is left there.
    assert page.url.endswith("?state__exact=failed&queue=bulk")
    assert page.locator("#result_list tbody tr").count() == 0

    by_state = dict(Job.objects.filter(queue="bulk").values_list("state").annotate(n=Count("id")))
    assert by_state == {"available": 100_000, "completed": 1}
    assert Job.objects.filter(queue="bulk", state="available").exclude(attempt=0).count() == 0
    assert {j.state for j in Job.objects.filter(id__in=[o.id for o in others])} == {"failed"}
    assert Job.objects.get(id=done.id).state == "completed"


def test_bulk_move_priority_cancel_and_discard_over_a_search(
    login: Callable[[User], Page],  # noqa: F811 (the fixtures of test_admin.py)
    superuser: User,  # noqa: F811
) -> None:
    mail = [make_job(kind="send_mail", queue="slow") for _ in range(3)]
    other = make_job(kind="resize", queue="slow")
    page = login(superuser)

    # Over a search, not a filter: every job whose kind matches "mail".
    page.goto(f"{JOBS_URL}?q=mail")
    submit(page, page.locator("#awa-bulk").get_by_text("Move to queue…"))
    assert "3 jobs will be touched" in page.locator("#awa-bulk-count").inner_text()
    page.fill("#awa-bulk-queue", "fast")
    submit(page, page.locator("#awa-bulk-confirm"))
    assert "Moved 3 job(s) in 1 batch(es)." in messages(page)
    assert {j.queue for j in Job.objects.filter(id__in=[m.id for m in mail])} == {"fast"}
    assert Job.objects.get(id=other.id).queue == "slow"

    page.goto(f"{JOBS_URL}?queue=fast")
    submit(page, page.locator("#awa-bulk").get_by_text("Change priority…"))
    page.select_option("#awa-bulk-priority", "1")
    submit(page, page.locator("#awa-bulk-confirm"))
    assert {j.priority for j in Job.objects.filter(queue="fast")} == {1}

    submit(page, page.locator("#awa-bulk").get_by_text("Cancel…"))
    submit(page, page.locator("#awa-bulk-confirm"))
    assert "Cancelled 3 job(s) in 1 batch(es)." in messages(page)
    assert {j.state for j in Job.objects.filter(queue="fast")} == {"cancelled"}
    assert "in admin by admin (bulk)" in Job.objects.filter(queue="fast")[0].errors[-1]["error"]

    submit(page, page.locator("#awa-bulk").get_by_text("Discard…"))
    submit(page, page.locator("#awa-bulk-confirm"))
    assert "Discarded 3 job(s) in 1 batch(es)." in messages(page)
    assert not Job.objects.filter(queue="fast").exists()
    assert Job.objects.filter(id=other.id).exists()


def test_bulk_operations_are_offered_and_allowed_by_permission(
    login: Callable[[User], Page],  # noqa: F811
    viewer: User,  # noqa: F811
) -> None:
    job = failed_job(queue="perm")
    page = login(viewer)
    page.goto(f"{JOBS_URL}?queue=perm")
    assert offered(page) == []  # view_job only: no bulk operation at all
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    for operation in ("retry", "cancel", "move", "priority", "discard"):
        assert page.request.get(bulk_url(operation, "queue=perm")).status == 403
        response = page.request.post(
            bulk_url(operation, "queue=perm"),
            form={"csrfmiddlewaretoken": csrf, "up_to": str(job.id), "queue": "x", "priority": "1"},
        )
        assert response.status == 403, operation

    # change_job without delete_job: all but discard.
    viewer.user_permissions.add(Permission.objects.get(codename="change_job"))
    page.goto(f"{JOBS_URL}?queue=perm")
    assert offered(page) == ["Retry…", "Cancel…", "Move to queue…", "Change priority…"]
    response = page.request.post(
        bulk_url("discard", "queue=perm"), form={"csrfmiddlewaretoken": csrf, "up_to": str(job.id)}
    )
    assert response.status == 403
    assert Job.objects.get(id=job.id).state == JobState.FAILED

    # Bad values are refused, nothing written.
    viewer.user_permissions.add(Permission.objects.get(codename="delete_job"))
    for operation, form in (
        ("move", {"queue": "no spaces allowed"}),
        ("priority", {"priority": "9"}),
        ("retry", {"up_to": "12x"}),
    ):
        response = page.request.post(
            bulk_url(operation, "queue=perm"),
            form={"csrfmiddlewaretoken": csrf, "up_to": str(job.id), **form},
        )
        assert response.status == 400, operation
    assert page.request.get(bulk_url("frobnicate")).status == 404
    row = Job.objects.get(id=job.id)
    assert (row.queue, row.priority, row.state) == ("perm", job.priority, JobState.FAILED)
