"""Running one attempt: the handler's ``JobContext`` and what its result means.

``run_attempt()`` turns one claimed row into an :class:`AttemptResult`;
``finalize.py`` writes it. A handler declared ``atomic=True`` runs inside the
transaction that finalizes it (``finalize.run_atomic_attempt``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from asgiref.sync import ThreadSensitiveContext, async_to_sync, sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connections

from . import db, sql
from .codec import (
    MAX_ERROR_CHARS,
    MAX_TRACEBACK_CHARS,
    ArgsDecodeError,
    check_storable,
    decode_args,
    escape_json,
    escape_text,
)
from .conf import awa_settings, callback_timeout, to_seconds
from .exceptions import TerminalError, ValidationError
from .followups import (
    COMPLETED,
    WAITING_FOR_CALLBACK,
    Cancelled,
    Exhausted,
    Outcome,
    OutcomeContext,
    Retried,
)
from .kinds import JobArgs, WorkerSpec, registry
from .models import ClaimedJob, Job, JobRow, JobState

if TYPE_CHECKING:
    from .otel import Traced

logger = logging.getLogger(__name__)

# The longest RetryAfter or Snooze delay (SPEC §5).
MAX_DELAY = 86400.0
# How often an async handler's supervisor looks at its attempt's cancelled flag.
CANCEL_POLL = 0.05


# -- what a handler may return -------------------------------------------------


def _seconds(value: float | dt.timedelta, what: str) -> float:
    """``value`` in seconds, refused (``ValidationError``) if negative or not a duration."""
    try:
        seconds = to_seconds(value)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{what}: {exc}") from exc
    if seconds < 0:
        raise ValidationError(f"{what}: the delay cannot be negative, got {value!r}")
    return seconds


def _delay(value: float | dt.timedelta) -> float:
    """A RetryAfter or Snooze delay in seconds, capped at a day (SPEC §5)."""
    return min(to_seconds(value), MAX_DELAY)


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """Retry after ``seconds`` (or a timedelta, at most 24 hours); the attempt counts."""

    seconds: float | dt.timedelta

    def __post_init__(self) -> None:
        _seconds(self.seconds, "RetryAfter")


@dataclass(frozen=True, slots=True)
class Snooze:
    """Run again after ``seconds`` (or a timedelta, at most 24 hours); no attempt is used."""

    seconds: float | dt.timedelta

    def __post_init__(self) -> None:
        _seconds(self.seconds, "Snooze")


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the job, recording ``reason`` (``None`` or ``""``: no reason)."""

    reason: str = ""

    def __post_init__(self) -> None:
        # A caller with no reason may say None: that is no reason, not the text "None".
        if self.reason is None:
            object.__setattr__(self, "reason", "")  # type: ignore[unreachable]


@dataclass(frozen=True, slots=True)
class CallbackToken:
    """A registered callback; hand ``id`` to the outside system."""

    id: uuid.UUID
    timeout_at_seconds: float


@dataclass(frozen=True, slots=True)
class WaitForCallback:
    """Park the job in ``waiting_external`` until its callback is resolved."""

    token: CallbackToken


# -- the attempt's shared state --------------------------------------------------


