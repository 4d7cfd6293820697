"""Helpers for testing your jobs: assert what was enqueued, run jobs inline (SPEC §13).

They work inside ``django.test.TestCase``, where nothing commits: everything
runs on the caller's connection and inside its transaction, with no worker,
no other connection and no NOTIFY. ``run_jobs`` goes through the real claim,
handler, finalize and follow-up code a worker runs, in the calling thread.

    from django_awa.testing import assert_enqueued, run_jobs

    def test_signup_sends_welcome(self):
        signup("ada@example.com")
        assert_enqueued(SendWelcome, email="ada@example.com")
        report = run_jobs()
        assert report.completed == 1

pytest-django users may add ``pytest_plugins = ["django_awa.testing.pytest"]``
to their ``conftest.py`` for the ``awa_jobs`` fixture.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from django.db import connections, transaction

from .. import db, sql
from ..codec import _encode, decode_args, encode_checked
from ..compat import savepoint_create
from ..conf import awa_settings
from ..enqueueing import database_alias
from ..exceptions import ConfigurationError, ValidationError
from ..execute import (
    Attempt,
    AttemptResult,
    JobContext,
    attempt_keys,
    call_handler,
    left_open,
    resolve_handler,
    run_attempt,
)
from ..finalize import finalize, run_atomic_attempt
from ..handlers import discard_open_transactions, transaction_marks
from ..kinds import JobArgs, WorkerSpec, registry
from ..models import Job, JobState, jobs_from_rows
from ..sequences import SEQUENCE_KEY

__all__ = [
    "RunLimitReached",
    "RunReport",
    "assert_enqueued",
    "enqueued",
    "perform_job",
    "refute_enqueued",
    "run_jobs",
]

# The states of a job that is enqueued: waiting for its next (or first) run, a
# workflow step's for its dependencies too.
ENQUEUED_STATES = (JobState.AVAILABLE, JobState.SCHEDULED, JobState.RETRYABLE, JobState.BLOCKED)
# Jobs claimed together by one round of run_jobs.
ROUND_SIZE = 100
# Jobs listed at most in a failure message.
LISTED = 20


# -- what was enqueued --------------------------------------------------------------


def _kind_and_fields(
    args_or_cls: JobArgs | type[JobArgs] | None, fields: Mapping[str, Any], where: str
) -> tuple[str | None, dict[str, Any]]:
    """The kind to match and the args fields (JSON values) its jobs must have."""
    if args_or_cls is None:
        if fields:
            raise TypeError(f"{where}: args fields {sorted(fields)} need a JobArgs class")
        return None, {}
    if isinstance(args_or_cls, JobArgs):
        wanted = encode_checked(args_or_cls)
        cls: type[JobArgs] = type(args_or_cls)
    elif isinstance(args_or_cls, type) and issubclass(args_or_cls, JobArgs):
        wanted = {}
        cls = args_or_cls
    else:
        raise TypeError(f"{where}: expected a JobArgs instance or subclass, got {args_or_cls!r}")
    names = {f.name for f in dataclasses.fields(cast(Any, cls))}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(
            f"{where}: {cls.__qualname__} has no field(s) {unknown}; its fields are {sorted(names)}"
        )
    if fields:
        # Encoded as the args are stored, so a date or a nested dataclass
        # compares with what the row holds.
        wanted.update(_encode_fields(cls, dict(fields), where))
    return cls.kind, wanted


def _encode_fields(cls: type[JobArgs], values: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        return {name: _encode(value) for name, value in values.items()}
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{where}: {cls.__qualname__}: {exc}") from exc


def enqueued(
    args_cls: type[JobArgs] | None = None, *, queue: str | None = None, using: str | None = None
) -> list[Job]:
    """The jobs waiting to run (available, scheduled, retryable or blocked), oldest first.

    Only those of ``args_cls``'s kind and of ``queue`` when given. Reads on
    connection ``using`` (default ``AWA["DATABASE"]``): inside a test's
    transaction, it sees what the test enqueued.
    """
    kind, _ = _kind_and_fields(args_cls, {}, "enqueued()")
    _check_queue(queue, "enqueued()")
    return _waiting(kind, queue, using)


def _check_queue(queue: object, where: str) -> None:
    """``queue`` is ``None`` or a queue's name: a list or a number would match no job."""
    if queue is not None and not isinstance(queue, str):
        raise TypeError(f"{where}: queue must be a queue's name (a str) or None, got {queue!r}")


