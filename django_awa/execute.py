"""Running one attempt: the handler's ``JobContext`` and what its result means.

``run_attempt()`` turns one claimed row into an :class:`AttemptResult`;
``finalize.py`` writes it. A handler declared ``atomic=True`` runs inside the
transaction that finalizes it (``finalize.run_atomic_attempt``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
from .conf import callback_timeout, to_seconds
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
from .models import Job, JobState

logger = logging.getLogger(__name__)

# The longest RetryAfter or Snooze delay (SPEC §5).
MAX_DELAY = 86400.0


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
    """Cancel the job, recording ``reason``."""

    reason: str = ""


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

    job: Job
    alias: str
    cancelled: Flag = field(default_factory=lambda: Flag())
    progress: dict[str, Any] | None = None
    progress_dirty: bool = False
    callback_id: uuid.UUID | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.run_lease)


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
        return self._attempt.job

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
        return self._attempt.job.dependencies()

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
        ``ValidationError``.
        """
        seconds = callback_timeout(timeout, "register_callback: timeout")
        callback_id = uuid.uuid4()
        job = self._attempt.job
        with connections[self._attempt.alias].cursor() as cursor:
            cursor.execute(
                sql.REGISTER_CALLBACK,
                {
                    "callback_id": callback_id,
                    "timeout": seconds,
                    "id": job.id,
                    "run_lease": job.run_lease,
                },
            )
            if cursor.fetchone() is None:
                self._attempt.cancelled.set()
                raise TerminalError(f"job {job.id} is no longer running this attempt")
        self._attempt.callback_id = callback_id
        job.callback_id = callback_id
        return CallbackToken(id=callback_id, timeout_at_seconds=seconds)


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

    job: Job
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
    # What a completed handler returned, as JSON text (Job.result); None: null.
    result: str | None = None
    # Set by finalize: the row as it stands after the transition, or, when it
    # was not written because another session held the row locked, locked;
    # whether the job has dependents to settle in the outcome's transaction.
    row: Job | None = None
    locked: bool = False
    has_dependents: bool = False

    @property
    def outcome(self) -> Outcome | None:
        context = self.context
        return None if context is None else context.outcome

    def params(self) -> dict[str, Any]:
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
            "result": self.result,
        }


def completed(job: Job) -> AttemptResult:
    return AttemptResult(job=job, state=JobState.COMPLETED, context=COMPLETED)


def failed_terminally(job: Job, error: str, tb: str = "") -> AttemptResult:
    error = escape_text(error, MAX_ERROR_CHARS)
    return AttemptResult(
        job=job,
        state=JobState.FAILED,
        context=Exhausted(error=error, attempt=job.attempt),
        error=error,
        traceback=escape_text(tb, MAX_TRACEBACK_CHARS),
    )


def errored(job: Job, error: str, tb: str = "") -> AttemptResult:
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


def from_exception(job: Job, exc: BaseException, *, during: str = "") -> AttemptResult:
    """The attempt failed with ``exc``: ``TerminalError`` fails it now, anything else retries.

    ``during`` names what failed, when it was not the handler itself.
    """
    tb = "".join(traceback.format_exception(exc))
    error = f"{during}: {describe(exc)}" if during else describe(exc)
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
            cancelled = Cancelled(reason=escape_text(str(reason), MAX_ERROR_CHARS))
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


def with_result(job: Job, value: Any) -> AttemptResult:
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


def resolve_handler(job: Job) -> tuple[WorkerSpec, JobArgs] | AttemptResult:
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
        return failed_terminally(job, f"unknown job kind {job.kind!r}: no handler is registered")
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
) -> AttemptResult:
    """Run the handler of a claimed, non-atomic attempt and interpret its result.

    ``resolved`` is ``resolve_handler(attempt.job)`` when the caller has it already.
    """
    if resolved is None:
        resolved = resolve_handler(attempt.job)
    if isinstance(resolved, AttemptResult):
        return resolved
    spec, args = resolved
    context = JobContext(attempt, args, flush_progress)
    try:
        value = spec.handler(context)
    except BaseException as exc:  # the handler boundary: every error is recorded
        if not handler_raised(exc):
            raise
        result = from_exception(attempt.job, exc)
    else:
        result = from_value(attempt, value)
    result.progress = attempt.progress
    return result
