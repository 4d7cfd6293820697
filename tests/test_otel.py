"""OpenTelemetry (the otel extra), with the SDK's in-memory exporters: spans, links, metrics.

And without it: a worker process with OpenTelemetry disabled, or not installed,
never imports it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

import django_awa as awa
from django_awa import metrics as awa_metrics
from django_awa import otel
from django_awa.completer import Completer
from django_awa.conf import awa_settings
from django_awa.handlers import HandlerPool
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState, MaintenanceLease, Queue
from django_awa.producer import Producer
from django_awa.state import WorkerState
from tests.conftest import ROOT, wait_for, wait_for_state
from tests.testapp.jobs import Act, Echo, Node, Parked, Pay, Timed
from tests.testapp.models import Ledger

pytestmark = pytest.mark.django_db

# The SDK's providers can be set once per process: these, for the whole module.
SPANS = InMemorySpanExporter()
READER = InMemoryMetricReader()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(SPANS))
trace.set_tracer_provider(_provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))
TRACER = trace.get_tracer("tests")


@pytest.fixture(autouse=True)
def _clear_spans() -> None:
    SPANS.clear()


def run_queue(queue: str, n: int = 1) -> WorkerState:
    """Claim, run and finalize ``n`` attempts of ``queue`` in this thread: the real path."""
    state = WorkerState.create({queue: n})
    runner = state.queues[queue]
    Producer(state, runner).run_once()
    pool = HandlerPool(state)
    ran = 0
    while pool.run_once(runner, timeout=0.5):
        ran += 1
    Completer(state).run_once()
    assert ran == n
    return state


def job_spans(kind: str) -> list[Any]:
    return [s for s in SPANS.get_finished_spans() if s.name == f"awa.job {kind}"]


def test_enqueue_records_the_trace_and_attempt_one_is_a_child_of_the_enqueuing_span():
    with TRACER.start_as_current_span("POST /orders") as request:
        job = awa.enqueue(Act(action="ok", tag="none"))
    stored = Job.objects.get(id=job.id).metadata["awa_trace"]
    context = request.get_span_context()
    assert stored["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert "awa_trace" not in Job.objects.get(id=awa.enqueue(Act(tag="none")).id).metadata

    run_queue("default", 2)
    spans = job_spans("act")
    span = next(s for s in spans if s.attributes["messaging.message.id"] == str(job.id))
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is not None and span.parent.span_id == context.span_id
    assert span.context.trace_id == context.trace_id
    assert dict(span.attributes) | {"messaging.client.id": "-"} == {
        "messaging.system": "awa",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "default",
        "messaging.message.id": str(job.id),
        "messaging.client.id": "-",
        "awa.job.kind": "act",
        "awa.job.attempt": 1,
        "awa.job.max_attempts": 3,
        "awa.job.priority": 2,
        "awa.job.outcome": "completed",
    }
    assert span.status.status_code is StatusCode.UNSET
    # The job enqueued outside any span runs in a trace of its own.
    other = next(s for s in spans if s is not span)
    assert other.parent is None and not other.links


def test_a_later_attempt_starts_a_new_trace_linked_to_the_enqueuing_span():
    with TRACER.start_as_current_span("request") as request:
        job = awa.enqueue(Act(action="ok", tag="none", fail_until=1))
    run_queue("default")
    Job.objects.filter(id=job.id).update(run_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    Maintenance().promote()
    run_queue("default")
    first, second = sorted(job_spans("act"), key=lambda s: s.attributes["awa.job.attempt"])
    assert first.parent.span_id == request.get_span_context().span_id
    assert first.status.status_code is StatusCode.ERROR
    assert "failing attempt 1" in first.status.description
    assert first.attributes["awa.job.outcome"] == "retryable"
    assert second.attributes["awa.job.attempt"] == 2 and second.parent is None
    assert second.context.trace_id != request.get_span_context().trace_id
    [link] = second.links
    assert link.context.span_id == request.get_span_context().span_id
    assert link.attributes["awa.link"] == "enqueue"


def test_follow_ups_link_to_their_triggers_attempt_span():
    with TRACER.start_as_current_span("request"):
        trigger = awa.enqueue(Act(action="ok"))
    run_queue("default")
    [attempt_span] = job_spans("act")
    followups = list(Job.objects.filter(kind="echo").order_by("id"))
    assert len(followups) == 2
    for followup in followups:
        [link] = followup.metadata["awa_trace"]["links"]
        assert link["traceparent"].split("-")[2] == f"{attempt_span.context.span_id:016x}"
        assert followup.metadata["awa_trigger"]["job_id"] == trigger.id
    # Due by this test transaction's clock (now() is when it began).
    Job.objects.filter(kind="echo").update(run_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    run_queue("echo", 2)
    for span in job_spans("echo"):
        [link] = span.links
        assert link.context.span_id == attempt_span.context.span_id
        assert link.attributes["awa.link"] == "trigger"


def test_an_atomic_jobs_follow_up_links_to_its_attempt_span():
    # Its follow-ups are written in the handler's transaction, before its span ends.
    awa.enqueue(Pay(reference="linked"))
    run_queue("default")
    [attempt_span] = job_spans("pay")
    [followup] = Job.objects.filter(kind="echo")
    [link] = followup.metadata["awa_trace"]["links"]
    assert link["traceparent"].split("-")[2] == f"{attempt_span.context.span_id:016x}"


def test_a_rescued_jobs_follow_up_links_to_the_trace_the_job_was_enqueued_in():
    # Its worker died: the attempt's span is in no live process, but the job's
    # trace is the one it recorded when it was enqueued.
    with TRACER.start_as_current_span("POST /reports") as request:
        job = awa.enqueue(Act(action="sleep", seconds=30))
    state = WorkerState.create({"default": 1})
    assert [c.id for c in Producer(state, state.queues["default"]).run_once() or ()] == [job.id]
    Job.objects.filter(id=job.id).update(heartbeat_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    Maintenance().rescue()
    [followup] = Job.objects.filter(kind="echo")
    assert followup.args["note"] == "rescued:stale_heartbeat"
    [link] = followup.metadata["awa_trace"]["links"]
    assert link == {"traceparent": Job.objects.get(id=job.id).metadata["awa_trace"]["traceparent"]}
    Job.objects.filter(id=followup.id).update(run_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    run_queue("echo")
    [span] = job_spans("echo")
    [link] = span.links
    assert link.context.span_id == request.get_span_context().span_id
    assert link.attributes["awa.link"] == "trigger"


def test_a_step_released_by_a_cancel_links_to_its_dependency():
    with TRACER.start_as_current_span("POST /imports") as importing:
        dependency = awa.enqueue(Act(action="ok"), queue="idle")
    with TRACER.start_as_current_span("POST /reports"):
        step = awa.enqueue(Echo(n=1), after=[dependency.id], requires="finished")
    awa.cancel(dependency.id)
    released = Job.objects.get(id=step.id)
    assert released.state == "available"
    assert released.metadata["awa_trace"]["links"] == [
        {"traceparent": Job.objects.get(id=dependency.id).metadata["awa_trace"]["traceparent"]}
    ]
    run_queue("echo")
    [span] = job_spans("echo")
    [link] = span.links
    assert link.context.span_id == importing.get_span_context().span_id


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["complete", "fail"])
def test_a_step_released_by_a_callback_links_to_its_dependency(start_worker, action: str):
    # The dependency's attempt ran (and parked) in a worker process: the
    # callback's answer comes here, where its attempt span never was.
    with TRACER.start_as_current_span("POST /payments") as paying:
        parked = awa.enqueue(awa.EnqueueRequest(Parked(), max_attempts=1))
    with TRACER.start_as_current_span("POST /receipts"):
        step = awa.enqueue(Echo(n=1), after=[parked.id], requires="finished")
    worker = start_worker("--queue", "default")
    callback_id = wait_for_state(parked.id, "waiting_external").callback_id
    assert worker.stop() == 0, worker.output()
    if action == "complete":
        awa.complete_external(callback_id, {"paid": True})
    else:
        awa.fail_external(callback_id, "declined")
    released = Job.objects.get(id=step.id)
    assert released.state == "available"
    [link] = released.metadata["awa_trace"]["links"]
    context = paying.get_span_context()
    assert link["traceparent"].split("-")[1:3] == [
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
    ]


def _gauge() -> dict[tuple[str, str], float]:
    return {
        (p.attributes["messaging.destination.name"], p.attributes["awa.job.state"]): p.value
        for p in _points("awa.jobs")
    }


def test_the_job_gauge_reports_0_where_jobs_were_and_the_samples_metrics_reports():
    Queue.objects.create(name="reports")  # known (awa_queue), not configured
    job = awa.enqueue(Act(action="ok", tag="none"), queue="reports")
    awa.enqueue(Echo(n=1))  # another queue's job: the count is not empty
    Maintenance().count_jobs()
    otel.instrumentation().observe_job_counts("default")
    assert _gauge()[("reports", "available")] == 1
    run_queue("reports")
    assert Job.objects.get(id=job.id).state == "completed"
    Job.objects.filter(id=job.id).delete()
    Maintenance().count_jobs()
    gauge = _gauge()
    # Drained: 0 in every state, not no series (a graph showed no data).
    assert {state: gauge[("reports", state)] for state in JobState.values} == dict.fromkeys(
        JobState.values, 0
    )
    exposition = awa_metrics.exposition("default", awa_settings())
    reported = {}
    for line in exposition.splitlines():
        if found := re.fullmatch(r'awa_jobs\{queue="(.*)",state="(.*)"\} (\d+)', line):
            reported[found[1], found[2]] = int(found[3])
    assert gauge == reported


def _points(name: str) -> list[Any]:
    data = READER.get_metrics_data()
    found = []
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def _sum(name: str, **attributes: Any) -> float:
    total = 0.0
    for point in _points(name):
        if all(point.attributes.get(k) == v for k, v in attributes.items()):
            total += getattr(point, "value", None) or getattr(point, "count", 0)
    return total


def test_metrics_count_outcomes_time_attempts_and_waits_and_gauge_jobs_per_state():
    labels = {"awa.job.kind": "act", "messaging.destination.name": "default"}
    before_done = _sum("awa.jobs.finished", **labels, **{"awa.job.outcome": "completed"})
    before_failed = _sum("awa.jobs.finished", **labels, **{"awa.job.outcome": "failed"})
    before_runs = _sum("awa.job.attempt.duration", **labels)
    before_waits = _sum("awa.job.wait", **labels)
    awa.enqueue(Act(action="ok", tag="none"))
    awa.enqueue(Act(action="terminal"))
    run_queue("default", 2)
    assert (
        _sum("awa.jobs.finished", **labels, **{"awa.job.outcome": "completed"}) == before_done + 1
    )
    assert _sum("awa.jobs.finished", **labels, **{"awa.job.outcome": "failed"}) == before_failed + 1
    assert _sum("awa.job.attempt.duration", **labels) == before_runs + 2
    assert _sum("awa.job.wait", **labels) == before_waits + 2

    awa.enqueue(Echo(n=1))
    awa.enqueue(Echo(n=2))
    Maintenance().count_jobs()
    otel.instrumentation().observe_job_counts("default")
    gauge = {
        (p.attributes["messaging.destination.name"], p.attributes["awa.job.state"]): p.value
        for p in _points("awa.jobs")
    }
    assert (
        gauge[("echo", "available")] == Job.objects.filter(queue="echo", state="available").count()
    )
    assert gauge[("echo", "available")] >= 2
    assert gauge[("default", "completed")] == 1 and gauge[("default", "failed")] == 1


@pytest.mark.django_db(transaction=True)
def test_a_project_without_time_zones_is_traced():
    # USE_TZ = False: a connection made then reads the claimed row's run_at naive.
    from django.db import connections
    from django.test import override_settings

    with override_settings(USE_TZ=False):
        connections.close_all()
        try:
            job = awa.enqueue(Act(action="ok", tag="none"))
            run_queue("default")
            assert Job.objects.get(id=job.id).state == "completed"
        finally:
            connections.close_all()
    [span] = job_spans("act")
    assert span.status.status_code != StatusCode.ERROR


def test_a_span_that_cannot_start_costs_the_job_its_span_not_its_run(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter misconfigured")

    monkeypatch.setattr(otel.instrumentation(), "start", broken)
    job = awa.enqueue(Act(action="ok", tag="none"))
    run_queue("default")
    assert Job.objects.get(id=job.id).state == "completed"
    assert not job_spans("act")


def test_disabled_it_records_nothing():
    from django.conf import settings
    from django.test import override_settings

    with override_settings(AWA={**settings.AWA, "OPENTELEMETRY": False}):
        assert otel.instrumentation() is None
        with TRACER.start_as_current_span("request"):
            job = awa.enqueue(Act(action="ok", tag="none"))
        assert "awa_trace" not in Job.objects.get(id=job.id).metadata
        run_queue("default")
        assert job_spans("act") == []
    assert otel.instrumentation() is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("how", "imported"), [("disabled", False), ("not installed", False), ("installed", True)]
)
def test_a_worker_without_opentelemetry_never_imports_it(start_worker, how: str, imported: bool):
    env = {}
    if how == "disabled":
        env = {"AWA_TEST_OPENTELEMETRY": "off"}
    elif how == "not installed":
        env = {"PYTHONPATH": f"{ROOT / 'tests' / 'blocked'}:{ROOT}"}
    job = awa.enqueue(Act(action="modules"))
    followed = awa.enqueue(Act(action="ok"))  # its follow-ups are built there too
    start_worker("--queue", "default", "--queue", "echo", env=env)
    wait_for_state(job.id, "completed")
    wait_for_state(followed.id, "completed")
    # "installed" is the control: the probe does see an import.
    assert Ledger.objects.get(job_id=job.id, note__startswith="opentelemetry:").note == (
        f"opentelemetry:{imported}"
    )
    assert Job.objects.filter(kind="echo").count() == 4  # two follow-ups each
    if not imported:
        assert not any("awa_trace" in j.metadata for j in Job.objects.filter(kind="echo"))


def test_the_blocker_really_blocks():
    import subprocess
    import sys

    env = {"PYTHONPATH": str(Path(ROOT, "tests", "blocked"))}
    probe = subprocess.run(
        [sys.executable, "-c", "import opentelemetry.trace"], env=env, capture_output=True,
        text=True, check=False, timeout=30,
    )  # fmt: skip
    assert probe.returncode == 1 and "blocked" in probe.stderr


def _last_exports(directory: Path) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Per worker process (pid), the data points of each metric in its latest
    export (tests/otel_settings.py)."""
    exports: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for path in directory.glob("metrics-*.jsonl"):
        last = json.loads(path.read_text().splitlines()[-1])
        points = exports[int(path.stem.split("-")[1])] = {}
        for resource in last["resource_metrics"]:
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    points[metric["name"]] = metric["data"]["data_points"]
    return exports