def _check_count(count: object, where: str) -> None:
    """``count`` is ``None`` or a whole number from 0: ``"1"`` or ``-1`` matches no number."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise TypeError(f"{where}: count must be a whole number from 0 or None, got {count!r}")


def _waiting(kind: str | None, queue: str | None, using: str | None) -> list[Job]:
    jobs = Job.objects.using(database_alias(using)).filter(state__in=ENQUEUED_STATES)
    if kind is not None:
        jobs = jobs.filter(kind=kind)
    if queue is not None:
        jobs = jobs.filter(queue=queue)
    return list(jobs.order_by("id"))


def _matching(
    args_or_cls: JobArgs | type[JobArgs],
    queue: str | None,
    fields: Mapping[str, Any],
    where: str,
    using: str | None,
) -> tuple[list[Job], list[Job], str]:
    """The waiting jobs that match, all waiting jobs (of connection ``using``), and a
    description of what was asked."""
    kind, wanted = _kind_and_fields(args_or_cls, fields, where)
    _check_queue(queue, where)
    everything = _waiting(None, None, using)
    found = [
        job
        for job in everything
        if job.kind == kind
        and (queue is None or job.queue == queue)
        and all(name in job.args and job.args[name] == value for name, value in wanted.items())
    ]
    asked = f"kind {kind!r}"
    if wanted:
        asked += f" with args {wanted}"
    if queue is not None:
        asked += f" on queue {queue!r}"
    return found, everything, asked


def _listing(jobs: list[Job]) -> str:
    if not jobs:
        return "no job is enqueued at all"
    lines = [
        f"  #{job.id} kind={job.kind!r} queue={job.queue!r} state={job.state} args={job.args}"
        for job in jobs[:LISTED]
    ]
    if len(jobs) > LISTED:
        lines.append(f"  ... and {len(jobs) - LISTED} more")
    return "the jobs enqueued are:\n" + "\n".join(lines)


def assert_enqueued(
    args_or_cls: JobArgs | type[JobArgs],
    *,
    queue: str | None = None,
    count: int | None = None,
    using: str | None = None,
    **fields: Any,
) -> list[Job]:
    """Assert a job of that kind waits to run; return the matching jobs.

    ``args_or_cls`` is a ``JobArgs`` instance (its args must all match) or
    class (any args); ``fields`` are args fields that must have these values;
    ``queue`` the queue it must be on; ``count`` how many must match exactly
    (default: at least one). "Waiting" means available, scheduled or
    retryable, or blocked on its dependencies: a job that ran to completion is
    no longer enqueued. Reads on
    connection ``using`` (default ``AWA["DATABASE"]``), as ``enqueued`` and
    ``run_jobs`` do. Raises ``AssertionError`` listing the jobs that are enqueued.
    """
    _check_count(count, "assert_enqueued()")
    found, everything, asked = _matching(args_or_cls, queue, fields, "assert_enqueued()", using)
    if count is None and not found:
        raise AssertionError(f"expected a job of {asked} to be enqueued, but none is; "
                             f"{_listing(everything)}")  # fmt: skip
    if count is not None and len(found) != count:
        raise AssertionError(
            f"expected {count} job(s) of {asked} to be enqueued, found {len(found)}; "
            f"{_listing(everything)}"
        )
    return found


def refute_enqueued(
    args_or_cls: JobArgs | type[JobArgs],
    *,
    queue: str | None = None,
    count: int | None = None,
    using: str | None = None,
    **fields: Any,
) -> None:
    """Assert no job of that kind (those args, that queue) waits to run.

    With ``count``, assert that the number of matching jobs is anything but
    ``count``. Reads on connection ``using`` (default ``AWA["DATABASE"]``).
    Raises ``AssertionError`` listing the jobs that match.
    """
    _check_count(count, "refute_enqueued()")
    found, _, asked = _matching(args_or_cls, queue, fields, "refute_enqueued()", using)
    if count is None and found:
        raise AssertionError(f"expected no job of {asked} to be enqueued, found "
                             f"{len(found)}: {_listing(found)}")  # fmt: skip
    if count is not None and len(found) == count:
        raise AssertionError(
            f"expected other than {count} job(s) of {asked} to be enqueued; {_listing(found)}"
        )


# -- running jobs inline ---------------------------------------------------------------


def _outcome_name(result: AttemptResult) -> str:
    return "snoozed" if result.snoozed else str(result.state)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReport:
    """What ``run_jobs`` did.

    ``counts`` is per outcome of each attempt run: the state it left its job
    in (``"completed"``, ``"retryable"``, ``"failed"``, ``"cancelled"``,
    ``"waiting_external"``), or ``"snoozed"``. ``jobs`` are the jobs that
    ran, in the order they first ran, as their rows stand now (a job run
    twice, after a snooze say, is listed once). ``ran`` counts attempts.
    """

    jobs: tuple[Job, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def ran(self) -> int:
        """How many attempts ran."""
        return sum(self.counts.values())

    completed = property(lambda self: self.counts.get("completed", 0))
    retryable = property(lambda self: self.counts.get("retryable", 0))
    failed = property(lambda self: self.counts.get("failed", 0))
    cancelled = property(lambda self: self.counts.get("cancelled", 0))
    snoozed = property(lambda self: self.counts.get("snoozed", 0))
    waiting_external = property(lambda self: self.counts.get("waiting_external", 0))

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(self.counts.items()))
        return f"ran {self.ran} attempt(s): {counts or 'none'}"


class RunLimitReached(AssertionError):
    """``run_jobs`` ran ``limit`` attempts and jobs are still due; ``report`` says what ran."""

    def __init__(self, message: str, report: RunReport) -> None:
        super().__init__(message)
        self.report = report


def run_jobs(
    *,
    queue: str | None = None,
    kinds: Iterable[str | type[JobArgs]] | None = None,
    limit: int = 1000,
    include_scheduled: bool = False,
    using: str | None = None,
) -> RunReport:
    """Run the due jobs in this thread, again and again until none is due.

    Each round promotes the scheduled and retryable jobs that are due, as
    maintenance would, then claims the due ``available`` jobs (of ``queue``
    and ``kinds`` when given; paused queues are skipped), runs their handlers
    (``async def`` ones too) and finalizes each outcome with its follow-ups,
    through the code a worker runs. So follow-ups, and jobs they enqueue, run
    too. A kind's ``timeout`` applies: a sync handler runs to its end, then is
    recorded as timed out; an async one is cancelled.

    Jobs due later are left alone: a retry's backoff, a ``Snooze``, a
    ``run_at`` in the future. Inside ``TestCase`` the database's clock stands
    still (``now()`` is when the test's transaction began), so they never
    become due; ``include_scheduled=True`` runs them anyway, retries included
    (until they complete or exhaust their attempts).

    ``limit`` bounds the attempts run in all, guarding against follow-ups that
    enqueue each other for ever: once it is reached while jobs are still due,
    ``RunLimitReached`` (an ``AssertionError``) is raised, its ``report``
    saying what ran. Works on connection ``using`` (default
    ``AWA["DATABASE"]``) and inside its open transaction; in a transactional
    test (or outside tests) each outcome commits as a worker's does. There a
    database error inside a non-atomic handler (which a worker would meet in
    autocommit) rolls back that handler's writes, to a savepoint, and is
    recorded as its error; the caller's transaction stays usable. Call it
    from sync code (in an async test: ``await sync_to_async(run_jobs)()``).
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValidationError(f"run_jobs(): limit must be a positive integer, got {limit!r}")
    _check_queue(queue, "run_jobs()")
    alias = database_alias(using)
    kind_names = None if kinds is None else _kind_names(kinds)
    _require_migrations(alias)
    filters = {"queue": queue, "kinds": kind_names}
    conf = awa_settings()
    ran: list[int] = []
    counts: Counter[str] = Counter()
    while True:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.PROMOTE_INLINE, {**filters, "all": include_scheduled})
        room = limit - len(ran)
        if room <= 0:
            report = _report(ran, counts, alias)
            if _still_due(alias, filters):
                raise RunLimitReached(
                    f"run_jobs() ran {len(ran)} attempts, its limit, and jobs are still due "
                    f"(follow-ups enqueuing each other for ever?); {report}; pass a larger "
                    f"limit= if that many are expected",
                    report,
                )
            return report
        with db.cursor(alias) as cursor:
            cursor.execute(
                sql.CLAIM_INLINE,
                {
                    **filters,
                    "limit": min(room, ROUND_SIZE),
                    "deadlines": registry.deadlines_json(),
                    "default_deadline": conf.default_deadline,
                },
            )
            rows = cursor.fetchall()
        if not rows:
            return _report(ran, counts, alias)
        claimed = jobs_from_rows(rows, alias)
        claimed.sort(key=lambda j: (j.priority, j.run_at, j.id))
        for job in claimed:
            result = _run_one(Attempt(job=job, alias=alias))
            if result is None:
                if job.metadata and SEQUENCE_KEY in job.metadata:
                    # Cancelled while it ran (its handler, say): the handler returned,
                    # so the key's place the cancel kept for it goes, as a worker's would.
                    with db.cursor(alias) as cursor:
                        cursor.execute(sql.RELEASE_HELD_LEASES, attempt_keys([Attempt(job, alias)]))
                continue
            counts[_outcome_name(result)] += 1
            ran.append(job.id)


