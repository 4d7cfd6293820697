"""Django Tasks (``django.tasks`` / the django-tasks backport) on the awa backend."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction
from django.utils import timezone

from django_awa.backends import awa_priority
from django_awa.models import Job, JobState
from tests.conftest import wait_for, wait_for_state

try:
    from django.tasks import TaskResultStatus
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    from django_tasks import TaskResultStatus
    from django_tasks.exceptions import TaskResultDoesNotExist

from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_priority_mapping():
    assert [awa_priority(p) for p in (100, 50, 49, 0, -1, -50, -51, -100)] == [
        1, 1, 2, 2, 3, 3, 4, 4,
    ]  # fmt: skip


def test_enqueue_joins_the_transaction_and_the_worker_runs_it(start_worker):
    with pytest.raises(RuntimeError), transaction.atomic():
        lost = tasks.add.enqueue(1, 1)
        raise RuntimeError("rolled back")
    assert not Job.objects.filter(id=int(lost.id)).exists()

    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY and result.id.isdigit()
    job = Job.objects.get(id=int(result.id))
    assert job.kind == "task:tests.testapp.tasks.add" and job.max_attempts == 1
    start_worker("--queue", "default")
    wait_for_state(job.id, JobState.COMPLETED)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert tasks.add.get_result(result.id).return_value == 5


def test_priority_queue_and_run_after_are_honoured():
    later = timezone.now() + dt.timedelta(hours=1)
    result = tasks.urgent.using(run_after=later).enqueue()
    job = Job.objects.get(id=int(result.id))
    assert (job.priority, job.queue, job.state) == (1, "default", JobState.SCHEDULED)
    assert job.run_at == later


def test_a_failing_task_gets_one_attempt_and_reports_its_error(start_worker):
    result = tasks.explode.enqueue()
    start_worker("--queue", "default")
    wait_for_state(int(result.id), JobState.FAILED)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path == "builtins.ValueError"
    assert "task exploded" in result.errors[0].traceback
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018


def test_max_attempts_asks_for_retries(start_worker):
    result = tasks.flaky.enqueue("flaky-1")
    assert Job.objects.get(id=int(result.id)).max_attempts == 3
    start_worker("--queue", "default")
    wait_for_state(int(result.id), JobState.COMPLETED, timeout=20)
    result.refresh()
    assert result.return_value == 2 and result.attempts == 2
    # Django's started_at is the first attempt's start, last_attempted_at the last's:
    # both read the last's, 2 s of backoff later.
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.last_attempted_at - result.started_at > dt.timedelta(seconds=1)
    assert result.enqueued_at <= result.started_at <= result.finished_at


def test_task_finished_is_sent_as_each_task_ends_with_its_errors_recorded():
    from django_awa.testing import run_jobs

    try:
        from django.tasks.signals import task_finished, task_started
    except ImportError:
        from django_tasks.signals import task_finished, task_started
    finished = {}
    sent = []
    started = []

    def receiver(sender, task_result, **kwargs):
        finished[task_result.id] = task_result
        sent.append(task_result.id)

    def on_started(sender, task_result, **kwargs):
        started.append(task_result)

    results = [tasks.add.enqueue(2, 3), tasks.explode.enqueue(), tasks.leave.enqueue()]
    results.append(tasks.not_a_number.enqueue())
    task_finished.connect(receiver)
    task_started.connect(on_started)
    try:
        run_jobs()
    finally:
        task_finished.disconnect(receiver)
        task_started.disconnect(on_started)
    assert sorted(sent) == sorted(r.id for r in results)  # once each
    # A started task says when it started (it read None: the row stores it 0.1 s in).
    assert len(started) == 4
    for result in started:
        assert result.status == TaskResultStatus.RUNNING and result.attempts == 1
        assert result.started_at is not None
        assert result.started_at == result.last_attempted_at >= result.enqueued_at
    added, exploded, left, nan = (finished[r.id] for r in results)
    assert added.status == TaskResultStatus.SUCCESSFUL and added.return_value == 5
    assert added.finished_at is not None
    assert exploded.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in exploded.errors] == ["builtins.ValueError"]
    # What Django's own backend records: BaseException too, and a value JSON cannot hold.
    for result, path in ((left, "builtins.SystemExit"), (nan, "builtins.ValueError")):
        assert result.status == TaskResultStatus.FAILED
        stored = tasks.add.get_backend().get_result(result.id)
        assert [e.exception_class_path for e in stored.errors] == [path]


def test_task_finished_agrees_with_the_result_of_a_task_cancelled_while_it_ran():
    """A task cancelled while its function ran, which then returned, sent task_finished
    SUCCESSFUL with its return value: the result stored (and read back) is FAILED. A
    task cancelled before it ran, or rescued, sent none. Each now sends it once, as stored."""
    import django_awa as awa
    from django_awa.maintenance import Maintenance
    from django_awa.testing import run_jobs

    try:
        from django.tasks.signals import task_finished
    except ImportError:
        from django_tasks.signals import task_finished
    finished = []

    def receiver(sender, task_result, **kwargs):
        finished.append(task_result)

    result = tasks.cancel_own_job.enqueue()
    waiting = tasks.add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(1, 2)
    task_finished.connect(receiver)
    try:
        run_jobs()
        awa.cancel(int(waiting.id), "not needed")
        # A worker that died running one, on its last attempt: the rescue fails it.
        lost = tasks.add.enqueue(2, 2)
        stale = timezone.now() - dt.timedelta(hours=1)
        Job.objects.filter(id=int(lost.id)).update(
            state=JobState.RUNNING, attempt=1, heartbeat_at=stale, attempted_at=stale
        )
        Maintenance().rescue()
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    sent, sent_waiting, sent_lost = finished
    assert (sent_waiting.id, sent_waiting.status) == (waiting.id, TaskResultStatus.FAILED)
    assert [e.traceback for e in sent_waiting.errors] == ["cancelled: not needed"]
    assert (sent_lost.id, sent_lost.status) == (lost.id, TaskResultStatus.FAILED)
    assert sent_lost.errors[0].traceback.startswith("rescued"), sent_lost.errors
    assert (sent.id, sent.status) == (result.id, TaskResultStatus.FAILED)
    assert [e.traceback for e in sent.errors] == ["cancelled: while it ran"]
    assert sent.finished_at == result.finished_at is not None


def test_a_result_read_back_names_the_task_as_it_was_enqueued():
    special = tasks.add.using(priority=80).enqueue(1, 2)
    plain = tasks.add.enqueue(1, 1)
    backend = tasks.add.get_backend()
    assert backend.get_result(plain.id).task.priority == 0
    assert backend.get_result(special.id).task.priority == 80
    assert backend.get_result(special.id).task.func is tasks.add.func


def test_context_and_unknown_results(start_worker):
    result = tasks.with_context.enqueue("ctx")
    start_worker("--queue", "default")
    wait_for_state(int(result.id), JobState.COMPLETED)
    assert tasks.with_context.get_result(result.id).return_value == "ctx:1"
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_backend().get_result("999999999")
    # Only an id as enqueue gives it: not int()'s other spellings of one.
    for spelled in (f" {result.id} ", f"{result.id}_0", "٣", None, str(2**64)):
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_backend().get_result(spelled)


def test_a_run_after_postgres_cannot_store_is_refused_and_nothing_is_written():
    import django_awa as awa

    year_zero = dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=14)))
    with pytest.raises(awa.ValidationError, match=r"run_at .*years 1 to 9999"):
        tasks.urgent.using(run_after=year_zero).enqueue()
    assert not Job.objects.exists()


def test_arguments_that_are_not_json_values_are_refused_naming_the_task_and_the_argument():
    """awa's codec stored a datetime, Decimal or UUID as a string, which the task then
    got: Django's own backends refuse them, and so does this one, before writing."""
    import decimal
    import uuid

    import django_awa as awa

    when = timezone.now()
    refused = {
        r"args\[0\] is a datetime, not a JSON value": ((when, 1), {}),
        r"args\[1\] is a Decimal": ((1, decimal.Decimal("1.5")), {}),
        r"kwargs\['b'\]\['ids'\]\[1\] is a UUID": ((1,), {"b": {"ids": [1, uuid.uuid4()]}}),
        r"args\[0\] has the key 1, not a string": (({1: "a"}, 2), {}),
    }
    for message, (args, kwargs) in refused.items():
        with pytest.raises(
            awa.ValidationError, match=r"^task tests\.testapp\.tasks\.add: " + message
        ):
            tasks.add.enqueue(*args, **kwargs)
    # What awa's codec refuses itself is named as the task too, not as kind 'task'.
    with pytest.raises(awa.ValidationError, match=r"^task tests\.testapp\.tasks\.add: .*nan"):
        tasks.add.enqueue(float("nan"), 1)
    assert not Job.objects.exists()
    # JSON values go through as Django gives them back: a tuple as a list.
    shared = [1]
    result = tasks.add.enqueue((1, 2), {"a": [shared, shared], "b": None, "c": True})
    assert Job.objects.get(id=int(result.id)).args["args"] == [
        [1, 2], {"a": [[1], [1]], "b": None, "c": True},
    ]  # fmt: skip


