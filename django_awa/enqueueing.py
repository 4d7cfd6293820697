"""Enqueueing: ``enqueue``, ``enqueue_many``, their awaitable forms, and ``EnqueueRequest``.

Everything is validated before the first statement is sent; the INSERT runs
on the Django connection ``using`` and so joins the caller's open
``transaction.atomic()``. Workers are woken by NOTIFY when it commits.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import operator
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import db, sql, wakeups
from .codec import ArgsDecodeError, canonical_json, check_json, encode_checked, require_text
from .conf import QUEUE_NAME_RE, awa_settings, invalid_queue_name, to_seconds

# Resolved and checked in db.py; imported from here by callbacks, control, backends.
from .db import database_alias as database_alias
from .exceptions import UniqueConflict, ValidationError
from .kinds import JobArgs, Unique, check_max_attempts, check_priority, registry
from .models import JOB_ATTNAMES, Job, JobState, jobs_from_rows, load_json
from .otel import with_trace


@dataclass(frozen=True, slots=True)
class EnqueueRequest:
    """One job to enqueue, with options overriding its kind's defaults."""

    args: JobArgs
    _: KW_ONLY
    queue: str | None = None
    priority: int | None = None
    run_at: dt.datetime | None = None
    max_attempts: int | None = None
    tags: Sequence[str] | None = None
    metadata: dict[str, Any] | None = None
    unique: Unique | None = None
    # Jobs (rows or ids) this one waits for, and what they must reach (SPEC §11).
    after: Sequence[Any] = ()
    requires: str = "completed"
    # This job's sequence key (SPEC 12): jobs sharing one run one at a time, in
    # enqueue order, whatever their kind. Wins over the kind's sequence=.
    sequence: str | None = None


# What a dependency must reach (models.Requires, kept here as text: the
# models' choices are read when validating).
REQUIRES = ("completed", "finished")


@dataclass(slots=True, kw_only=True)
class PreparedJob:
    """A validated job, ready to insert."""

    kind: str
    queue: str
    args: str  # JSON text
    priority: int
    max_attempts: int
    run_at: dt.datetime | None
    tags: list[str]
    metadata: str  # JSON text
    unique_key: str | None
    unique_states: list[str] | None
    # Dependencies (dependencies.py): ids of the jobs this one waits for, in
    # `after` order, and what they must reach; the workflow it belongs to;
    # its id when drawn beforehand (a Workflow's steps); whether another new
    # job depends on it.
    after: list[int] = field(default_factory=list)
    requires: str = "completed"
    workflow_id: uuid.UUID | None = None
    id: int | None = None
    has_dependents: bool = False
    # Its sequence's key (metadata["awa_sequence"]), if it has one.
    sequence_key: str | None = None

    def params(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "queue": self.queue,
            "args": self.args,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "run_at": self.run_at,
            "tags": _json_list(self.tags),
            "metadata": self.metadata,
            "unique_key": self.unique_key,
            "unique_states": None if self.unique_states is None else json.dumps(self.unique_states),
        }


# Metadata keys django-awa writes (awa_trigger, awa_periodic, awa_callback_result,
# ...) and reads back: users may not set them (SPEC §3).
ENGINE_METADATA_PREFIX = "awa_"

# Tags are labels to filter by, each 1 to 255 characters.
MAX_TAGS = 100

# json.dumps(..., ensure_ascii=False) would build an encoder per call.
_ARGS_ENCODER = json.JSONEncoder(ensure_ascii=False)