def _require_migrations(alias: str) -> None:
    """Raise, naming them, if django-awa's migrations are not all applied to ``alias``.

    Its tables made from the models alone (pytest-django's ``--nomigrations``) take
    an enqueue, but a run fails on a table only a migration makes
    (``relation "awa_job_done_current" does not exist``), which says nothing of why.
    One read of ``django_migrations`` (``db.migrations_not_in_step``).
    """
    missing, _ = db.migrations_not_in_step(alias)
    if not missing:
        return
    raise ConfigurationError(
        f"run_jobs(): {db.not_migrated(alias, missing)}. Its tables need the SQL they hold, "
        f"which the models do not describe: run the tests with migrations (not "
        f"pytest-django's --nomigrations), or `manage.py migrate django_awa`"
    )


def _report(ran: list[int], counts: Counter[str], alias: str) -> RunReport:
    rows = Job.objects.using(alias).in_bulk(ran)
    jobs = tuple(rows[i] for i in dict.fromkeys(ran) if i in rows)
    return RunReport(jobs=jobs, counts=dict(counts))


def _still_due(alias: str, filters: dict[str, Any]) -> bool:
    with db.cursor(alias) as cursor:
        cursor.execute(sql.DUE_INLINE, filters)
        row = cursor.fetchone()
    return bool(row and row[0])