class Flag:
    """A flag set once from any thread (a cheaper ``threading.Event`` that is never waited on)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass(slots=True, eq=False)
class Attempt:
    """One claimed attempt as the worker tracks it (shared with its handler thread)."""

    job: JobRow
    alias: str
    cancelled: Flag = field(default_factory=lambda: Flag())
    progress: dict[str, Any] | None = None
    progress_dirty: bool = False
    callback_id: uuid.UUID | None = None
    timeout: float | None = None  # the kind's timeout, once its handler is known
    # Its kind has awa.Limit(concurrency=...): a place of its key is held while it runs.
    holds_key: bool = False
    # Past its timeout while its kind holds a key: the failed attempt the worker
    # writes once the handler returns (or its thread is abandoned), so the key's
    # place stays taken while a handler that cannot be stopped still runs.
    timed_out: AttemptResult | None = None
    # Past its timeout (any kind): the failed attempt written for it, whatever its
    # handler returns later. Its span reports this outcome, not the handler's.
    gave_up: AttemptResult | None = None
    # Its span while its handler runs, with the otel extra (otel.Instrumentation.start).
    traced: Traced | None = None
    # time.monotonic() when the claim returned it, and when a handler thread
    # began it (None while it waits in the queue's inbox: claimed, not running
    # yet). started_written: MARK_STARTED stored attempted_at for it, or need
    # not (its handler returned: the outcome stores it).
    claimed: float = field(default_factory=time.monotonic)
    started: float | None = None
    started_written: bool = False
    # Its handler returned (or gave it up); its outcome may still wait for the
    # completer's batch. Not among the jobs the worker's row says it runs.
    returned: bool = False
    # Claimed under a rate: time.monotonic() by which its handler must start, or it
    # is given back unstarted (producer.RATED_START_WITHIN). None: no such bound.
    start_by: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.run_lease)

    @property
    def sequenced(self) -> bool:
        """A sequence member: cancelled while its handler runs, its key's place is
        kept until the handler returns (``sql.CANCEL_JOBS``), as a limited key's is."""
        metadata = self.job.metadata
        return bool(metadata) and "awa_sequence" in metadata

    def instance(self) -> Job:
        """The attempt's job as a ``Job``: built from its claimed row on first use, then
        kept (``JobContext.row`` gives the handler the same instance each time)."""
        job = self.job
        if isinstance(job, ClaimedJob):
            job = self.job = job.instance(self.alias)
        return job


def attempt_keys(attempts: Iterable[Attempt | AttemptResult]) -> dict[str, str]:
    """The ``%(id)s`` and ``%(run_lease)s`` arrays naming these attempts (or the
    attempts of these results), for the statements guarded by ``(id, run_lease)``."""
    attempts = list(attempts)
    return {
        "id": db.int_array(a.job.id for a in attempts),
        "run_lease": db.int_array(a.job.run_lease for a in attempts),
    }


