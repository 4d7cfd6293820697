"""django_awa.testing: the helpers inside TestCase (nothing commits) and TransactionTestCase."""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.test import TestCase, TransactionTestCase
from django.utils import timezone

import django_awa as awa
from django_awa.models import Job, JobState
from django_awa.testing import (
    RunLimitReached,
    RunReport,
    assert_enqueued,
    enqueued,
    perform_job,
    refute_enqueued,
    run_jobs,
)
from tests.testapp.jobs import (
    Act,
    AsyncAct,
    Echo,
    Forever,
    LeakyAtomic,
    Pay,
    Timed,
    TimedAsync,
    Unhandled,
)
from tests.testapp.models import Ledger, Order


@dataclass
class CancelsItself(awa.JobArgs):
    """A sequence member whose handler cancels its own job (a handler may)."""

    key: str = ""
    n: int = 0


@awa.worker(CancelsItself, queue="selfcancel", sequence="key")
def cancels_itself(job: awa.JobContext) -> None:
    Ledger.objects.create(
        job_id=job.id,
        attempt=job.attempt,
        run_lease=job.row.run_lease,
        note=f"{job.args.key}{job.args.n}",
    )
    if job.args.n == 0:
        awa.cancel(job.id)


def _notes() -> list[str]:
    return list(Ledger.objects.order_by("id").values_list("note", flat=True))