def test_a_queue_name_awa_cannot_store_is_refused_when_the_task_is_declared():
    """Django takes any name listed in QUEUES; awa's enqueue refused it, at the first
    call, as "job of kind 'task': invalid queue name"."""
    from django.test import override_settings

    try:
        from django.tasks import task
        from django.tasks.exceptions import InvalidTask
    except ImportError:
        from django_tasks import task
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

    backend = {"BACKEND": "django_awa.backends.AwaTaskBackend"}
    with override_settings(TASKS={"default": {**backend, "QUEUES": ["default", "my queue"]}}):
        with pytest.raises(InvalidTask, match=r"^Queue 'my queue' is not a valid awa queue name"):
            task(queue_name="my queue")(tasks.add.func)
        with pytest.raises(InvalidTask, match="'my queue' is not a valid awa queue name"):
            tasks.add.using(queue_name="my queue")
        assert tasks.add.using(queue_name="default").enqueue(1, 2).status == "READY"


def test_a_task_the_worker_cannot_find_fails_with_an_error_about_tasks_not_jobargs():
    from django_awa.testing import run_jobs

    result = tasks.add.enqueue(1, 2)
    Job.objects.filter(id=int(result.id)).update(kind="task:tests.testapp.tasks.removed")
    assert run_jobs().counts["failed"] == 1
    error = Job.objects.get(id=int(result.id)).errors[-1]["error"]
    assert error.startswith(
        "unknown job kind 'task:tests.testapp.tasks.removed': this worker finds no Django "
        "task tests.testapp.tasks.removed"
    )
    assert "django_awa.backends.AwaTaskBackend" in error and "ClassVar" not in error