class JobContext:
    """What a handler receives: the job's args and row, and a few controls."""

    __slots__ = ("_attempt", "_flush_progress", "args")

    def __init__(
        self,
        attempt: Attempt,
        args: JobArgs,
        flush_progress: Callable[[Attempt], None] | None = None,
    ) -> None:
        self._attempt = attempt
        self._flush_progress = flush_progress
        self.args = args

    @property
    def row(self) -> Job:
        return self._attempt.instance()

    id = property(lambda self: self._attempt.job.id)
    kind = property(lambda self: self._attempt.job.kind)
    queue = property(lambda self: self._attempt.job.queue)
    attempt = property(lambda self: self._attempt.job.attempt)
    max_attempts = property(lambda self: self._attempt.job.max_attempts)
    metadata = property(lambda self: self._attempt.job.metadata)

    def set_progress(self, percent: float, message: str | None = None, **metadata: Any) -> None:
        """Record progress (0-100); stored on the row while the job runs."""
        if isinstance(percent, bool) or not isinstance(percent, (int, float)):
            raise ValidationError(f"set_progress: percent must be a number, got {percent!r}")
        if not 0 <= percent <= 100:
            raise ValidationError(f"set_progress: percent must be 0 to 100, got {percent!r}")
        progress = {"percent": percent, "message": message, "metadata": metadata}
        try:
            json.dumps(progress, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"set_progress: metadata is not JSON: {exc}") from exc
        except RecursionError:
            raise ValidationError("set_progress: metadata is nested too deeply") from None
        # Text PostgreSQL cannot hold (NUL, lone surrogates) is kept escaped:
        # one bad message must not make the batched progress write fail.
        progress = escape_json(progress)
        self._attempt.progress = progress
        self._attempt.progress_dirty = True
        if self._flush_progress is None:
            write_progress([self._attempt])
        else:
            self._flush_progress(self._attempt)

    def dependencies(self) -> list[Job]:
        """The jobs this one waited for, each with its ``result``, in ``after`` order."""
        _refuse_on_event_loop("dependencies")
        return self._attempt.instance().dependencies()

    async def adependencies(self) -> list[Job]:
        """``dependencies`` for ``async def`` handlers (it reads the database)."""
        return await sync_to_async(self.dependencies)()

    @property
    def workflow_id(self) -> uuid.UUID | None:
        return self._attempt.job.workflow_id

    def is_cancelled(self) -> bool:
        """True once the job was cancelled (or its attempt lost) while this handler runs."""
        return self._attempt.cancelled.is_set()

    def register_callback(self, timeout: float | dt.timedelta) -> CallbackToken:
        """Register a callback id for an outside system; then return ``WaitForCallback``.

        The id is stored at once, so the outside system may answer even before
        the handler returns. ``timeout`` is 1 second to 365 days, else
        ``ValidationError``. One callback per attempt: a second call raises
        ``RuntimeError`` naming the first, which stays registered.
        """
        _refuse_on_event_loop("register_callback")
        seconds = callback_timeout(timeout, "register_callback: timeout")
        job = self._attempt.job
        if self._attempt.callback_id is not None:
            # A second id would replace the first on the row, which the outside
            # system may already hold: its answer would find no job waiting on it.
            raise RuntimeError(
                f"register_callback: job {job.id} already registered callback "
                f"{self._attempt.callback_id} in this attempt (attempt {job.attempt}); "
                "an attempt has one callback: return awa.WaitForCallback(token) with its token"
            )
        callback_id = uuid.uuid4()
        if isinstance(job, Job) and job._state.adding:
            raise RuntimeError(
                f"register_callback: job {job.id} has no row to store the callback on "
                "(perform_job runs a handler without one); test a callback with run_jobs"
            )
        alias = self._attempt.alias
        params: dict[str, Any] = {
            "callback_id": callback_id,
            "timeout": seconds,
            "id": job.id,
            "run_lease": job.run_lease,
        }
        # Inside a transaction (atomic=True, or the handler's own atomic block) the
        # id would show only once it commits: an answer sent before that would find
        # no job waiting on it. It is stored apart, at once, where it can be.
        registered = connections[alias].in_atomic_block and _register_apart(alias, params)
        if not registered:
            with connections[alias].cursor() as cursor:
                cursor.execute(sql.REGISTER_CALLBACK, params)
                registered = cursor.fetchone() is not None
        if not registered:
            self._attempt.cancelled.set()
            raise TerminalError(f"job {job.id} is no longer running this attempt")
        self._attempt.callback_id = callback_id
        self._attempt.instance().callback_id = callback_id
        return CallbackToken(id=callback_id, timeout_at_seconds=seconds)

    async def aregister_callback(self, timeout: float | dt.timedelta) -> CallbackToken:
        """``register_callback`` for ``async def`` handlers (it writes to the database)."""
        return await sync_to_async(self.register_callback)(timeout)


def _refuse_on_event_loop(method: str) -> None:
    """Name the awaitable form when a database method is called from async code (an
    ``async def`` handler): Django's ``SynchronousOnlyOperation`` would say only "use
    a thread or sync_to_async". Not with ``DJANGO_ALLOW_ASYNC_UNSAFE``, as Django's own."""
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise SynchronousOnlyOperation(
        f"job.{method}() reads or writes the database, which Django refuses on an event "
        f"loop: from an async def handler call `await job.a{method}(...)`"
    )


# How long a callback registered apart from the handler's transaction waits for the
# job's row: the transaction may hold it (a handler that wrote its own row).
REGISTER_APART_LOCK_TIMEOUT = "1s"


def _register_apart(alias: str, params: dict[str, Any]) -> bool:
    """``REGISTER_CALLBACK`` committed at once on a connection of its own; whether it was
    written there. If not (the row locked by the handler's own transaction, or not
    to be seen outside it, as a row a test's transaction inserted; or no
    connection), it is written in the transaction, which decides.

    The connection reaches ``AWA["DIRECT_DATABASE"]`` for jobs of ``AWA["DATABASE"]``,
    as the listener's does: through a transaction-mode pooler whose server connections
    the handlers' open transactions all hold, it would wait for one of them, and they
    for it."""
    conf = awa_settings()
    if alias == conf.database and conf.direct_database is not None:
        alias = conf.direct_database
    try:
        with (
            psycopg.connect(**db.listen_params(alias), autocommit=True) as conn,
            conn.transaction(),
        ):
            conn.execute(sql.LOCAL_LOCK_TIMEOUT, {"timeout": REGISTER_APART_LOCK_TIMEOUT})
            return conn.execute(sql.REGISTER_CALLBACK, params).fetchone() is not None
    except psycopg.Error:
        return False