def _exported_spans(directory: Path) -> list[dict[str, Any]]:
    """The spans the worker processes exported (tests/otel_settings.py), as JSON."""
    return [
        json.loads(line)
        for path in directory.glob("spans-*.jsonl")
        for line in path.read_text().splitlines()
    ]


def _noted_statements(directory: Path) -> list[str]:
    """The trace links' statements the worker processes ran (tests/otel_settings.py)."""
    return [
        line for path in directory.glob("statements-*.txt") for line in path.read_text().split()
    ]


@pytest.mark.django_db(transaction=True)
def test_a_worker_without_a_tracer_provider_costs_no_trace_statement_until_one_is_set(
    start_worker, tmp_path: Path
):
    # The API alone (a library pulled it in, no SDK set up): no span would ever be
    # recorded here, so no attempt span and no link looked up or written; a context
    # made current all the same is passed on, as the API passes it on. The project
    # may set its SDK's provider later: from then on, it traces.
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.otel_settings",
        "AWA_TEST_OTEL_DIR": str(tmp_path),
        "AWA_TEST_OTEL_TRACER": "late",
    }
    start_worker("--queue", "default", "--queue", "flow", env=env)
    requests: list[str] = []  # the enqueuing spans' ids

    def run(name: str) -> tuple[Job, Job, Job, Job]:
        # Enqueued under a span this process's SDK records: each job carries its trace.
        with TRACER.start_as_current_span(f"POST /{name}") as request:
            flow = awa.Workflow()
            first = flow.add(Node(name=f"{name}-first"))
            flow.add(Node(name=f"{name}-second"), after=[first])
            first_job, second_job = flow.enqueue()
            enqueuing = awa.enqueue(Act(action="propagate", tag="none"))  # from its handler
            followed = awa.enqueue(Act(action="ok"))  # two follow-ups, built there
        for job in (second_job, enqueuing, followed):
            wait_for_state(job.id, "completed")
        requests.append(f"{request.get_span_context().span_id:016x}")
        return first_job, second_job, enqueuing, followed

    def echoes(job: Job) -> list[Job]:
        return list(Job.objects.filter(kind="echo", args__n=job.id).order_by("id"))

    first, second, enqueuing, followed = run("untraced")
    assert _noted_statements(tmp_path) == []
    assert "links" not in Job.objects.get(id=second.id).metadata["awa_trace"]
    # Passed on without a span of the worker's: the request's context the handler
    # made current, and the trigger's own trace as the follow-ups' link.
    [from_handler] = echoes(enqueuing)
    assert from_handler.metadata["awa_trace"]["traceparent"].split("-")[2] == requests[-1]
    followups = echoes(followed)
    assert len(followups) == 2
    for followup in followups:
        [link] = followup.metadata["awa_trace"]["links"]
        assert link["traceparent"].split("-")[2] == requests[-1]
    assert _exported_spans(tmp_path) == []

    def steps_timed() -> int:  # the metrics go on without a tracer provider
        return sum(
            point["count"]
            for export in _last_exports(tmp_path).values()
            for point in export.get("awa.job.attempt.duration", ())
            if point["attributes"]["awa.job.kind"] == "node"
        )

    wait_for(lambda: steps_timed() == 2, message="the steps' durations were not exported")

    wait_for_state(awa.enqueue(Act(action="tracing", tag="none")).id, "completed")
    first, second, enqueuing, followed = run("traced")
    assert _noted_statements(tmp_path) == ["TRIGGER_EDGES", "ADD_TRACE_LINKS"]

    def span_ids() -> dict[int, str] | None:
        found = {
            int(s["attributes"]["messaging.message.id"]): s["context"]["span_id"][2:]
            for s in _exported_spans(tmp_path)
        }
        return found if {first.id, enqueuing.id, followed.id} <= found.keys() else None

    span_id = wait_for(span_ids, message="the traced attempts' spans were not exported")
    [link] = Job.objects.get(id=second.id).metadata["awa_trace"]["links"]
    assert link["traceparent"].split("-")[2] == span_id[first.id]
    [from_handler] = echoes(enqueuing)
    assert from_handler.metadata["awa_trace"]["traceparent"].split("-")[2] == requests[-1]
    for followup in echoes(followed):
        [link] = followup.metadata["awa_trace"]["links"]
        assert link["traceparent"].split("-")[2] == span_id[followed.id]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_timed_out_attempts_span_ends_when_its_outcome_is_written_and_only_once(
    start_worker, tmp_path: Path
):
    env = {"DJANGO_SETTINGS_MODULE": "tests.otel_settings", "AWA_TEST_OTEL_DIR": str(tmp_path)}
    worker = start_worker("--queue", "default", env=env)
    # A sync handler cannot be stopped: it sleeps on for seconds past its 1 s timeout.
    job = awa.enqueue(awa.EnqueueRequest(Timed(seconds=6), max_attempts=1))
    wait_for_state(job.id, "failed")

    def exported() -> list[dict[str, Any]]:
        return [
            s
            for s in _exported_spans(tmp_path)
            if s["attributes"]["messaging.message.id"] == str(job.id)
        ]

    [span] = wait_for(exported, message="the timed-out attempt's span was not ended")
    assert not Ledger.objects.filter(job_id=job.id, note__startswith="timed:end").exists()
    assert span["attributes"]["awa.job.outcome"] == "failed"
    assert span["status"]["status_code"] == "ERROR"
    assert "timed out" in span["status"]["description"]
    wait_for(lambda: Ledger.objects.filter(job_id=job.id, note__startswith="timed:end").exists())
    assert worker.stop() == 0  # its metrics are exported as it exits
    # The handler's return ended nothing again: one span, one duration.
    assert len(exported()) == 1
    [duration] = [
        point
        for export in _last_exports(tmp_path).values()
        for point in export.get("awa.job.attempt.duration", ())
        if point["attributes"]["awa.job.kind"] == "timed"
    ]
    assert duration["count"] == 1
    assert duration["attributes"]["awa.job.outcome"] == "failed"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_worker_processes_export_written_outcomes_and_the_job_counts_once(
    start_worker, tmp_path: Path
):
    env = {"DJANGO_SETTINGS_MODULE": "tests.otel_settings", "AWA_TEST_OTEL_DIR": str(tmp_path)}
    worker = start_worker("--processes", "2", "--queue", "default", "--queue", "flow", env=env)
    with TRACER.start_as_current_span("POST /flows") as request:
        flow = awa.Workflow()
        first = flow.add(Node(name="first"))
        flow.add(Node(name="second"), after=[first])
        first_job, second_job = flow.enqueue()
    # A job cancelled while it runs and one past its kind's timeout: their
    # handlers return normally later, and neither is a completed job.
    done = awa.enqueue(Act(action="ok"))
    cancelled = awa.enqueue(Act(action="sleep", seconds=1.5))
    timed = awa.enqueue(awa.EnqueueRequest(Timed(seconds=2), max_attempts=1))
    waiting = awa.enqueue(Act(action="ok"), queue="idle")  # no worker runs queue idle
    wait_for_state(cancelled.id, "running")
    awa.cancel(cancelled.id)
    wait_for_state(timed.id, "failed")
    wait_for_state(done.id, "completed")
    wait_for_state(second_job.id, "completed")
    wait_for(lambda: Ledger.objects.filter(job_id=timed.id, note__startswith="timed:end").exists())

    # awa.jobs: one series per queue and state for the fleet, from the leader
    # alone, not one per worker process (summed, they would count each job twice).
    def counts_reported() -> dict[int, list[dict[str, Any]]] | None:
        exports = _last_exports(tmp_path)  # a process with nothing to report writes none
        reported = {pid: e["awa.jobs"] for pid, e in exports.items() if e.get("awa.jobs")}
        idle = [
            p for points in reported.values() for p in points
            if p["attributes"] == {"messaging.destination.name": "idle",
                                   "awa.job.state": "available"}
        ]  # fmt: skip
        return reported if idle else None

    reported = wait_for(counts_reported, message="no process reported queue idle's count")
    time.sleep(1.2)  # two more exports each: the other process's too
    reported = counts_reported()
    leader = MaintenanceLease.objects.get().holder
    assert reported is not None
    assert [f"{socket.gethostname()}:{pid}" for pid in reported] == [leader]
    [points] = reported.values()
    idle = {
        p["attributes"]["awa.job.state"]: p["value"]
        for p in points
        if p["attributes"]["messaging.destination.name"] == "idle"
    }
    assert idle == {**dict.fromkeys(JobState.values, 0), "available": 1}
    assert Job.objects.get(id=waiting.id).state == "available"

    assert worker.stop() == 0  # its metrics are exported as it exits
    finished: dict[tuple[str, str], int] = {}
    for export in _last_exports(tmp_path).values():
        for point in export.get("awa.jobs.finished", ()):
            key = (point["attributes"]["awa.job.kind"], point["attributes"]["awa.job.outcome"])
            finished[key] = finished.get(key, 0) + point["value"]
    # As the database has them: one act completed (the cancel was written by the
    # caller), one timed job failed, two workflow steps completed; nothing counted
    # completed that was not.
    assert finished == {("act", "completed"): 1, ("timed", "failed"): 1, ("node", "completed"): 2}
    by_job = {int(s["attributes"]["messaging.message.id"]): s for s in _exported_spans(tmp_path)}
    # The workflow's second step: a child of the request that enqueued the
    # workflow, linked to the attempt of the step that released it.
    second = by_job[second_job.id]
    assert second["parent_id"] == f"0x{request.get_span_context().span_id:016x}"
    assert [(link["context"]["span_id"], link["attributes"]) for link in second["links"]] == [
        (by_job[first_job.id]["context"]["span_id"], {"awa.link": "trigger"})
    ]
    # Cancelled while it ran: its handler's return is not the job's outcome.
    assert by_job[cancelled.id]["attributes"]["awa.job.outcome"] == "lost"
    timed_span = by_job[timed.id]
    assert timed_span["attributes"]["awa.job.outcome"] == "failed"
    assert timed_span["status"]["status_code"] == "ERROR"
    assert "timed out" in timed_span["status"]["description"]