def prepare(
    item: JobArgs | EnqueueRequest,
    *,
    queue: str | None = None,
    priority: int | None = None,
    run_at: dt.datetime | None = None,
    max_attempts: int | None = None,
    tags: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
    unique: Unique | None = None,
    metadata_json: str | None = None,
    after: Sequence[Any] = (),
    requires: str = "completed",
) -> PreparedJob:
    """Validate one job and resolve its kind's defaults. Raises ``ValidationError``.

    ``metadata`` (here or on an ``EnqueueRequest``) is the user's and checked
    as such: no key may begin with ``awa_``. ``metadata_json`` is metadata
    django-awa writes itself (``awa_trigger``, ``awa_periodic``), as the JSON
    text of an object whose keys all begin with ``awa_``, taken unchecked and
    added to the user's: the only way engine keys reach a row.
    """
    if isinstance(item, EnqueueRequest):
        args = item.args
        queue = item.queue if item.queue is not None else queue
        priority = item.priority if item.priority is not None else priority
        run_at = item.run_at if item.run_at is not None else run_at
        max_attempts = item.max_attempts if item.max_attempts is not None else max_attempts
        tags = item.tags if item.tags is not None else tags
        metadata = item.metadata if item.metadata is not None else metadata
        unique = item.unique if item.unique is not None else unique
        after = item.after or after
        requires = item.requires if item.after else requires
        sequence = item.sequence
    else:
        args = item
        sequence = None
    if isinstance(args, type) and issubclass(args, JobArgs):
        name = args.__qualname__
        raise ValidationError(
            f"expected JobArgs or awa.EnqueueRequest, got the class {name} itself, not a job "
            f"of it: enqueue {name}(...)"
        )
    if not isinstance(args, JobArgs):
        raise ValidationError(
            f"expected JobArgs or awa.EnqueueRequest, got {type(args).__name__}: {args!r}"
        )
    kind = args.kind
    where = _where(kind)
    conf = awa_settings()
    encoded, args_json = _encoded_args(args, where, conf.max_args_bytes)
    defaults = registry.defaults(kind)
    queue = defaults.queue if queue is None else queue
    if not isinstance(queue, str) or not QUEUE_NAME_RE.match(queue):
        raise ValidationError(f"{where}: {invalid_queue_name(queue)}")
    if defaults.limited and queue != defaults.queue:
        raise ValidationError(
            f"{where}: the kind has an awa.Limit, which holds on its queue "
            f"{defaults.queue!r}; it cannot be enqueued on {queue!r}"
        )
    priority = defaults.priority if priority is None else priority
    check_priority(priority, where)
    max_attempts = defaults.max_attempts if max_attempts is None else max_attempts
    check_max_attempts(max_attempts, where)
    if run_at is not None:
        run_at = _check_run_at(run_at, where)
    tag_list = _check_tags(tags, where)
    meta = _check_metadata(metadata, where)
    _check_size(meta, "metadata", conf.max_metadata_bytes, "MAX_METADATA_BYTES", where)
    metadata_json = with_trace(metadata_json)  # the enqueuing span, with the otel extra
    if metadata_json is not None:
        meta = _with_engine_metadata(meta, metadata_json)
    sequence_key = _sequence_key(sequence, defaults.sequence, kind, encoded, where)
    if sequence_key is not None:
        meta = _with_engine_metadata(meta, json.dumps({"awa_sequence": sequence_key}))
    unique = defaults.unique if unique is None else unique
    unique_key = unique_states = None
    if unique is not None:
        unique_key, unique_states = _unique_key(unique, kind, encoded, queue, run_at, where)
    return PreparedJob(
        kind=kind,
        queue=queue,
        args=args_json,
        priority=priority,
        max_attempts=max_attempts,
        run_at=run_at,
        tags=tag_list,
        metadata=meta,
        unique_key=unique_key,
        unique_states=unique_states,
        after=dependency_ids(after, where),
        requires=check_requires(requires, where),
        sequence_key=sequence_key,
    )


def _where(kind: str) -> str:
    """How a ``ValidationError`` about a job of ``kind`` begins."""
    return f"job of kind {kind!r}"


def _encoded_args(args: JobArgs, where: str, max_bytes: int) -> tuple[dict[str, Any], str]:
    """``args`` as the JSON object the worker will decode, and its text; ``ValidationError``
    if it would not decode back, or its text is over ``max_bytes`` (``MAX_ARGS_BYTES``)."""
    try:
        # What the worker will decode: refuse now what it could not.
        encoded = encode_checked(args)
    except ArgsDecodeError as exc:
        raise ValidationError(f"{where}: {exc}") from exc
    args_json = _ARGS_ENCODER.encode(encoded)
    _check_size(args_json, "args", max_bytes, "MAX_ARGS_BYTES", where)
    return encoded, args_json


def _shares_kind_part(kind: str) -> bool:
    """Whether every job of ``kind`` given as plain args prepares to the same row but its
    args: no unique key and no sequence key of the kind's are made from them."""
    defaults = registry.defaults(kind)
    return defaults.unique is None and not defaults.sequence