class AssertEnqueuedTests(TestCase):
    def test_matches_kind_args_fields_queue_and_count(self):
        awa.enqueue(Echo(n=1, note="a"))
        awa.enqueue(Echo(n=2, note="a"), queue="other")
        awa.enqueue(Act(action="ok"))
        assert len(assert_enqueued(Echo)) == 2
        assert_enqueued(Echo, count=2)
        assert_enqueued(Echo, note="a", count=2)
        [job] = assert_enqueued(Echo, n=2)
        assert job.queue == "other"
        assert_enqueued(Echo, queue="other", count=1)
        assert_enqueued(Echo(n=1, note="a"))  # an instance: all its args must match
        refute_enqueued(Echo(n=1, note="b"))
        refute_enqueued(Echo, n=3)
        refute_enqueued(Pay)
        refute_enqueued(Echo, count=1)  # anything but one
        assert [j.args["n"] for j in enqueued(Echo)] == [1, 2]
        assert [j.kind for j in enqueued()] == ["echo", "echo", "act"]
        assert [j.args["n"] for j in enqueued(Echo, queue="other")] == [2]

    def test_the_failure_message_lists_the_jobs_that_exist(self):
        awa.enqueue(Echo(n=7, note="x"), queue="other")
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(Echo, n=8)
        message = str(failure.value)
        assert "expected a job of kind 'echo' with args {'n': 8} to be enqueued, but none is" in (
            message
        )
        assert re.search(r"#\d+ kind='echo' queue='other' state=available args=\{.*'n': 7", message)

        with pytest.raises(AssertionError, match=r"expected 2 job\(s\) of kind 'echo'.*found 1"):
            assert_enqueued(Echo, count=2)
        listed = r"(?s)on queue 'default'.*kind='echo' queue='other'"
        with pytest.raises(AssertionError, match=listed):
            assert_enqueued(Echo, queue="default")
        with pytest.raises(AssertionError, match=r"(?s)expected no job of kind 'echo'.*found 1"):
            refute_enqueued(Echo)
        Job.objects.all().delete()
        with pytest.raises(AssertionError, match="no job is enqueued at all"):
            assert_enqueued(Echo)

    def test_finished_jobs_are_not_enqueued(self):
        job = awa.enqueue(Echo(n=1))
        Job.objects.filter(id=job.id).update(state=JobState.COMPLETED)
        refute_enqueued(Echo)
        Job.objects.filter(id=job.id).update(state=JobState.RETRYABLE)
        assert_enqueued(Echo)

    def test_a_workflow_step_waiting_for_its_dependencies_is_enqueued(self):
        flow = awa.Workflow("steps")
        first = flow.add(Echo(n=1))
        flow.add(Echo(n=2), after=[first])
        flow.enqueue()
        [blocked] = assert_enqueued(Echo, n=2)
        assert blocked.state == JobState.BLOCKED
        assert [j.args["n"] for j in enqueued(Echo)] == [1, 2]

    def test_bad_questions_are_refused_by_name(self):
        with pytest.raises(TypeError, match=r"Echo has no field\(s\) \['nn'\]"):
            assert_enqueued(Echo, nn=1)
        with pytest.raises(TypeError, match="expected a JobArgs instance or subclass"):
            assert_enqueued("echo")  # type: ignore[arg-type]

    def test_a_queue_or_count_that_could_match_nothing_is_refused_by_name(self):
        awa.enqueue(Echo(n=1))
        # Not "expected 1 job(s) ..., found 1": a count of "1" equals no number.
        with pytest.raises(TypeError, match=r"\(\): count must be a whole .* or None, got '1'"):
            assert_enqueued(Echo, count="1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"refute_enqueued\(\): count must be .* got -1"):
            refute_enqueued(Echo, count=-1)
        with pytest.raises(TypeError, match=r"count must be .* got True"):
            assert_enqueued(Echo, count=True)
        # A list of queues matched no job: enqueued() answered [] and refute_enqueued passed.
        with pytest.raises(TypeError, match=r"refute_enqueued\(\): queue must be a queue's name"):
            refute_enqueued(Echo, queue=["echo"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"enqueued\(\): queue must be .* got \['echo'\]"):
            enqueued(Echo, queue=["echo"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"assert_enqueued\(\): queue must be .* got 1"):
            assert_enqueued(Echo, queue=1)  # type: ignore[arg-type]
        assert_enqueued(Echo, queue="echo", count=1)


class RunJobsTests(TestCase):
    def test_a_member_cancelled_by_its_own_handler_hands_its_sequence_on(self):
        # Its handler returned: the key's place the cancel kept for it is freed, and
        # the next member runs in the same call (now() stands still in the test's
        # transaction, so a place left kept would hold the key for good).
        awa.enqueue_many([CancelsItself(key="s", n=0), CancelsItself(key="s", n=1)])
        report = run_jobs(queue="selfcancel")
        assert _notes() == ["s0", "s1"], report
        assert sorted(Job.objects.values_list("state", flat=True)) == ["cancelled", "completed"]

    def test_runs_due_jobs_and_their_followups_in_the_tests_transaction(self):
        job = awa.enqueue(Act(action="ok"))
        report = run_jobs()
        assert isinstance(report, RunReport)
        # The job, then the two Echo follow-ups its completion enqueued.
        assert report.completed == 3 and report.ran == 3 and report.counts == {"completed": 3}
        assert [j.kind for j in report.jobs] == ["act", "echo", "echo"]
        assert all(j.state == JobState.COMPLETED for j in report.jobs)
        assert Job.objects.get(id=job.id).state == JobState.COMPLETED
        assert sorted(_notes()) == [f"echo:{job.id}"] * 2 + ["ok"]
        refute_enqueued(Act)
        assert str(report) == "ran 3 attempt(s): 3 completed"
        assert run_jobs().ran == 0  # nothing left

    def test_retries_wait_for_their_backoff_unless_scheduled_jobs_are_included(self):
        job = awa.enqueue(Act(action="raise"))
        report = run_jobs()
        # Attempt 1 failed; its retried follow-up (an Echo) ran; the retry is not due yet.
        assert report.counts == {"retryable": 1, "completed": 1}
        assert_enqueued(Act, count=1)
        row = Job.objects.get(id=job.id)
        assert (
            row.state == JobState.RETRYABLE
            and "ValueError: boom on attempt 1" in (row.errors[-1]["error"])
        )
        report = run_jobs(include_scheduled=True)
        # Attempts 2 and 3 (retryable, then exhausted), each with its follow-up.
        assert report.counts == {"retryable": 1, "failed": 1, "completed": 2}
        row.refresh_from_db()
        assert row.state == JobState.FAILED and row.attempt == 3
        assert Job.objects.filter(kind="echo", args__note="exhausted:3").exists()

    def test_future_jobs_are_not_due_until_included(self):
        later = awa.enqueue(Echo(n=1), run_at=timezone.now() + dt.timedelta(hours=1))
        assert run_jobs().ran == 0
        assert Job.objects.get(id=later.id).state == JobState.SCHEDULED
        assert run_jobs(include_scheduled=True).completed == 1

    def test_snooze_runs_again_in_the_next_round(self):
        job = awa.enqueue(Act(action="snooze", seconds=0))
        report = run_jobs(kinds=[Act])
        assert report.counts == {"snoozed": 1, "completed": 1}
        assert Job.objects.get(id=job.id).attempt == 1  # a snooze uses no attempt
        assert [j.id for j in report.jobs] == [job.id]  # listed once, as it stands now

    def test_queue_and_kinds_choose_what_runs(self):
        echo = awa.enqueue(Echo(n=1))  # queue "echo"
        act = awa.enqueue(Act(action="ok", tag="none"))  # queue "default"
        assert run_jobs(queue="default", kinds=["echo"]).ran == 0
        report = run_jobs(queue="default")
        assert [j.id for j in report.jobs] == [act.id]
        # Act's second completed follow-up is skipped for tag "none": nothing else enqueued.
        assert Job.objects.get(id=echo.id).state == JobState.AVAILABLE
        assert run_jobs(kinds=[Echo]).completed == 1

    def test_kinds_or_a_queue_that_would_choose_nothing_are_refused_by_name(self):
        awa.enqueue(Echo(n=1))
        # A lone name was taken letter by letter, a list of queues as no queue: nothing
        # ran, and the report said so without saying why.
        with pytest.raises(TypeError, match=r"got 'echo' alone: pass kinds=\['echo'\]"):
            run_jobs(kinds="echo")
        with pytest.raises(TypeError, match=r"got the class Echo alone: pass kinds=\[Echo\]"):
            run_jobs(kinds=Echo)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"run_jobs\(\): queue must be .* got \['echo'\]"):
            run_jobs(queue=["echo"])  # type: ignore[arg-type]
        assert_enqueued(Echo, count=1)  # nothing ran
        assert run_jobs(kinds=("echo",), queue="echo").completed == 1

    def test_a_database_without_awas_migrations_is_named_before_anything_runs(self):
        # As pytest-django's --nomigrations leaves it: the tables the models make take an
        # enqueue, and a run failed on 'relation "awa_job_done_current" does not exist'.
        job = awa.enqueue(Echo(n=1))
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM django_migrations WHERE app = 'django_awa' AND name LIKE '0016%%'"
            )
        missing = (
            r"run_jobs\(\): django-awa's migrations are not applied to database 'default' "
            r"\(.*\): 0016_finished_segments is missing\..*not pytest-django's --nomigrations"
        )
        with pytest.raises(awa.ConfigurationError, match=missing):
            run_jobs()
        assert Job.objects.get(id=job.id).state == JobState.AVAILABLE

    def test_paused_queues_are_skipped(self):
        awa.pause_queue("echo")
        awa.enqueue(Echo(n=1))
        assert run_jobs().ran == 0
        awa.resume_queue("echo")
        assert run_jobs().completed == 1

    def test_the_limit_bounds_runs_and_says_so(self):
        awa.enqueue(Forever())
        with pytest.raises(RunLimitReached) as reached:
            run_jobs(limit=25)
        assert reached.value.report.ran == 25 and reached.value.report.completed == 25
        assert "ran 25 attempts, its limit, and jobs are still due" in str(reached.value)
        assert isinstance(reached.value, AssertionError)
        # Exactly as many jobs as the limit: no error.
        Job.objects.all().delete()
        awa.enqueue_many([Echo(n=i) for i in range(3)])
        assert run_jobs(limit=3).completed == 3
        with pytest.raises(awa.ValidationError, match="limit must be a positive integer"):
            run_jobs(limit=0)

    def test_every_outcome_goes_through_the_workers_rules(self):
        ids = {
            action: awa.enqueue(Act(action=action, tag="none")).id
            for action in ("terminal", "cancel", "callback", "bad_return")
        }
        ids["retry_after"] = awa.enqueue(Act(action="retry_after", seconds=30, tag="none")).id
        unknown = awa.enqueue(Unhandled())
        report = run_jobs(queue="default", kinds=[Act, Unhandled])
        states = dict(Job.objects.filter(id__in=ids.values()).values_list("id", "state"))
        assert states[ids["terminal"]] == JobState.FAILED
        assert states[ids["cancel"]] == JobState.CANCELLED
        assert states[ids["callback"]] == JobState.WAITING_EXTERNAL
        assert states[ids["bad_return"]] == JobState.RETRYABLE
        assert states[ids["retry_after"]] == JobState.RETRYABLE
        assert Job.objects.get(id=unknown.id).state == JobState.FAILED
        assert report.failed == 2 and report.cancelled == 1 and report.waiting_external == 1

    def test_a_database_error_in_a_handler_leaves_the_tests_transaction_usable(self):
        job = awa.enqueue(Act(action="bad_sql", tag="none"))
        assert run_jobs(kinds=[Act]).retryable == 1
        row = Job.objects.get(id=job.id)
        assert "DataError: division by zero" in row.errors[-1]["error"]
        assert not Ledger.objects.filter(note="bad_sql").exists()  # rolled back with it
        assert Job.objects.filter(kind="echo", args__note__startswith="retried:1").exists()

    def test_a_failed_orm_write_in_a_handler_is_its_error_and_the_test_goes_on(self):
        # The ORM, unlike a raw cursor, marks the test's atomic block for rollback.
        job = awa.enqueue(Act(action="bad_orm", tag="none"))
        assert run_jobs(kinds=[Act]).retryable == 1
        row = Job.objects.get(id=job.id)
        assert "DataError" in row.errors[-1]["error"], row.errors
        assert not Ledger.objects.filter(note="bad_orm").exists()  # rolled back with it
        assert Job.objects.filter(kind="echo", args__note__startswith="retried:1").exists()
        assert run_jobs(kinds=[Act], include_scheduled=True).counts == {
            "retryable": 1,
            "failed": 1,
        }

    def test_a_database_error_in_a_django_task_is_its_recorded_error(self):
        # Recording the task's error in the aborted transaction failed, and that
        # failure ("current transaction is aborted") was recorded instead, with no
        # result.errors.
        from tests.testapp import tasks

        for how, error in (("raw", "DataError: division by zero"), ("orm", "DataError")):
            result = tasks.bad_sql.enqueue(how)
            assert run_jobs().failed == 1
            row = Job.objects.get(id=int(result.id))
            assert row.errors[-1]["error"].startswith(error), row.errors
            result.refresh()
            assert [e.exception_class_path for e in result.errors] == ["django.db.utils.DataError"]
            assert "division by zero" in result.errors[0].traceback or how == "orm"
            assert not Ledger.objects.filter(note=f"task-{how}").exists()  # rolled back

    def test_a_transaction_the_handler_leaves_open_is_its_error_and_undone(self):
        # A worker closes such a connection (rolling it back) and records an error;
        # here the test's transaction must go on, at the depth it had.
        depth = len(connection.atomic_blocks)
        plain = awa.enqueue(Act(action="leave_atomic", tag="none"))
        atomic = awa.enqueue(LeakyAtomic(reference="leaked-atomic"))
        report = run_jobs(kinds=[Act, LeakyAtomic])
        assert report.counts == {"retryable": 1, "failed": 1}
        assert len(connection.atomic_blocks) == depth
        for job in (plain, atomic):
            error = Job.objects.get(id=job.id).errors[-1]["error"]
            assert "left a transaction open on database 'default'" in error, error
            assert error.endswith("and the test's transaction kept"), error
        assert not Order.objects.exists()  # both handlers' writes undone
        assert not Ledger.objects.filter(note="leave_atomic").exists()
        assert run_jobs(kinds=[Act], include_scheduled=True).counts == {
            "retryable": 1,
            "failed": 1,
        }
        assert len(connection.atomic_blocks) == depth

    def test_atomic_handlers_commit_their_writes_with_the_outcome(self):
        awa.enqueue(Pay(reference="r1"))
        awa.enqueue(Pay(reference="r2", fail=True))
        run_jobs(kinds=[Pay])
        assert list(Order.objects.values_list("reference", flat=True)) == ["r1"]
        assert_enqueued(Echo, note="receipt:r1")

    def test_the_rows_say_when_their_handlers_began_as_a_workers_do(self):
        # attempted_at stayed empty under run_jobs (a worker's handler pool stores it),
        # and a Django task's result had no started_at or last_attempted_at.
        from tests.testapp import tasks

        before = timezone.now()
        awa.enqueue(Echo(n=1))
        awa.enqueue(Act(action="raise"))  # retryable
        awa.enqueue(AsyncAct(action="ok"))
        awa.enqueue(Pay(reference="began"))  # atomic
        task = tasks.add.enqueue(1, 2)
        assert run_jobs().ran == 7  # and the follow-ups of Act's retry and Pay
        for row in Job.objects.exclude(state=JobState.AVAILABLE):
            assert row.attempted_at is not None, (row.kind, row.state)
            assert before <= row.attempted_at <= (row.finalized_at or timezone.now())
        task.refresh()
        assert task.started_at is not None and task.last_attempted_at is not None

    def test_an_atomic_handler_whose_followup_fails_is_reported_as_retried(self):
        job = awa.enqueue(Pay(reference="bad-followup-report"))
        report = run_jobs(kinds=[Pay], include_scheduled=True)
        # Its completion's follow-up raised: each attempt was recorded as an error.
        assert Job.objects.get(id=job.id).state == JobState.FAILED
        assert report.counts == {"retryable": 1, "failed": 1}
        assert not Order.objects.filter(reference="bad-followup-report").exists()

    def test_async_handlers_run_on_the_tests_connection(self):
        awa.enqueue(AsyncAct(action="enqueue", n=5))
        awa.enqueue(AsyncAct(action="raise"))
        report = run_jobs()
        # The async ORM's writes and aenqueue's job are in this test's transaction.
        assert sorted(_notes()) == ["async:enqueue", "async:raise", "echo:5"]
        assert report.counts == {"completed": 2, "retryable": 1}
        assert Job.objects.get(kind="echo").args["note"] == "from-async-handler"

    def test_a_sync_database_method_in_an_async_handler_names_its_awaitable_form(self):
        # Django's SynchronousOnlyOperation said "use a thread or sync_to_async".
        jobs = {
            method: awa.enqueue(AsyncAct(action=f"sync_{method}"))
            for method in ("callback", "dependencies")
        }
        # Without the setting that lifts Django's refusal, which the browser tests'
        # modules set for the whole process once imported.
        with mock.patch.dict(os.environ):
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
            assert run_jobs(kinds=[AsyncAct]).retryable == 2
        for method, name in (("callback", "register_callback"), ("dependencies", "dependencies")):
            error = Job.objects.get(id=jobs[method].id).errors[-1]["error"]
            assert error.startswith(
                f"SynchronousOnlyOperation: job.{name}() reads or writes the database, which "
                f"Django refuses on an event loop: from an async def handler call "
                f"`await job.a{name}(...)`"
            ), error

    def test_async_progress_is_stored_with_the_outcome(self):
        job = awa.enqueue(AsyncAct(action="progress"))
        run_jobs()
        assert Job.objects.get(id=job.id).progress["message"] == "async halfway"

    def test_a_kinds_timeout_applies(self):
        sync_job = awa.enqueue(Timed(seconds=1.2))
        async_job = awa.enqueue(TimedAsync(seconds=30))
        report = run_jobs()
        assert report.retryable == 2
        for job in (sync_job, async_job):
            row = Job.objects.get(id=job.id)
            assert row.state == JobState.RETRYABLE
            error = row.errors[-1]["error"]
            assert "timed out: the attempt passed its kind's timeout of 1s" in error
        notes = _notes()
        # The sync handler ran to its end (its result ignored); the async one was cancelled.
        assert "timed:end:cancelled=False" in notes
        assert "timed-async:cancelled" in notes and "timed-async:end" not in notes


class PerformJobTests(TestCase):
    def test_returns_what_the_handler_returned_without_a_row(self):
        assert perform_job(AsyncAct(action="value", n=4)) == {"doubled": 8}
        snooze = perform_job(Act(action="snooze", seconds=3), metadata={"snoozed_once": False})
        assert snooze == awa.Snooze(3)
        assert perform_job(Act(action="cancel")) == awa.Cancel("not needed any more")
        assert Job.objects.count() == 0

    def test_context_fields_reach_the_handler(self):
        with pytest.raises(RuntimeError, match="failing attempt 2"):
            perform_job(Act(action="ok", fail_until=2), attempt=2)
        assert perform_job(Act(action="ok", fail_until=2), attempt=3) is None
        assert list(Ledger.objects.values_list("attempt", flat=True)) == [2, 3]

    def test_raises_what_the_handler_raises_and_refuses_bad_input(self):
        with pytest.raises(ValueError, match="async boom on attempt 1"):
            perform_job(AsyncAct(action="raise"))
        with pytest.raises(TypeError, match=r"unknown context field\(s\) \['atempt'\]"):
            perform_job(Act(), atempt=2)
        with pytest.raises(LookupError, match="no handler is registered for kind 'unhandled'"):
            perform_job(Unhandled())
        with pytest.raises(ValueError, match="attempt must be a whole number from 1, got 0"):
            perform_job(Act(), attempt=0)
        with pytest.raises(RuntimeError, match=r"no row to store the callback on.*run_jobs"):
            perform_job(Act(action="callback"))


class AsyncTestCaseTests(TestCase):
    async def test_an_async_test_sees_aenqueue_in_its_transaction(self):
        job = await awa.aenqueue(Echo(n=3, note="async-test"))
        [found] = await sync_to_async(assert_enqueued)(Echo, n=3)
        assert found.id == job.id
        report = await sync_to_async(run_jobs)()
        assert report.completed == 1

    async def test_perform_job_of_an_async_handler_says_how_to_call_it_from_async_code(self):
        # Not asgiref's "just await the async function directly", with the
        # handler's coroutine never awaited.
        async_handler = r"'async_act' is async and this thread runs an event loop .*sync_to_async"
        with pytest.raises(RuntimeError, match=async_handler):
            perform_job(AsyncAct(action="value", n=2))
        assert await sync_to_async(perform_job)(AsyncAct(action="value", n=2)) == {"doubled": 4}


class TransactionalRunJobsTests(TransactionTestCase):
    def test_outcomes_commit_and_the_helpers_work_the_same(self):
        job = awa.enqueue(Act(action="ok", tag="none"))
        assert_enqueued(Act, action="ok", count=1)
        with pytest.raises(AssertionError, match="kind='act' queue='default'"):
            assert_enqueued(Act, action="raise")
        report = run_jobs()
        assert report.counts == {"completed": 1}  # tag "none": no follow-up
        assert not connection.in_atomic_block
        # Committed: another connection sees it.
        from django.db import connections

        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("SELECT state FROM awa_job WHERE id = %s", [job.id])
                assert cursor.fetchone() == ("completed",)
        finally:
            other.close()
        refute_enqueued(Act)
        bad = awa.enqueue(Act(action="bad_sql", tag="none"))
        assert run_jobs(kinds=[Act]).retryable == 1
        # In autocommit, as in a worker, the handler's writes before the error stay.
        assert Ledger.objects.filter(job_id=bad.id, note="bad_sql").exists()

    def test_a_transaction_the_handler_leaves_open_is_rolled_back_as_a_worker_does(self):
        plain = awa.enqueue(Act(action="leave_atomic", tag="none"))
        atomic = awa.enqueue(LeakyAtomic(reference="leaked-atomic"))
        report = run_jobs(kinds=[Act, LeakyAtomic])
        assert report.counts == {"retryable": 1, "failed": 1}
        assert not connection.in_atomic_block
        for job in (plain, atomic):
            error = Job.objects.get(id=job.id).errors[-1]["error"]
            assert error.endswith("and the connection closed"), error
        assert not Order.objects.exists()


def test_the_pytest_fixture_gives_the_helpers(awa_jobs):
    awa.enqueue(Echo(n=9))
    awa_jobs.assert_enqueued(Echo, n=9)
    assert awa_jobs.run_jobs().completed == 1
    awa_jobs.refute_enqueued(Echo)
    assert awa_jobs.perform_job(AsyncAct(action="value", n=1)) == {"doubled": 2}
