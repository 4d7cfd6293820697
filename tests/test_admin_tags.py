"""Searching the job list by a tag that holds spaces: ``tag:"my tag"`` (or the whole
word quoted, ``"tag:my tag"``), as Django quotes a phrase in a search."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conftest import make_job

pytestmark = pytest.mark.django_db(transaction=True)

JOBS_URL = "/admin/django_awa/job/"


def shown(client: Any, term: str) -> list[int]:
    response = client.get(JOBS_URL, {"q": term})
    assert response.status_code == 200
    return sorted(j.id for j in response.context["cl"].result_list)


def test_a_tag_with_spaces_is_found_quoted(admin_client: Any) -> None:
    spaced = make_job(kind="report", tags=["nightly run", "eu"])
    plain = make_job(kind="report", tags=["nightly"])
    make_job(kind="report", tags=["run"])
    quoted = make_job(kind="report", tags=['say "hi" \\ bye'])
    # Quoted as Django quotes a phrase: the value, or the whole word.
    assert shown(admin_client, 'tag:"nightly run"') == [spaced.id]
    assert shown(admin_client, "tag:'nightly run'") == [spaced.id]
    assert shown(admin_client, '"tag:nightly run"') == [spaced.id]
    # With another word, each must match.
    assert shown(admin_client, 'tag:"nightly run" tag:eu report') == [spaced.id]
    assert shown(admin_client, 'tag:"nightly run" tag:nightly') == []
    # Backslash escapes inside the quotes.
    assert shown(admin_client, r'tag:"say \"hi\" \\ bye"') == [quoted.id]
    # Unquoted, the words are searched apart, as before: a tag is matched whole.
    assert shown(admin_client, "tag:nightly") == [plain.id]
    assert shown(admin_client, "tag:nightly run") == []


def test_the_bulk_link_of_a_tag_search_reaches_the_tagged_jobs(admin_client: Any) -> None:
    spaced = make_job(kind="report", tags=["nightly run"])
    make_job(kind="report", tags=["nightly"])
    response = admin_client.get(JOBS_URL, {"q": 'tag:"nightly run"'})
    # The search box shows the phrase as typed, to search again.
    assert re.search(r'name="q"[^>]*value="tag:&quot;nightly run&quot;"', response.text)
    links = dict(response.context["awa_bulk_links"])
    confirmation = admin_client.get(links["Cancel"])
    assert confirmation.status_code == 200
    assert confirmation.context["count"] == 1
    assert [j.id for j in confirmation.context["sample"]] == [spaced.id]


def test_the_job_page_labels_its_tags_and_its_wait(admin_client: Any) -> None:
    job = make_job(kind="report", tags=["nightly run", "eu"])
    page = admin_client.get(f"{JOBS_URL}{job.id}/change/").text
    labels = dict(re.findall(r'fieldBox field-(\w+)">\s*<label[^>]*>(.*?)</label>', page))
    assert labels["tag_list"] == "Tags:"
    assert labels["waited"] == "Waited (due to start):"
    assert "nightly run, eu" in page