def _like(first: PreparedJob, args: JobArgs, max_bytes: int) -> PreparedJob:
    """What ``prepare(args)`` would return, given ``first``: what ``prepare`` made, in the
    same ``enqueue_many`` call, of plain args of the same class, a kind that
    ``_shares_kind_part``. Only ``args`` themselves are checked and encoded; the
    rest is ``first``'s."""
    _, args_json = _encoded_args(args, _where(first.kind), max_bytes)
    return PreparedJob(
        kind=first.kind,
        queue=first.queue,
        args=args_json,
        priority=first.priority,
        max_attempts=first.max_attempts,
        run_at=None,
        tags=[],
        metadata=first.metadata,
        unique_key=None,
        unique_states=None,
    )


def check_requires(requires: Any, where: str) -> str:
    """``requires`` if it is one of ``REQUIRES``; else ``ValidationError`` naming it."""
    if not isinstance(requires, str) or requires not in REQUIRES:
        raise ValidationError(
            f"{where}: requires must be one of {', '.join(map(repr, REQUIRES))}, got {requires!r}"
        )
    return requires


# The states a blocked job is released into (SPEC §11).
BLOCKED = JobState.BLOCKED.value
RELEASED_INTO = frozenset((JobState.AVAILABLE.value, JobState.SCHEDULED.value))
# Every state's value: JobState.values builds its list anew at each use, and a
# unique key's states are checked for each job enqueued or rekinded.
STATE_VALUES = frozenset(JobState.values)
# The largest id a job can have (awa_job.id is a bigint).
MAX_JOB_ID = 2**63 - 1


def dependency_ids(after: Any, where: str, *, alias: str | None = None) -> list[int]:
    """The ids of the jobs named in ``after`` (``Job`` rows or ids), in order, each once.

    ``alias``: a ``Job`` read from another database is refused. Rows are
    checked again against the enqueue's database by ``dependency_database``.
    """
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        raise ValidationError(f"{where}: after must be a list of jobs or job ids, got {after!r}")
    ids: list[int] = []
    for item in after:
        if isinstance(item, Job):
            if item.id is None:
                raise ValidationError(f"{where}: after names a job that was never saved")
            if alias is not None and item._state.db != alias:
                raise ValidationError(
                    f"{where}: after names job {item.id} of database {item._state.db!r}, "
                    f"not {alias!r}: a dependency must be in the same database"
                )
            job_id = item.id
        elif isinstance(item, int) and not isinstance(item, bool):
            if not 1 <= item <= MAX_JOB_ID:
                # Refused here: the database would fail on it rather than find no job.
                raise ValidationError(f"{where}: after names job id {item}, which does not exist")
            job_id = item
        elif _is_step(item):
            # A Workflow's steps come here only from awa.enqueue / EnqueueRequest:
            # Workflow.add takes them before.
            raise ValidationError(
                f"{where}: after names {item!r}: a Workflow's step is taken by "
                f"Workflow.add(after=...) of its own workflow; here, give its job "
                f"(step.job, once its workflow is enqueued)"
            )
        else:
            raise ValidationError(
                f"{where}: after takes Job rows or job ids (or a Workflow's steps), "
                f"got {safe_type(item)}: {item!r}"
            )
        if job_id not in ids:
            ids.append(job_id)
    return ids


def _is_step(item: object) -> bool:
    from .workflows import Step  # workflows.py imports this module

    return isinstance(item, Step)


def dependency_databases(after: Any) -> set[str]:
    """The databases of the ``Job`` rows named in ``after``."""
    if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
        return set()
    return {item._state.db for item in after if isinstance(item, Job) and item._state.db}


def safe_type(value: object) -> str:
    return type(value).__name__


def _check_size(text: str, what: str, limit: int, setting: str, where: str) -> None:
    """``ValidationError`` if JSON ``text`` is over ``limit`` bytes of UTF-8 (``AWA[setting]``)."""
    # A character is at most 4 bytes of UTF-8: most texts need no byte count.
    if len(text) * 4 > limit and (size := len(text.encode())) > limit:
        raise ValidationError(
            f"{where}: {what}: {size} bytes of JSON, over the limit of {limit} (AWA[{setting!r}])"
        )


