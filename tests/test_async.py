"""Async handlers and per-kind timeouts in real ``awa_worker`` processes; ``aenqueue`` in
async views driven by Django's AsyncClient."""

from __future__ import annotations

import datetime as dt
import signal
import time

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient

import django_awa as awa
from django_awa.models import Job, JobState
from tests.conftest import wait_for, wait_for_state
from tests.testapp.jobs import AsyncAct, Echo, Timed, TimedAsync
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db(transaction=True)


def _ran(job_id: int, note: str) -> bool:
    return Ledger.objects.filter(job_id=job_id, note=note).exists()


def test_async_handlers_follow_the_outcome_table(start_worker):
    jobs = {
        "ok": awa.enqueue(AsyncAct(action="ok")),
        "raise": awa.enqueue(AsyncAct(action="raise")),
        "terminal": awa.enqueue(AsyncAct(action="terminal")),
        "retry_after": awa.enqueue(AsyncAct(action="retry_after", seconds=30)),
        "snooze": awa.enqueue(AsyncAct(action="snooze", seconds=0.5)),
        "cancel": awa.enqueue(AsyncAct(action="cancel")),
        "callback": awa.enqueue(AsyncAct(action="callback")),
        "enqueue": awa.enqueue(AsyncAct(action="enqueue", n=42)),
    }
    start_worker("--queue", "default", "--queue", "echo")

    ok = wait_for_state(jobs["ok"].id, JobState.COMPLETED)
    assert ok.attempt == 1 and ok.errors == []
    assert _ran(ok.id, "async:ok")  # the async ORM's write committed

    raised = wait_for_state(jobs["raise"].id, JobState.RETRYABLE)
    assert "ValueError: async boom on attempt 1" in raised.errors[-1]["error"]
    assert "Traceback" in raised.errors[-1]["traceback"]

    terminal = wait_for_state(jobs["terminal"].id, JobState.FAILED)
    assert "TerminalError: async: no point retrying" in terminal.errors[-1]["error"]

    retried = wait_for_state(jobs["retry_after"].id, JobState.RETRYABLE)
    assert retried.errors == [] and 25 < (retried.run_at - retried.attempted_at).total_seconds()

    cancelled = wait_for_state(jobs["cancel"].id, JobState.CANCELLED)
    assert "async: not needed" in cancelled.errors[-1]["error"]

    waiting = wait_for_state(jobs["callback"].id, JobState.WAITING_EXTERNAL)
    assert waiting.callback_id is not None  # registered through aregister_callback

    wait_for_state(jobs["enqueue"].id, JobState.COMPLETED)
    echo = wait_for(lambda: Job.objects.filter(kind="echo", args__n=42).first())
    assert echo.args["note"] == "from-async-handler"
    wait_for_state(echo.id, JobState.COMPLETED)

    snoozed = wait_for_state(jobs["snooze"].id, JobState.COMPLETED, timeout=20)
    runs = list(Ledger.objects.filter(job_id=snoozed.id).values_list("attempt", flat=True))
    assert runs == [1, 1]


def test_what_asyncio_would_not_treat_as_an_error_is_the_async_handlers_error(start_worker):
    # SystemExit and KeyboardInterrupt escape an asyncio task and stop its loop; a
    # CancelledError nobody asked for reads as a cancelled task. From a handler, each
    # is its attempt's error, as from a sync one, and the worker's loop runs on.
    raising = {
        "system_exit": "SystemExit: 3",
        "keyboard_interrupt": "KeyboardInterrupt",
        "own_cancel": "CancelledError: my own cancel",
        "inner_cancel": "CancelledError",
    }
    jobs = {action: awa.enqueue(AsyncAct(action=action)) for action in raising}
    start_worker("--queue", "default=1")  # one place: each runs after the one before
    for action, error in raising.items():
        row = wait_for_state(jobs[action].id, JobState.RETRYABLE)
        assert row.attempt == 1 and row.errors[-1]["error"] == error, row.errors
    later = awa.enqueue(AsyncAct(action="value", n=4))
    assert wait_for_state(later.id, JobState.COMPLETED).result == {"doubled": 8}


def test_an_async_handler_reads_its_dependencies_results(start_worker):
    first = awa.enqueue(AsyncAct(action="value", n=21))
    dependent = awa.enqueue(AsyncAct(action="dependencies"), after=[first])
    start_worker("--queue", "default")
    done = wait_for_state(dependent.id, JobState.COMPLETED)
    assert done.result == [{"doubled": 42}]


