"""Django Tasks run by awa (``TASKS`` uses ``AwaTaskBackend`` in tests/settings.py)."""

from __future__ import annotations

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task(priority=60)
def urgent() -> str:
    return "done"


@task()
def explode() -> None:
    raise ValueError("task exploded")


@task(max_attempts=3)
def flaky(marker: str) -> int:
    from tests.testapp.models import Ledger

    Ledger.objects.create(job_id=0, attempt=0, run_lease=0, note=marker)
    runs = Ledger.objects.filter(note=marker).count()
    if runs < 2:
        raise RuntimeError(f"flaky run {runs}")
    return runs


@task(takes_context=True)
def with_context(context, label: str) -> str:
    return f"{label}:{context.attempt}"


@task(takes_context=True)
def backend_seen(context) -> list[str]:
    """The backend of the result a task is run with, and of its task (refresh()'s)."""
    return [context.task_result.backend, context.task_result.task.backend]


@task()
def nap(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


@task()
def leave() -> None:
    raise SystemExit(3)


@task()
def not_a_number() -> float:
    return float("nan")


@task()
def bad_sql(how: str) -> None:
    """Writes a Ledger row, then meets a database error: a raw statement's or the ORM's."""
    from django.db import connection

    from tests.testapp.models import Ledger

    Ledger.objects.create(job_id=0, attempt=0, run_lease=0, note=f"task-{how}")
    if how == "raw":
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    else:  # the note is longer than its column
        Ledger.objects.create(job_id=0, attempt=0, run_lease=0, note="x" * 101)


@task(takes_context=True)
def cancel_own_job(context) -> str:
    """Cancels its own job, as a user would while it runs, then returns."""
    import django_awa as awa

    awa.cancel(int(context.task_result.id), "while it ran")
    return "returned anyway"


def _note_finished(sender, task_result, **kwargs) -> None:
    """In a worker started with AWA_TEST_TASK_FINISHED: each task_finished, a line."""
    import os

    with open(os.environ["AWA_TEST_TASK_FINISHED"], "a") as out:
        out.write(f"{task_result.id} {task_result.status}\n")


def _listen() -> None:
    import os

    if os.environ.get("AWA_TEST_TASK_FINISHED"):
        try:
            from django.tasks.signals import task_finished
        except ImportError:
            from django_tasks.signals import task_finished
        task_finished.connect(_note_finished)


_listen()
