"""Django Tasks on awa: ``TASKS = {"default": {"BACKEND": "django_awa.backends.AwaTaskBackend"}}``.

A ``@task`` function becomes an awa job of kind ``task:<module path>``:
``enqueue`` joins the caller's transaction, ``awa_worker`` runs it,
``get_result`` reads its row. Works with ``django.tasks`` (Django 6) and the
``django-tasks`` backport (Django 5.2).

The function is looked up by its module path only among tasks of this
backend: registered when their module was imported, or imported on demand
from a module of an installed app. Nothing else named in a row is imported.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import json
import reprlib
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.db import connections, transaction
from django.utils import timezone

if TYPE_CHECKING:
    # Typed by django-stubs' django.tasks; the backport has the same names.
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
else:
    try:  # Django 6
        from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import Task, TaskError
        from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
        from django.tasks.signals import task_enqueued, task_finished, task_started
    except ImportError:  # Django 5.2 with the django-tasks backport
        from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started

from . import signals, sql
from .compat import savepoint_create
from .conf import QUEUE_NAME_RE, not_kept_note
from .db import postgresql_problem, transaction_failed
from .enqueueing import EnqueueRequest, database_alias, enqueue_prepared, prepare
from .exceptions import ValidationError
from .execute import JobContext
from .kinds import JobArgs, WorkerSpec, check_max_attempts, registry
from .models import Job, JobState

KIND_PREFIX = "task"
RETURN_KEY = "awa_task_return"
ERRORS_KEY = "awa_task_errors"
PRIORITY_KEY = "awa_task_priority"
STARTED_KEY = "awa_task_started_at"
# The keys AwaTaskBackend takes in TASKS[...]["OPTIONS"].
OPTIONS = ("DATABASE",)

STATUS = {
    JobState.SCHEDULED: TaskResultStatus.READY,
    JobState.AVAILABLE: TaskResultStatus.READY,
    JobState.RETRYABLE: TaskResultStatus.READY,
    JobState.BLOCKED: TaskResultStatus.READY,
    JobState.RUNNING: TaskResultStatus.RUNNING,
    JobState.WAITING_EXTERNAL: TaskResultStatus.RUNNING,
    JobState.COMPLETED: TaskResultStatus.SUCCESSFUL,
    JobState.FAILED: TaskResultStatus.FAILED,
    JobState.CANCELLED: TaskResultStatus.FAILED,
}

_tasks: dict[str, AwaTask] = {}


def awa_priority(priority: int) -> int:
    """Django's -100..100 onto awa's 4..1."""
    if priority >= 50:
        return 1
    if priority >= 0:
        return 2
    if priority >= -50:
        return 3
    return 4


if TYPE_CHECKING:
    _Task = Task[..., Any]
else:
    _Task = Task  # generic in django-stubs only: Django's Task takes no subscript


@dataclass(frozen=True, slots=True, kw_only=True)
class AwaTask(_Task):
    """A Django Task with awa's extra option: ``@task(max_attempts=N)`` (default 1)."""

    max_attempts: int = 1

    def __post_init__(self) -> None:
        check_max_attempts(self.max_attempts, f"@task {self.func.__qualname__}")
        Task.__post_init__(self)  # not super(): slots=True makes a new class
        # The task as declared: not a copy made by .using() (the same function
        # with other options), which would give every row read back its options.
        # A module imported again declares a new function, which replaces it.
        known = _tasks.get(self.module_path)
        if known is None or known.func is not self.func:
            _tasks[self.module_path] = self


@dataclass
class TaskCall(JobArgs):
    """The stored call of a Django Task (its args are JSON, as Django's own)."""

    kind = "task"
    args: list[Any] = dataclasses.field(default_factory=list)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    backend: str = "default"


