"""The admin of SPEC §8 in a real browser: Playwright on Debian's Chromium, live_server.

Every test works the pages as an operator would (filters, search, links,
actions, buttons) and checks the database afterwards.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis
import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape
from hypothesis import strategies as st

from django_awa import admin as awa_admin
from django_awa.models import Job, JobState, PendingFollowup, PeriodicSchedule, Queue
from tests.browser import chromium
from tests.conftest import make_job

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

# Playwright's sync API keeps an event loop running in this thread; the ORM
# calls the tests make between page actions are still plain synchronous code.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

pytestmark = pytest.mark.django_db(transaction=True)

JOBS_URL = "/admin/django_awa/job/"
# Screenshots of the job list and a job page, to look at: /tmp/awa-admin-*.png.
SCREENSHOTS = Path(os.environ.get("AWA_SCREENSHOT_DIR", tempfile.gettempdir()))
QUEUES_URL = "/admin/django_awa/queue/"


def change_url(job: Job) -> str:
    return reverse("admin:django_awa_job_change", args=[job.id])


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


@pytest.fixture
def superuser(transactional_db: Any) -> User:
    return User.objects.create_superuser("admin", "admin@example.com", password=None)


@pytest.fixture
def viewer(transactional_db: Any) -> User:
    """Staff with ``view_job`` only: may look, may not retry, cancel or discard."""
    user = User.objects.create_user("viewer", "viewer@example.com", password=None, is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    return user


@pytest.fixture
def login(browser: Browser, live_server: Any) -> Iterator[Callable[[User], Page]]:
    """A browser page logged in as a user (a session cookie: no password hashing)."""
    contexts = []

    def login_as(user: User) -> Page:
        client = Client()
        client.force_login(user)
        context = browser.new_context(
            base_url=live_server.url, viewport={"width": 1400, "height": 900}
        )
        contexts.append(context)
        session = client.cookies[settings.SESSION_COOKIE_NAME].value
        context.add_cookies(
            [{"name": settings.SESSION_COOKIE_NAME, "value": session, "url": live_server.url}]
        )
        page = context.new_page()
        page.set_default_timeout(10_000)
        page.goto("/admin/")
        assert page.locator("#user-tools").get_by_text(user.username).count() == 1
        return page

    yield login_as
    for context in contexts:
        context.close()


def result_ids(page: Page) -> list[int]:
    """Job ids of the change list rows, top to bottom."""
    return [
        int(text) for text in page.locator("#result_list tbody th.field-id a").all_inner_texts()
    ]


def submit(page: Page, target: Locator) -> None:
    """Click ``target`` and wait for the page it loads (often the same URL again)."""
    with page.expect_navigation():
        target.click()


def click_filter(page: Page, title: str, choice: str) -> None:
    links = page.locator(f'#changelist-filter details[data-filter-title="{title}"] a')
    submit(page, links.get_by_text(choice, exact=True))


def run_action(page: Page, action: str, job_ids: list[int]) -> None:
    for job_id in job_ids:
        page.check(f'input.action-select[value="{job_id}"]')
    page.select_option("select[name=action]", action)
    submit(page, page.locator("button[name=index]"))


def messages(page: Page) -> list[str]:
    return page.locator("ul.messagelist li").all_inner_texts()


def failed_job(**fields: Any) -> Job:
    now = timezone.now()
    return make_job(
        **{
            "state": JobState.FAILED,
            "attempt": 3,
            "max_attempts": 3,
            "finalized_at": now,
            "attempted_at": now,
            "errors": [
                {"attempt": 3, "at": now.isoformat(), "error": "ValueError: boom", "traceback": ""}
            ],
            **fields,
        }
    )


def test_list_columns_filters_and_search(login: Callable[[User], Page], superuser: User) -> None:
    available = [make_job(kind="act", queue="default") for _ in range(3)]
    failed = [failed_job(kind="echo", queue="mail", args={"n": i}) for i in range(2)]
    mail_available = make_job(kind="echo", queue="mail", args={"n": 9}, priority=1)
    completed = make_job(kind="act", state=JobState.COMPLETED, finalized_at=timezone.now())
    page = login(superuser)

    page.goto(JOBS_URL)
    headers = page.locator("#result_list thead th").all_inner_texts()
    for column in ("ID", "KIND", "QUEUE", "STATE", "PRIORITY", "ATTEMPT", "RUN AT", "FINALIZED AT"):
        assert column in [h.strip().upper() for h in headers], headers
    assert result_ids(page) == sorted(
        [j.id for j in [*available, *failed, mail_available, completed]], reverse=True
    )
    row = page.locator("#result_list tbody tr").filter(
        has=page.locator(f'a:text-is("{failed[0].id}")')
    )
    assert row.locator("td.field-attempts").inner_text() == "3/3"
    assert row.locator("td.field-state_badge .awa-state-failed").inner_text() == "Failed"
    page.screenshot(path=SCREENSHOTS / "awa-admin-list.png", full_page=True)

    click_filter(page, "state", "Failed")
    assert sorted(result_ids(page)) == sorted(j.id for j in failed)
    click_filter(page, "state", "All")
    click_filter(page, "queue", "mail")
    assert sorted(result_ids(page)) == sorted([*(j.id for j in failed), mail_available.id])
    click_filter(page, "kind", "act")  # narrows within queue "mail": none
    assert result_ids(page) == []
    click_filter(page, "queue", "All")
    assert sorted(result_ids(page)) == sorted([*(j.id for j in available), completed.id])

    page.goto(JOBS_URL)
    page.fill("#searchbar", str(failed[1].id))
    with page.expect_navigation():
        page.press("#searchbar", "Enter")
    assert result_ids(page) == [failed[1].id]
    page.fill("#searchbar", "mail")
    with page.expect_navigation():
        page.press("#searchbar", "Enter")
    assert sorted(result_ids(page)) == sorted([*(j.id for j in failed), mail_available.id])

    # The "Failed jobs" shortcut is the list filtered to state=failed.
    page.goto(JOBS_URL)
    submit(page, page.locator(".object-tools").get_by_text("Failed jobs"))
    assert sorted(result_ids(page)) == sorted(j.id for j in failed)


def test_detail_shows_args_errors_progress_and_followup_chain_both_ways(
    login: Callable[[User], Page], superuser: User
) -> None:
    now = timezone.now()
    trigger = make_job(
        kind="act",
        args={"action": "raise", "tag": "nested", "fail_until": 2},
        state=JobState.FAILED,
        attempt=2,
        max_attempts=2,
        finalized_at=now,
        progress={"percent": 40, "message": "halfway there"},
        errors=[
            {
                "attempt": 1,
                "at": (now - dt.timedelta(minutes=1)).isoformat(),
                "error": "ValueError: first failure",
                "traceback": 'Traceback (most recent call last):\n  File "handler.py", line 10\n'
                "ValueError: first failure",
            },
            {
                "attempt": 2,
                "at": now.isoformat(),
                "error": "ValueError: second failure",
                "traceback": 'Traceback (most recent call last):\n  File "handler.py", line 12\n'
                "ValueError: second failure",
            },
        ],
    )
    lineage = {"job_id": trigger.id, "kind": "act", "outcome": "exhausted"}
    followup = make_job(kind="echo", args={"n": trigger.id}, metadata={"awa_trigger": lineage})
    other = make_job(kind="echo", args={"n": 0})  # enqueued directly: in no chain
    page = login(superuser)

    page.goto(change_url(trigger))
    args = page.locator(".field-args_json pre").inner_text()
    assert '"action": "raise"' in args
    assert '"fail_until": 2' in args
    errors = page.locator(".field-error_list li.awa-error")
    assert errors.count() == 2
    assert "Attempt 1" in errors.nth(0).inner_text()
    assert (
        "ValueError: first failure" in errors.nth(0).locator("pre.awa-error-message").inner_text()
    )
    assert "line 10" in errors.nth(0).locator("pre.awa-traceback").inner_text()
    assert "second failure" in errors.nth(1).inner_text()
    assert "line 12" in errors.nth(1).locator("pre.awa-traceback").inner_text()
    assert errors.nth(1).locator("pre.awa-traceback").is_visible()
    assert "halfway there" in page.locator(".field-progress_json").inner_text()
    assert page.locator("input[name=_save]").count() == 0  # read-only page
    assert "no trigger" in page.locator(".field-trigger_link").inner_text()
    followup_links = page.locator(".field-followup_links a")
    assert followup_links.all_inner_texts() == [f"echo #{followup.id}"]
    page.screenshot(path=SCREENSHOTS / "awa-admin-detail.png", full_page=True)

    followup_links.first.click()
    page.wait_for_url(f"**{change_url(followup)}")
    trigger_cell = page.locator(".field-trigger_link")
    assert "exhausted" in trigger_cell.inner_text()
    assert '"awa_trigger"' in page.locator(".field-metadata_json").inner_text()
    trigger_cell.get_by_role("link", name=f"act #{trigger.id}").click()
    page.wait_for_url(f"**{change_url(trigger)}")
    assert "first failure" in page.locator(".field-error_list").inner_text()

    page.goto(change_url(other))
    assert "no trigger" in page.locator(".field-trigger_link").inner_text()
    assert page.locator(".field-followup_links").inner_text().strip().endswith("(none)")


def test_retry_action_makes_failed_job_available_with_attempts_reset(
    login: Callable[[User], Page], superuser: User
) -> None:
    failed = failed_job()
    completed = make_job(state=JobState.COMPLETED, attempt=1, finalized_at=timezone.now())
    page = login(superuser)
    page.goto(JOBS_URL)
    before = timezone.now()

    run_action(page, "retry_jobs", [failed.id, completed.id])

    failed.refresh_from_db()
    assert failed.state == JobState.AVAILABLE
    assert failed.attempt == 0
    assert failed.finalized_at is None
    assert before - dt.timedelta(seconds=5) <= failed.run_at <= timezone.now()
    completed.refresh_from_db()
    assert completed.state == JobState.COMPLETED
    assert any("Retried 1 job." in m for m in messages(page))
    assert any("1 job was not retried" in m for m in messages(page))


def test_cancel_action_cancels_available_job_with_an_errors_entry(
    login: Callable[[User], Page], superuser: User
) -> None:
    job = make_job(kind="act", args={"action": "ok"})
    untouched = make_job(kind="act", args={"action": "ok"})
    page = login(superuser)
    page.goto(JOBS_URL)

    run_action(page, "cancel_jobs", [job.id])

    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert job.finalized_at is not None
    assert job.errors[-1]["error"] == "cancelled: cancelled in admin by admin"
    untouched.refresh_from_db()
    assert untouched.state == JobState.AVAILABLE
    assert any("Cancelled 1 job." in m for m in messages(page))
    # Act's on_cancelled follow-up was enqueued with the cancel.
    assert [f.kind for f in job.followups()] == ["echo"]


def test_detail_page_retry_and_cancel_buttons(
    login: Callable[[User], Page], superuser: User
) -> None:
    job = make_job(kind="echo", args={"n": 1})
    page = login(superuser)
    page.goto(change_url(job))
    assert page.get_by_role("button", name="Retry now").count() == 0  # available: nothing to retry

    submit(page, page.get_by_role("button", name="Cancel job"))
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert page.locator(".field-state_badge .awa-state").inner_text() == "Cancelled"

    submit(page, page.get_by_role("button", name="Retry now"))
    job.refresh_from_db()
    assert (job.state, job.attempt) == (JobState.AVAILABLE, 0)
    assert any("Retried 1 job." in m for m in messages(page))


def test_discard_action_deletes_after_confirmation(
    login: Callable[[User], Page], superuser: User
) -> None:
    doomed = failed_job()
    kept = failed_job()
    page = login(superuser)
    page.goto(JOBS_URL)

    run_action(page, "discard_jobs", [doomed.id])
    assert "Discard (delete) 1 job?" in page.locator("#content").inner_text()
    assert Job.objects.filter(id=doomed.id).exists()  # not before confirming
    submit(page, page.get_by_role("button", name="Yes, discard"))

    assert not Job.objects.filter(id=doomed.id).exists()
    assert Job.objects.filter(id=kept.id).exists()
    assert any("Discarded 1 job." in m for m in messages(page))
    assert result_ids(page) == [kept.id]


def test_limited_user_is_neither_offered_nor_allowed_the_actions(
    login: Callable[[User], Page], viewer: User
) -> None:
    failed = failed_job()
    available = make_job()
    page = login(viewer)

    page.goto(JOBS_URL)
    assert sorted(result_ids(page)) == sorted([failed.id, available.id])  # may look
    offered = page.locator("select[name=action] option").evaluate_all(
        "options => options.map(o => o.value)"
    )
    for name in ("retry_jobs", "cancel_jobs", "discard_jobs", "delete_selected"):
        assert name not in offered
    assert page.locator("input.action-select").count() == 0  # no action at all: no checkboxes
    page.goto(change_url(failed))
    assert page.get_by_role("button", name="Retry now").count() == 0
    assert page.get_by_role("button", name="Cancel job").count() == 0

    # Forged POSTs with the viewer's valid session and CSRF token.
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    for action, job in (
        ("retry_jobs", failed),
        ("cancel_jobs", available),
        ("discard_jobs", failed),
    ):
        response = page.request.post(
            JOBS_URL,
            form={
                "csrfmiddlewaretoken": csrf,
                "action": action,
                "index": "0",
                "select_across": "0",
                "_selected_action": str(job.id),
                "confirm": "yes",
            },
        )
        assert response.status in (200, 403), response.status
    for url in (f"{change_url(failed)}retry/", f"{change_url(available)}cancel/"):
        response = page.request.post(url, form={"csrfmiddlewaretoken": csrf})
        assert response.status == 403
    response = page.request.post(
        QUEUES_URL, form={"csrfmiddlewaretoken": csrf, "queue": "default", "operation": "pause"}
    )
    assert response.status == 403

    failed.refresh_from_db()
    available.refresh_from_db()
    assert (failed.state, failed.attempt) == (JobState.FAILED, 3)
    assert available.state == JobState.AVAILABLE
    assert available.errors == []
    assert Job.objects.count() == 2
    assert not Queue.objects.filter(paused=True).exists()


def test_queue_overview_counts_and_pause_resume(
    login: Callable[[User], Page], superuser: User
) -> None:
    make_job(queue="default")
    make_job(queue="default")
    failed_job(queue="default")
    make_job(queue="mail", state=JobState.COMPLETED, finalized_at=timezone.now())
    page = login(superuser)

    page.goto("/admin/django_awa/")
    # The shortcuts lead to filtered job lists the app's list of pages does not.
    shortcuts = page.locator("#awa-shortcuts")
    assert shortcuts.get_by_role("link").all_inner_texts() == [
        "Failed jobs",
        "Running jobs",
        "Jobs waiting for a callback",
        "Jobs waiting for their dependencies",
    ]
    shortcuts.get_by_role("link", name="Failed jobs").click()
    page.wait_for_url("**/job/?state__exact=failed")
    assert page.locator("#result_list tbody tr").count() == 1
    page.goto("/admin/django_awa/")
    page.locator("#content-main").get_by_role("link", name="Queues", exact=True).click()
    page.wait_for_url(f"**{QUEUES_URL}")
    default = page.locator('tr[data-queue="default"]')
    mail = page.locator('tr[data-queue="mail"]')
    assert default.locator('td[data-state="available"]').inner_text() == "2"
    assert default.locator('td[data-state="failed"]').inner_text() == "1"
    assert default.locator("td.total").inner_text() == "3"
    assert mail.locator('td[data-state="completed"]').inner_text() == "1"
    # No worker is alive: the queue is not said to run (test_admin_triage.py has one alive).
    assert default.locator("td.status").inner_text() == "no live worker"

    submit(page, default.get_by_role("button", name="Pause"))
    assert Queue.objects.get(name="default").paused
    assert default.locator("td.status").inner_text().startswith("paused")
    assert mail.locator("td.status").inner_text() == "no live worker"
    assert any("Paused queue default" in m for m in messages(page))

    submit(page, default.get_by_role("button", name="Resume"))
    assert not Queue.objects.get(name="default").paused
    assert default.locator("td.status").inner_text() == "no live worker"

    submit(page, default.locator('td[data-state="failed"] a'))
    assert len(result_ids(page)) == 1


def test_pending_followups_and_periodic_schedules_are_listed_read_only(
    login: Callable[[User], Page], superuser: User
) -> None:
    job = make_job(kind="act", state=JobState.RETRYABLE, attempt=1)
    pending = PendingFollowup.objects.create(
        job_id=job.id,
        kind="act",
        outcome="rescued",
        context={"reason": "stale_heartbeat"},
        snapshot={"id": job.id},
        attempts=4,
        last_error="RuntimeError: rescued follow-up exploded",
    )
    PeriodicSchedule.objects.create(name="nightly-report", cron="0 3 * * *", kind="act")
    page = login(superuser)

    page.goto(JOBS_URL)
    submit(page, page.locator(".object-tools").get_by_text("Pending follow-ups"))
    row = page.locator("#result_list tbody tr")
    assert row.count() == 1
    assert "rescued follow-up exploded" in row.inner_text()
    assert row.locator("td.field-attempts").inner_text() == "4"
    assert page.locator(".object-tools a.addlink").count() == 0
    row.get_by_role("link", name=f"#{job.id}").click()
    page.wait_for_url(f"**{change_url(job)}")

    page.goto(reverse("admin:django_awa_pendingfollowup_change", args=[pending.id]))
    assert "stale_heartbeat" in page.locator(".field-context_json").inner_text()
    assert page.locator("input[name=_save]").count() == 0

    page.goto(JOBS_URL)
    submit(page, page.locator(".object-tools").get_by_text("Periodic schedules"))
    assert "nightly-report" in page.locator("#result_list").inner_text()
    assert "0 3 * * *" in page.locator("#result_list").inner_text()


def test_job_list_queries_do_not_grow_with_rows(
    client: Any, superuser: User, django_assert_max_num_queries: Any
) -> None:
    """No per-row queries: one page of 50 costs what a page of 2 does."""
    client.force_login(superuser)
    parent = make_job()
    make_job(metadata={"awa_trigger": {"job_id": parent.id, "kind": "act", "outcome": "completed"}})
    with django_assert_max_num_queries(100) as small:
        assert client.get(JOBS_URL).status_code == 200
    for i in range(60):
        make_job(kind=f"kind{i % 7}", queue=f"q{i % 3}", state=JobState.FAILED, tags=["t"])
    with django_assert_max_num_queries(len(small.captured_queries)):
        response = client.get(JOBS_URL)
    assert response.status_code == 200
    assert response.content.count(b'class="action-select"') == 50


def test_job_list_on_a_large_table_reads_catalogs_not_rows(
    client: Any, superuser: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SMALL_TABLE_BYTES the filter choices and the count come from the catalogs."""
    monkeypatch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
    monkeypatch.setattr(awa_admin, "ESTIMATE_ABOVE", 1)
    for _ in range(3):
        failed_job(kind="legacy_kind", queue="archive")
    make_job(kind="echo", queue="mail")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE awa_job")
    client.force_login(superuser)

    with CaptureQueriesContext(connection) as queries:
        response = client.get(JOBS_URL)

    assert response.status_code == 200
    html = response.content.decode()
    for choice in ("?queue=archive", "?queue=mail", "?kind=legacy_kind", "?kind=echo"):
        assert f'href="{choice}"' in html, choice
    reads = [q["sql"] for q in queries.captured_queries if re.search(r'FROM "?awa_job\b', q["sql"])]
    assert reads  # the page of rows itself
    assert not [sql for sql in reads if re.search(r"DISTINCT|COUNT\(", sql, re.IGNORECASE)]
    assert response.context["cl"].result_count == 4  # reltuples after ANALYZE