def write_progress(attempts: list[Attempt]) -> None:
    """Store dirty progress of running attempts (guarded by run_lease)."""
    dirty = [a for a in attempts if a.progress_dirty]
    if not dirty:
        return
    for a in dirty:
        a.progress_dirty = False
    with db.cursor(dirty[0].alias) as cursor:
        cursor.execute(
            sql.SET_PROGRESS,
            {
                "id": [a.job.id for a in dirty],
                "run_lease": [a.job.run_lease for a in dirty],
                "progress": [json.dumps(a.progress) for a in dirty],
            },
        )


# -- interpreting a run ---------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class AttemptResult:
    """The outcome of one attempt, to be written by ``finalize``."""

    job: JobRow
    state: JobState
    # The outcome and what its follow-ups and signal get; None: no outcome
    # (a Snooze), so neither.
    context: OutcomeContext | None = None
    # Seconds from now to the next run_at; None keeps run_at, except that a
    # retryable result without a delay waits the backoff (sql._backoff).
    delay: float | None = None
    error: str | None = None
    traceback: str = ""
    snoozed: bool = False
    reset_attempts: bool = False
    progress: dict[str, Any] | None = None
    # time.monotonic() when the attempt's handler began (Attempt.started):
    # finalize stores it as attempted_at. None: no handler began.
    started: float | None = None
    # What a completed handler returned, as JSON text (Job.result); None: null.
    result: str | None = None
    # Set by finalize: the row as it stands after the transition, or, when it
    # was not written because another session held the row locked, locked;
    # whether the job has dependents to settle in the outcome's transaction.
    row: Job | None = None
    locked: bool = False
    has_dependents: bool = False
    # Its handler still runs, abandoned (HandlerPool.abandon): the outcome is
    # written now, but its key's lease (awa.Limit(concurrency=...)) is kept,
    # held until the handler returns (sql.HOLD_LEASES).
    keeps_lease: bool = False
    # Past its kind's timeout while its handler still runs (HandlerPool.time_out),
    # with the otel extra: the attempt's span, ended with this outcome once it is
    # written (otel.count_written), not when (if ever) the handler returns.
    open_span: Traced | None = None

    @property
    def outcome(self) -> Outcome | None:
        context = self.context
        return None if context is None else context.outcome

    def params(self, now: float | None = None) -> dict[str, Any]:
        """The row of FINALIZE's arrays for this result; ``now`` as in ``started_ago``."""
        return {
            "id": self.job.id,
            "run_lease": self.job.run_lease,
            "state": self.state.value,
            "delay": self.delay,
            "error": self.error,
            "traceback": self.traceback,
            "snoozed": self.snoozed,
            "reset_attempts": self.reset_attempts,
            "progress": None if self.progress is None else json.dumps(self.progress),
            "started_ago": self.started_ago(now),
            "result": self.result,
        }

    def started_ago(self, now: float | None = None) -> float | None:
        """Seconds since the attempt's handler began, by this process's clock: until
        ``now`` (a ``time.monotonic()`` reading, one for a whole batch) or until now."""
        if self.started is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - self.started)


def unstarted(job: JobRow) -> AttemptResult:
    """A claimed job no handler started, given back: available at once, its attempt
    unused (the next claim runs it under the same attempt number)."""
    return AttemptResult(job=job, state=JobState.AVAILABLE, delay=0.0, snoozed=True)


def completed(job: JobRow) -> AttemptResult:
    return AttemptResult(job=job, state=JobState.COMPLETED, context=COMPLETED)


def failed_terminally(job: JobRow, error: str, tb: str = "") -> AttemptResult:
    error = escape_text(error, MAX_ERROR_CHARS)
    return AttemptResult(
        job=job,
        state=JobState.FAILED,
        context=Exhausted(error=error, attempt=job.attempt),
        error=error,
        traceback=escape_text(tb, MAX_TRACEBACK_CHARS),
    )