@pytest.mark.slow
def test_a_task_failed_by_what_it_did_not_raise_reports_why(start_worker, tmp_path):
    """A task that failed without raising (interrupted at shutdown on its one attempt,
    rescued, cancelled, not found by the worker) read ``FAILED`` with ``errors`` empty:
    the reason was only in the job row. It is a TaskError naming ``AwaError``."""
    import django_awa as awa
    from django_awa.exceptions import AwaError

    cancelled = tasks.add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(1, 2)
    awa.cancel(int(cancelled.id), "not needed")
    cancelled.refresh()
    assert cancelled.status == TaskResultStatus.FAILED
    (error,) = cancelled.errors
    assert error.exception_class is AwaError and error.traceback == "cancelled: not needed"

    finished = tmp_path / "finished"
    worker = start_worker(
        "--queue",
        "default",
        "--shutdown-timeout",
        "0",
        env={"AWA_TEST_TASK_FINISHED": str(finished)},
    )
    napping = tasks.nap.enqueue(30)
    # Its handler started (not a claimed job given back unused): the heartbeat says so.
    wait_for(lambda: Job.objects.filter(id=int(napping.id), attempted_at__isnull=False).exists())
    assert worker.stop() == 0
    napping.refresh()
    assert napping.status == TaskResultStatus.FAILED
    (error,) = napping.errors
    assert error.exception_class_path == "django_awa.exceptions.AwaError"
    assert error.traceback.startswith("interrupted: the worker shut down"), error.traceback
    # The worker sent task_finished for it, once, as for one that raised.
    assert finished.read_text() == f"{napping.id} FAILED\n"

    # What the function raised is reported as it was, not again from the row's errors.
    start_worker("--queue", "default")
    exploded = tasks.explode.enqueue()
    wait_for_state(int(exploded.id), JobState.FAILED)
    exploded.refresh()
    assert [e.exception_class_path for e in exploded.errors] == ["builtins.ValueError"]