def test_running_jobs_no_worker_holds_any_more_are_marked(client: Any, superuser: User) -> None:
    now = timezone.now()
    held = make_job(
        state=JobState.RUNNING, heartbeat_at=now, deadline_at=now + dt.timedelta(seconds=60)
    )
    overdue = make_job(
        state=JobState.RUNNING, heartbeat_at=now, deadline_at=now - dt.timedelta(seconds=42)
    )
    silent = make_job(state=JobState.RUNNING, heartbeat_at=now - dt.timedelta(seconds=90))
    client.force_login(superuser)
    html = client.get(JOBS_URL, {"state__exact": JobState.RUNNING}).content.decode()
    rows = {
        int(match[1]): match[2]
        for match in re.finditer(r'<tr>.*?/job/(\d+)/change/.*?field-state_badge">(.*?)</td>', html)
    }
    assert "not held" not in rows[held.id]
    assert re.search(r"not held: deadline passed 4\ds ago", rows[overdue.id]), rows[overdue.id]
    assert re.search(r"not held: no heartbeat for 9\ds", rows[silent.id]), rows[silent.id]


# -- odd input: a 4xx or a page, never a 500 (issue 16) ------------------------------


def nested(depth: int) -> str:
    """JSON text of lists nested ``depth`` deep around a marker string."""
    return "[" * depth + '"the-innermost-value"' + "]" * depth


