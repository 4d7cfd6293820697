"""Job kinds: :class:`JobArgs`, ``@worker``, ``Unique`` and the registry ``jobs.py`` fills.

A kind is a string (``ChargeCard`` -> ``"charge_card"``). Handlers are found
by kind in :data:`registry`, never imported from a path read from a row.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from django.core.exceptions import ImproperlyConfigured

from .conf import (
    MAX_DURATION,
    MAX_GLOBAL_CONCURRENCY,
    QUEUE_NAME_RE,
    Rate,
    invalid_queue_name,
    parse_rate,
    positive_int,
    to_seconds,
)
from .exceptions import ValidationError

_CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
KIND_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,254}$")

PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 1, 4, 2
MAX_ATTEMPTS_MIN, MAX_ATTEMPTS_MAX, MAX_ATTEMPTS_DEFAULT = 1, 1000, 25


def snake_case(name: str) -> str:
    return _CAMEL_RE.sub("_", name).lower()


class JobArgs:
    """Base class for job arguments. Subclasses are dataclasses.

    ``kind`` defaults to the class name in snake_case; a class attribute
    ``kind: ClassVar[str] = "..."`` overrides it.
    """

    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        annotation = inspect.get_annotations(cls).get("kind")
        if annotation is not None and "ClassVar" not in str(annotation):
            # A field named kind would be the instance's kind: jobs of this class
            # stored under whatever kind their args named.
            raise ImproperlyConfigured(
                f"{cls.__qualname__}: a JobArgs field cannot be named 'kind', the job's "
                f"kind; rename the field, or name the kind with kind: ClassVar[str] = '...'"
            )
        if "kind" not in cls.__dict__:
            cls.kind = snake_case(cls.__name__)
        if not isinstance(cls.kind, str) or not KIND_RE.match(cls.kind):
            raise ImproperlyConfigured(f"{cls.__qualname__}.kind is not a valid kind: {cls.kind!r}")
        registry.args_classes.setdefault(cls.kind, cls)
        if registry.args_classes[cls.kind] is not cls:
            previous = registry.args_classes[cls.kind]
            # A module re-imported (autoreload, tests) re-creates its classes: replace.
            if (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ImproperlyConfigured(
                    f"job kind {cls.kind!r} is declared twice: by "
                    f"{previous.__module__}.{previous.__qualname__} and "
                    f"{cls.__module__}.{cls.__qualname__}"
                )
            registry.args_classes[cls.kind] = cls


def _unique_held() -> tuple[str, ...]:
    # Imported when called: JobArgs, Unique and @worker work before the app
    # registry is ready, and importing the models needs it.
    from .models import JobState

    return JobState.UNIQUE_HELD


@dataclass(frozen=True, slots=True, kw_only=True)
class Unique:
    """Uniqueness of a job: the database refuses a second job with the same key.

    The key covers the kind, plus the args, queue and ``run_at`` period bucket
    as chosen; it is held while the job is in one of ``states``.
    """

    by_args: bool = True
    by_queue: bool = False
    by_period: float | dt.timedelta | None = None
    states: tuple[str, ...] = field(default_factory=_unique_held)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """Fleet-wide flow control of one kind (``@awa.worker(..., limit=awa.Limit(...))``).

    ``concurrency``: at most this many of the kind's attempts run at once;
    ``rate`` (``"N/s"``, ``"N/m"``, ``"N/h"``): at most N start in any such
    window. With ``by`` (an args field name, or a tuple of them) both hold per
    value of those fields instead: one busy account never holds back another.
    """

    concurrency: int | None = None
    rate: str | None = None
    by: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValidationError("awa.Limit() needs concurrency=, rate= or both")
        if self.concurrency is not None and not positive_int(
            self.concurrency, MAX_GLOBAL_CONCURRENCY
        ):
            raise ValidationError(
                f"awa.Limit(concurrency=) must be an integer from 1 to "
                f"{MAX_GLOBAL_CONCURRENCY:,}, got {self.concurrency!r}"
            )
        if self.rate is not None:
            parse_rate(self.rate, "awa.Limit(rate=)")
        if self.by is not None:
            fields_of(self.by, "awa.Limit(by=)")

    @property
    def parsed_rate(self) -> Rate | None:
        return None if self.rate is None else parse_rate(self.rate, "awa.Limit(rate=)")

    @property
    def fields(self) -> tuple[str, ...]:
        return () if self.by is None else fields_of(self.by, "awa.Limit(by=)")


def fields_of(by: Any, what: str) -> tuple[str, ...]:
    """The args field names ``by`` gives (a name or a tuple of names, each once)."""
    names = (by,) if isinstance(by, str) else by
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(n, str) and n.isidentifier() for n in names)
    ):
        raise ValidationError(f"{what} takes a field name or a tuple of field names, got {by!r}")
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ValidationError(
            f"{what} names field {', '.join(map(repr, repeated))} more than once, "
            f"got {by!r}: give each field once"
        )
    return names


def _check_fields(args_cls: type[JobArgs], names: tuple[str, ...], what: str) -> None:
    known = {f.name for f in dataclasses.fields(cast(Any, args_cls))}
    for name in names:
        if name not in known:
            raise ValidationError(
                f"{what}: {args_cls.__qualname__} has no field {name!r} "
                f"(fields: {', '.join(sorted(known)) or 'none'})"
            )


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    args_cls: type[JobArgs]
    handler: Callable[..., Any]
    queue: str = "default"
    priority: int = PRIORITY_DEFAULT
    max_attempts: int = MAX_ATTEMPTS_DEFAULT
    deadline: float | None = None
    unique: Unique | None = None
    atomic: bool = False
    # Seconds after which the worker gives the attempt up (``timeout=``); None: never.
    timeout: float | None = None
    # An ``async def`` handler: the worker runs it on its event loop thread.
    is_async: bool = False
    # Flow control (SPEC 12): a kind limit, and the args fields of its sequence key.
    limit: Limit | None = None
    sequence: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.args_cls.kind

    @functools.cached_property
    def defaults(self) -> KindDefaults:
        return KindDefaults(
            queue=self.queue,
            priority=self.priority,
            max_attempts=self.max_attempts,
            unique=self.unique,
            sequence=self.sequence,
            limited=self.limit is not None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KindDefaults:
    """What ``enqueue`` uses when the caller does not override it."""

    queue: str = "default"
    priority: int = PRIORITY_DEFAULT
    max_attempts: int = MAX_ATTEMPTS_DEFAULT
    unique: Unique | None = None
    sequence: tuple[str, ...] = ()  # args fields whose values make the sequence key
    limited: bool = False  # an awa.Limit: its jobs run on ``queue`` only


class Registry:
    """Kinds known to this process: args classes and their one handler each."""

    def __init__(self) -> None:
        self.args_classes: dict[str, type[JobArgs]] = {}
        self.workers: dict[str, WorkerSpec] = {}
        # Families of kinds served by one handler (Django Tasks: "task:<path>").
        self.resolvers: dict[str, Callable[[str], WorkerSpec | None]] = {}
        self._deadlines_json: str | None = None
        self._limits_json: dict[str, str] = {}
        self._leased_kinds: frozenset[str] | None = None

    def handler_for(self, kind: str) -> WorkerSpec | None:
        spec = self.workers.get(kind)
        if spec is None:
            prefix, sep, _ = kind.partition(":")
            resolver = self.resolvers.get(prefix) if sep else None
            spec = resolver(kind) if resolver else None
        return spec

    def defaults(self, kind: str) -> KindDefaults:
        spec = self.workers.get(kind)
        if spec is None:
            return _NO_DEFAULTS
        return spec.defaults

    def deadlines_json(self) -> str:
        """``{kind: seconds}`` of the kinds with their own deadline, as the claim takes it.

        Built once, not per claim; ``register`` drops it when a handler is added.
        """
        if self._deadlines_json is None:
            self._deadlines_json = json.dumps(
                {kind: spec.deadline for kind, spec in self.workers.items() if spec.deadline}
            )
        return self._deadlines_json

    def limits_json(self, queue: str) -> str:
        """``{kind: {"c", "rn", "rs", "by"}}`` of the kinds on ``queue`` with an
        ``awa.Limit``, as the limited claim takes it ("{}" when none has one).

        A kind's limit holds on the queue it is declared on; enqueue refuses its
        jobs on any other, so the queue's lock serializes every claim that counts.
        """
        cached = self._limits_json.get(queue)
        if cached is None:
            limits: dict[str, dict[str, Any]] = {}
            for kind, spec in self.workers.items():
                if spec.limit is None or spec.queue != queue:
                    continue
                entry: dict[str, Any] = {"by": list(spec.limit.fields)}
                if spec.limit.concurrency is not None:
                    entry["c"] = spec.limit.concurrency
                rate = spec.limit.parsed_rate
                if rate is not None:
                    entry["rn"], entry["rs"] = rate.count, rate.period
                limits[kind] = entry
            cached = self._limits_json[queue] = json.dumps(limits, sort_keys=True)
        return cached

    def leased_kinds(self) -> frozenset[str]:
        """The kinds whose attempts may hold a per-key lease (an ``awa.Limit`` with
        ``concurrency``): their outcomes are written releasing it (``sql.RELEASING``)."""
        if self._leased_kinds is None:
            self._leased_kinds = frozenset(
                kind
                for kind, spec in self.workers.items()
                if spec.limit is not None and spec.limit.concurrency is not None
            )
        return self._leased_kinds

    def register(self, spec: WorkerSpec) -> None:
        self.workers[spec.kind] = spec
        self._deadlines_json = None
        self._limits_json = {}
        self._leased_kinds = None


_NO_DEFAULTS = KindDefaults()
registry = Registry()


def worker(
    args_cls: type[JobArgs],
    *,
    queue: str = "default",
    priority: int = PRIORITY_DEFAULT,
    max_attempts: int = MAX_ATTEMPTS_DEFAULT,
    deadline: float | dt.timedelta | None = None,
    unique: Unique | None = None,
    atomic: bool = False,
    timeout: float | dt.timedelta | None = None,
    limit: Limit | None = None,
    sequence: str | tuple[str, ...] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the one handler for ``args_cls.kind`` and its enqueue defaults.

    The handler may be an ``async def`` function (not with ``atomic=True``).
    ``timeout`` (seconds or a timedelta) is a hard limit on each attempt: past
    it the attempt is recorded as failed ("timed out") and retried per the
    retry policy; an async handler is cancelled, a sync handler's result is
    ignored. It must not exceed the kind's ``deadline`` when both are given.
    ``limit`` (an ``awa.Limit``) and ``sequence`` (args field names) are the
    kind's flow control, fleet-wide (README, *Flow control*).
    """
    given = cast(object, args_cls)  # whatever the caller passed, typed or not
    if not (isinstance(given, type) and issubclass(given, JobArgs)):
        raise ImproperlyConfigured(f"@awa.worker() takes a JobArgs subclass, got {args_cls!r}")
    if not dataclasses.is_dataclass(cast(object, args_cls)):
        raise ImproperlyConfigured(f"{args_cls.__qualname__} must be a @dataclass")
    where = f"@awa.worker({args_cls.__qualname__})"
    if not isinstance(queue, str) or not QUEUE_NAME_RE.match(queue):
        raise ValidationError(f"{where}: {invalid_queue_name(queue)}")
    check_priority(priority, where)
    check_max_attempts(max_attempts, where)
    if unique is not None and not isinstance(unique, Unique):
        raise ValidationError(f"{where}: unique must be an awa.Unique, got {unique!r}")
    deadline_s = _duration(deadline, "deadline", where)
    timeout_s = _duration(timeout, "timeout", where)
    if timeout_s is not None and deadline_s is not None and timeout_s > deadline_s:
        raise ValidationError(
            f"{where}: timeout ({timeout_s:g}s) is longer than the deadline ({deadline_s:g}s): "
            f"maintenance would rescue the attempt before it timed out"
        )
    sequence_fields = _flow_control(args_cls, limit, sequence, where)

    def decorator(handler: Callable[..., Any]) -> Callable[..., Any]:
        kind = args_cls.kind
        if not callable(handler):
            raise ImproperlyConfigured(f"{where} decorates a callable, got {handler!r}")
        is_async = inspect.iscoroutinefunction(handler)
        if is_async and atomic:
            raise ImproperlyConfigured(
                f"{where}: atomic=True needs a sync handler, and {_qualname(handler)} is "
                f"async def: its ORM calls run in another thread, outside the transaction. "
                f"Make the database work one sync function called through sync_to_async"
            )
        previous = registry.workers.get(kind)
        if previous is not None and _qualname(previous.handler) != _qualname(handler):
            raise ImproperlyConfigured(
                f"job kind {kind!r} has two handlers: {_qualname(previous.handler)} and "
                f"{_qualname(handler)}"
            )
        registry.register(
            WorkerSpec(
                args_cls=args_cls,
                handler=handler,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                deadline=deadline_s,
                unique=unique,
                atomic=atomic,
                timeout=timeout_s,
                is_async=is_async,
                limit=limit,
                sequence=sequence_fields,
            )
        )
        return handler

    return decorator


