"""The admin's workflow page in real Chromium: the graph, links both ways, and the
whole-workflow cancel and retry, permission-checked like the job actions."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

import django_awa as awa
from django_awa.models import Job, JobState
from tests.test_admin import browser, change_url, login, messages, submit, superuser, viewer
from tests.test_workflows import run_all
from tests.testapp.jobs import Node

__all__ = ["browser", "login", "superuser", "viewer"]  # fixtures used by name


def _workflow() -> tuple[awa.Workflow, list[Job]]:
    flow = awa.Workflow("order-42")
    charge = flow.add(Node(name="charge", action="terminal"), name="charge")
    pack = flow.add(Node(name="pack"), name="pack")
    ship = flow.add(Node(name="ship"), after=[charge, pack], name="ship")
    flow.add(Node(name="report"), after=[ship], requires="finished", name="report")
    flow.add(Node(name="slow"), name="slow")
    jobs = flow.enqueue()
    return flow, jobs


def _states(jobs: list[Job]) -> list[str]:
    return [Job.objects.get(id=j.id).state for j in jobs]


def test_the_graph_links_each_node_to_its_job_and_back(login: Any, superuser: Any) -> None:
    _flow, jobs = _workflow()
    page = login(superuser)
    page.goto(change_url(jobs[2]))
    link = page.locator(".field-workflow_link a")
    assert link.inner_text() == "order-42"
    # The job page shows its dependency edges and its follow-up lineage.
    waits = page.locator(".field-dependency_links li").all_inner_texts()
    assert [w.split()[0] for w in waits] == ["node", "node"]
    assert f"#{jobs[0].id}" in waits[0] and f"#{jobs[1].id}" in waits[1]
    submit(page, link)
    # The admin's own breadcrumbs bar, as on every other page (it was unstyled text).
    crumbs = page.locator("nav ol.breadcrumbs li")
    assert crumbs.all_inner_texts()[:3] == ["Home", "Awa jobs", "Jobs"]
    assert crumbs.nth(3).inner_text().startswith("Workflow order-42")
    assert (
        page.locator("nav ol.breadcrumbs").evaluate("el => getComputedStyle(el).backgroundColor")
        != "rgba(0, 0, 0, 0)"
    )
    nodes = page.locator("svg.awa-graph a.awa-node")
    assert nodes.count() == 5
    assert [nodes.nth(i).get_attribute("data-state") for i in range(5)] == [
        "available", "available", "blocked", "blocked", "available"
    ]  # fmt: skip
    # Nodes are coloured by state, by the stylesheet's class per state.
    fill = page.locator(f'a.awa-node[data-job="{jobs[2].id}"] rect').evaluate(
        "el => getComputedStyle(el).fill"
    )
    assert fill == "rgb(161, 98, 7)"
    assert page.locator("svg.awa-graph line").count() == 3
    assert page.locator("svg.awa-graph line.awa-edge-finished").count() == 1
    submit(page, page.locator(f'a.awa-node[data-job="{jobs[3].id}"]'))
    assert page.url.endswith(change_url(jobs[3]))


def test_cancel_and_retry_the_whole_workflow(login: Any, superuser: Any) -> None:
    flow, jobs = _workflow()
    run_all()  # charge fails for good: ship is cancelled, report runs
    assert _states(jobs) == ["failed", "completed", "cancelled", "completed", "completed"]
    page = login(superuser)
    # A completed step's page shows its result.
    page.goto(change_url(jobs[1]))
    assert '"name": "pack"' in page.locator(".field-result_json").inner_text()
    page.goto(reverse("admin:django_awa_job_workflow", args=[flow.id]))
    assert page.locator(".awa-workflow-state").inner_text() == "failed"
    # The charge now succeeds: retrying the workflow retries it and reopens ship.
    Job.objects.filter(id=jobs[0].id).update(args={"name": "charge", "action": "ok"})
    submit(page, page.get_by_role("button", name="Retry workflow"))
    # The retry also reopened ship, which the charge's failure had cancelled.
    assert "Retried 1 job and reopened 1 dependent job." in messages(page)
    assert _states(jobs)[:3] == ["available", "completed", "blocked"]
    submit(page, page.get_by_role("button", name="Cancel workflow"))
    assert _states(jobs)[:3] == ["cancelled", "completed", "cancelled"]
    assert page.get_by_role("button", name="Cancel workflow").count() == 0


def test_a_viewer_sees_the_graph_but_cannot_cancel_or_retry(login: Any, viewer: Any) -> None:
    flow, jobs = _workflow()
    page = login(viewer)
    page.goto(reverse("admin:django_awa_job_workflow", args=[flow.id]))
    assert page.locator("svg.awa-graph a.awa-node").count() == 5
    assert page.get_by_role("button", name="Cancel workflow").count() == 0
    assert page.get_by_role("button", name="Retry workflow").count() == 0
    client = Client()
    client.force_login(viewer)
    url = reverse("admin:django_awa_job_workflow_operation", args=[flow.id, "cancel"])
    assert client.post(url).status_code == 403
    assert JobState.CANCELLED not in _states(jobs)


@pytest.mark.django_db
def test_an_unknown_workflow_is_404(admin_client: Client) -> None:
    url = reverse("admin:django_awa_job_workflow", args=["00000000-0000-0000-0000-000000000000"])
    assert admin_client.get(url).status_code == 404


@pytest.mark.django_db
def test_retry_workflow_blocks_again_a_finished_dependent_that_has_not_run(
    admin_client: Client,
) -> None:
    flow = awa.Workflow("chain")
    first = flow.add(Node(name="first"))
    second = flow.add(Node(name="second"), after=[first])
    report = flow.add(Node(name="report"), after=[second], requires="finished")
    jobs = flow.enqueue()
    awa.cancel(first.job.id)  # second is cancelled with it, which releases report
    assert _states(jobs) == ["cancelled", "cancelled", "available"]
    url = reverse("admin:django_awa_job_workflow_operation", args=[flow.id, "retry"])
    assert admin_client.post(url).status_code == 302
    # Reopened, second is not finished: report, not started, waits for it again.
    assert _states(jobs) == ["available", "blocked", "blocked"]
    assert run_all() == [first.job.id, second.job.id, report.job.id]