def errored(job: JobRow, error: str, tb: str = "") -> AttemptResult:
    """The handler failed: retry after the backoff, or exhaust on the last attempt.

    The backoff is drawn by the database as the outcome is written (FINALIZE):
    a retryable result without a ``delay`` waits it.
    """
    if job.attempt >= job.max_attempts:
        return failed_terminally(job, error, tb)
    error = escape_text(error, MAX_ERROR_CHARS)
    return AttemptResult(
        job=job,
        state=JobState.RETRYABLE,
        context=Retried(error=error, attempt=job.attempt),
        error=error,
        traceback=escape_text(tb, MAX_TRACEBACK_CHARS),
    )


def left_open(
    job: JobRow, aliases: list[str], undone: str = "the connection closed"
) -> AttemptResult:
    """The attempt's outcome when its handler left a transaction open: it failed.

    ``undone`` says how it was rolled back (``run_jobs`` inside a test's
    transaction rolls back to a savepoint, not closing the connection).
    """
    names = ", ".join(repr(alias) for alias in aliases)
    return errored(
        job,
        f"the handler left a transaction open on database {names} (an atomic block it "
        f"entered and never exited, or autocommit turned off): it was rolled back, the "
        f"handler's writes in it with it, and {undone}",
    )


def timed_out(job: JobRow, timeout: float, ran: float | None = None) -> AttemptResult:
    """The attempt ran past its kind's ``timeout``: a failed attempt, retried per the policy."""
    ran_text = f", ran {ran:.1f}s" if ran is not None else ""
    return errored(
        job,
        f"timed out: the attempt passed its kind's timeout of {timeout:g}s{ran_text}; "
        f"the handler was given up and its result is ignored",
    )


def handler_raised(exc: BaseException) -> bool:
    """Whether ``exc`` came from the job's own code, to be recorded as its outcome.

    Everything a handler raises is, ``BaseException`` subclasses included
    (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``,
    ``asyncio.CancelledError``...): the worker's handler threads never get
    signals, which Python delivers to the main thread and the worker takes
    there through a queue. Only a ``KeyboardInterrupt`` in the main thread may
    be the user's Ctrl-C (a handler run in-process, by a test say), so that one
    is left to propagate.
    """
    return not (
        isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
    )