def _duration(value: float | dt.timedelta | None, name: str, where: str) -> float | None:
    """``value`` in seconds, positive and at most ``MAX_DURATION``; else ``ValidationError``."""
    if value is None:
        return None
    try:
        seconds = to_seconds(value)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{where}: {name}: {exc}") from exc
    if not 0 < seconds <= MAX_DURATION:
        raise ValidationError(
            f"{where}: {name} must be positive and at most {MAX_DURATION / 86400:.0f} days, "
            f"got {value!r}"
        )
    return seconds


def _flow_control(
    args_cls: type[JobArgs], limit: Any, sequence: Any, where: str
) -> tuple[str, ...]:
    """Check ``limit=`` and ``sequence=`` of ``@awa.worker``; return the sequence's fields."""
    if limit is not None:
        if not isinstance(limit, Limit):
            raise ValidationError(f"{where}: limit must be an awa.Limit, got {limit!r}")
        _check_fields(args_cls, limit.fields, f"{where}: limit by=")
    if sequence is None:
        return ()
    names = fields_of(sequence, f"{where}: sequence=")
    _check_fields(args_cls, names, f"{where}: sequence=")
    return names


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_priority(priority: Any, where: str) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValidationError(f"{where}: priority must be an integer 1-4, got {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValidationError(f"{where}: priority must be 1 (highest) to 4, got {priority}")


def check_max_attempts(max_attempts: Any, where: str) -> None:
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool):
        raise ValidationError(
            f"{where}: max_attempts must be an integer 1-1000, got {max_attempts!r}"
        )
    if not MAX_ATTEMPTS_MIN <= max_attempts <= MAX_ATTEMPTS_MAX:
        raise ValidationError(f"{where}: max_attempts must be 1 to 1000, got {max_attempts}")
