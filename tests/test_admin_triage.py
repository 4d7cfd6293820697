"""Operator triage in the admin job list (issue 21, item 3): the last error of each job."""

from __future__ import annotations

import os
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_awa.models import JobState
from tests.conftest import make_job
from tests.test_admin import JOBS_URL, browser, login, superuser  # noqa: F401 (fixtures)

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