@pytest.mark.slow
def test_shutdown_cancels_an_async_handler_still_running(start_worker):
    # Run five times: the cancellation once raced the loop's stop and was lost.
    for _ in range(5):
        job = awa.enqueue(AsyncAct(action="sleep", seconds=60))
        worker = start_worker("--queue", "default", "--shutdown-timeout", "0.5")
        wait_for(lambda job=job: _ran(job.id, "async:sleep"))
        began = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert worker.wait(20) == 0
        assert time.monotonic() - began < 3.5, worker.output()
        assert _ran(job.id, "async-cancelled")  # its except ran, and wrote
        back = Job.objects.get(id=job.id)
        assert back.state == JobState.AVAILABLE, back.state
        Job.objects.filter(id=job.id).delete()


@pytest.mark.slow
def test_an_async_handlers_progress_shows_and_heartbeats_keep_it_alive(start_worker):
    # 4.5 s: past STALE_AFTER (3 s in tests), so only heartbeats keep it from a rescue.
    job = awa.enqueue(AsyncAct(action="progress", seconds=4.5))
    start_worker("--queue", "default")
    running = wait_for(
        lambda: Job.objects.filter(
            id=job.id, state=JobState.RUNNING, progress__isnull=False
        ).first()
    )
    assert running.progress["percent"] == 60 and running.progress["message"] == "async halfway"
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=20)
    assert done.attempt == 1 and done.errors == []


def test_cancelling_a_running_async_job_cancels_its_coroutine(start_worker):
    job = awa.enqueue(AsyncAct(action="sleep", seconds=60))
    start_worker("--queue", "default")
    wait_for(lambda: _ran(job.id, "async:sleep"))
    awa.cancel(job.id, "operator said so")
    # The coroutine gets CancelledError at its await (through NOTIFY or the heartbeat).
    wait_for(lambda: _ran(job.id, "async-cancelled"), timeout=5)
    final = Job.objects.get(id=job.id)
    assert final.state == JobState.CANCELLED
    assert "operator said so" in final.errors[-1]["error"]


@pytest.mark.slow
def test_an_async_handler_past_its_timeout_is_cancelled_and_retried(start_worker):
    job = awa.enqueue(TimedAsync(seconds=60))
    start_worker("--queue", "default")
    retrying = wait_for_state(job.id, JobState.RETRYABLE, timeout=10)
    assert retrying.attempt == 1
    assert "timed out: the attempt passed its kind's timeout of 1s" in retrying.errors[-1]["error"]
    wait_for(lambda: _ran(job.id, "timed-async:cancelled"), timeout=5)
    # The retry (max_attempts=2) times out too: failed.
    failed = wait_for_state(job.id, JobState.FAILED, timeout=20)
    assert failed.attempt == 2 and len(failed.errors) == 2
    assert all("timed out" in e["error"] for e in failed.errors)
    assert not _ran(job.id, "timed-async:end")


@pytest.mark.slow
def test_a_sync_handler_past_its_timeout_is_given_up_and_keeps_its_slot(start_worker):
    job = awa.enqueue(Timed(seconds=3))
    start_worker("--queue", "default=1")
    wait_for(lambda: _ran(job.id, "timed:start"))
    queued = awa.enqueue(Echo(n=1), queue="default")
    retrying = wait_for_state(job.id, JobState.RETRYABLE, timeout=10)
    assert "timed out" in retrying.errors[-1]["error"]
    # Recorded while the handler still runs: it cannot be stopped.
    assert not _ran(job.id, "timed:end:cancelled=True")
    wait_for(lambda: _ran(job.id, "timed:end:cancelled=True"), timeout=10)
    wait_for_state(queued.id, JobState.COMPLETED, timeout=10)
    started = Ledger.objects.get(job_id=queued.id).id
    ended = Ledger.objects.get(job_id=job.id, note="timed:end:cancelled=True").id
    # Its one slot stayed busy until the timed-out handler returned.
    assert started > ended
    # The late return changed nothing: attempt 1 has its one timed-out entry.
    row = Job.objects.get(id=job.id)
    assert row.state in (JobState.RETRYABLE, JobState.RUNNING, JobState.FAILED)
    assert [e["attempt"] for e in row.errors][:1] == [1] and row.errors[0]["error"].startswith(
        "timed out"
    )


