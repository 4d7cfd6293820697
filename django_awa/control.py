"""Operator controls: cancel, retry, pause and resume queues, queue limits, statistics.

Each joins the caller's open transaction on ``using`` (default
``AWA["DATABASE"]``).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Final, Literal

from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from . import sql
from .conf import (
    MAX_GLOBAL_CONCURRENCY,
    QUEUE_NAME_RE,
    awa_settings,
    invalid_queue_name,
    not_kept_note,
    parse_rate,
    positive_int,
)
from .dependencies import after_outcomes, reopen
from .enqueueing import database_alias
from .exceptions import JobNotFound, UniqueConflict, ValidationError
from .followups import Cancelled, dispatch, send_signal
from .models import Job, JobState, Queue, jobs_from_rows
from .sequences import after_finishing


def _get(job_id: int, alias: str) -> Job:
    try:
        return Job.objects.using(alias).get(id=job_id)
    except Job.DoesNotExist:
        raise JobNotFound(f"no job with id {job_id}{not_kept_note()}") from None


_JOB_ID_TEXT = re.compile(r"[+-]?[0-9]+")
_MAX_JOB_ID: Final = 2**63 - 1  # ids are bigint


def _job_id(job_id: Any, where: str) -> int:
    """``job_id`` as an int (text of one is taken, as before), or ``ValidationError``
    naming it: given to PostgreSQL as it is, a float was rounded to another job's id
    (``cancel(1.5)`` cancelled job 2), and a ``Job`` row, a bool or text that is no
    number failed with a database error naming neither the value nor the call.
    ``JobNotFound`` for an id past what a bigint holds: no job has it."""
    if isinstance(job_id, str) and _JOB_ID_TEXT.fullmatch(job_id.strip()):
        job_id = int(job_id)
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        given = (
            f"the Job row {job_id} (pass job.id)"
            if isinstance(job_id, Job)
            else f"{type(job_id).__name__} {job_id!r}"
        )
        raise ValidationError(f"{where}: a job id is an int, got {given}")
    if abs(job_id) > _MAX_JOB_ID:
        raise JobNotFound(f"no job with id {job_id}")
    return job_id


def cancel(job_id: int, reason: str = "", *, using: str | None = None) -> Job:
    """Cancel a job that has not finished; return its row (``reason`` ``None``: no reason).

    Jobs that depend on it with ``requires="completed"`` are cancelled in the
    same transaction (the cascade); those with ``requires="finished"`` may run.
    A running job is cancelled at once; its handler sees ``is_cancelled()``
    within a second and whatever it returns is discarded; of a kind with
    ``awa.Limit(concurrency=...)``, or a sequence member, its key's place stays
    taken until that handler returns (while its worker lives). ``on_cancelled``
    follow-ups are inserted in the same transaction (a failing one raises and
    nothing changes). A job already finished is returned unchanged.
    Raises ``JobNotFound``.
    """
    return cancel_with_dependents(job_id, reason, using=using)[0]


def cancel_with_dependents(
    job_id: int, reason: str = "", *, using: str | None = None
) -> tuple[Job, list[int]]:
    """``cancel``, also returning the ids of the dependents it cancelled (the admin's counts)."""
    alias = database_alias(using)
    job_id = _job_id(job_id, "cancel")
    # Kept, not refused, as a handler's awa.Cancel reason is: escaped if PostgreSQL
    # cannot hold it (a NUL, a lone surrogate from a mis-decoded terminal), cut if huge.
    context = Cancelled.given("" if reason is None else reason)
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute(
                sql.CANCEL_JOBS,
                {
                    "ids": [job_id],
                    "error": context.error_entry,
                    "states": list(JobState.LIVE),
                    # A handler still running keeps its key's place (sql.CANCEL_JOBS).
                    "stale_after": awa_settings().stale_after,
                },
            )
            row = cursor.fetchone()
            if row is None:
                return _get(job_id, alias), []
            previous, (job,) = row[0], jobs_from_rows([row[1:]], alias)
            if previous == JobState.RUNNING:
                cursor.execute(sql.NOTIFY_CANCEL, {"job_id": str(job_id)})
        dispatch(job, context, alias)
        send_signal(job, context, alias)
        cancelled = after_outcomes([job], alias)
        after_finishing([job], alias)
    return job, cancelled


def retry(job_id: int, *, using: str | None = None) -> Job:
    """Make a failed, cancelled or retryable job available now, its attempts reset.

    A job with dependencies waits for them again (``blocked``, settled at
    once). Its dependents that its failure or cancellation cancelled are
    reopened, ``blocked`` again until it completes.
    Any other state is returned unchanged. Raises ``JobNotFound``, or
    ``UniqueConflict`` if another job now holds its unique key.
    """
    return retry_with_dependents(job_id, using=using)[0]


def retry_with_dependents(job_id: int, *, using: str | None = None) -> tuple[Job, list[int]]:
    """``retry``, also returning the ids of the dependents it reopened (the admin's counts)."""
    alias = database_alias(using)
    job_id = _job_id(job_id, "retry")
    params: dict[str, Any] = {"ids": [job_id], "states": list(JobState.RETRIABLE)}
    reopening = False
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            # A finished row in awa_job_done comes back into awa_job first.
            cursor.execute(sql.REVIVE_DONE, params)
            cursor.execute(sql.RETRY_JOBS, params)
            row = cursor.fetchone()
            if row is None:
                job = _get(job_id, alias)
                if job.state not in JobState.RETRIABLE:
                    return job, []
                # Maintenance moved the row into awa_job_done while these
                # statements waited for it: the copy there was not yet
                # committed when they began. The next statements see it.
                cursor.execute(sql.REVIVE_DONE, params)
                cursor.execute(sql.RETRY_JOBS, params)
                row = cursor.fetchone()
                if row is None:
                    return _get(job_id, alias), []
            (job,) = jobs_from_rows([row], alias)
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": [job.queue]})
            # Its dependents that its failure cancelled wait for it again, and
            # it waits for its own dependencies again (SPEC §11).
            reopening = True
            reopened = reopen(job, alias)
            if job.state == JobState.AVAILABLE:
                job.refresh_from_db(using=alias, fields=["state"])
    except IntegrityError as exc:
        if reopening:
            raise UniqueConflict(
                f"job {job_id} cannot be retried: a job that waits for it, cancelled with "
                f"it and waiting again once it is retried, has a unique key another job "
                f"holds now"
            ) from exc
        raise UniqueConflict(
            f"job {job_id} cannot be retried: another job holds its unique key"
        ) from exc
    return job, reopened


def _check_queue_name(name: Any, where: str) -> None:
    """``ValidationError`` unless ``name`` is a queue name enqueue accepts: a row
    for any other would pause or limit a queue no job can be in."""
    if not isinstance(name, str) or not QUEUE_NAME_RE.match(name):
        raise ValidationError(f"{where}: {invalid_queue_name(name)}")


def pause_queue(name: str, *, using: str | None = None) -> None:
    """Stop workers claiming from queue ``name`` (running jobs finish).

    Raises ``ValidationError`` naming an invalid queue name, nothing written.
    """
    _check_queue_name(name, "pause_queue")
    alias = database_alias(using)
    now = timezone.now()
    Queue.objects.using(alias).update_or_create(
        name=name, defaults={"paused": True, "paused_at": now, "updated_at": now}
    )


def resume_queue(name: str, *, using: str | None = None) -> None:
    """Let workers claim from queue ``name`` again, and wake them.

    Raises ``ValidationError`` naming an invalid queue name, nothing written.
    """
    _check_queue_name(name, "resume_queue")
    alias = database_alias(using)
    with transaction.atomic(using=alias):
        Queue.objects.using(alias).update_or_create(
            name=name, defaults={"paused": False, "paused_at": None, "updated_at": timezone.now()}
        )
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": [name]})


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP: Final = _Keep.KEEP  # set_queue_limits: leave this limit as it is


def set_queue_limits(
    name: str,
    *,
    rate_limit: str | Literal[_Keep.KEEP] | None = KEEP,
    global_concurrency: int | Literal[_Keep.KEEP] | None = KEEP,
    reset: bool = False,
    using: str | None = None,
) -> dict[str, Any]:
    """Change queue ``name``'s fleet-wide limits at runtime; return what is stored.

    ``rate_limit`` (``"N/s"``, ``"N/m"``, ``"N/h"``) and ``global_concurrency``
    override ``AWA["QUEUES"][name]`` for every worker; ``None`` removes that
    limit, an argument left out keeps what was there. ``reset=True`` first drops
    every runtime value, so the settings apply again. Stored in the database
    (``awa_queue.limits``) in the caller's transaction; each worker applies it
    as soon as the commit's NOTIFY reaches it, and within one ``POLL_INTERVAL``
    if it does not (its listener reconnecting, say). Raises
    ``ValidationError`` naming a bad value, nothing written.
    """
    where = f"set_queue_limits({name!r})"
    _check_queue_name(name, "set_queue_limits")
    if not isinstance(reset, bool):
        raise ValidationError(f"{where}: reset must be True or False, got {reset!r}")
    changes: dict[str, Any] = {}
    if rate_limit is not KEEP:
        if rate_limit is None:
            changes["rate_limit"] = None
        else:
            rate = parse_rate(rate_limit, f"{where}: rate_limit")
            changes.update(rate_limit=rate.text, rate_count=rate.count, rate_period=rate.period)
    if global_concurrency is not KEEP:
        if global_concurrency is not None and not positive_int(
            global_concurrency, MAX_GLOBAL_CONCURRENCY
        ):
            raise ValidationError(
                f"{where}: global_concurrency must be an integer from 1 to "
                f"{MAX_GLOBAL_CONCURRENCY:,}, or None, got {global_concurrency!r}"
            )
        changes["global_concurrency"] = global_concurrency
    alias = database_alias(using)
    with transaction.atomic(using=alias):
        queue, _ = Queue.objects.using(alias).select_for_update().get_or_create(name=name)
        limits = {} if reset else dict(queue.limits or {})
        if changes.get("rate_limit", "") is None:
            for key in ("rate_count", "rate_period"):
                limits.pop(key, None)
        limits.update(changes)
        queue.limits = limits
        queue.updated_at = timezone.now()
        queue.save(update_fields=["limits", "updated_at"])
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.NOTIFY_LIMITS, {"queue": name})
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": [name]})
    return limits


def empty_queue_stats() -> dict[str, Any]:
    """A queue's ``queue_stats()`` entry before it holds any job: 0 in every state, not paused."""
    return {state: 0 for state in JobState.values} | {"paused": False}


def queue_stats(*, using: str | None = None, counted: bool = False) -> dict[str, dict[str, Any]]:
    """``{queue: {state: count for every state, "paused": bool}}`` for every known queue:
    those of ``AWA["QUEUES"]`` (as ``/metrics`` lists them), with jobs, or with a row
    in ``awa_queue`` (paused, or given limits).

    ``counted=True`` reads the maintenance leader's last count (``awa_job_count``)
    instead of counting every row: live jobs as of its last tick, and only the
    finished ones not yet moved to ``awa_job_done``.
    """
    alias = database_alias(using)
    stats: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        if name not in stats:
            stats[name] = empty_queue_stats()
        return stats[name]

    for name in awa_settings().queues:
        entry(name)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.COUNTED_QUEUE_STATS if counted else sql.QUEUE_STATS)
        for queue, state, count in cursor.fetchall():
            entry(queue)[state] = count
    for queue in Queue.objects.using(alias).all():
        entry(queue.name)["paused"] = queue.paused
    return dict(sorted(stats.items()))