def _check_run_at(run_at: Any, where: str) -> dt.datetime:
    """``run_at`` as an aware datetime PostgreSQL can store; else ``ValidationError``.

    timestamptz holds years 1 to 9999 in UTC, as Python's datetime does, but an
    aware datetime near either end may lie outside them in UTC (year 1 at
    UTC+14 is year 0 there). PostgreSQL would store it and the row could not be
    read back; the ``awa_job_run_at_range`` check (migration 0005) refuses it
    on any other path.
    """
    if not isinstance(run_at, dt.datetime):
        raise ValidationError(f"{where}: run_at must be a datetime, got {run_at!r}")
    try:
        naive = timezone.is_naive(run_at)
    except (TypeError, ValueError) as exc:  # a tzinfo giving no valid offset
        raise ValidationError(f"{where}: run_at {run_at!r}: {exc}") from exc
    if naive:
        if settings.USE_TZ:
            raise ValidationError(
                f"{where}: run_at {run_at.isoformat()} is a naive datetime while USE_TZ "
                f"is True; pass an aware datetime"
            )
        try:
            run_at = timezone.make_aware(run_at, timezone.get_default_timezone())
        except (OverflowError, ValueError) as exc:
            raise ValidationError(f"{where}: run_at {run_at.isoformat()}: {exc}") from exc
    try:
        run_at.astimezone(dt.UTC)
    except (OverflowError, ValueError):
        raise ValidationError(
            f"{where}: run_at {run_at.isoformat()} is outside what PostgreSQL stores "
            f"(years 1 to 9999 in UTC)"
        ) from None
    checked: dt.datetime = run_at
    return checked


def _check_tags(tags: Sequence[str] | None, where: str) -> list[str]:
    if tags is None:
        return []
    # A list or tuple, in the order given: a set's order changes from one
    # process to the next, and a dict or string is seldom meant as its keys or
    # characters. Sort a set (sorted(tags)) to pass it.
    if not isinstance(tags, (list, tuple)):
        raise ValidationError(
            f"{where}: tags must be a list or tuple of strings, got {type(tags).__name__}"
        )
    if len(tags) > MAX_TAGS:
        raise ValidationError(f"{where}: {len(tags)} tags, over the limit of {MAX_TAGS}")
    tag_list = list(tags)
    for tag in tag_list:
        if not isinstance(tag, str) or not tag or len(tag) > 255:
            raise ValidationError(
                f"{where}: each tag must be a string of 1-255 characters: {tag!r}"
            )
        require_text(tag, f"{where}: tag {tag!r}")
    return tag_list


def _check_metadata(metadata: dict[str, Any] | None, where: str) -> str:
    """``metadata`` as JSON text, checked to be storable."""
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise ValidationError(f"{where}: metadata must be a dict, got {metadata!r}")
    if not metadata:
        return "{}"
    for key in metadata:
        if not isinstance(key, str):
            raise ValidationError(f"{where}: metadata keys must be strings, got {key!r}")
        if key.startswith(ENGINE_METADATA_PREFIX):
            raise ValidationError(
                f"{where}: metadata key {key!r} is refused: keys beginning with "
                f"{ENGINE_METADATA_PREFIX!r} belong to django-awa"
            )
    try:
        return check_json(metadata)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{where}: metadata cannot be stored as JSON: {exc}") from exc


# A sequence key is an index entry: keep it short.
MAX_SEQUENCE_KEY = 255


def _sequence_key(
    given: Any, fields: tuple[str, ...], kind: str, encoded: dict[str, Any], where: str
) -> str | None:
    """The job's sequence key: ``EnqueueRequest(sequence=)`` as given, else the
    kind's ``sequence=`` fields' values (prefixed with the kind); ``None`` if neither."""
    if given is not None:
        if not isinstance(given, str) or not 1 <= len(given) <= MAX_SEQUENCE_KEY:
            raise ValidationError(
                f"{where}: sequence must be a string of 1 to {MAX_SEQUENCE_KEY} characters, "
                f"got {given!r}"
            )
        return given
    if not fields:
        return None
    key = f"{kind}:{json.dumps([encoded.get(name) for name in fields], sort_keys=True)}"
    if len(key) > MAX_SEQUENCE_KEY:
        # Long values: their digest keeps the key short and still one per value.
        key = f"{kind}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def is_kind_sequence_key(key: str, kind: str) -> bool:
    """Whether ``key`` has the form of a sequence key ``_sequence_key`` makes from
    ``kind``'s ``sequence=`` fields, not one given as ``EnqueueRequest(sequence=)``."""
    prefix = f"{kind}:"
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix) :]
    return (rest.startswith("[") and rest.endswith("]")) or re.fullmatch(
        r"sha256:[0-9a-f]{64}", rest
    ) is not None