def _task_for(path: str) -> AwaTask | None:
    task = _tasks.get(path)
    if task is not None:
        return task
    module_name = path.rpartition(".")[0]
    # Import on demand, but only modules of installed apps.
    owner = module_name.split(".")
    if not any(
        owner[: len(app.name.split("."))] == app.name.split(".") for app in apps.get_app_configs()
    ):
        return None
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # No such module: no such task. Any other error while importing one
        # that exists (a missing dependency too) is raised, so the worker
        # records it on the job instead of calling the kind unknown.
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise
        return None
    return _tasks.get(path)


def _resolve(kind: str) -> WorkerSpec | None:
    task = _task_for(kind.partition(":")[2])
    if task is None:
        return None
    return WorkerSpec(
        args_cls=TaskCall,
        handler=_run_task,
        queue=task.queue_name,
        max_attempts=getattr(task, "max_attempts", 1),
    )


registry.resolvers[KIND_PREFIX] = _resolve


def _run_task(job: JobContext) -> Any:
    task = _task_for(job.kind.partition(":")[2])
    if task is None:  # pragma: no cover - resolved just before
        raise RuntimeError(f"task {job.kind} vanished")
    call = job.args
    alias = job.row._state.db
    # _resolve names TaskCall as the args class; an AwaTask is made by the
    # backend whose task_class it is; a claimed row was loaded from a database.
    if not isinstance(call, TaskCall):  # pragma: no cover
        raise TypeError(f"task {job.kind}: args are {type(call).__name__}, not TaskCall")
    # The backend the call was enqueued through (``task.using(backend=...)``), whose
    # database holds the row; the task's own if that alias is no longer an awa one.
    backend = task_backends[call.backend] if _is_awa_backend(call.backend) else task.get_backend()
    if not isinstance(backend, AwaTaskBackend):  # pragma: no cover
        raise TypeError(f"task {job.kind}: backend {task.backend!r} is not an AwaTaskBackend")
    if alias is None:  # pragma: no cover
        raise RuntimeError(f"task {job.kind}: job {job.id} has no database")
    connection = connections[alias]
    if job.max_attempts > 1 and STARTED_KEY not in (job.row.metadata or {}):
        # TaskResult.started_at is the first attempt's start: a retry's claim
        # replaces attempted_at, so the first run of a task that may be retried keeps it.
        with connection.cursor() as cursor:
            cursor.execute(sql.RECORD_TASK_STARTED, {"id": job.id, "run_lease": job.row.run_lease})
    result = backend.result_from_job(job.row, task)
    # The row stores this attempt's start only once it has run 0.1 s (and the first's,
    # if this is it, only just now): it starts now.
    now = timezone.now()
    started: dict[str, Any] = {"started_at": result.started_at or now, "last_attempted_at": now}
    result = dataclasses.replace(result, **{k: v for k, v in started.items() if hasattr(result, k)})
    task_started.send(sender=type(backend), task_result=result)
    # A worker runs the task in autocommit. Inside a transaction (run_jobs in a
    # TestCase) a database error the task meets aborts it: the error could not be
    # recorded, and the "transaction is aborted" of recording it would replace it.
    # The task's writes are rolled back to here first, as run_jobs would after it.
    savepoint = savepoint_create(using=alias) if connection.in_atomic_block else None
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *call.args, **call.kwargs)
        else:
            value = task.call(*call.args, **call.kwargs)
        # What Job.result cannot hold (NaN too) is the task's error.
        json.dumps(value, allow_nan=False)
    except BaseException as exc:  # as Django's own backend records them (the worker's too)
        error = {
            "exception_class_path": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "traceback": "".join(traceback.format_exception(exc)),
        }
        stored = {**error, "attempt": job.attempt}  # which of the row's errors it explains
        if savepoint is not None and (transaction_failed(alias) or connection.needs_rollback):
            connection.needs_rollback = False  # else Django refuses the rollback too
            transaction.savepoint_rollback(savepoint, using=alias)
        with connection.cursor() as cursor:
            cursor.execute(
                sql.RECORD_TASK_ERROR,
                {"error": json.dumps([stored]), "id": job.id, "run_lease": job.row.run_lease},
            )
            ours = cursor.rowcount > 0
        if savepoint is not None:
            transaction.savepoint_commit(savepoint, using=alias)
        # Not if cancelled or rescued meanwhile: its error is not the outcome.
        if ours and job.attempt >= job.max_attempts:  # no retry: the task is finished
            errors = [*result.errors, TaskError(**error)]
            _send_finished(backend, result, TaskResultStatus.FAILED, errors=errors)
        raise
    if savepoint is not None:
        transaction.savepoint_commit(savepoint, using=alias)
    with connection.cursor() as cursor:
        cursor.execute(sql.TASK_STILL_RUNNING, {"id": job.id, "run_lease": job.row.run_lease})
        ours = cursor.fetchone() is not None
    if ours:  # else cancelled or rescued meanwhile: what it returned is discarded
        _send_finished(backend, result, TaskResultStatus.SUCCESSFUL, value=value)
    # Stored as Job.result by the completing transaction (SPEC §9, §11).
    return value