def _kind_names(kinds: Iterable[str | type[JobArgs]]) -> list[str]:
    """The kind names of ``kinds``, a collection: a lone name would be iterated
    letter by letter (and match nothing), a lone class not at all."""
    if isinstance(kinds, str):
        alone = f"{kinds!r} alone: pass kinds=[{kinds!r}]"
    elif isinstance(kinds, type) and issubclass(kinds, JobArgs):
        alone = f"the class {kinds.__qualname__} alone: pass kinds=[{kinds.__qualname__}]"
    else:
        return sorted({_kind_name(k) for k in kinds})
    raise TypeError(f"run_jobs(): kinds takes a list of kind names or JobArgs classes, got {alone}")


def _kind_name(kind: str | type[JobArgs]) -> str:
    if isinstance(kind, str):
        return kind
    if isinstance(kind, type) and issubclass(kind, JobArgs):
        return kind.kind
    raise TypeError(f"run_jobs(): kinds holds {kind!r}, not a kind name or JobArgs class")


def _run_one(attempt: Attempt) -> AttemptResult | None:
    """One claimed attempt through the worker's path; the result as written."""
    alias = attempt.alias
    connection = connections[alias]
    resolved = resolve_handler(attempt.job)
    atomic = not isinstance(resolved, AttemptResult) and resolved[0].atomic
    # Where the caller's connections stand, to tell a transaction the handler
    # left open (the worker's check, handlers.discard_open_transactions).
    marks = transaction_marks()
    depth, savepoints = len(connection.atomic_blocks), len(connection.savepoint_ids)
    # A worker runs a non-atomic handler in autocommit, where a failed statement
    # spoils nothing else. Inside the caller's transaction (TestCase) it would
    # abort that transaction: the handler runs in a savepoint, rolled back
    # only then, so its error is recorded and the test's transaction goes on.
    # An atomic one gets a savepoint too, to be undone if it leaves a block open.
    savepoint = savepoint_create(using=alias) if connection.in_atomic_block else None
    # When the handler began, stored as the row's attempted_at with the outcome,
    # as a worker's handler pool does (HandlerPool sets it as a thread takes the job).
    attempt.started = time.monotonic()
    if atomic:
        spec, args = cast(tuple[WorkerSpec, JobArgs], resolved)
        written = run_atomic_attempt(attempt, spec, args)
    else:
        # Progress is stored with the outcome (no heartbeat thread here).
        result = run_attempt(attempt, _keep_progress, resolved, enforce_timeout=True)
    left: list[str] = []
    if savepoint is not None:
        # A block the handler entered and never left is left here, its writes
        # (and an atomic handler's outcome) rolled back with the savepoint: a
        # worker closes such a connection, which would end the test's transaction.
        if len(connection.atomic_blocks) > depth:
            del connection.atomic_blocks[depth:]
            del connection.savepoint_ids[savepoints:]
            left.append(alias)
        # A failed ORM write also marks the caller's atomic block for rollback
        # (needs_rollback), and Django then refuses every query, the savepoint's
        # rollback too: cleared first, as Atomic.__exit__ does before its own.
        if left or (not atomic and (db.transaction_failed(alias) or connection.needs_rollback)):
            connection.needs_rollback = False
            transaction.savepoint_rollback(savepoint, using=alias)
        else:
            transaction.savepoint_commit(savepoint, using=alias)
    # Outside a transaction (TransactionTestCase), as a worker: the connection
    # the handler left in one is closed, which rolls that transaction back.
    closed = discard_open_transactions(marks)
    if left or closed:
        undone = "the connection closed" if closed else "the test's transaction kept"
        result = left_open(attempt.job, left + closed, undone)
    elif atomic:
        return written
    result.started = attempt.started
    applied = finalize([result], alias)
    return applied[0] if applied else None


