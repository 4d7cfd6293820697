"""The admin's answers to a large table: capped counts shown as estimates, a bounded
number of pages, a text search by the indexed names, sorting by indexed columns only,
the queue overview from the leader's count (admin.py)."""

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


def test_text_search_finds_kind_and_queue_names_among_all_jobs_and_tags_among_the_newest(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reports = [make_job(kind="alpha_report", tags=["nightly"]) for _ in range(6)]
    mail = make_job(kind="send", queue="Alpha_mail")
    other = make_job(kind="beta", tags=["nightly"])
    newest = other.id
    monkeypatch.setattr(awa_admin, "SEARCH_WINDOW", 3)
    client.force_login(superuser)

    def shown(term: str) -> list[int]:
        response = client.get(JOBS_URL, {"q": term})
        assert response.status_code == 200
        return sorted(j.id for j in response.context["cl"].result_list)

    # Part of a kind or a queue name, case aside: every such job, however old.
    assert shown("ALPHA") == sorted([*(j.id for j in reports), mail.id])
    assert shown("report") == sorted(j.id for j in reports)
    assert shown("nothing_like_it") == []
    # A tag, exactly, among the newest SEARCH_WINDOW jobs only.
    assert shown("tag:nightly") == [i for i in [*(j.id for j in reports), newest] if i > newest - 3]
    # A job id finds an old job all the same.
    assert shown(str(reports[0].id)) == [reports[0].id]


def test_a_word_no_filter_offers_still_matches_that_kind_or_queue_exactly(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a large table the filters offer the declared and sampled names only; a
    word naming none of them is looked for as a kind or queue of its own."""
    rare = make_job(kind="rare_legacy_kind")
    make_job(kind="act")
    monkeypatch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
    client.force_login(superuser)
    response = client.get(JOBS_URL, {"q": "rare_legacy_kind"})
    assert [j.id for j in response.context["cl"].result_list] == [rare.id]


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


def test_a_large_table_sorts_by_id_kind_and_queue_only(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sorting by a column no index orders would sort every row for each page: on a
    large table only id, kind and queue sort (ties by id, the same way round)."""
    jobs = [make_job(kind=kind, priority=p) for kind, p in (("b", 1), ("a", 4), ("c", 2), ("a", 3))]
    client.force_login(superuser)
    by_priority = client.get(JOBS_URL, {"o": "5"})  # small table: sorted by priority
    assert [j.priority for j in by_priority.context["cl"].result_list] == [1, 2, 3, 4]

    monkeypatch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
    response = client.get(JOBS_URL, {"o": "2"})
    ids = [j.id for j in jobs]
    assert [j.id for j in response.context["cl"].result_list] == [ids[1], ids[3], ids[0], ids[2]]
    response = client.get(JOBS_URL, {"o": "-2"})
    assert [j.id for j in response.context["cl"].result_list] == [ids[2], ids[0], ids[3], ids[1]]
    html = response.content.decode()
    assert 'class="sortable column-kind sorted descending"' in html
    assert 'class="sortable column-queue' in html
    assert "column-priority" in html and 'class="sortable column-priority' not in html
    # Asked by priority anyway (an old link): newest first, and the page says so.
    response = client.get(JOBS_URL, {"o": "5.2"})
    assert [j.id for j in response.context["cl"].result_list] == [ids[1], ids[3], ids[0], ids[2]]
    assert response.context["cl"].params["o"] == "2"


def test_an_estimated_list_offers_a_bounded_number_of_pages(
    client: Any,
    superuser: User,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the count cap a deep page would read every row before it: the list
    offers MAX_PAGES pages, says so, and sorting by id the other way shows the oldest."""
    jobs = [failed_job(queue="many") for _ in range(9)]
    monkeypatch.setattr(awa_admin, "COUNT_CAP", 5)
    monkeypatch.setattr(awa_admin, "MAX_PAGES", 2)
    monkeypatch.setattr(awa_admin.JobAdmin, "list_per_page", 2)
    client.force_login(superuser)

    response = client.get(JOBS_URL, {"queue": "many", "p": "2"})
    assert response.status_code == 200
    assert [j.id for j in response.context["cl"].result_list] == [jobs[6].id, jobs[5].id]
    assert "the first 2 pages" in response.content.decode()
    assert client.get(JOBS_URL, {"queue": "many", "p": "3"}).status_code == 302  # ?e=1
    oldest = client.get(JOBS_URL, {"queue": "many", "o": "1"})
    assert [j.id for j in oldest.context["cl"].result_list] == [jobs[0].id, jobs[1].id]
