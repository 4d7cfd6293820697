"""The admin's answers to a large table: capped counts shown as estimates, a bounded
text search, the queue overview from the leader's count (admin.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_awa import admin as awa_admin
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState
from tests.conftest import make_job
from tests.test_admin import JOBS_URL, QUEUES_URL, failed_job, superuser  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def count_text(html: str) -> str:
    found = re.search(r'<span class="awa-count[^"]*"[^>]*>([^<]*)</span>', html)
    assert found, "no count on the page"
    return found.group(1)


def test_a_filtered_count_stops_at_the_cap_and_says_about(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(awa_admin, "COUNT_CAP", 5)
    for _ in range(8):
        failed_job(queue="many")
    for _ in range(3):
        failed_job(queue="few")
    client.force_login(superuser)

    response = client.get(JOBS_URL, {"queue": "few"})
    assert count_text(response.content.decode()) == "3"
    assert response.context["cl"].result_count == 3

    with CaptureQueriesContext(connection) as queries:
        response = client.get(JOBS_URL, {"queue": "many"})
    text = count_text(response.content.decode())
    assert text.startswith("about ") and int(text.split()[1]) >= 6
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT 6" in sql for sql in counts), counts


def test_text_search_looks_at_the_newest_jobs_and_an_id_at_all(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [make_job(kind="alpha_report") for _ in range(6)]
    newest = max(j.id for j in jobs)
    monkeypatch.setattr(awa_admin, "SEARCH_WINDOW", 3)
    client.force_login(superuser)

    response = client.get(JOBS_URL, {"q": "alpha"})
    shown = sorted(j.id for j in response.context["cl"].result_list)
    assert shown == [i for i in sorted(j.id for j in jobs) if i > newest - 3]
    # A job id finds an old job all the same.
    response = client.get(JOBS_URL, {"q": str(jobs[0].id)})
    assert [j.id for j in response.context["cl"].result_list] == [jobs[0].id]


def test_the_queue_overview_of_a_large_table_reads_the_leaders_count(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for _ in range(2):
        make_job(queue="billing")
    failed_job(queue="billing")
    Maintenance().count_jobs()
    make_job(queue="billing")  # after the count: not shown until the next one
    monkeypatch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
    client.force_login(superuser)

    with CaptureQueriesContext(connection) as queries:
        response = client.get(QUEUES_URL)
    assert response.status_code == 200
    html = response.content.decode()
    row = re.search(r'<tr data-queue="billing">(.*?)</tr>', html, re.S)
    assert row
    cells = dict(re.findall(r'data-state="(\w+)"><a [^>]*>([^<]*)</a>', row.group(1)))
    assert cells[JobState.AVAILABLE] == "2"
    assert cells[JobState.FAILED] == "…" and cells[JobState.COMPLETED] == "…"
    assert 'id="awa-counted"' in html
    # Not the count over every row (sql.QUEUE_STATS).
    assert not [q for q in queries.captured_queries if "GROUP BY queue, state" in q["sql"]]
    assert Job.objects.filter(queue="billing").count() == 4


def test_a_large_table_lists_newest_first_whatever_the_sort_asked(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [make_job(kind=kind) for kind in ("b_kind", "a_kind", "c_kind")]
    client.force_login(superuser)
    by_kind = client.get(JOBS_URL, {"o": "2"})  # small table: sorted by kind
    assert [j.kind for j in by_kind.context["cl"].result_list] == ["a_kind", "b_kind", "c_kind"]

    monkeypatch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
    response = client.get(JOBS_URL, {"o": "2"})
    assert response.status_code == 200
    assert [j.id for j in response.context["cl"].result_list] == sorted(
        (j.id for j in jobs), reverse=True
    )
    assert 'class="sortable' not in response.content.decode()
