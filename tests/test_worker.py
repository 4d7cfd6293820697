"""The worker, end to end: real ``awa_worker`` processes on the test database."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.models import Count
from django.utils import timezone

import django_awa as awa
from django_awa.models import Job, JobState, MaintenanceLease, Worker
from tests.conftest import ROOT, make_job, scratch_database, wait_for, wait_for_state
from tests.testapp.jobs import (
    Act,
    AsyncAct,
    Bailout,
    Echo,
    LeakyAtomic,
    Severed,
    Unhandled,
    Unwound,
)
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db(transaction=True)


def _at(entry: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(entry["at"])


def test_every_handler_result_of_the_table(start_worker):
    jobs = {
        "ok": awa.enqueue(Act(action="ok")),
        "retry_after": awa.enqueue(Act(action="retry_after", seconds=30)),
        "retry_after_td": awa.enqueue(Act(action="retry_after_td", seconds=45)),
        "snooze": awa.enqueue(Act(action="snooze", seconds=1)),
        "cancel": awa.enqueue(Act(action="cancel")),
        "callback": awa.enqueue(Act(action="callback", seconds=60)),
        "terminal": awa.enqueue(Act(action="terminal")),
        "raise": awa.enqueue(Act(action="raise")),
        "last": awa.enqueue(Act(action="raise"), max_attempts=1),
        "bad_return": awa.enqueue(Act(action="bad_return"), max_attempts=1),
    }
    start_worker("--queue", "default")

    ok = wait_for_state(jobs["ok"].id, JobState.COMPLETED)
    assert ok.attempt == 1 and ok.finalized_at is not None and ok.errors == []

    retried = wait_for_state(jobs["retry_after"].id, JobState.RETRYABLE)
    assert retried.attempt == 1 and retried.errors == [] and retried.finalized_at is None
    assert 25 < (retried.run_at - retried.attempted_at).total_seconds() < 35
    retried_td = wait_for_state(jobs["retry_after_td"].id, JobState.RETRYABLE)
    assert 40 < (retried_td.run_at - retried_td.attempted_at).total_seconds() < 50

    cancelled = wait_for_state(jobs["cancel"].id, JobState.CANCELLED)
    assert cancelled.finalized_at is not None
    assert "not needed any more" in cancelled.errors[-1]["error"]

    waiting = wait_for_state(jobs["callback"].id, JobState.WAITING_EXTERNAL)
    assert waiting.callback_id is not None and waiting.callback_timeout_at is not None
    assert waiting.finalized_at is None

    terminal = wait_for_state(jobs["terminal"].id, JobState.FAILED)
    assert terminal.attempt == 1 and terminal.max_attempts == 3
    assert "TerminalError: no point retrying" in terminal.errors[-1]["error"]

    raised = wait_for_state(jobs["raise"].id, JobState.RETRYABLE)
    entry = raised.errors[-1]
    assert entry["attempt"] == 1 and "ValueError: boom on attempt 1" in entry["error"]
    assert "Traceback" in entry["traceback"]
    # The first retry comes 2 to 2.5 s after the failure.
    delay = (raised.run_at - _at(entry)).total_seconds()
    assert 1.95 <= delay <= 2.55, delay

    exhausted = wait_for_state(jobs["last"].id, JobState.FAILED)
    assert exhausted.attempt == 1 and len(exhausted.errors) == 1

    bad = wait_for_state(jobs["bad_return"].id, JobState.FAILED)
    assert "handler returned a dict" in bad.errors[-1]["error"]
    assert "set is not JSON serializable" in bad.errors[-1]["error"]

    # Snooze: scheduled without using an attempt, then the next run keeps the number.
    snoozed = wait_for_state(jobs["snooze"].id, JobState.COMPLETED, timeout=20)
    runs = list(Ledger.objects.filter(job_id=snoozed.id).values_list("attempt", flat=True))
    assert runs == [1, 1] and snoozed.attempt == 1


def test_a_failing_job_retries_with_backoff_until_it_succeeds(start_worker):
    job = awa.enqueue(Act(action="ok", fail_until=1))
    start_worker("--queue", "default")
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=20)
    assert done.attempt == 2
    assert [e["attempt"] for e in done.errors] == [1]
    assert list(Ledger.objects.filter(job_id=job.id).values_list("attempt", flat=True)) == [1, 2]


def test_retries_exhaust_the_job(start_worker):
    job = awa.enqueue(Act(action="raise"), max_attempts=2)
    start_worker("--queue", "default")
    failed = wait_for_state(job.id, JobState.FAILED, timeout=20)
    assert failed.attempt == 2 and [e["attempt"] for e in failed.errors] == [1, 2]
    assert failed.finalized_at is not None


def test_unknown_kind_and_undecodable_args_fail_terminally(start_worker):
    unknown = awa.enqueue(Unhandled(x=1))
    bad_args = make_job(kind="echo", queue="default", args={"n": "not a number"})
    missing = make_job(kind="echo", queue="default", args={})
    start_worker("--queue", "default")
    failed = wait_for_state(unknown.id, JobState.FAILED)
    assert failed.attempt == 1 and "unknown job kind 'unhandled'" in failed.errors[-1]["error"]
    # A kind renamed while its jobs were queued: the error says how to keep the
    # kind and how to run the jobs it failed once a worker declares it again.
    assert "kind: ClassVar[str] = 'unhandled'" in failed.errors[-1]["error"]
    assert "awa_jobs retry --kind unhandled" in failed.errors[-1]["error"]
    bad = wait_for_state(bad_args.id, JobState.FAILED)
    assert "kind 'echo'" in bad.errors[-1]["error"] and "'n'" in bad.errors[-1]["error"]
    gone = wait_for_state(missing.id, JobState.FAILED)
    assert "field 'n' is missing" in gone.errors[-1]["error"]


@pytest.mark.slow
def test_two_worker_processes_never_run_the_same_attempt(start_worker):
    ids = awa.enqueue_many([Echo(n=i) for i in range(2000)])
    start_worker("--queue", "echo=8")
    start_worker("--queue", "echo=8")
    wait_for(
        lambda: Job.objects.filter(id__in=ids, state=JobState.COMPLETED).count() == 2000,
        timeout=90,
        message=lambda: str(Job.objects.filter(id__in=ids).values("state").annotate(n=Count("id"))),
    )
    runs = Ledger.objects.filter(job_id__in=ids).values("job_id").annotate(n=Count("id"))
    counts = {row["job_id"]: row["n"] for row in runs}
    assert len(counts) == 2000
    assert set(counts.values()) == {1}


def test_processes_option_runs_several_processes(start_worker):
    ids = awa.enqueue_many([Act(action="pid") for _ in range(200)])
    start_worker("--queue", "default=4", "--processes", "2")
    wait_for(
        lambda: Job.objects.filter(id__in=ids, state=JobState.COMPLETED).count() == 200,
        timeout=60,
    )
    notes = set(Ledger.objects.filter(note__startswith="pid:").values_list("note", flat=True))
    assert len(notes) == 2


@pytest.mark.parametrize("service", ["producer", "listener"])
def test_a_service_thread_that_fails_stops_the_worker(start_worker, service):
    # Before, the thread died alone and the worker stayed up, heartbeating: claiming
    # nothing from the queue (a producer) or hearing no NOTIFY and no cancel (the
    # listener), with nothing but a traceback on stderr to say so.
    worker = start_worker("--queue", "default=2", env={"AWA_TEST_BREAK_THREAD": service})
    assert worker.wait(20) == 70, worker.output()[-3000:]
    out = worker.output()
    assert re.search(rf"CRITICAL .*its thread awa-{service}[-\w]* failed; stopping", out), out
    assert f"RuntimeError('injected fault in the {service}')" in out
    assert not Worker.objects.exists()  # deregistered as at any stop


def test_a_failed_completer_stops_the_worker_and_gives_running_jobs_back_now(start_worker):
    job = awa.enqueue(Act(action="ok"))
    worker = start_worker("--queue", "default=2", env={"AWA_TEST_BREAK_THREAD": "completer"})
    assert worker.wait(20) == 70, worker.output()[-3000:]
    assert "its thread awa-completer failed; stopping, giving running jobs back now" in (
        worker.output()
    )
    # Its outcome was never written: not left running until rescue, but given back.
    done = Job.objects.get(id=job.id)
    assert done.state == JobState.AVAILABLE, (done.state, done.errors)
    assert "interrupted" in done.errors[-1]["error"]


@pytest.mark.slow
def test_a_child_stopped_by_a_failed_thread_is_started_again(start_worker):
    worker = start_worker(
        "--queue", "default=2", "--processes", "2", env={"AWA_TEST_BREAK_THREAD": "producer"}
    )
    wait_for(
        lambda: re.search(r"exited \(code 70\) without being asked to stop; started \d+",
                          worker.output()),
        timeout=30,
        message=lambda: worker.output()[-3000:],
    )  # fmt: skip
    os.kill(worker.pid, signal.SIGTERM)
    # 1 when the last children failed too, 0 when they stopped at the SIGTERM first.
    assert worker.wait(20) in (0, 1)


@pytest.mark.slow
def test_a_killed_child_of_a_processes_group_is_started_again(start_worker):
    # A child killed by SIGKILL (the OOM killer) took its share of the capacity with
    # it while the supervisor ran on, saying nothing.
    worker = start_worker("--queue", "default=2", "--processes", "2")
    started = wait_for(
        lambda: re.search(r"started 2 processes: (\d+), (\d+)", worker.output()), timeout=30
    )
    wait_for(lambda: worker.output().count("listening for new jobs") == 2, timeout=30)
    os.kill(int(started.group(1)), signal.SIGKILL)
    replaced = wait_for(
        lambda: re.search(
            r"exited \(code -9\) without being asked to stop; started (\d+)", worker.output()
        ),
        timeout=30,
        message=lambda: worker.output()[-3000:],
    )
    wait_for(lambda: worker.output().count("listening for new jobs") == 3, timeout=30)
    ids = awa.enqueue_many([Act(action="pid") for _ in range(100)])
    wait_for(
        lambda: Job.objects.filter(id__in=ids, state=JobState.COMPLETED).count() == 100,
        timeout=60,
    )
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait(20) == 0
    # The new child ran jobs, and both processes stopped with the supervisor.
    assert Ledger.objects.filter(note=f"pid:{replaced.group(1)}").exists()


@pytest.mark.slow
def test_ctrl_c_on_a_processes_group_lets_in_flight_jobs_finish(start_worker):
    # The terminal sends SIGINT to the supervisor and to each child, and the
    # supervisor passes one on: a child gets it twice, but one Ctrl-C must
    # still mean "finish what you run", not "give it back now".
    job = awa.enqueue(Act(action="sleep", seconds=1.5))
    worker = start_worker("--queue", "default=2", "--processes", "2")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0
    done = Job.objects.get(id=job.id)
    assert done.state == JobState.COMPLETED and done.errors == [], worker.output()
    assert "giving back in-flight jobs now" not in worker.output()


@pytest.mark.slow
def test_a_second_ctrl_c_on_a_processes_group_gives_jobs_back_now(start_worker):
    job = awa.enqueue(Act(action="sleep", seconds=30))
    worker = start_worker("--queue", "default=2", "--processes", "2")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    os.killpg(worker.pid, signal.SIGINT)
    wait_for(lambda: "supervisor: SIGINT received; children finish" in worker.output())
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0
    back = Job.objects.get(id=job.id)
    assert back.state == JobState.AVAILABLE and "worker shut down" in back.errors[-1]["error"]
    assert "children give back in-flight jobs now" in worker.output()
    assert "SIGQUIT: giving back in-flight jobs now" in worker.output()


@pytest.mark.slow
def test_a_burst_of_signals_still_shuts_the_worker_down(start_worker):
    # A signal arriving while the handler of the one before runs (or while the
    # main thread holds a lock the handler needs) must not hang the worker.
    job = awa.enqueue(Act(action="sleep", seconds=30))
    worker = start_worker("--queue", "default")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    for _ in range(200):
        worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert Job.objects.get(id=job.id).state == JobState.AVAILABLE


@pytest.mark.slow
def test_a_sigkilled_workers_job_is_rescued_and_finished_by_another(start_worker):
    job = awa.enqueue(Act(action="sleep", seconds=2))
    victim = start_worker("--queue", "default")
    running = wait_for_state(job.id, JobState.RUNNING)
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    victim.kill()
    start_worker("--queue", "default")
    # STALE_AFTER (3 s) plus a maintenance cycle, then a backoff of 2-2.5 s.
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=25)
    assert done.attempt == 2 and done.run_lease > running.run_lease
    assert "rescued: stale heartbeat" in done.errors[0]["error"]
    assert list(Ledger.objects.filter(job_id=job.id).values_list("attempt", flat=True)) == [1, 2]


@pytest.mark.slow
def test_sigterm_lets_in_flight_jobs_finish_and_claims_no_more(start_worker):
    job = awa.enqueue(Act(action="sleep", seconds=1.5))
    worker = start_worker("--queue", "default=1")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    waiting = awa.enqueue(Act(action="ok"))
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED
    assert Job.objects.get(id=waiting.id).state == JobState.AVAILABLE
    assert "finishing in-flight jobs" in worker.output()


@pytest.mark.slow
def test_sigterm_gives_back_jobs_that_outlive_the_shutdown_timeout(start_worker):
    job = awa.enqueue(Act(action="sleep", seconds=30))
    worker = start_worker("--queue", "default", "--shutdown-timeout", "0.5")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    back = Job.objects.get(id=job.id)
    # The interrupted attempt counts: the next run is attempt 2, never attempt 1 again.
    assert back.state == JobState.AVAILABLE and back.attempt == 1
    assert "worker shut down" in back.errors[-1]["error"]
    assert "gave back 1 interrupted job(s)" in worker.output()
    # Like any retry, with its follow-up in the same transaction.
    retried = Job.objects.filter(kind="echo", args__note__startswith="retried:1:interrupted")
    assert retried.count() == 1


def test_a_handler_that_ignores_the_stop_does_not_hold_up_the_exit(start_worker):
    # Its job is given back at SHUTDOWN_TIMEOUT; the worker then waited 3 s more for
    # the thread still in the handler, which ends with the process anyway.
    job = awa.enqueue(Act(action="progress", seconds=30))  # sleeps, ignoring cancels
    worker = start_worker("--queue", "default", "--shutdown-timeout", "0")
    wait_for(lambda: Job.objects.get(id=job.id).progress is not None)
    signalled = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert time.monotonic() - signalled < 2.0, worker.output()[-2000:]
    assert Job.objects.get(id=job.id).state == JobState.AVAILABLE


def test_sighup_stops_a_worker_as_sigterm_does(start_worker):
    # A closed terminal or a dropped ssh session: left to its default, SIGHUP killed
    # the worker, its running job left for the rescue at STALE_AFTER.
    job = awa.enqueue(Act(action="sleep", seconds=1))
    worker = start_worker("--queue", "default")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    worker.signal(signal.SIGHUP)
    assert worker.wait(20) == 0
    assert "SIGHUP received: finishing in-flight jobs" in worker.output()
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED


@pytest.mark.slow
def test_an_attempt_interrupted_on_its_last_try_is_exhausted_with_its_followups(start_worker):
    job = awa.enqueue(Act(action="sleep", seconds=30), max_attempts=1)
    worker = start_worker("--queue", "default", "--shutdown-timeout", "0.5")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    back = Job.objects.get(id=job.id)
    assert back.state == JobState.FAILED and back.finalized_at is not None
    assert "worker shut down" in back.errors[-1]["error"]
    followup = Job.objects.get(kind="echo", metadata__awa_trigger__job_id=job.id)
    assert followup.args["note"] == "exhausted:1"
    assert followup.metadata["awa_trigger"]["outcome"] == "exhausted"


@pytest.mark.slow
def test_sigterm_gives_back_prefetched_jobs_without_using_an_attempt(start_worker):
    # Quick jobs first (priority 1) teach the worker that handlers are fast, so
    # it claims ahead; the slow ones after them fill its prefetch buffer.
    awa.enqueue_many([awa.EnqueueRequest(Act(action="ok"), priority=1) for _ in range(60)])
    slow = awa.enqueue_many(
        [awa.EnqueueRequest(Act(action="sleep", seconds=3), priority=2) for _ in range(30)]
    )
    worker = start_worker("--queue", "default=2", "--shutdown-timeout", "10")
    wait_for(lambda: Ledger.objects.filter(job_id__in=slow).count() == 2)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0

    states = dict(Job.objects.filter(id__in=slow).values_list("id", "state"))
    ran = set(Ledger.objects.filter(job_id__in=slow).values_list("job_id", flat=True))
    assert len(ran) == 2 and all(states[i] == JobState.COMPLETED for i in ran)
    # Available again: those the worker claimed ahead and gave back (their row
    # was touched), and those it never claimed (attempt 0, how many depends on
    # how far ahead it claimed).
    available = Job.objects.filter(id__in=slow, state=JobState.AVAILABLE)
    held = [j for j in available if j.attempt or j.snoozed]
    # The worker did prefetch slow jobs, and gave them back untouched.
    assert len(held) >= 5, states
    # As after a Snooze: the row keeps the number its next run will use.
    assert all(j.attempt == 1 and j.snoozed and j.errors == [] for j in held)
    assert f"gave back {len(held)} prefetched job(s)" in worker.output()
    # The next run of a given-back job is its first attempt.
    start_worker("--queue", "default=30")
    again = wait_for_state(held[0].id, JobState.COMPLETED, timeout=20)
    assert again.attempt == 1


@pytest.mark.slow
def test_maintenance_leader_failover(start_worker):
    first = start_worker("--queue", "default")
    wait_for(lambda: "is now the maintenance leader" in first.output(), timeout=10)
    second = start_worker("--queue", "default", "--queue", "other")
    # A job only the second runs: by its outcome the second worker's
    # maintenance thread (started before its producers) has tried to lead.
    wait_for_state(awa.enqueue(Act(action="ok"), queue="other").id, JobState.COMPLETED)
    assert "is now the maintenance leader" not in second.output()
    assert MaintenanceLease.objects.get(name="maintenance").holder.endswith(f":{first.pid}")
    first.kill()
    wait_for(lambda: "is now the maintenance leader" in second.output(), timeout=10)
    # The new leader does maintenance: a scheduled job becomes due and runs.
    soon = awa.enqueue(Act(action="ok"), run_at=timezone.now() + dt.timedelta(seconds=1))
    assert Job.objects.get(id=soon.id).state == JobState.SCHEDULED
    wait_for_state(soon.id, JobState.COMPLETED, timeout=10)


@pytest.mark.slow
def test_a_frozen_leader_loses_the_lease_and_does_nothing_when_thawed(start_worker):
    frozen = start_worker("--queue", "default")
    wait_for(lambda: "is now the maintenance leader" in frozen.output(), timeout=10)
    other = start_worker("--queue", "default")
    wait_for(lambda: "starting" in other.output())
    frozen.signal(signal.SIGSTOP)  # its session stays open, as a paused VM's would
    try:
        # A job whose worker died: rescued only by a leader's maintenance.
        stale = make_job(
            state=JobState.RUNNING,
            kind="act",
            attempt=1,
            max_attempts=3,
            heartbeat_at=timezone.now() - dt.timedelta(minutes=5),
        )
        # STALE_AFTER (3 s here) without renewal, and the other worker leads.
        wait_for(lambda: "is now the maintenance leader" in other.output(), timeout=15)
        rescued = wait_for(
            lambda: Job.objects.filter(id=stale.id).exclude(errors=[]).first(), timeout=10
        )
        assert rescued.errors[0]["error"] == "rescued: stale heartbeat"
    finally:
        frozen.signal(signal.SIGCONT)
    # Thawed, it finds out one of two ways: frozen between transactions, its
    # next renewal matches nothing (another term); frozen inside one, the
    # server has ended that transaction (idle_in_transaction_session_timeout)
    # and closed its session, so it stops leading until it reconnects.
    wait_for(
        lambda: (
            "is no longer the maintenance leader" in frozen.output()
            or "stops leading maintenance until it reconnects" in frozen.output()
        ),
        timeout=15,
        message=lambda: frozen.output()[-3000:],
    )
    # The thawed worker did not take the lease back; the other still leads.
    lease = MaintenanceLease.objects.get(name="maintenance")
    assert lease.holder.endswith(f":{other.pid}")
    soon = awa.enqueue(Act(action="ok"), run_at=timezone.now() + dt.timedelta(seconds=1))
    wait_for_state(soon.id, JobState.COMPLETED, timeout=10)
    assert frozen.output().count("is now the maintenance leader") == 1


def test_cancel_reaches_the_running_handler_within_a_second(start_worker):
    # Through NOTIFY awa_cancel: with heartbeats 20 s apart, the heartbeat
    # (which also finds the row no longer running this attempt) comes too late.
    job = awa.enqueue(Act(action="sleep", seconds=20))
    worker = start_worker(
        "--queue",
        "default",
        env={"AWA_TEST_HEARTBEAT_INTERVAL": "20", "AWA_TEST_STALE_AFTER": "60"},
    )
    wait_for(lambda: "listening for new jobs" in worker.output(), message=worker.output)
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    cancelled = awa.cancel(job.id, "operator said so")
    assert cancelled.state == JobState.CANCELLED
    wait_for(lambda: Ledger.objects.filter(job_id=job.id, note="saw-cancel").exists(), timeout=1.5)
    final = Job.objects.get(id=job.id)
    assert final.state == JobState.CANCELLED  # the handler's return is discarded
    assert "operator said so" in final.errors[-1]["error"]


def test_progress_is_visible_while_the_job_runs(start_worker):
    job = awa.enqueue(Act(action="progress", seconds=3))
    start_worker("--queue", "default")
    running = wait_for(
        lambda: (j := Job.objects.get(id=job.id)).state == JobState.RUNNING and j.progress and j,
        timeout=10,
    )
    assert running.progress == {"percent": 40, "message": "working", "metadata": {"step": 2}}
    done = wait_for_state(job.id, JobState.COMPLETED)
    assert done.progress["percent"] == 40


@pytest.mark.slow
def test_heartbeats_keep_a_long_job_alive(start_worker):
    # Longer than STALE_AFTER (3 s): only heartbeats keep it from being rescued.
    job = awa.enqueue(Act(action="sleep", seconds=5))
    start_worker("--queue", "default")
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=20)
    assert done.attempt == 1 and done.errors == []


def test_worker_wakes_on_notify_without_waiting_for_the_poll(start_worker):
    # Polling every 30 s: only NOTIFY picks a job up within seconds. The
    # listener wakes every queue as it connects, and a producer claims once as
    # it starts, so the job timed is enqueued once the listener listens and a
    # first job has been picked up: the producer sleeps again by then.
    worker = start_worker("--queue", "default", env={"AWA_TEST_POLL_INTERVAL": "30"})
    wait_for(lambda: "listening for new jobs" in worker.output(), message=worker.output)
    wait_for_state(awa.enqueue(Act(action="ok")).id, JobState.COMPLETED, timeout=5)
    job = awa.enqueue(Act(action="ok"))
    enqueued = time.monotonic()
    done = wait_for_state(job.id, JobState.COMPLETED, timeout=5)
    assert time.monotonic() - enqueued < 3
    assert (done.attempted_at - done.created_at).total_seconds() < 3


def test_startup_log_names_queues_concurrency_database_and_pid(start_worker):
    worker = start_worker("--queue", "default=3", "--queue", "other")
    wait_for(lambda: "starting" in worker.output())
    line = next(x for x in worker.output().splitlines() if "starting" in x)
    assert "default=3" in line and "other=10" in line
    assert connection.settings_dict["NAME"] in line
    assert re.search(rf":{worker.pid}\b", line)


def test_a_handler_leaving_a_transaction_open_fails_alone_and_the_next_jobs_commit(
    start_worker,
):
    # One handler thread: every job after the leaky ones runs on its connection.
    leaky = [
        awa.enqueue(Act(action="leave_atomic")),
        awa.enqueue(Act(action="leave_autocommit")),
        awa.enqueue(LeakyAtomic(reference="atomic-leak")),
    ]
    after = [awa.enqueue(Act(action="ok", tag=f"after{i}")) for i in range(3)]
    start_worker("--queue", "default=1")
    for job in after:
        wait_for_state(job.id, JobState.COMPLETED)
        assert Ledger.objects.filter(job_id=job.id, note="ok").exists()  # committed
    expected = (JobState.RETRYABLE, JobState.RETRYABLE, JobState.FAILED)
    for job, state in zip(leaky, expected, strict=True):
        row = wait_for_state(job.id, state)
        assert "left a transaction open on database 'default'" in row.errors[0]["error"]
    assert not Order.objects.filter(reference__contains="leak").exists()  # rolled back
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state LIKE 'idle in transaction%%'"
        )
        assert cursor.fetchone()[0] == 0


def test_an_async_handler_leaving_a_transaction_open_fails_as_a_sync_one_does(start_worker):
    # Its sync part's thread had its connections closed after it, which rolled the
    # transaction back unseen: the job completed with its writes lost.
    leaky = awa.enqueue(AsyncAct(action="leave_atomic"))
    after = awa.enqueue(AsyncAct(action="ok"))
    start_worker("--queue", "default=1")
    row = wait_for_state(leaky.id, JobState.RETRYABLE)
    assert "left a transaction open on database 'default'" in row.errors[0]["error"]
    assert not Order.objects.filter(reference__startswith="async-leak-").exists()
    wait_for_state(after.id, JobState.COMPLETED)
    assert Ledger.objects.filter(job_id=after.id, note="async:ok").exists()


def test_a_handler_threads_connection_closed_while_idle_costs_no_attempt(start_worker):
    # A server or pooler closing an idle connection (idle_session_timeout, PgBouncer's
    # client_idle_timeout) closes the handler thread's alone: the worker sees no outage.
    start_worker("--queue", "default=1")
    first = awa.enqueue(Act(action="backend_pid"))
    wait_for_state(first.id, JobState.COMPLETED)
    note = Ledger.objects.get(job_id=first.id, note__startswith="backend:").note
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [int(note.partition(":")[2])])
    time.sleep(1.5)  # idle past IDLE_CHECK_AFTER
    second = awa.enqueue(Act(action="ok"), max_attempts=1)
    row = wait_for_state(second.id, JobState.COMPLETED)
    assert row.attempt == 1 and row.errors == []


def test_the_worker_names_the_queues_of_declared_kinds_it_does_not_run(start_worker):
    worker = start_worker("--queue", "default")
    wait_for(lambda: "listening for new jobs" in worker.output(), timeout=30)
    said = [line for line in worker.output().splitlines() if "does not run queue(s)" in line]
    assert len(said) == 1 and "echo (echo)" in said[0] and "flow (" in said[0]
    assert " default (" not in said[0]  # it runs that one
    assert "awa.W102" not in worker.output()  # no job waits in a queue nothing names


def test_the_worker_warns_once_of_queues_nothing_names_or_runs(start_worker):
    now = timezone.now()
    later = now + dt.timedelta(hours=1)
    make_job(queue="renamed_billing")
    make_job(queue="renamed_billing")
    make_job(queue="renamed_billing", state=JobState.SCHEDULED, run_at=later)
    make_job(queue="renamed_billing", state=JobState.RUNNING, heartbeat_at=now)
    make_job(queue="gone_done", state=JobState.COMPLETED, finalized_at=now)
    make_job(queue="echo")  # a kind's queue
    make_job(queue="served_elsewhere")
    make_job(queue="stale_served", state=JobState.RETRYABLE, run_at=later)
    for queue, seen in (("served_elsewhere", now), ("stale_served", now - dt.timedelta(hours=1))):
        Worker.objects.create(
            id=uuid.uuid4(), name=f"elsewhere:{queue}", host="elsewhere", pid=1,
            queues={queue: 1}, last_seen_at=seen,
        )  # fmt: skip
    worker = start_worker("--queue", "default")
    wait_for(lambda: "listening for new jobs" in worker.output(), timeout=30)
    warned = [line for line in worker.output().splitlines() if "awa.W102" in line]
    assert len(warned) == 1, worker.output()
    assert (
        "queue(s) renamed_billing (3 job(s)), stale_served (1 job(s)) that no worker runs"
        in (warned[0])
    )


def test_a_queue_concurrency_past_the_bound_is_refused_by_name():
    from django_awa.management.commands.awa_worker import parse_queue

    assert parse_queue("q=1000") == ("q", 1000)
    for value in ("q=0", "q=1001", f"q={10**12}"):
        words = rf"--queue '{value}': concurrency must be 1 to 1,000"
        with pytest.raises(CommandError, match=words):
            parse_queue(value)


def _awa_migrations() -> list[str]:
    """django-awa's migrations as Django's own loader finds them."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    found = {name: m for (app, name), m in loader.disk_migrations.items() if app == "django_awa"}
    # The worker's cheap start-up check compares names: it holds without squashes.
    assert not [name for name, migration in found.items() if migration.replaces]
    return sorted(found)


