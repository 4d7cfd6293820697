"""Follow-ups: which job to enqueue when a job of some kind reaches an outcome.

An app declares them in its ``followups.py``::

    @on_completed(ChargeCard)
    def send_receipt(args, job):
        return SendReceipt(order_id=args.order_id)

Worker-driven outcomes, callback resolution and ``awa.cancel`` insert the
follow-ups in the transaction that commits the state change (see
``finalize.py``); a rescue inserts them right after it commits, through a
durable pending row (``pending.py``) that maintenance replays.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import inspect
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, ClassVar, Self

from django.db import transaction
from django.dispatch import Signal

from . import signals
from .codec import MAX_ERROR_CHARS, ArgsDecodeError, decode_args, escape_text
from .enqueueing import EnqueueRequest, PreparedJob, insert, prepare
from .exceptions import AwaError, ValidationError
from .kinds import JobArgs
from .models import Job
from .otel import followup_trace

logger = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    """The state change a follow-up is declared for (``awa_trigger["outcome"]``)."""

    COMPLETED = "completed"
    RETRIED = "retried"
    EXHAUSTED = "exhausted"
    CANCELLED = "cancelled"
    WAITING_FOR_CALLBACK = "waiting_for_callback"
    RESCUED = "rescued"


class RescueReason(enum.StrEnum):
    """Why maintenance took a job back."""

    STALE_HEARTBEAT = "stale_heartbeat"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CALLBACK_TIMEOUT = "callback_timeout"


# -- outcome contexts: what each outcome's follow-ups get after (args, job) --------


class _Context:
    """The base of the outcome contexts: one frozen dataclass per outcome.

    Its fields are the arguments the outcome's follow-up functions receive
    after ``(args, job)``, in SPEC §6 order, and the keyword arguments of the
    outcome's signal.
    """

    __slots__ = ()
    outcome: ClassVar[Outcome]

    def values(self) -> tuple[Any, ...]:
        """The fields in declaration order: the follow-up function's arguments."""
        names = CONTEXT_PARAMETERS[self.outcome]
        return tuple([getattr(self, name) for name in names]) if names else ()

    def as_dict(self) -> dict[str, Any]:
        """``{field: value}``: the signal's keyword arguments."""
        return {name: getattr(self, name) for name in CONTEXT_PARAMETERS[self.outcome]}

    def after(self, row: Job) -> Self:
        """This context once ``row`` (the trigger as the transition left it) is known."""
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed(_Context):
    """The handler returned, or ``complete_external`` resolved the callback."""

    outcome: ClassVar[Outcome] = Outcome.COMPLETED


@dataclass(frozen=True, slots=True, kw_only=True)
class Retried(_Context):
    """The attempt failed (or asked for a retry) and another follows at ``next_run_at``.

    ``error`` is ``""`` for a ``RetryAfter``. ``next_run_at`` is the row's
    ``run_at`` once the transition is written (``after``); until then None.
    """

    error: str
    attempt: int
    next_run_at: dt.datetime | None = None
    outcome: ClassVar[Outcome] = Outcome.RETRIED

    def after(self, row: Job) -> Retried:
        return replace(self, next_run_at=row.run_at)


@dataclass(frozen=True, slots=True, kw_only=True)
class Exhausted(_Context):
    """The job failed for good: a terminal error, or its last attempt failed."""

    error: str
    attempt: int
    outcome: ClassVar[Outcome] = Outcome.EXHAUSTED


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancelled(_Context):
    """The handler returned ``awa.Cancel(reason)``, or an operator cancelled the job."""

    reason: str
    outcome: ClassVar[Outcome] = Outcome.CANCELLED

    @classmethod
    def given(cls, reason: object) -> Self:
        """The context of a cancel whose ``reason`` came from outside (a handler's
        ``awa.Cancel``, ``awa.cancel``, a bulk cancel): kept, not refused, escaped
        where PostgreSQL cannot hold it (a NUL, a lone surrogate) and cut if huge."""
        return cls(reason=escape_text(str(reason), MAX_ERROR_CHARS))

    @property
    def error_entry(self) -> str:
        """The text of the ``errors`` entry the cancel adds."""
        return f"cancelled: {self.reason}" if self.reason else "cancelled"


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingForCallback(_Context):
    """The job parked in ``waiting_external``; ``job.callback_id`` is set."""

    outcome: ClassVar[Outcome] = Outcome.WAITING_FOR_CALLBACK


@dataclass(frozen=True, slots=True, kw_only=True)
class Rescued(_Context):
    """Maintenance took the job back, for ``reason``."""

    reason: RescueReason
    outcome: ClassVar[Outcome] = Outcome.RESCUED


type OutcomeContext = Completed | Retried | Exhausted | Cancelled | WaitingForCallback | Rescued