def _with_engine_metadata(user_json: str, engine_json: str) -> str:
    """The union of two JSON objects' texts, without decoding either.

    Their keys cannot clash: the user's never begin with ``awa_``, the
    engine's always do. ``"{}"`` stands for an empty object, as
    ``_check_metadata`` writes it.
    """
    if user_json == "{}":
        return engine_json
    if engine_json == "{}":
        return user_json
    return f"{user_json[:-1]}, {engine_json[1:]}"


class KindKeys(NamedTuple):
    """The keys ``enqueue`` makes from a job's args by its kind's declarations."""

    # The unique key and the states holding it (the kind's ``awa.Unique``), or None.
    unique: tuple[str, list[str]] | None
    # The sequence key (the kind's ``sequence=``), or None.
    sequence: str | None


def kind_keys(args: JobArgs, *, queue: str, run_at: dt.datetime) -> KindKeys:
    """The unique key (and the states holding it) and the sequence key that
    ``enqueue(args, queue=queue, run_at=run_at)`` gives by the ``awa.Unique`` and
    ``sequence=`` of ``args``' kind; None for what the kind does not declare.
    Raises ``ValidationError`` naming the kind."""
    defaults = registry.defaults(args.kind)
    if defaults.unique is None and not defaults.sequence:
        return KindKeys(unique=None, sequence=None)
    where = _where(args.kind)
    encoded, _ = _encoded_args(args, where, awa_settings().max_args_bytes)
    unique = (
        None
        if defaults.unique is None
        else _unique_key(defaults.unique, args.kind, encoded, queue, run_at, where)
    )
    return KindKeys(
        unique=unique, sequence=_sequence_key(None, defaults.sequence, args.kind, encoded, where)
    )


def _unique_key(
    unique: Unique,
    kind: str,
    encoded: dict[str, Any],
    queue: str,
    run_at: dt.datetime | None,
    where: str,
) -> tuple[str, list[str]]:
    if not isinstance(unique, Unique):
        raise ValidationError(f"{where}: unique must be an awa.Unique, got {unique!r}")
    if not isinstance(unique.states, (list, tuple, set, frozenset)):
        raise ValidationError(
            f"{where}: Unique.states must be a tuple of states, got {unique.states!r}"
        )
    states = list(unique.states)
    bad = [s for s in states if not isinstance(s, str) or s not in STATE_VALUES]
    if bad or not states:
        raise ValidationError(f"{where}: Unique.states has invalid states {bad or states!r}")
    if JobState.RUNNING in states and JobState.AVAILABLE not in states:
        # A claim makes an available job running: with a twin enqueued while one was
        # available, claiming it breaks the unique index, and every claim of the
        # queue fails with it (the claim is one statement for many jobs).
        raise ValidationError(
            f"{where}: Unique.states holds the key while 'running' but not while "
            f"'available': a twin enqueued while one waits would make its claim break the "
            f"key, and stop the queue. Add 'available' (and 'scheduled', 'retryable' to "
            f"keep twins out while one waits); for one job of a key running at a time, use "
            f"awa.Limit(concurrency=1, by=...) or sequence= on the kind"
        )
    if BLOCKED not in states and any(s in RELEASED_INTO for s in states):
        # A blocked job is released in the transaction of its last dependency's
        # outcome, which must not fail on the job's key: where it would hold its
        # key once released, it holds it while it waits too, and a clash shows
        # when it is enqueued (or reopened by a retry).
        states.append(BLOCKED)
    parts: list[Any] = [kind]
    if unique.by_args:
        parts.append(encoded)
    if unique.by_queue:
        parts.append(queue)
    if unique.by_period is not None:
        try:
            period = to_seconds(unique.by_period)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"{where}: Unique.by_period: {exc}") from exc
        if period <= 0:
            raise ValidationError(f"{where}: Unique.by_period must be positive")
        moment = run_at or timezone.now()
        try:
            parts.append(math.floor(moment.timestamp() / period))
        except (OverflowError, ValueError) as exc:
            raise ValidationError(f"{where}: Unique.by_period {unique.by_period!r}: {exc}") from exc
    digest = hashlib.sha256(canonical_json(parts).encode()).hexdigest()
    return digest, states