def readonly_value(html: str, field: str) -> str:
    """The text a job page shows for a read-only field that shares its row."""
    found = re.search(rf'fieldBox field-{field}".*?<div class="readonly">(.*?)</div>', html, re.S)
    assert found is not None, field
    return found[1]


def deep_row(depth: int) -> Job:
    """A job whose args and callback payload are nested ``depth`` deep, written with raw
    SQL as an older release or another program might have left it."""
    job = make_job(kind="act", state=JobState.COMPLETED, finalized_at=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE awa_job SET args = %(deep)s::jsonb, metadata = jsonb_build_object("
            "'awa_callback_result', %(deep)s::jsonb) WHERE id = %(id)s",
            {"deep": nested(depth), "id": job.id},
        )
    return job


@pytest.mark.parametrize(
    "query",
    [
        "kind=%00",
        "queue=%00",
        "state__exact=%00",
        "state__exact=failed&kind=a%00b",
        "q=%00",
        "trigger=%00",
        "%00=1",
    ],
)
def test_a_list_filter_postgres_cannot_hold_is_400(
    client: Any, superuser: User, query: str
) -> None:
    make_job()
    client.force_login(superuser)
    response = client.get(f"{JOBS_URL}?{query}")
    assert response.status_code == 400, response.content[:300]
    assert b"NUL" in response.content
    for url in ("/admin/django_awa/pendingfollowup/", "/admin/django_awa/periodicschedule/"):
        assert client.get(f"{url}?{query}").status_code == 400


@pytest.mark.parametrize("value", ["²", "١٢", "1²", "-1", "1.0", " 1", "99999999999999999999"])
def test_a_trigger_that_is_not_a_job_id_is_400(client: Any, superuser: User, value: str) -> None:
    make_job()
    client.force_login(superuser)
    response = client.get(JOBS_URL, {"trigger": value})
    assert response.status_code == 400, response.content[:300]
    assert b"job id" in response.content


def test_search_by_a_digit_that_is_not_ascii_is_a_text_search(client: Any, superuser: User) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` raises: ``²`` is searched as text."""
    plain = make_job(kind="act")
    squared = make_job(kind="area_m²")
    client.force_login(superuser)
    for term, expected in (
        ("²", [squared.id]),
        ("#²", []),
        (str(plain.id), [plain.id]),
        (f"#{squared.id}", [squared.id]),
        ("99999999999999999999", []),
    ):
        response = client.get(JOBS_URL, {"q": term})
        assert response.status_code == 200, term
        assert [job.id for job in response.context["cl"].result_list] == expected, term


@pytest.mark.parametrize("object_id", ["%C2%B2", "1%C2%B2", "%D9%A1", "99999999999999999999"])
@pytest.mark.parametrize("operation", ["retry", "cancel"])
def test_retry_or_cancel_of_an_odd_job_id_is_400_and_changes_nothing(
    client: Any, superuser: User, object_id: str, operation: str
) -> None:
    job = failed_job() if operation == "retry" else make_job()
    before = Job.objects.filter(id=job.id).values()[0]
    client.force_login(superuser)
    response = client.post(f"{JOBS_URL}{object_id}/{operation}/")
    assert response.status_code == 400, response.content[:300]
    assert Job.objects.filter(id=job.id).values()[0] == before


@pytest.mark.parametrize("selected", ["²", "\x00", "1\x00", "99999999999999999999"])
def test_an_action_on_odd_job_ids_is_400_and_changes_nothing(
    client: Any, superuser: User, selected: str
) -> None:
    job = failed_job()
    before = Job.objects.filter(id=job.id).values()[0]
    client.force_login(superuser)
    response = client.post(
        JOBS_URL,
        {"action": "retry_jobs", "index": "0", "_selected_action": [str(job.id), selected]},
    )
    assert response.status_code == 400, response.content[:300]
    assert Job.objects.filter(id=job.id).values()[0] == before


@pytest.mark.parametrize(
    "url",
    [
        f"{JOBS_URL}%00/change/",
        f"{JOBS_URL}%C2%B2/change/",
        "/admin/django_awa/pendingfollowup/%00/change/",
        "/admin/django_awa/periodicschedule/%00/change/",
        "/admin/django_awa/periodicschedule/a%00b/change/",
    ],
)
def test_an_object_id_postgres_cannot_hold_is_not_found(
    client: Any, superuser: User, url: str
) -> None:
    client.force_login(superuser)
    response = client.get(url, follow=True)
    assert response.status_code == 200
    assert any("exist" in str(m) for m in response.context["messages"])


def test_a_queue_name_postgres_cannot_hold_is_400(client: Any, superuser: User) -> None:
    client.force_login(superuser)
    response = client.post(QUEUES_URL, {"queue": "mail\x00", "operation": "pause"})
    assert response.status_code == 400
    assert not Queue.objects.exists()


SCRIPT = "<script>alert(document.cookie)</script>"
QUOTED_SCRIPT = "%3Cscript%3Ealert(document.cookie)%3C/script%3E"


@pytest.mark.parametrize(
    ("method", "url", "data"),
    [
        ("get", f"/admin/django_awa/dashboard/?window={QUOTED_SCRIPT}", None),
        ("get", f"{JOBS_URL}?trigger={QUOTED_SCRIPT}", None),
        ("get", f"{JOBS_URL}?{QUOTED_SCRIPT}%00=1", None),
        ("get", f"/admin/django_awa/periodicschedule/?{QUOTED_SCRIPT}%00=1", None),
        ("get", f"/admin/django_awa/pendingfollowup/?{QUOTED_SCRIPT}%00=1", None),
        ("get", f"{JOBS_URL}bulk/retry/?{QUOTED_SCRIPT}=1", None),
        ("post", f"{JOBS_URL}bulk/retry/", {"up_to": SCRIPT}),
        ("post", JOBS_URL, {"action": "retry_jobs", "index": "0", "_selected_action": SCRIPT}),
        ("post", "/admin/django_awa/deadletter/", {"operation": SCRIPT}),
    ],
)
def test_a_400_quoting_the_request_is_plain_text(
    client: Any, superuser: User, method: str, url: str, data: dict[str, str] | None
) -> None:
    """A refusal names what was sent, as text: never HTML a link could put a script in."""
    make_job()
    client.force_login(superuser)
    response = getattr(client, method)(url, data)
    assert response.status_code == 400, response.content[:300]
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert "<script>" in response.content.decode()  # named, so the operator sees what was wrong


@pytest.mark.parametrize("operation", ["pause", "resume"])
def test_pausing_a_queue_name_enqueue_refuses_shows_the_error_and_writes_nothing(
    client: Any, superuser: User, operation: str
) -> None:
    client.force_login(superuser)
    response = client.post(QUEUES_URL, {"queue": "<b>sp ace", "operation": operation}, follow=True)
    assert response.status_code == 200
    shown = [(m.level_tag, str(m)) for m in response.context["messages"]]
    assert shown == [
        (
            "error",
            f"{operation}_queue: invalid queue name '<b>sp ace': 1 to 128 letters, digits and "
            "_ . : -; nothing changed.",
        )
    ]
    assert escape("'<b>sp ace'") in response.content.decode()
    assert not Queue.objects.exists()


@pytest.mark.parametrize("depth", [950, 5000])
def test_deeply_nested_json_is_shown_and_the_list_still_loads(
    client: Any, superuser: User, depth: int
) -> None:
    deep = deep_row(depth)
    other = failed_job()
    client.force_login(superuser)

    response = client.get(JOBS_URL)
    assert response.status_code == 200
    assert {job.id for job in response.context["cl"].result_list} == {deep.id, other.id}

    response = client.get(change_url(deep))
    assert response.status_code == 200
    html = response.content.decode()
    # Compact JSON text, not pretty-printed 950 levels deep; cut, and saying so.
    assert "[[[[[[[[" in html
    assert "nested too deep" in html
    assert len(html) < 200_000
    assert client.get(change_url(other)).status_code == 200


def test_deep_json_text_in_a_short_page_shows_the_innermost_value(
    client: Any, superuser: User
) -> None:
    deep = deep_row(200)
    client.force_login(superuser)
    html = client.get(change_url(deep)).content.decode()
    assert html.count("the-innermost-value") == 2  # args and the callback payload


def test_json_is_pretty_printed_as_before() -> None:
    value = {"b": [1, 2.5, {"c": None}], "a": "ü <x>", "e": {}, "f": [], "t": True}
    html = str(awa_admin._pretty_json(value))
    expected = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    assert html == f'<pre class="awa-json">{escape(expected)}</pre>'


def test_the_chain_is_shown_both_ways_between_jobs_nested_too_deep_to_read(
    client: Any, superuser: User
) -> None:
    parent = deep_row(5000)
    child = make_job(kind="echo")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE awa_job SET args = %(deep)s::jsonb, tags = %(deep)s::jsonb, "
            "errors = %(deep)s::jsonb, metadata = jsonb_build_object('awa_trigger', "
            "jsonb_build_object('job_id', %(parent)s, 'kind', 'act', 'outcome', 'exhausted')) "
            "WHERE id = %(id)s",
            {"deep": nested(5000), "parent": parent.id, "id": child.id},
        )
    client.force_login(superuser)

    html = client.get(change_url(parent)).content.decode()
    assert f'<a href="{change_url(child)}">echo #{child.id}</a>' in html
    assert "on exhausted" in html

    response = client.get(change_url(child))
    assert response.status_code == 200
    html = response.content.decode()
    assert f'<a href="{change_url(parent)}">act #{parent.id}</a>' in html
    assert 'outcome <span class="awa-outcome">exhausted</span>' in html
    assert html.count("nested too deep") == 2  # args and errors
    tags = re.search(
        r'fieldBox field-tag_list.*?<div class="readonly">(.*?)</div>', html, re.DOTALL
    )
    assert tags is not None and tags[1].startswith("[[[[[[[[") and len(tags[1]) < 300


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda children: st.lists(children) | st.dictionaries(st.text(), children),
        max_leaves=30,
    )
)
def test_json_text_writes_what_json_dumps_writes(value: Any) -> None:
    for indent in (None, 2):
        expected = json.dumps(value, indent=indent, sort_keys=True, ensure_ascii=False)
        assert awa_admin.json_text(value, indent=indent) == expected
    compact = json.dumps(value, sort_keys=True, ensure_ascii=False)
    cut = compact if len(compact) <= 5 else compact[:5] + "…"
    assert awa_admin.json_text(value, limit=5) == cut


def test_queue_overview_shows_limits_held_back_jobs_and_rate_and_edits_limits(
    login: Callable[[User], Page], superuser: User
) -> None:
    now = timezone.now()
    # bykey: KeyedSpan's awa.Limit(concurrency=1, by="key"). Key a runs, so its
    # three due jobs are held back; key b's one is not.
    make_job(kind="keyed_span", queue="bykey", args={"key": "a"}, state=JobState.RUNNING,
             attempted_at=now, heartbeat_at=now)  # fmt: skip
    for key in "aaab":
        make_job(kind="keyed_span", queue="bykey", args={"key": key})
    for _ in range(6):
        make_job(queue="default", state=JobState.RUNNING, attempted_at=now, heartbeat_at=now)
    page = login(superuser)
    page.goto(QUEUES_URL)
    bykey = page.locator('tr[data-queue="bykey"]')
    assert bykey.locator('[data-limit="kind"]').inner_text() == "keyed_span: 1 at once, per key"
    assert bykey.locator("td.held-back").inner_text() == "3"
    default = page.locator('tr[data-queue="default"]')
    assert default.locator("td.held-back").inner_text() == "0"
    assert default.locator("td.rate").inner_text() == "0.1"  # 6 starts in the last minute
    assert default.locator("td.limits").inner_text() == "none"

    form = default.locator("form.awa-limits-form")
    form.locator('input[name="rate_limit"]').fill("5/s")
    form.locator('input[name="global_concurrency"]').fill("2")
    submit(page, form.get_by_role("button", name="Set limits"))
    assert any("Changed the limits of queue default" in m for m in messages(page))
    stored = {"rate_limit": "5/s", "rate_count": 5, "rate_period": 1.0, "global_concurrency": 2}
    assert Queue.objects.get(name="default").limits == stored
    assert default.locator('[data-limit="rate_limit"]').inner_text() == "5/s"
    assert default.locator('[data-limit="global_concurrency"]').inner_text() == "2 at once"
    assert "set at runtime" in default.locator("td.limits").inner_text()

    form.locator('input[name="rate_limit"]').fill("5 per sec")
    submit(page, form.get_by_role("button", name="Set limits"))
    shown = messages(page)
    assert any("rate_limit must be a rate" in m and "nothing changed" in m for m in shown), shown
    assert Queue.objects.get(name="default").limits["rate_limit"] == "5/s"

    submit(page, form.get_by_role("button", name="Use settings"))
    assert Queue.objects.get(name="default").limits == {}
    assert default.locator("td.limits").inner_text() == "none"


def test_the_queue_page_fits_a_laptop_screen_its_controls_two_lines_a_queue(
    login: Callable[[User], Page], superuser: User
) -> None:
    """At 1280 px, with the admin's sidebar open, the table of queues is wider than the
    page: it scrolls in its own box, as the admin's changelists do, and each queue's
    pause and limit controls stay on two lines. It ran off the right of the page, and
    its controls, squeezed into a column a word wide, made every row 170 px tall."""
    for queue in ("billing", "default", "email"):
        make_job(queue=queue)
    page = login(superuser)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(QUEUES_URL)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    row = page.locator('tr[data-queue="default"]').bounding_box()
    assert row
    # A line of a button and one of inputs and a button: 95 px here.
    assert row["height"] < 120, row
    controls = page.locator('tr[data-queue="default"] td.controls')
    controls.get_by_role("button", name="Set limits").scroll_into_view_if_needed()
    assert controls.get_by_role("button", name="Set limits").is_visible()


def test_the_job_list_keeps_a_long_last_error_to_two_lines(
    login: Callable[[User], Page], superuser: User
) -> None:
    """At a laptop's 1366 px, the last error (cut at 120 characters) wrapped whole into
    a column the others squeezed, five lines tall: every row of the list was 97 px."""
    error = "CardDeclined: card declined for order ORD-0852975DA0 by the issuing bank " * 3
    for _ in range(3):
        make_job(state="failed", errors=[{"at": "2026-12-07T10:00:00+00:00", "attempt": 1,
                                          "error": error}])  # fmt: skip
    page = login(superuser)
    page.set_viewport_size({"width": 1366, "height": 800})
    page.goto(JOBS_URL)
    cell = page.locator("#result_list tbody tr td.field-last_error").first
    box = cell.bounding_box()
    assert box and box["height"] < 60, box
    assert cell.locator("span").get_attribute("title") == error.strip()[:119] + "…"


def test_queue_limits_form_refuses_a_bad_number_and_needs_change_permission(
    client: Any, superuser: User, viewer: User
) -> None:
    form = {"queue": "mail", "operation": "limits", "rate_limit": "", "global_concurrency": "x"}
    client.force_login(superuser)
    response = client.post(QUEUES_URL, form, follow=True)
    shown = [str(m) for m in response.context["messages"]]
    assert shown == ["Queue mail: global concurrency must be a positive integer, got 'x'; "
                     "nothing changed."]  # fmt: skip
    assert not Queue.objects.filter(name="mail").exists()
    client.force_login(viewer)
    assert client.post(QUEUES_URL, {**form, "global_concurrency": "3"}).status_code == 403
    assert not Queue.objects.filter(name="mail").exists()


@pytest.mark.parametrize(
    "codenames",
    [
        ("view_job",),
        ("change_job",),
        ("view_job", "change_queue"),
        ("view_job", "change_periodicschedule"),
        ("view_job", "view_pendingfollowup"),
    ],
)
def test_the_job_list_links_exactly_the_awa_pages_the_user_may_open(
    transactional_db: Any, codenames: tuple[str, ...]
) -> None:
    # A staff user with change_job alone, or change_queue, could open the queues
    # page but found no link to it; the same for the periodic schedules.
    user = User.objects.create_user("staff", password=None, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="django_awa", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    job_list = client.get(reverse("admin:django_awa_job_changelist"))
    assert job_list.status_code == 200
    # The page's own shortcuts (the sidebar lists the models apart).
    tools = re.search(r'<ul class="object-tools">(.*?)</ul>', job_list.content.decode(), re.S)
    assert tools is not None
    for page in ("queue", "deadletter", "dashboard", "pendingfollowup", "periodicschedule"):
        url = reverse(f"admin:django_awa_{page}_changelist")
        opens = client.get(url).status_code == 200
        linked = f'href="{url}"' in tools.group(1)
        assert linked == opens, f"{codenames}: {page} page opens={opens}, linked={linked}"