def _is_awa_backend(alias: Any) -> bool:
    """Whether ``alias`` names an ``AwaTaskBackend`` in ``TASKS``."""
    if not isinstance(alias, str) or alias not in getattr(settings, "TASKS", {}):
        return False
    return isinstance(task_backends[alias], AwaTaskBackend)


def _send_finished(
    backend: AwaTaskBackend,
    result: TaskResult[..., Any],
    status: TaskResultStatus,
    *,
    value: Any = None,
    errors: list[TaskError] | None = None,
) -> None:
    """Django's ``task_finished``, as its own backends send it: once the function
    returned, or raised on its last attempt. The worker writes the outcome next."""
    finished = dataclasses.replace(
        result,
        status=status,
        finished_at=timezone.now(),
        errors=result.errors if errors is None else errors,
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(finished, "_return_value", value)
    task_finished.send(sender=type(backend), task_result=finished)


def _finished_unraised(sender: type[Job], job: Job, **kwargs: Any) -> None:
    """``task_finished`` for a task failed for good by what its function did not raise
    or return (a cancel, a rescue, its attempt interrupted at shutdown), once that
    commits: the result as stored. What the function raised or returned on its last
    attempt was sent by ``_run_task``, and so is not sent again."""
    if not job.kind.startswith(f"{KIND_PREFIX}:") or job.state not in (
        JobState.FAILED,
        JobState.CANCELLED,
    ):
        return
    raised = (job.metadata or {}).get(ERRORS_KEY, [])
    if job.state == JobState.FAILED and any(e.get("attempt") == job.attempt for e in raised):
        return
    task = _task_for(job.kind.partition(":")[2])
    if task is None:  # no task to name (not found by the worker either)
        return
    called = (job.args or {}).get("backend")
    if isinstance(called, str) and _is_awa_backend(called):
        backend = task_backends[called]
    else:
        backend = task.get_backend()
    if isinstance(backend, AwaTaskBackend):
        task_finished.send(sender=type(backend), task_result=backend.result_from_job(job, task))


for _signal in (signals.job_exhausted, signals.job_cancelled, signals.job_rescued):
    # No sender=: has_listeners(), which send_signal asks first, counts only those.
    _signal.connect(_finished_unraised, dispatch_uid="awa_task_finished_unraised")


def _check_json_arguments(args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse a call whose arguments are not JSON values, as Django's backends do.

    awa's codec stores a ``datetime``, ``Decimal`` or ``UUID`` as a string, which a
    job's ``JobArgs`` field turns back, but a task's arguments have no field: the
    function would get the string. ``ValidationError`` names the argument.
    """
    stack: list[tuple[str, Any]] = [(f"args[{i}]", value) for i, value in enumerate(args)]
    stack += [(f"kwargs[{name!r}]", value) for name, value in kwargs.items()]
    seen: set[int] = set()  # a list or dict met twice (or holding itself) is walked once
    while stack:
        path, value = stack.pop()
        if value is None or isinstance(value, (str, int, float)):  # bool is an int
            continue
        if isinstance(value, (list, tuple, dict)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise ValidationError(
                            f"{where}: {path} has the key {key!r}, not a string: a task's "
                            f"arguments are JSON, whose objects have string keys"
                        )
                    stack.append((f"{path}[{key!r}]", item))
            else:
                stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
            continue
        raise ValidationError(
            f"{where}: {path} is a {type(value).__qualname__}, not a JSON value "
            f"({reprlib.repr(value)}): a task's arguments may hold only str, int, float, "
            f"bool, None, lists and dicts with string keys, as Django requires; pass a JSON "
            f"form of it (value.isoformat(), str(value)) and convert it back in the task"
        )


# The exception class a TaskError names for a failure the function did not raise.
NOT_RAISED = "django_awa.exceptions.AwaError"


def _task_errors(job: Job) -> list[TaskError]:
    """``TaskResult.errors``: what the function raised, as recorded by ``_run_task``, and
    the row's errors of the attempts it raised nothing in (its worker died or shut down,
    its deadline passed, no worker found the task, a cancel): a task failed by one of
    those read ``FAILED`` with no error at all."""
    raised = (job.metadata or {}).get(ERRORS_KEY, [])
    explained = {e.get("attempt") for e in raised}
    entries: list[tuple[int, dict[str, Any]]] = [(e.get("attempt", 0), e) for e in raised]
    if None not in explained:  # rows written before 0.2.0 name no attempt: read as then
        entries += [
            (e.get("attempt", 0), {"exception_class_path": NOT_RAISED, "traceback": _text(e)})
            for e in job.errors or []
            if isinstance(e, dict) and e.get("attempt") not in explained
        ]
    entries.sort(key=lambda entry: entry[0] if isinstance(entry[0], int) else 0)
    return [
        TaskError(
            exception_class_path=e.get("exception_class_path", "builtins.Exception"),
            traceback=e.get("traceback", ""),
        )
        for _, e in entries
    ]


def _started_at(metadata: dict[str, Any]) -> dt.datetime | None:
    """The first attempt's start, kept by a task that may be retried (``STARTED_KEY``)."""
    value = metadata.get(STARTED_KEY)
    return dt.datetime.fromisoformat(value) if isinstance(value, str) else None


def _text(entry: dict[str, Any]) -> str:
    """A row's ``errors`` entry as a TaskError's traceback: its traceback, if any, and error."""
    error, trace = str(entry.get("error", "")), str(entry.get("traceback") or "")
    return f"{trace.rstrip()}\n{error}" if trace else error


class AwaTaskBackend(BaseTaskBackend):
    task_class = AwaTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database = self.options.get("DATABASE")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Django's checks; ``OPTIONS`` holding only ``DATABASE`` (a misspelt key would
        leave the tasks' jobs in ``AWA["DATABASE"]`` in silence), and that naming a
        PostgreSQL alias: else every ``enqueue`` and ``get_result`` would raise
        ``ConfigurationError``."""
        messages = list(super().check(**kwargs))
        unknown = sorted(map(repr, set(self.options) - set(OPTIONS)))
        if unknown:
            messages.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS'] has unknown key(s) {', '.join(unknown)}; "
                    f"AwaTaskBackend takes only {', '.join(map(repr, OPTIONS))}",
                    hint="Spell it as listed, or remove it.",
                    id="awa.E103",
                )
            )
        if self.database is None:
            return messages
        where = f"TASKS[{self.alias!r}]['OPTIONS']['DATABASE']"
        if not isinstance(self.database, str) or self.database not in settings.DATABASES:
            problem = f"{where} names no entry of DATABASES: {self.database!r}"
        else:
            found = postgresql_problem(self.database)
            if found is None:
                return messages
            problem = f"{where}: {found}"
        hint = "Name a PostgreSQL alias of DATABASES, or leave it out for AWA['DATABASE']."
        return [*messages, checks.Error(problem, hint=hint, id="awa.E102")]

    def validate_task(self, task: Task[..., Any]) -> None:
        """Django's checks, and a ``queue_name`` awa can store: refused when the task is
        declared (or ``.using()`` makes it), not at its first ``enqueue``."""
        super().validate_task(task)
        if not isinstance(task.queue_name, str) or not QUEUE_NAME_RE.match(task.queue_name):
            raise InvalidTask(
                f"Queue {task.queue_name!r} is not a valid awa queue name: 1 to 128 letters, "
                f"digits, '_', '.', ':' or '-'."
            )

    def enqueue[**P, R](
        self, task: Task[P, R], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> TaskResult[P, R]:
        """Insert the task as an awa job in the caller's transaction."""
        self.validate_task(task)
        where = f"task {task.module_path}"
        _check_json_arguments(args, kwargs, where)
        alias = database_alias(self.database)
        call = TaskCall(args=list(args), kwargs=dict(kwargs), backend=self.alias)
        try:
            prepared = prepare(
                EnqueueRequest(
                    call,
                    queue=task.queue_name,
                    priority=awa_priority(task.priority),
                    run_at=task.run_after,
                    max_attempts=getattr(task, "max_attempts", 1),
                ),
                # Django's priority (-100 to 100): awa's own keeps only its quarter.
                metadata_json=json.dumps({PRIORITY_KEY: task.priority}),
            )
        except ValidationError as exc:
            # Named as the task, not as the kind "task" all tasks' calls share.
            raise ValidationError(f"{where}: {exc}") from exc
        prepared.kind = f"{KIND_PREFIX}:{task.module_path}"
        job = enqueue_prepared(prepared, alias)
        result = self.result_from_job(job, task)
        task_enqueued.send(sender=type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        alias = database_alias(self.database)
        # Only the ids enqueue gives out: int() would take " 5 ", "1_0" or "٣" too.
        if not (isinstance(result_id, str) and result_id.isascii() and result_id.isdigit()):
            raise TaskResultDoesNotExist(result_id)
        try:
            job = Job.objects.using(alias).get(id=int(result_id), kind__startswith="task:")
        except (ValueError, OverflowError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(f"{result_id}{not_kept_note()}") from None
        task = _task_for(job.kind.partition(":")[2])
        if task is None:
            raise TaskResultDoesNotExist(f"{result_id}: task {job.kind} is not known here")
        return self.result_from_job(job, task)

    def result_from_job[**P, R](self, job: Job, task: Task[P, R]) -> TaskResult[P, R]:
        metadata = job.metadata or {}
        call = job.args or {}
        # The task as this job was enqueued: its queue, and its priority if stored,
        # through this backend (whose database holds the row: a result's refresh()
        # asks its task's backend).
        priority = metadata.get(PRIORITY_KEY)
        if (
            job.queue != task.queue_name
            or (priority is not None and priority != task.priority)
            or task.backend != self.alias
        ):
            task = task.using(
                queue_name=job.queue,
                priority=task.priority if priority is None else priority,
                backend=self.alias,
            )
        values = {
            "task": task,
            "id": str(job.id),
            "status": STATUS[JobState(job.state)],
            "enqueued_at": job.created_at,
            "started_at": (job.attempt > 1 and _started_at(metadata)) or job.attempted_at,
            "finished_at": job.finalized_at,
            "last_attempted_at": job.attempted_at,
            "args": call.get("args", []),
            "kwargs": call.get("kwargs", {}),
            "backend": self.alias,
            "errors": _task_errors(job),
            "worker_ids": ["awa"] * job.attempt,
        }
        names = {f.name for f in dataclasses.fields(TaskResult) if f.init}
        result: TaskResult[P, R] = TaskResult(**{k: v for k, v in values.items() if k in names})
        if RETURN_KEY in metadata:  # written by 0.1.0
            object.__setattr__(result, "_return_value", metadata[RETURN_KEY])
        elif job.state == JobState.COMPLETED:
            object.__setattr__(result, "_return_value", job.result)
        return result