def enqueue(
    args: JobArgs,
    *,
    queue: str | None = None,
    priority: int | None = None,
    run_at: dt.datetime | None = None,
    max_attempts: int | None = None,
    tags: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
    unique: Unique | None = None,
    using: str | None = None,
    after: Sequence[Any] = (),
    requires: str = "completed",
) -> Job:
    """Insert one job and return its row.

    Runs on connection ``using`` (default ``AWA["DATABASE"]``) and joins its
    open transaction: the job exists only if that transaction commits. Raises
    ``ValidationError`` (nothing written) or ``UniqueConflict`` (nothing
    written; the caller's transaction stays usable).

    ``after`` (Job rows or ids) makes it wait for those jobs: ``blocked``
    until each has completed (``requires="completed"``) or finished
    (``requires="finished"``), see SPEC §11.
    """
    alias = database_alias(using)
    item_after = args.after if isinstance(args, EnqueueRequest) else ()
    for database in dependency_databases(after) | dependency_databases(item_after):
        if database != alias:
            raise ValidationError(
                f"job of kind {getattr(args, 'kind', '?')!r}: after names a job of database "
                f"{database!r}, not {alias!r}: a dependency must be in the same database"
            )
    prepared = prepare(
        args,
        queue=queue,
        priority=priority,
        run_at=run_at,
        max_attempts=max_attempts,
        tags=tags,
        metadata=metadata,
        unique=unique,
        after=after,
        requires=requires,
    )
    if prepared.after:
        # Imported here: dependencies.py sits above this module (it settles
        # the new job, with follow-ups for a cascaded cancel).
        from .dependencies import enqueue_with_dependencies

        return enqueue_with_dependencies(prepared, alias)
    return enqueue_prepared(prepared, alias)


def enqueue_prepared(prepared: PreparedJob, alias: str) -> Job:
    """``enqueue`` of a validated job: insert it on ``alias`` and return its row.

    Raises ``UniqueConflict`` (nothing written) if its unique key is held.
    """
    row = _insert_alone(prepared, alias)
    if row is None:
        raise unique_conflict(prepared, alias)
    return _inserted_job(prepared, row, alias)


def unique_conflict(
    prepared: PreparedJob, alias: str, *, where: str = "", then: str = ""
) -> UniqueConflict:
    """The ``UniqueConflict`` for ``prepared``, whose key another job holds: naming that
    job, as ``conflicting_id`` too. ``where`` goes before the message, ``then`` after."""
    holder = db.fetch_one(alias, sql.FIND_UNIQUE_HOLDER, {"unique_key": prepared.unique_key})
    holder_id = holder[0] if holder else None
    return UniqueConflict(
        f"{where}a job of kind {prepared.kind!r} with the same unique key is already held"
        + (f" by job {holder_id}" if holder_id else "")
        + then,
        conflicting_id=holder_id,
    )


# The row enqueue builds its Job from, in sql.JOB_COLUMNS order, is picked
# (_row) from the columns the server set (INSERTED_COLUMNS, as RETURNING
# gives them), then those enqueue sent (in _SENT order), then defaults:
# every other column holds its field's default, the value the migration gives
# the column too (a test compares every field with the row). Defaults are taken
# once where they are fixed and immutable (None, 0, False); a callable default
# (``errors``' list) is called for each job.
_SENT = (
    "kind", "queue", "args", "priority", "max_attempts", "metadata", "tags",
    "unique_key", "unique_states",
)  # fmt: skip
_DEFAULTED = [
    f for f in Job._meta.concrete_fields if f.attname not in {*_SENT, *sql.INSERTED_COLUMNS}
]


def _is_constant(f: Any) -> bool:
    return not (f.has_default() and callable(f.default)) and isinstance(
        f.get_default(), (type(None), bool, int, str)
    )


_FRESH_DEFAULTS = [f for f in _DEFAULTED if not _is_constant(f)]
_CONSTANT_DEFAULTS = [f for f in _DEFAULTED if _is_constant(f)]
_CONSTANT_VALUES = tuple(f.get_default() for f in _CONSTANT_DEFAULTS)
_SOURCES = [
    *sql.INSERTED_COLUMNS,
    "",  # RETURNING's last value: the NOTIFY (NULL when deferred)
    *_SENT,
    *(f.attname for f in _FRESH_DEFAULTS),
    *(f.attname for f in _CONSTANT_DEFAULTS),
]
_row = operator.itemgetter(*(_SOURCES.index(name) for name in JOB_ATTNAMES))