CONTEXTS: dict[Outcome, type[OutcomeContext]] = {
    cls.outcome: cls
    for cls in (Completed, Retried, Exhausted, Cancelled, WaitingForCallback, Rescued)
}
# The extra arguments each outcome's function receives after (args, job).
CONTEXT_PARAMETERS: dict[Outcome, tuple[str, ...]] = {
    outcome: tuple(f.name for f in fields(cls)) for outcome, cls in CONTEXTS.items()
}
# The contexts without fields, one instance each.
COMPLETED = Completed()
WAITING_FOR_CALLBACK = WaitingForCallback()


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowupSpec:
    outcome: Outcome
    trigger: Any  # the declared class; checks.py reports one that is not a JobArgs
    function: Callable[..., Any]

    @property
    def name(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"


class FollowupError(AwaError):
    """A follow-up function raised, returned something unusable, or its insert failed."""

    def __init__(self, message: str, *, spec: FollowupSpec | None = None) -> None:
        super().__init__(message)
        self.spec = spec


class FollowupRegistry:
    """(outcome, kind) -> follow-up specs, in declaration order."""

    def __init__(self) -> None:
        self._specs: dict[tuple[Outcome, str], list[FollowupSpec]] = {}
        self.all: list[FollowupSpec] = []

    def add(self, spec: FollowupSpec) -> None:
        kind = getattr(spec.trigger, "kind", None)
        # A re-imported followups.py (autoreload, tests) declares the same functions
        # again: the same function, outcome and trigger replace the declaration. One
        # function may be declared for several kinds (stacked decorators, a loop).
        for existing in self.all:
            if (
                existing.outcome == spec.outcome
                and existing.name == spec.name
                and getattr(existing.trigger, "kind", None) == kind
            ):
                self._remove(existing)
                break
        self.all.append(spec)
        if isinstance(kind, str):
            self._specs.setdefault((spec.outcome, kind), []).append(spec)

    def _remove(self, spec: FollowupSpec) -> None:
        self.all.remove(spec)
        for specs in self._specs.values():
            if spec in specs:
                specs.remove(spec)

    def get(self, outcome: Outcome, kind: str) -> Sequence[FollowupSpec]:
        return self._specs.get((outcome, kind), ())

    def has(self, outcome: Outcome, kind: str) -> bool:
        return bool(self._specs.get((outcome, kind)))

    def clear(self) -> None:
        self._specs.clear()
        self.all.clear()


followup_registry = FollowupRegistry()


def _decorator(
    outcome: Outcome,
) -> Callable[[Any], Callable[[Callable[..., Any]], Callable[..., Any]]]:
    params = ", ".join(("args", "job", *CONTEXT_PARAMETERS[outcome]))

    def declare(trigger: type[JobArgs]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(function: Callable[..., Any]) -> Callable[..., Any]:
            followup_registry.add(FollowupSpec(outcome=outcome, trigger=trigger, function=function))
            return function

        return register

    declare.__name__ = f"on_{outcome.value}"
    declare.__doc__ = (
        f"Declare a follow-up for the {outcome.value!r} outcome of ``trigger``'s kind.\n\n"
        f"The function is called as ``fn({params})`` and returns JobArgs, an "
        f"``awa.EnqueueRequest`` or ``None``."
    )
    return declare


on_completed = _decorator(Outcome.COMPLETED)
on_retried = _decorator(Outcome.RETRIED)
on_exhausted = _decorator(Outcome.EXHAUSTED)
on_cancelled = _decorator(Outcome.CANCELLED)
on_waiting_for_callback = _decorator(Outcome.WAITING_FOR_CALLBACK)
on_rescued = _decorator(Outcome.RESCUED)


def signature_fits(spec: FollowupSpec) -> bool:
    """Whether ``spec.function`` accepts its outcome's positional arguments."""
    try:
        signature = inspect.signature(spec.function)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(*range(2 + len(CONTEXT_PARAMETERS[spec.outcome])))
    except TypeError:
        return False
    return True


def trigger_metadata_json(job: Job, outcome: Outcome) -> str:
    """``{"awa_trigger": {"job_id", "kind", "outcome"}}`` as JSON text, written out directly.

    One per follow-up, in the completer's batch: formatting an int and two
    strings is a fraction of what encoding the dict would cost.
    """
    return (
        f'{{"awa_trigger": {{"job_id": {int(job.id)}, "kind": {_json_text(job.kind)}, '
        f'"outcome": {_json_text(outcome.value)}}}}}'
    )


@functools.lru_cache(maxsize=1024)
def _json_text(value: str) -> str:
    return json.dumps(value)


def build(job: Job, context: OutcomeContext) -> list[tuple[FollowupSpec, PreparedJob]]:
    """Call every follow-up function of (``context.outcome``, ``job.kind``) with
    ``(args, job, *context.values())`` and validate what they return.

    Raises ``FollowupError`` naming the function on the first failure.
    """
    outcome = context.outcome
    specs = followup_registry.get(outcome, job.kind)
    if not specs:
        return []
    extra = context.values()
    engine_json = trigger_metadata_json(job, outcome)
    trace = followup_trace(job)  # with the otel extra: a link to the trigger's attempt span
    if trace is not None:
        engine_json = f'{engine_json[:-1]}, "awa_trace": {json.dumps(trace)}}}'
    prepared: list[tuple[FollowupSpec, PreparedJob]] = []
    decoded: dict[type, JobArgs] = {}
    for spec in specs:
        args_cls = spec.trigger
        try:
            if args_cls not in decoded:
                decoded[args_cls] = decode_args(args_cls, job.args)
            result = spec.function(decoded[args_cls], job, *extra)
            if result is None:
                continue
            if not isinstance(result, (JobArgs, EnqueueRequest)):
                raise ValidationError(
                    f"returned {type(result).__name__}, expected JobArgs, "
                    f"awa.EnqueueRequest or None"
                )
            # An EnqueueRequest's own metadata is checked as any user's is.
            follow_up = prepare(result, metadata_json=engine_json)
            prepared.append((spec, follow_up))
        except ArgsDecodeError as exc:
            raise FollowupError(f"follow-up {spec.name} failed: {exc}", spec=spec) from exc
        except BaseException as exc:  # the function is the user's code, as a handler is
            # SystemExit, asyncio.CancelledError... too: let out, it would end the
            # completer's thread and leave every job of its worker running for good.
            if _interrupted(exc):
                raise
            text = str(exc)
            raise FollowupError(
                f"follow-up {spec.name} failed: {type(exc).__name__}"
                + (f": {text}" if text else ""),
                spec=spec,
            ) from exc
    return prepared


# The Django signal sent after each outcome commits (best effort; SPEC §8).
OUTCOME_SIGNALS = {
    Outcome.COMPLETED: signals.job_completed,
    Outcome.RETRIED: signals.job_retried,
    Outcome.EXHAUSTED: signals.job_exhausted,
    Outcome.CANCELLED: signals.job_cancelled,
    Outcome.RESCUED: signals.job_rescued,
}


def dispatch(row: Job, context: OutcomeContext, alias: str) -> list[int]:
    """Insert the follow-ups of ``context``'s outcome for ``row`` in the caller's transaction.

    Raises ``FollowupError`` if a function fails or an insert is refused.
    Returns the ids of the inserted follow-ups.
    """
    return dispatch_many([(row, context)], alias)


def dispatch_many(outcomes: Sequence[tuple[Job, OutcomeContext]], alias: str) -> list[int]:
    """``dispatch`` for many (row, context) pairs: every follow-up in one insert."""
    prepared = [job for row, context in outcomes for _, job in build(row, context)]
    if not prepared:
        return []
    try:
        inserted = insert(prepared, alias)
    except ValidationError as exc:  # after= naming a job that no longer exists
        raise FollowupError(f"follow-up insert refused: {exc}") from exc
    if inserted.skipped:
        raise FollowupError(
            f"follow-up insert refused: UniqueConflict: a job of kind "
            f"{prepared[inserted.skipped[0]].kind!r} with the same unique key is already held"
        )
    return inserted.ids


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc``, raised by the user's code, is to propagate: only a
    ``KeyboardInterrupt`` in the main thread, which may be the user's Ctrl-C (as
    ``execute.handler_raised`` judges); the worker's other threads never get signals."""
    return isinstance(exc, KeyboardInterrupt) and (
        threading.current_thread() is threading.main_thread()
    )


def _send_robust(signal: Signal, row: Job, context: OutcomeContext) -> None:
    """``signal.send_robust``, which logs what a receiver raises, ``BaseException``
    subclasses too: one let out would end the thread that committed the outcome."""
    try:
        signal.send_robust(sender=Job, job=row, **context.as_dict())
    except BaseException as exc:
        if _interrupted(exc):
            raise
        logger.exception(
            "a receiver of the %s signal of job %s raised %s; ignored",
            context.outcome.value,
            row.id,
            type(exc).__name__,
        )


def send_signal(row: Job, context: OutcomeContext, alias: str) -> None:
    """Send the signal of ``context``'s outcome after the current transaction commits
    (if anyone listens), with ``job=row`` and the context's fields."""
    signal = OUTCOME_SIGNALS.get(context.outcome)
    if signal is not None and signal.has_listeners():
        transaction.on_commit(partial(_send_robust, signal, row, context), using=alias, robust=True)