def _keep_progress(attempt: Attempt) -> None:
    """Progress waits on the attempt and is written with its outcome."""


# -- one handler without a row ---------------------------------------------------------

_CONTEXT_FIELDS = {"id", "queue", "attempt", "max_attempts", "metadata", "priority", "tags"}


def perform_job(args: JobArgs, **context: Any) -> Any:
    """Run the handler registered for ``args``'s kind and return what it returned.

    Nothing is read or written: the handler gets a ``JobContext`` on an
    unsaved ``Job`` (``context`` sets its ``id``, ``queue``, ``attempt``
    (default 1), ``max_attempts``, ``metadata``, ``priority``, ``tags``).
    ``args`` go through the same JSON round trip as an enqueued job's. The
    return value is not interpreted (an ``awa.Snooze`` comes back as it is),
    and what the handler raises propagates. ``async def`` handlers run to
    completion (from async code: ``await sync_to_async(perform_job)(...)``).
    ``set_progress`` is kept on the context's attempt;
    ``register_callback`` needs a row (use ``run_jobs``).
    """
    if not isinstance(args, JobArgs):
        raise TypeError(f"perform_job() takes a JobArgs instance, got {args!r}")
    unknown = sorted(set(context) - _CONTEXT_FIELDS)
    if unknown:
        raise TypeError(
            f"perform_job(): unknown context field(s) {unknown}; allowed: {sorted(_CONTEXT_FIELDS)}"
        )
    attempt = context.get("attempt", 1)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"perform_job(): attempt must be a whole number from 1, got {attempt!r}")
    spec = registry.handler_for(args.kind)
    if spec is None:
        raise LookupError(f"perform_job(): no handler is registered for kind {args.kind!r}")
    if spec.is_async and _loop_running():
        # asgiref's "cannot use AsyncToSync in the same thread as an async event
        # loop" would leave the handler's coroutine never awaited, and the caller
        # cannot "await the async function directly" as it advises.
        raise RuntimeError(
            f"perform_job(): the handler of kind {args.kind!r} is async and this thread runs "
            f"an event loop (an async test?): call "
            f"`await sync_to_async(perform_job)(...)` instead"
        )
    encoded = encode_checked(args)
    decoded = decode_args(spec.args_cls, encoded)
    now = dt.datetime.now(dt.UTC)
    job = Job(
        kind=args.kind,
        queue=context.get("queue", spec.queue),
        args=encoded,
        state=JobState.RUNNING,
        priority=context.get("priority", spec.priority),
        attempt=attempt,
        max_attempts=context.get("max_attempts", spec.max_attempts),
        metadata=context.get("metadata", {}),
        tags=list(context.get("tags", [])),
        run_at=now,
        attempted_at=now,
    )
    job.id = context.get("id", 0)
    running = Attempt(job=job, alias=database_alias(None))
    return call_handler(spec, JobContext(running, decoded, _keep_progress))


def _loop_running() -> bool:
    """Whether this thread runs an event loop (the caller is async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