def _inserted_job(prepared: PreparedJob, returned: tuple[Any, ...], alias: str) -> Job:
    """The row INSERT_ONE wrote: the server's ``sql.INSERTED_COLUMNS``, the rest as sent."""
    unique_states = prepared.unique_states
    sent = (
        prepared.kind,
        prepared.queue,
        load_json(prepared.args),
        prepared.priority,
        prepared.max_attempts,
        load_json(prepared.metadata),
        list(prepared.tags),
        prepared.unique_key,
        None if unique_states is None else list(unique_states),
    )
    fresh = tuple([f.get_default() for f in _FRESH_DEFAULTS])
    row = _row(returned + sent + fresh + _CONSTANT_VALUES)
    (job,) = jobs_from_rows((row,), alias, json_text=False)
    return job


def enqueue_many(
    items: Iterable[JobArgs | EnqueueRequest], *, using: str | None = None
) -> list[int]:
    """Insert many jobs in bulk; return the inserted ids in input order.

    Every item is validated before anything is written: one bad item raises
    ``ValidationError`` naming its index and nothing is inserted. Unique
    duplicates are skipped (absent from the result). Joins the caller's
    transaction on ``using``.
    """
    alias = database_alias(using)
    prepared = []
    # Jobs given as plain args of one class differ only in their args (unless the
    # kind makes a unique or sequence key of them): what the kind decides (queue,
    # priority, attempts, metadata with the enqueuing span) is checked once, for
    # the first of them, and its job lends it to the others (``_like``).
    firsts: dict[type[JobArgs], PreparedJob] = {}
    max_bytes = awa_settings().max_args_bytes
    for index, item in enumerate(items):
        try:
            if isinstance(item, EnqueueRequest):
                for database in dependency_databases(item.after):
                    if database != alias:
                        raise ValidationError(
                            f"after names a job of database {database!r}, not {alias!r}: "
                            f"a dependency must be in the same database"
                        )
                prepared.append(prepare(item))
                continue
            first = firsts.get(type(item))
            if first is not None:
                prepared.append(_like(first, item, max_bytes))
                continue
            job = prepare(item)
            if _shares_kind_part(job.kind):
                firsts[type(item)] = job
            prepared.append(job)
        except ValidationError as exc:
            raise ValidationError(f"enqueue_many item {index}: {exc}") from exc
    if not prepared:
        return []
    return insert(prepared, alias, where=lambda n: f"enqueue_many item {n}: ").ids


async def aenqueue(
    args: JobArgs,
    *,
    queue: str | None = None,
    priority: int | None = None,
    run_at: dt.datetime | None = None,
    max_attempts: int | None = None,
    tags: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
    unique: Unique | None = None,
    using: str | None = None,
    after: Sequence[Any] = (),
    requires: str = "completed",
) -> Job:
    """``enqueue`` for async code (an async view, an async handler): same options, same errors.

    It runs ``enqueue`` through ``sync_to_async(thread_sensitive=True)``, the
    thread Django's own async ORM methods use, so it is on the same connection
    as the view's other ORM calls. It joins a transaction open on that
    connection (an ``atomic()`` block of sync code that called this async code
    through ``async_to_sync``; in tests, ``TestCase``'s); otherwise the insert
    commits at once (autocommit), as any ORM write from an async view does.
    """
    return await sync_to_async(enqueue, thread_sensitive=True)(
        args,
        queue=queue,
        priority=priority,
        run_at=run_at,
        max_attempts=max_attempts,
        tags=tags,
        metadata=metadata,
        unique=unique,
        using=using,
        after=after,
        requires=requires,
    )


async def aenqueue_many(
    items: Iterable[JobArgs | EnqueueRequest], *, using: str | None = None
) -> list[int]:
    """``enqueue_many`` for async code, on the connection ``aenqueue`` uses (see there)."""
    return await sync_to_async(enqueue_many, thread_sensitive=True)(list(items), using=using)


# Below this many plain jobs, one INSERT is as quick as a COPY.
COPY_THRESHOLD = 20


def _json_list(value: list[str]) -> str:
    return json.dumps(value) if value else "[]"


class Inserted(NamedTuple):
    """What ``insert`` wrote."""

    # The inserted jobs' ids, in input order; empty unless asked for (ids=True).
    ids: list[int]
    # The positions, in the input, of the jobs skipped as unique duplicates.
    skipped: list[int]


