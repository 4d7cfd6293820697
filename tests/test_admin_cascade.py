"""The admin's messages count the jobs a cascade moved too (SPEC §11): cancelling,
discarding or retrying a job also cancels or reopens its dependents."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

import django_awa as awa
from django_awa.models import Job
from tests.testapp.jobs import Node

pytestmark = pytest.mark.django_db(transaction=True)

JOBS_URL = "/admin/django_awa/job/"


def chain(name: str) -> list[Job]:
    """a <- b <- c <- d (each requires the one before to complete)."""
    flow = awa.Workflow(name)
    a = flow.add(Node(name="a"), name="a")
    b = flow.add(Node(name="b"), after=[a], name="b")
    c = flow.add(Node(name="c"), after=[b], name="c")
    flow.add(Node(name="d"), after=[c], name="d")
    return flow.enqueue()


def texts(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def states(jobs: list[Job]) -> list[str]:
    return [Job.objects.get(id=j.id).state for j in jobs]


def gone_or_state(jobs: list[Job]) -> list[str | None]:
    return [Job.objects.filter(id=j.id).values_list("state", flat=True).first() for j in jobs]


def test_the_cancel_action_counts_the_dependents_the_cascade_cancelled(admin_client: Any) -> None:
    first, second = chain("one"), chain("two")
    response = admin_client.post(
        JOBS_URL,
        {"action": "cancel_jobs", "index": "0", "_selected_action": [first[0].id, second[0].id]},
        follow=True,
    )
    assert texts(response) == ["Cancelled 2 jobs and 6 dependent jobs."]
    assert set(states(first + second)) == {"cancelled"}


def test_the_bulk_cancel_page_counts_the_dependents_the_cascade_cancelled(
    admin_client: Any,
) -> None:
    first, second = chain("one"), chain("two")
    url = reverse("admin:django_awa_job_bulk", args=["cancel"]) + "?state__exact=available"
    up_to = max(first[0].id, second[0].id)
    response = admin_client.post(url, {"up_to": str(up_to)}, follow=True)
    assert texts(response) == ["Cancelled 2 job(s) and 6 dependent job(s) in 1 batch(es)."]
    assert set(states(first + second)) == {"cancelled"}


def test_discarding_counts_the_dependents_it_cancelled(admin_client: Any) -> None:
    first, second = chain("one"), chain("two")
    response = admin_client.post(
        JOBS_URL,
        {
            "action": "discard_jobs",
            "index": "0",
            "confirm": "yes",
            "_selected_action": [first[0].id],
        },
        follow=True,
    )
    assert texts(response) == ["Discarded 1 job and cancelled 3 dependent jobs."]
    assert gone_or_state(first) == [None, "cancelled", "cancelled", "cancelled"]
    url = reverse("admin:django_awa_job_bulk", args=["discard"]) + "?state__exact=available"
    response = admin_client.post(url, {"up_to": str(second[0].id)}, follow=True)
    assert texts(response) == [
        "Discarded 1 job(s) and cancelled 3 dependent job(s) in 1 batch(es)."
    ]
    assert gone_or_state(second) == [None, "cancelled", "cancelled", "cancelled"]


def test_retrying_counts_the_dependents_it_reopened(admin_client: Any) -> None:
    first, second = chain("one"), chain("two")
    awa.cancel(first[0].id)
    awa.cancel(second[0].id)
    response = admin_client.post(
        JOBS_URL,
        {"action": "retry_jobs", "index": "0", "_selected_action": [first[0].id]},
        follow=True,
    )
    assert texts(response) == ["Retried 1 job and reopened 3 dependent jobs."]
    assert states(first) == ["available", "blocked", "blocked", "blocked"]
    url = reverse("admin:django_awa_job_bulk", args=["retry"]) + "?state__exact=cancelled"
    response = admin_client.post(url, {"up_to": str(second[0].id)}, follow=True)
    assert texts(response) == ["Retried 1 job(s) and reopened 3 dependent job(s) in 1 batch(es)."]
    assert states(second) == ["available", "blocked", "blocked", "blocked"]


def test_without_dependents_the_messages_are_as_before(admin_client: Any) -> None:
    flow = awa.Workflow("flat")
    flow.add(Node(name="x"), name="x")
    flow.add(Node(name="y"), name="y")
    jobs = flow.enqueue()
    response = admin_client.post(
        JOBS_URL,
        {"action": "cancel_jobs", "index": "0", "_selected_action": [j.id for j in jobs]},
        follow=True,
    )
    assert texts(response) == ["Cancelled 2 jobs."]