@pytest.mark.slow
def test_a_slow_cleanup_of_a_cancelled_async_handler_holds_up_shutdown_one_grace_only(
    start_worker,
):
    """At shutdown the worker's event loop stops LOOP_GRACE (1 s) after it cancelled the
    handlers still on it. A handler whose cleanup outlasts that (here 2 s of a sync call
    in its thread; under load, its `except` writing a row) was left pending, and its
    handler thread waited for a loop that had stopped: the worker's stop then waited
    the drain's 3 s bound on that thread (test_shutdown_cancels_... failed so in CI)."""
    job = awa.enqueue(AsyncAct(action="slow_cleanup", seconds=60))
    worker = start_worker("--queue", "default", "--shutdown-timeout", "0.5")
    wait_for(lambda: _ran(job.id, "async:slow_cleanup"))
    began = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    # SHUTDOWN_TIMEOUT (0.5 s), LOOP_GRACE (1 s), then LOOP_LOOK (0.25 s) at most.
    took = time.monotonic() - began
    assert took < 3, f"the worker took {took:.1f}s to stop\n{worker.output()}"
    back = Job.objects.get(id=job.id)
    assert back.state == JobState.AVAILABLE and "worker shut down" in back.errors[-1]["error"]


@pytest.mark.slow
def test_an_async_handler_ignoring_cancellation_cannot_hold_up_shutdown(start_worker):
    job = awa.enqueue(AsyncAct(action="stubborn", seconds=120))
    worker = start_worker("--queue", "default", "--shutdown-timeout", "1")
    wait_for(lambda: _ran(job.id, "async:stubborn"))
    began = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    # SHUTDOWN_TIMEOUT (1 s) plus the drain's bounded joins, never the handler's 120 s.
    assert time.monotonic() - began < 10
    back = Job.objects.get(id=job.id)
    assert back.state == JobState.AVAILABLE and "worker shut down" in back.errors[-1]["error"]
    assert "gave back 1 interrupted job(s)" in worker.output()


def test_timeout_and_async_options_are_checked_when_declared():
    with pytest.raises(awa.ValidationError, match=r"@awa.worker\(Echo\): timeout: expected"):
        awa.worker(Echo, timeout="10")  # type: ignore[arg-type]
    with pytest.raises(awa.ValidationError, match="timeout must be positive"):
        awa.worker(Echo, timeout=0)
    with pytest.raises(awa.ValidationError, match="timeout must be positive"):
        awa.worker(Echo, timeout=dt.timedelta(seconds=-1))
    with pytest.raises(awa.ValidationError, match=r"timeout \(60s\) is longer than the deadline"):
        awa.worker(Echo, timeout=60, deadline=30)

    async def handler(job):
        return None

    with pytest.raises(ImproperlyConfigured, match="atomic=True needs a sync handler"):
        awa.worker(Echo, atomic=True)(handler)


def test_aenqueue_in_an_async_view_commits_with_its_orm_writes():
    response = async_to_sync(AsyncClient().get)("/async/enqueue/", {"reference": "a1"})
    assert response.status_code == 200, response.content
    body = response.json()
    job = Job.objects.get(id=body["job"])
    assert job.kind == "echo" and job.args["note"] == "order:a1" and job.queue == "echo"
    assert job.state == JobState.AVAILABLE
    assert Job.objects.filter(id__in=body["many"], args__note__startswith="bulk:a1").count() == 2
    assert Order.objects.filter(id=body["order"]).exists()


def test_aenqueue_joins_the_views_transaction_and_rolls_back_with_it():
    client = AsyncClient(raise_request_exception=False)
    response = async_to_sync(client.get)("/async/checkout/", {"reference": "ok"})
    assert response.status_code == 200, response.content
    assert Job.objects.filter(id=response.json()["job"], args__note="checkout:ok").exists()

    response = async_to_sync(client.get)("/async/checkout/", {"reference": "no", "fail": "1"})
    assert response.status_code == 500
    # The order and the job aenqueue inserted in that transaction are both gone.
    assert not Order.objects.filter(reference="no").exists()
    assert not Job.objects.filter(args__note="checkout:no").exists()