def _refused(worker, database: str, missing: str):
    assert worker.wait(15) == 1  # a CommandError, at once
    output = worker.output()
    settings_dict = connection.settings_dict
    server = f"{settings_dict['HOST'] or 'local socket'}:{settings_dict['PORT'] or 5432}"
    assert (
        f"CommandError: django-awa's migrations are not applied to database 'default' "
        f"({server}/{database}): {missing}; run `manage.py migrate django_awa` before "
        "starting workers"
    ) in output
    assert "awa worker" not in output and "unavailable" not in output
    return output


def test_a_worker_refuses_a_database_never_migrated_naming_the_migrations(start_worker):
    names = _awa_migrations()
    with scratch_database("unmigrated") as name:
        worker = start_worker("--queue", "default", env={"AWA_TEST_DB_NAME": name})
        _refused(worker, name, f"{len(names)} are missing, {names[0]} to {names[-1]}")


def test_a_worker_refuses_a_database_behind_its_code_even_with_processes(start_worker):
    *_, before, last_but_one, last = _awa_migrations()  # 0016, 0017 and 0018 today
    with scratch_database("behind") as name:
        env = {"AWA_TEST_DB_NAME": name}
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "django_awa", before, "-v0"],
            cwd=ROOT,
            env={**os.environ, **env},
            check=True,
            timeout=120,
        )
        single = start_worker("--queue", "default", env=env)
        group = start_worker("--queue", "default", "--processes", "2", env=env)
        missing = f"{last_but_one}, {last} are missing"
        _refused(single, name, missing)
        # The supervisor checks before it forks: no child started, none restarted.
        assert "supervisor" not in _refused(group, name, missing)