def insert(
    prepared: Sequence[PreparedJob],
    alias: str,
    *,
    ids: bool = True,
    where: Callable[[int], str] | None = None,
) -> Inserted:
    """Insert validated jobs on ``alias``, in its current transaction: the one way jobs
    are written (``enqueue`` through ``enqueue_prepared``, which reads the row back).

    A unique duplicate is skipped, not raised, and leaves the transaction
    usable. Workers of the queues of jobs to run now are woken at commit.
    One job is one INSERT. For several, ids are drawn first, so they follow
    the input order; jobs to run now without a unique key (the common bulk
    case) are streamed with COPY from ``COPY_THRESHOLD`` of them, the others go
    through one INSERT that resolves scheduling by the database clock.
    ``ids=False`` is for callers that need no ids (the completer's follow-ups):
    jobs nothing can refuse then take theirs from the column's default and are
    streamed with COPY however few; only the others draw ids, to tell which
    were skipped. ``where`` names a job by its position in an error about its
    ``after`` (``dependencies.insert_with_dependencies``).
    """
    if any(p.after for p in prepared):
        # Imported here: dependencies.py sits above this module.
        from .dependencies import insert_with_dependencies

        return insert_with_dependencies(prepared, alias, ids=ids, where=where)
    if len(prepared) == 1:
        row = _insert_alone(prepared[0], alias)
        if row is None:
            return Inserted([], [0])
        return Inserted([row[0]] if ids else [], [])
    return _insert_bulk(prepared, alias, ids)


def _insert_alone(prepared: PreparedJob, alias: str) -> tuple[Any, ...] | None:
    """INSERT one job; the columns the server set (``sql.INSERTED_COLUMNS``), or None
    for a unique duplicate. Its queue is woken by the statement's NOTIFY, or, in
    the engine's own transaction, after its commit (``wakeups``)."""
    if not wakeups.deferring(alias):
        statement = sql.INSERT_ONE_UNIQUE if prepared.unique_key else sql.INSERT_ONE
        return db.fetch_one(alias, statement, prepared.params())
    statement = sql.INSERT_ONE_UNIQUE_QUIET if prepared.unique_key else sql.INSERT_ONE_QUIET
    row = db.fetch_one(alias, statement, prepared.params())
    if row is not None and row[1] == JobState.AVAILABLE:
        wakeups.announce(alias, [prepared.queue])
    return row


def _copy_values(p: PreparedJob) -> tuple[Any, ...]:
    """A job's values for ``sql._COPY_COLUMNS``."""
    return (p.kind, p.queue, p.args, p.priority, p.max_attempts, _json_list(p.tags), p.metadata)


def _insert_bulk(prepared: Sequence[PreparedJob], alias: str, number_plain: bool) -> Inserted:
    """``insert`` of several jobs; ``number_plain``: draw ids for plain jobs too."""
    plain = [p.run_at is None and p.unique_key is None for p in prepared]
    if number_plain and sum(plain) < COPY_THRESHOLD:
        plain = [False] * len(prepared)
    with transaction.atomic(using=alias, savepoint=False), db.cursor(alias) as cursor:
        drawn: list[int] = []
        count = len(prepared) if number_plain else plain.count(False)
        if count:
            cursor.execute(sql.RESERVE_IDS, {"n": count})
            drawn = [row[0] for row in cursor.fetchall()]
        numbers = iter(drawn)
        ids = [None if is_plain and not number_plain else next(numbers) for is_plain in plain]
        copied = [(p, i) for p, i, is_plain in zip(prepared, ids, plain, strict=True) if is_plain]
        if copied and number_plain:
            cursor.copy_rows(sql.COPY_AVAILABLE, ((i, *_copy_values(p)) for p, i in copied))
        elif copied:
            cursor.copy_rows(sql.COPY_AVAILABLE_UNNUMBERED, (_copy_values(p) for p, _ in copied))
        inserted = {i for _, i in copied if i is not None}
        rest = [(p, i) for p, i, is_plain in zip(prepared, ids, plain, strict=True) if not is_plain]
        if rest:
            # Each job's values as INSERT_ONE takes them, one array per column.
            columns = db.as_columns([p.params() for p, _ in rest])
            cursor.execute(sql.INSERT_MANY, {"id": [i for _, i in rest], **columns})
            inserted.update(row[0] for row in cursor.fetchall())
        queues = {p.queue for p, _ in copied}
        queues.update(p.queue for p, i in rest if i in inserted)
        wakeups.announce(alias, queues, cursor)
    if len(inserted) == len(drawn):  # no duplicate skipped: the common case
        return Inserted(drawn if number_plain else [], [])
    skipped = [n for n, i in enumerate(ids) if i is not None and i not in inserted]
    return Inserted([i for i in drawn if i in inserted] if number_plain else [], skipped)