def describe(exc: BaseException) -> str:
    """``ValueError: text``, or only the type's name when the text is empty or unprintable."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the attempt
        text = ""
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def from_exception(
    job: JobRow, exc: BaseException, *, during: str = "", need: db.ConnectionNeed | None = None
) -> AttemptResult:
    """The attempt failed with ``exc``: ``TerminalError`` fails it now, anything else retries.

    ``during`` names what failed, when it was not the handler itself. When
    ``exc`` is the server refusing a new connection (or Django's pool having
    none free), the error says so first and names the fix, with the worker's
    connections (``need``).
    """
    tb = "".join(traceback.format_exception(exc))
    error = f"{during}: {describe(exc)}" if during else describe(exc)
    refusal = db.connection_refusal(exc, need)
    if refusal is not None:
        error = f"{refusal}. {error}"
    if isinstance(exc, TerminalError):
        return failed_terminally(job, error, tb)
    return errored(job, error, tb)


def from_value(attempt: Attempt, value: Any) -> AttemptResult:
    job = attempt.job
    match value:
        case None:
            return completed(job)
        case RetryAfter(seconds=seconds):
            if job.attempt >= job.max_attempts:
                error = f"RetryAfter on the last attempt ({job.attempt} of {job.max_attempts})"
                return failed_terminally(job, error)
            return AttemptResult(
                job=job,
                state=JobState.RETRYABLE,
                context=Retried(error="", attempt=job.attempt),
                delay=_delay(seconds),
            )
        case Snooze(seconds=seconds):
            delay = _delay(seconds)
            return AttemptResult(
                job=job,
                state=JobState.SCHEDULED if delay > 0 else JobState.AVAILABLE,
                delay=delay,
                snoozed=True,
            )
        case Cancel(reason=reason):
            cancelled = Cancelled.given(reason)
            return AttemptResult(
                job=job, state=JobState.CANCELLED, context=cancelled, error=cancelled.error_entry
            )
        case WaitForCallback(token=token):
            if attempt.callback_id is None or token.id != attempt.callback_id:
                return errored(
                    job,
                    "handler returned WaitForCallback with a token this attempt did not "
                    "register (call job.register_callback() first)",
                )
            return AttemptResult(
                job=job, state=JobState.WAITING_EXTERNAL, context=WAITING_FOR_CALLBACK
            )
        case _:
            return with_result(job, value)


def with_result(job: JobRow, value: Any) -> AttemptResult:
    """The handler returned ``value``: completed with it as ``Job.result`` (SPEC §11), or,
    when it cannot be stored as JSON, a failed attempt naming its type."""
    try:
        # Text PostgreSQL cannot hold (NUL, lone surrogates) is kept escaped.
        escaped = escape_json(value)
        text = json.dumps(escaped, allow_nan=False, ensure_ascii=False)
        check_storable(escaped)
    except (TypeError, ValueError) as exc:
        return errored(
            job,
            f"handler returned a {type(value).__qualname__} ({safe_repr(value)[:200]}), "
            f"which cannot be stored as Job.result: it must encode as JSON ({exc})",
        )
    except RecursionError:
        return errored(
            job,
            f"handler returned a {type(value).__qualname__} nested too deeply to store "
            f"as Job.result",
        )
    result = completed(job)
    result.result = text
    return result


def safe_repr(value: object) -> str:
    """``repr(value)``, or a stand-in when its ``__repr__`` itself raises."""
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a handler's object may do anything
        return f"<{type(value).__qualname__} object (its repr() raised)>"


def unknown_kind_error(kind: str) -> str:
    """The error of a job whose kind no handler in this process declares: most
    often a JobArgs class renamed (or removed) while jobs of it were queued.

    A Django Task's kind (``task:<module path>``, backends.py) names a function,
    not a JobArgs class: it is missing when renamed or moved, or when this
    worker's settings do not route ``TASKS`` to awa.
    """
    prefix, _, path = kind.partition(":")
    if prefix == "task" and path:
        return (
            f"unknown job kind {kind!r}: this worker finds no Django task {path} "
            f"(the function renamed or moved, its app not installed, or TASKS in this "
            f"worker's settings not using django_awa.backends.AwaTaskBackend?); once a "
            f"worker finds it, retry the job (admin, or manage.py awa_jobs retry --kind {kind})"
        )
    return (
        f"unknown job kind {kind!r}: no handler is registered in this worker "
        f"(its JobArgs class renamed, or its app removed?). A renamed class keeps the "
        f"kind with kind: ClassVar[str] = {kind!r}; once a worker declares it, retry "
        f"the job (admin, or manage.py awa_jobs retry --kind {kind})"
    )


def resolve_handler(job: JobRow) -> tuple[WorkerSpec, JobArgs] | AttemptResult:
    """The kind's handler and decoded args, or the attempt's result explaining why not.

    An unknown kind or undecodable args fail the job terminally. Anything else
    raised on the way (a module imported on demand for the kind that fails to
    import, a ``__post_init__`` that raises) is the attempt's error, with its
    traceback: retryable after a backoff, or failed on the last attempt.
    """
    try:
        spec = registry.handler_for(job.kind)
    except BaseException as exc:  # the handler boundary: the kind's own code
        if not handler_raised(exc):
            raise
        return from_exception(job, exc, during=f"cannot load the handler of kind {job.kind!r}")
    if spec is None:
        return failed_terminally(job, unknown_kind_error(job.kind))
    try:
        return spec, decode_args(spec.args_cls, job.args)
    except ArgsDecodeError as exc:
        return failed_terminally(job, str(exc))
    except BaseException as exc:  # the handler boundary: the args' own code
        if not handler_raised(exc):
            raise
        return from_exception(job, exc, during=f"cannot decode args of kind {job.kind!r}")


def run_attempt(
    attempt: Attempt,
    flush_progress: Callable[[Attempt], None] | None = None,
    resolved: tuple[WorkerSpec, JobArgs] | AttemptResult | None = None,
    need: db.ConnectionNeed | None = None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    enforce_timeout: bool = False,
) -> AttemptResult:
    """Run the handler of a claimed, non-atomic attempt and interpret its result.

    ``resolved`` is ``resolve_handler(attempt.job)`` when the caller has it already.
    An ``async def`` handler runs on ``loop`` (the worker's event loop thread),
    or, without one, on a loop of its own in this thread (``call_handler``).
    ``need``, the worker's connections, for an error that is the server refusing
    one. With ``enforce_timeout`` the kind's timeout is applied here (``run_jobs``);
    in a worker the handler pool applies it instead, while the handler runs.
    """
    if resolved is None:
        resolved = resolve_handler(attempt.job)
    if isinstance(resolved, AttemptResult):
        return resolved
    spec, args = resolved
    attempt.timeout = spec.timeout
    context = JobContext(attempt, args, flush_progress)
    timeout = spec.timeout if enforce_timeout else None
    started = time.monotonic() if timeout is not None else 0.0
    try:
        if spec.is_async:
            value = call_handler(spec, context, loop=loop, timeout=timeout)
        else:
            value = spec.handler(context)
    except HandlerTimedOut:
        result = timed_out(attempt.job, spec.timeout or 0.0, time.monotonic() - started)
    except TransactionLeftOpen as exc:
        job = attempt.job
        logger.error(
            "job %s kind=%s left a transaction open on %s: rolled back, connection closed",
            job.id, job.kind, ", ".join(exc.aliases),
        )  # fmt: skip
        result = left_open(job, exc.aliases)
    except BaseException as exc:  # the handler boundary: every error is recorded
        if not handler_raised(exc):
            raise
        result = from_exception(attempt.job, exc, need=need)
    else:
        if timeout is not None and (ran := time.monotonic() - started) > timeout:
            # A sync handler cannot be stopped: it ran to its end, its result is ignored.
            result = timed_out(attempt.job, timeout, ran)
        else:
            result = from_value(attempt, value)
    result.progress = attempt.progress
    return result


# -- async handlers ----------------------------------------------------------------


class HandlerTimedOut(Exception):
    """An async handler ran past its timeout and was cancelled (``supervise``)."""


class AttemptLost(Exception):
    """An async handler was cancelled because its attempt was lost (``supervise``).

    Cancelled, rescued, timed out by the worker or given back at shutdown: the
    row no longer runs this attempt, so the result made of this is stale.
    """


def call_handler(
    spec: WorkerSpec,
    context: JobContext,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    timeout: float | None = None,
) -> Any:
    """Call the kind's handler and return what it returned; it raises what the handler raised.

    A sync handler is called in this thread. An ``async def`` one runs under
    ``supervise``: on ``loop`` when given (the worker's event loop thread; this
    thread waits for it, so the attempt holds its place on the queue as a sync
    handler does), else through asgiref's ``async_to_sync``, whose
    thread-sensitive calls (``sync_to_async``, the ORM's ``a*`` methods) come
    back to this thread and its connection: inside a test's transaction, that
    is the test's. ``timeout`` cancels it past that many seconds
    (``HandlerTimedOut``).
    """
    if not spec.is_async:
        return spec.handler(context)
    attempt = context._attempt
    try:
        if loop is None:
            return async_to_sync(supervise)(spec.handler(context), attempt, timeout)
        future = asyncio.run_coroutine_threadsafe(
            _own_thread(supervise(spec.handler(context), attempt, timeout)), loop
        )
        try:
            return _outcome(future, loop)
        except concurrent.futures.CancelledError:
            # The loop itself cancelled the supervisor: it is stopping, at shutdown.
            raise AttemptLost("cancelled: the worker's event loop stopped") from None
    except _Raised as carried:
        raise carried.exc from None


# How often a handler thread waiting for its async handler looks whether the
# worker's event loop is gone (_outcome).
LOOP_LOOK = 0.25


def _outcome(future: concurrent.futures.Future[Any], loop: asyncio.AbstractEventLoop) -> Any:
    """What ``future`` (an async handler's, on the worker's ``loop``) comes to.

    At shutdown the loop stops ``LOOP_GRACE`` after it cancelled the handlers
    still on it (``handlers.stop_loop``); one whose cleanup takes longer (a
    slow ``except CancelledError`` under load, or a handler that catches every
    cancellation) is left pending, its future never done: this thread would
    wait for it until the process exits, and the worker's stop would wait for
    this thread. It raises ``AttemptLost`` once the loop is closed instead.
    """
    while True:
        done, _ = concurrent.futures.wait((future,), timeout=LOOP_LOOK)
        if done:
            return future.result()
        if loop.is_closed():
            raise AttemptLost("cancelled: the worker's event loop stopped")


class _Raised(Exception):
    """What an async handler raised that asyncio would not treat as the task's error.

    A task re-raises ``SystemExit`` and ``KeyboardInterrupt`` out of the event
    loop, which would stop the worker's loop for every other async handler;
    and a ``CancelledError`` the handler raised itself (no one cancelled its
    task: a cancelled inner task's, say) would read as its attempt being lost.
    Carried to the handler's thread inside this, they are raised there again,
    and recorded as any other exception a handler raises.
    """

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


async def _carried(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await the handler's ``coro``, with what it raises that asyncio would not
    treat as a task's error carried in ``_Raised``."""
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Raised(exc) from None
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # cancelled by supervise (a lost attempt, a timeout) or at shutdown
        raise _Raised(exc) from None


async def _own_thread(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` with its thread-sensitive sync calls in one thread of its own.

    On the worker's shared loop they would otherwise all queue for asgiref's
    one global thread. That thread's database connections are closed before
    it goes, as Django closes a request's.
    """
    async with ThreadSensitiveContext():
        try:
            value = await coro
        except BaseException:
            await sync_to_async(_close_thread_connections)()
            raise
        if left := await sync_to_async(_close_thread_connections)():
            raise TransactionLeftOpen(left)
        return value


class TransactionLeftOpen(Exception):
    """An async handler's sync calls left a transaction open on ``aliases`` (``_own_thread``):
    closing their connections rolled it back, the handler's writes in it with it."""

    def __init__(self, aliases: list[str]) -> None:
        super().__init__(aliases)
        self.aliases = aliases


def _close_thread_connections() -> list[str]:
    """Close this thread's connections; the aliases of those its handler left inside a
    transaction (an atomic block never exited, autocommit turned off).

    Closing rolled that transaction back; without a look, the job completed with
    its writes lost. Such an alias's connection object, still marked as inside
    the block, is dropped (a pooled one was put back by the close).
    """
    left = []
    for conn in connections.all(initialized_only=True):
        open_ = conn.connection is not None and (
            conn.in_atomic_block or conn.autocommit != conn.settings_dict["AUTOCOMMIT"]
        )
        conn.close()
        if open_:
            left.append(conn.alias)
            del connections[conn.alias]
    return left


async def supervise(coro: Coroutine[Any, Any, Any], attempt: Attempt, timeout: float | None) -> Any:
    """Await an async handler, cancelling it once its attempt is lost or past ``timeout``.

    The attempt's cancelled flag is set when the job is cancelled, rescued,
    timed out (by the handler pool) or given back at shutdown. A handler that
    catches the cancellation and goes on is waited for: like a sync handler
    that ignores ``is_cancelled()``, it keeps its thread until it returns (the
    handler pool replaces such threads within a bound); the worker does not
    wait for it past ``SHUTDOWN_TIMEOUT``.
    """
    task = asyncio.ensure_future(_carried(coro))
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        wait = (
            CANCEL_POLL if deadline is None else max(0.0, min(CANCEL_POLL, deadline - loop.time()))
        )
        done, _ = await asyncio.wait({task}, timeout=wait)
        if done:
            return task.result()
        expired = deadline is not None and loop.time() >= deadline
        if expired or attempt.cancelled.is_set():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            if expired:
                raise HandlerTimedOut
            raise AttemptLost("cancelled: the attempt was lost while its handler ran")