@pytest.fixture
def newer_migration():
    """A django-awa migration recorded that this code does not have: a newer release's."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) "
            "VALUES ('django_awa', '9999_of_a_newer_release', now())"
        )
    yield "9999_of_a_newer_release"
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE name = '9999_of_a_newer_release'")


def test_a_worker_starts_on_a_database_ahead_of_its_code_and_says_so(start_worker, newer_migration):
    worker = start_worker("--queue", "default")
    job = awa.enqueue(Act(action="ok"))
    wait_for_state(job.id, JobState.COMPLETED)
    assert (
        "has django-awa migrations this worker does not know, a newer release's: "
        f"{newer_migration}; starting"
    ) in worker.output()
    assert worker.stop() == 0


def test_bad_queue_option_is_refused(start_worker):
    worker = start_worker("--queue", "bad name")
    assert worker.wait(20) == 2
    assert "invalid queue name" in worker.output()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--queue", "default=abc"), "concurrency must be a whole number"),
        (("--queue", "default=0"), "concurrency must be 1 to 1,000"),
        (("--processes", "0"), "--processes must be at least 1"),
        (("--database", "nope"), "no database alias 'nope' in DATABASES"),
        (("--reload", "--processes", "2"), "leave out --processes"),
    ],
)
def test_a_bad_option_value_is_a_usage_error_exit_2_as_for_the_operator_commands(args, words):
    with pytest.raises(CommandError, match=words) as refused:
        call_command("awa_worker", *args)
    assert refused.value.returncode == 2


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e400", "31536001"])
def test_a_shutdown_timeout_that_is_no_wait_is_a_usage_error(start_worker, value):
    # nan waited for nothing (in-flight jobs given back at once); inf could wait for ever.
    worker = start_worker("--queue", "default", f"--shutdown-timeout={value}")
    assert worker.wait(20) == 2
    assert (
        "awa_worker: error: argument --shutdown-timeout: must be a number of seconds from 0 "
        f"to 31,536,000 (365 days), got '{value}'"
    ) in worker.output()
    assert "starting" not in worker.output()


def test_a_shutdown_timeout_given_to_call_command_is_checked_too():
    with pytest.raises(CommandError, match="--shutdown-timeout: must be a number") as refused:
        call_command("awa_worker", "--queue", "default", shutdown_timeout=float("nan"))
    assert refused.value.returncode == 2


def test_the_maintenance_leader_warns_when_autovacuum_will_not_visit_awa_job(start_worker):
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('autovacuum')::boolean")
        server_on = cursor.fetchone()[0]
    first = start_worker("--queue", "default")
    wait_for(lambda: "is now the maintenance leader" in first.output(), timeout=10)
    wait_for_state(awa.enqueue(Act(action="ok")).id, JobState.COMPLETED)  # a tick later
    assert first.stop() == 0
    # The warning follows the server's setting, whatever it is.
    assert ("autovacuum is off on this PostgreSQL server" in first.output()) != server_on
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE awa_job SET (autovacuum_enabled = false)")
    try:
        second = start_worker("--queue", "default")
        wait_for(lambda: "autovacuum is off" in second.output(), timeout=10)
        expected = "the awa_job table" if server_on else "this PostgreSQL server"
        assert f"autovacuum is off {'for' if server_on else 'on'} {expected}" in second.output()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE awa_job RESET (autovacuum_enabled)")


BASE_EXCEPTIONS = ("KeyboardInterrupt", "SystemExit", "GeneratorExit", "CancelledError", "Bail")


def test_a_handler_raising_a_base_exception_is_retried_and_its_thread_lives_on(start_worker):
    # A BaseException of the handler's own is "anything else" (SPEC 5): the
    # attempt is recorded, and the queue's only handler thread runs the next job.
    raising = {name: awa.enqueue(Act(action="base", tag=name)) for name in BASE_EXCEPTIONS}
    last = awa.enqueue(Act(action="base", tag="KeyboardInterrupt"), max_attempts=1)
    atomic = {
        name: awa.enqueue(Bailout(reference=f"bail-{name}", exc=name)) for name in BASE_EXCEPTIONS
    }
    atomic_last = awa.enqueue(Bailout(reference="bail-last", exc="SystemExit"), max_attempts=1)
    after = awa.enqueue_many([Act(action="ok") for _ in range(5)])
    worker = start_worker("--queue", "default=1")

    for job_id in after:
        wait_for_state(job_id, JobState.COMPLETED)
    # The first retry is 2 s away: every one of them is still retryable now.
    for name, job in [*raising.items(), *atomic.items()]:
        retried = wait_for_state(job.id, JobState.RETRYABLE, timeout=5)
        entry = retried.errors[-1]
        assert retried.attempt == 1 and entry["attempt"] == 1, retried.errors
        assert entry["error"].startswith(name), entry
        assert "Traceback" in entry["traceback"] and "base_exception" in entry["traceback"]
    for job in (last, atomic_last):
        failed = wait_for_state(job.id, JobState.FAILED, timeout=5)
        assert failed.attempt == 1 and failed.errors[-1]["error"].startswith(
            "KeyboardInterrupt" if job is last else "SystemExit: 3"
        )
    # The atomic handlers' writes rolled back with their attempts.
    assert not Order.objects.filter(reference__startswith="bail-").exists()
    atomic_ids = [j.id for j in [*atomic.values(), atomic_last]]
    assert not Ledger.objects.filter(job_id__in=atomic_ids).exists()
    assert worker.proc.poll() is None, worker.output()
    assert "Exception in thread" not in worker.output()


def test_in_the_main_thread_only_keyboard_interrupt_escapes_the_handler_boundary():
    # A handler run in-process (by a test, say) may meet a real Ctrl-C there;
    # the worker's handler threads never do.
    from django_awa.execute import Attempt, run_attempt

    for name in ("SystemExit", "Bail", "CancelledError"):
        job = make_job(args={"action": "base", "tag": name}, state=JobState.RUNNING)
        result = run_attempt(Attempt(job=job, alias="default"))
        assert result.state == JobState.RETRYABLE and result.error.startswith(name)
    job = make_job(args={"action": "base", "tag": "KeyboardInterrupt"}, state=JobState.RUNNING)
    with pytest.raises(KeyboardInterrupt):
        run_attempt(Attempt(job=job, alias="default"))


def test_errors_while_loading_a_handler_or_finalizing_are_the_attempts_error(start_worker):
    # Not lost to the log with the job left running until its heartbeat goes
    # stale: each is recorded on the job at once, with its traceback.
    broken = make_job(
        kind="task:tests.testapp.broken_tasks.anything",
        args={"args": [], "kwargs": {}, "backend": "default"},
        max_attempts=2,
    )
    needy = make_job(
        kind="task:tests.testapp.needy_tasks.anything",
        args={"args": [], "kwargs": {}, "backend": "default"},
    )
    missing = make_job(
        kind="task:tests.testapp.no_such_module.anything",
        args={"args": [], "kwargs": {}, "backend": "default"},
    )
    severed = awa.enqueue(Severed(n=1))
    quietly_severed = awa.enqueue(Severed(n=2, quiet=True))
    after = awa.enqueue(Act(action="ok"))
    start_worker("--queue", "default=1")

    # Sooner than STALE_AFTER (3 s) plus a maintenance cycle, when rescue would come.
    retried = wait_for_state(broken.id, JobState.RETRYABLE, timeout=3)
    entry = retried.errors[-1]
    assert entry["attempt"] == 1 and retried.attempt == 1
    assert (
        "cannot load the handler of kind 'task:tests.testapp.broken_tasks.anything'"
        in (entry["error"])
    )
    assert "TypeError: tests.testapp.broken_tasks cannot be imported" in entry["error"]
    assert "broken_tasks.py" in entry["traceback"]

    # A module that is there but fails to import is not an unknown kind...
    needs = wait_for_state(needy.id, JobState.RETRYABLE, timeout=3)
    entry = needs.errors[-1]
    assert "No module named 'awa_test_missing_dependency'" in entry["error"], entry
    assert "needy_tasks.py" in entry["traceback"]
    # ...and one that is not there still is.
    unknown = wait_for_state(missing.id, JobState.FAILED, timeout=3)
    assert "unknown job kind" in unknown.errors[-1]["error"]

    # The handler's error is its attempt's: written on a new connection once its
    # transaction (and its dead one) is gone.
    lost = wait_for_state(severed.id, JobState.FAILED, timeout=3)
    entry = lost.errors[-1]
    assert "OperationalError" in entry["error"], entry
    assert "terminating connection" in entry["error"] and "Traceback" in entry["traceback"]
    assert "rescued" not in entry["error"]
    # A handler that swallowed it returns, and its outcome cannot be written there.
    lost = wait_for_state(quietly_severed.id, JobState.FAILED, timeout=3)
    entry = lost.errors[-1]
    assert "could not be finalized" in entry["error"] and "Traceback" in entry["traceback"]
    assert "rescued" not in entry["error"]
    wait_for_state(after.id, JobState.COMPLETED, timeout=3)


def test_an_atomic_handler_returning_in_a_spoilt_transaction_is_retried_with_a_clear_error(
    start_worker,
):
    # set_rollback(True) rolled the outcome back with the writes, unseen: the job
    # stayed running until rescue. A caught error or a closed connection gave
    # the outcome's own error ("current transaction is aborted").
    expected = {
        "set_rollback": "transaction was marked for rollback (transaction.set_rollback(True)",
        "orm_error": "transaction was marked for rollback (transaction.set_rollback(True)",
        "sql_error": "went on after a database error in its transaction",
        "close": "closed its database connection inside its transaction",
    }
    jobs = {how: awa.enqueue(Unwound(reference=f"unwound-{how}", how=how)) for how in expected}
    after = awa.enqueue(Act(action="ok"))
    start_worker("--queue", "default=1")

    for how, job in jobs.items():
        # Sooner than STALE_AFTER (3 s) plus a maintenance cycle, when rescue would come.
        retried = wait_for_state(job.id, JobState.RETRYABLE, timeout=3)
        error = retried.errors[-1]["error"]
        assert expected[how] in error and "its writes were rolled back" in error, (how, error)
    assert not Order.objects.filter(reference__startswith="unwound-").exists()
    wait_for_state(after.id, JobState.COMPLETED, timeout=3)


def test_an_atomic_handler_cancelling_its_own_job_is_not_left_running(start_worker):
    # Its outcome found the row cancelled (by its own transaction) and rolled back,
    # the cancel with it: the job stayed running, unlogged, until rescue.
    job = awa.enqueue(Unwound(reference="self-cancel", how="self_cancel"))
    start_worker("--queue", "default=1")
    retried = wait_for_state(job.id, JobState.RETRYABLE, timeout=3)
    assert "changed its own job's row in its transaction" in retried.errors[-1]["error"]
    assert not Order.objects.filter(reference="self-cancel").exists()


@pytest.mark.slow
def test_handlers_stuck_after_their_attempt_was_lost_are_replaced_within_a_bound(start_worker):
    # Handlers that ignore cancellation and their deadline (1 s here). Once
    # rescued, each holds its thread until the grace (5 s here) runs out; then
    # a new thread takes its place, up to as many abandoned ones as the
    # queue's concurrency.
    stuck = [awa.enqueue(Act(action="stubborn", seconds=60), max_attempts=1) for _ in range(2)]
    quick = awa.enqueue_many([Act(action="ok") for _ in range(5)])
    more = [awa.enqueue(Act(action="stubborn", seconds=60), max_attempts=1) for _ in range(2)]
    worker = start_worker("--queue", "default=2", env={"AWA_TEST_DEFAULT_DEADLINE": "1"})

    for job in stuck:
        rescued = wait_for_state(job.id, JobState.FAILED, timeout=10)
        assert "rescued: deadline exceeded" in rescued.errors[-1]["error"]
    for job_id in quick:
        wait_for_state(job_id, JobState.COMPLETED, timeout=15)
    for job in stuck:
        line = next(
            line
            for line in worker.output().splitlines()
            if f"is stuck in job {job.id} kind=act" in line
        )
        assert "WARNING" in line and re.search(r"handler thread awa-default_[01] ", line), line
        assert re.search(r"lost \(cancelled or rescued\) \d+\.\ds ago", line), line
        assert re.search(r"takes its place", line), line

    # The replacements are stuck in turn: the bound (2 abandoned threads) holds.
    for job in more:
        wait_for_state(job.id, JobState.FAILED, timeout=10)
    wait_for(
        lambda: "queue default already has 2 abandoned handler threads" in worker.output(),
        timeout=15,
        message=worker.output,
    )
    bound = next(line for line in worker.output().splitlines() if "already has 2" in line)
    assert "ERROR" in bound and any(f"stuck in job {job.id} " in bound for job in more)
    assert worker.output().count("takes its place") == 2
    assert worker.proc.poll() is None


@pytest.mark.slow
def test_a_cancelled_handler_that_will_not_stop_gives_up_its_thread_then_exits(start_worker):
    job = awa.enqueue(Act(action="stubborn", seconds=10))
    worker = start_worker("--queue", "default=1")
    wait_for(lambda: Ledger.objects.filter(job_id=job.id).exists())
    awa.cancel(job.id, "operator said so")
    quick = awa.enqueue(Act(action="ok"))
    # After the grace (5 s here), while the stubborn handler still sleeps.
    wait_for_state(quick.id, JobState.COMPLETED, timeout=8)
    assert Ledger.objects.filter(job_id=job.id).count() == 1
    assert "handler thread awa-default_0 is stuck in job" in worker.output()
    wait_for(lambda: "abandoned handler thread awa-default_0 returned" in worker.output())
    # Its late return changed nothing, and the queue still runs on its replacement.
    final = Job.objects.get(id=job.id)
    assert final.state == JobState.CANCELLED and "operator said so" in final.errors[-1]["error"]
    wait_for_state(awa.enqueue(Act(action="ok")).id, JobState.COMPLETED)
    assert worker.stop() == 0
    assert "gave back" not in worker.output()


def test_a_follow_up_on_another_workers_queue_is_picked_up_without_waiting_for_the_poll(
    start_worker,
):
    # Polling every 30 s, and the follow-ups' queue served by the other worker only:
    # just the first worker's wake-up after its outcome's commit (a NOTIFY from its
    # listener) gets them claimed within seconds. Each worker's producer claims as
    # it starts and its listener wakes every queue as it connects, so the job is
    # enqueued once a first job went through each.
    env = {"AWA_TEST_POLL_INTERVAL": "30"}
    first = start_worker("--queue", "default", env=env)
    other = start_worker("--queue", "echo", env=env)
    for worker in (first, other):
        wait_for(lambda w=worker: "listening for new jobs" in w.output(), message=worker.output)
    wait_for_state(awa.enqueue(Act(action="ok", tag="none")).id, JobState.COMPLETED, timeout=10)
    wait_for_state(awa.enqueue(Echo(n=0)).id, JobState.COMPLETED, timeout=10)
    job = awa.enqueue(Act(action="ok"))
    wait_for_state(job.id, JobState.COMPLETED, timeout=10)
    echoes = Job.objects.filter(kind="echo", args__n=job.id, state=JobState.COMPLETED)
    wait_for(
        lambda: echoes.count() == 2,
        timeout=10,
        message=lambda: f"{first.output()}\n{other.output()}",
    )
