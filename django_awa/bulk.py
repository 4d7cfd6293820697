"""Bulk operations over a filter: retry, cancel, discard, move or reprioritize
every job a queryset matches, in batches (issue 21, item 6).

Used by the admin's "all matching jobs" page and ``manage.py awa_jobs``. The
ids are picked by keyset over ``id`` from the operator's filter (a read that
locks nothing), ``BATCH_SIZE`` at a time, up to the largest id that matched
when the operation was previewed, so jobs enqueued meanwhile are left alone.
Each batch is one transaction of a few set-based statements on those ids:
row locks on that batch only, for tens of milliseconds, never a table lock.

The rules of the single-job controls hold for every batch: a retry moves
finished rows back from ``awa_job_done``, reopens the dependents its failure
cancelled and waits for its own dependencies again (``reopen_all``); a cancel
cascades to dependents and inserts the ``on_cancelled`` follow-ups in the
batch's transaction. A batch one job spoils (its unique key taken, a
follow-up function raising) rolls back and is redone one job at a time with
``control.retry`` / ``control.cancel``, so only that job is reported failed.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import Count, Max, QuerySet
from django.utils.text import Truncator

from . import control, sql
from .codec import check_text, decode_args
from .conf import QUEUE_NAME_RE, awa_settings, invalid_queue_name
from .dependencies import after_outcomes, deleting, reopen_all, settle
from .enqueueing import KindKeys, is_kind_sequence_key, kind_keys
from .exceptions import UniqueConflict, ValidationError
from .followups import Cancelled, FollowupError, dispatch, send_signal
from .kinds import JobArgs, WorkerSpec, check_priority, registry
from .models import Job, JobState, jobs_from_rows, load_json

logger = logging.getLogger(__name__)

# Ids per batch (per transaction). Each batch locks this many rows at most,
# for the few statements of its transaction.
BATCH_SIZE = 1000


class Operation(enum.StrEnum):
    RETRY = "retry"
    CANCEL = "cancel"
    DISCARD = "discard"
    MOVE = "move"
    PRIORITY = "priority"


# The states each operation applies to; jobs in other states are left alone.
ALLOWED: dict[Operation, tuple[JobState, ...]] = {
    Operation.RETRY: JobState.RETRIABLE,
    Operation.CANCEL: JobState.LIVE,
    Operation.DISCARD: tuple(JobState),
    Operation.MOVE: JobState.WAITING,
    Operation.PRIORITY: JobState.WAITING,
}

# The model permission each operation needs (as the admin's actions do).
PERMISSION: dict[Operation, str] = {
    Operation.RETRY: "change",
    Operation.CANCEL: "change",
    Operation.DISCARD: "delete",
    Operation.MOVE: "change",
    Operation.PRIORITY: "change",
}

PAST: dict[Operation, str] = {
    Operation.RETRY: "retried",
    Operation.CANCEL: "cancelled",
    Operation.DISCARD: "discarded",
    Operation.MOVE: "moved",
    Operation.PRIORITY: "reprioritized",
}

# What an operation does to the dependents of the jobs it changes (SPEC §11):
# a cancel or discard cancels those that require them to complete (and the
# cascade goes on), a retry reopens those their failure had cancelled.
DEPENDENTS_PAST: dict[Operation, str] = {
    Operation.RETRY: "reopened",
    Operation.CANCEL: "cancelled",
    Operation.DISCARD: "cancelled",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Preview:
    """How many jobs an operation would touch now, and the largest id among them."""

    operation: Operation
    count: int
    up_to: int | None


@dataclass(slots=True, kw_only=True)
class Result:
    """What a bulk operation did. ``unchanged``: jobs that had moved on to a
    state the operation does not apply to by the time their batch ran.
    ``dependents``: jobs not matched that it moved through their dependencies
    too (``DEPENDENTS_PAST``: cancelled by the cascade, or reopened)."""

    operation: Operation
    changed: int = 0
    dependents: int = 0
    unchanged: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "operation": str(self.operation),
            PAST[self.operation]: self.changed,
            "dependents": self.dependents,
            "unchanged": self.unchanged,
            "failed": [{"id": i, "error": e} for i, e in self.failed],
            "batches": len(self.batch_seconds),
            "longest_batch_seconds": round(max(self.batch_seconds, default=0.0), 4),
        }


# A kind's attempt under way: a rekind leaves its jobs alone.
IN_PROGRESS = (JobState.RUNNING, JobState.WAITING_EXTERNAL)
MAX_KIND_LENGTH = 255  # awa_job.kind is a varchar(255)
# How many of the jobs a rekind refuses for one reason it names.
UNFIT_SHOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Rekinded:
    """What ``rekind`` changed (with ``dry_run``: would change), and the jobs of the
    old kind it left alone because their attempt was under way.

    ``declared``: whether the new kind's JobArgs class is known here. Of the jobs
    changed: ``unfit`` have args that class cannot decode (``unfit_shown``: the
    first few, with the reason), so a worker fails them; ``keys_remade`` got the
    unique key the new kind's ``awa.Unique`` makes; ``keys_kept`` kept one made
    from the old kind (the new kind is not declared or declares no
    ``awa.Unique``, or their args do not fit it). ``sequence_keys_remade`` got the
    sequence key the new kind's ``sequence=`` makes; ``sequence_keys_kept`` kept
    one made from the old kind's (for the same reasons). ``off_queue``: (queue,
    jobs) of those on a queue other than the one the new kind's ``awa.Limit``
    holds on (``force``). ``split``: jobs not rekinded that hold a sequence key
    the rekinded jobs left, or run under one they joined (``force``), and
    ``split_shown``, the first few (id, state, key).
    """

    changed: int
    in_progress: int
    declared: bool
    unfit: int = 0
    unfit_shown: tuple[tuple[int, str], ...] = ()
    keys_remade: int = 0
    keys_kept: int = 0
    sequence_keys_remade: int = 0
    sequence_keys_kept: int = 0
    off_queue: tuple[tuple[str, int], ...] = ()
    split: int = 0
    split_shown: tuple[tuple[int, str, str], ...] = ()


def check_rekind(old_kind: str, new_kind: str, queues: Sequence[str]) -> None:
    """Raise ``ValidationError`` naming a bad kind or queue name of a rekind."""
    for what, kind in (("old kind", old_kind), ("new kind", new_kind)):
        if not isinstance(kind, str) or not kind or len(kind) > MAX_KIND_LENGTH:
            raise ValidationError(
                f"rekind: the {what} must be 1-{MAX_KIND_LENGTH} characters, got {kind!r}"
            )
        try:
            check_text(kind)
        except ValueError as exc:
            raise ValidationError(f"rekind: the {what} {kind!r} cannot be stored: {exc}") from None
    if old_kind == new_kind:
        raise ValidationError(f"rekind: the jobs are of kind {old_kind!r} already")
    bad = [queue for queue in queues if not QUEUE_NAME_RE.match(queue)]
    if bad:
        raise ValidationError(f"rekind: {invalid_queue_name(bad[0])}")


def rekind(
    old_kind: str,
    new_kind: str,
    *,
    queues: Sequence[str] = (),
    dry_run: bool = False,
    force: bool = False,
    batch_size: int = BATCH_SIZE,
    using: str,
) -> Rekinded:
    """Give every job of ``old_kind`` that waits to run (``JobState.WAITING``; in
    ``queues`` when given) the kind ``new_kind``, in one transaction on ``using``:
    all of them or none. Jobs running or waiting for a callback keep their kind,
    and so does a job a worker claims while it runs.

    Where the JobArgs class of ``new_kind`` is known here, each job's args are
    decoded with it as a worker would, and the job gets the unique key (and
    states) and the sequence key ``enqueue`` gives such args of the new kind by
    its ``awa.Unique`` and ``sequence=``. A sequence key given at enqueue
    (``EnqueueRequest(sequence=)``) is kept, as is one made from the old kind
    where the new kind declares no ``sequence=``: those jobs still run one at a
    time, in order, behind the old kind's members of that key.

    Raises ``ValidationError``, unless ``force``, if some args do not fit the
    class, if the new kind has an ``awa.Limit`` and jobs wait on another queue
    than its own (which ``enqueue`` refuses), or if a job not rekinded would be
    left in a sequence the rekinded jobs leave, or one under way holds a key
    they join (they could start before it finished); ``UniqueConflict`` if two
    jobs would then hold one key, naming them, and ``ValidationError`` for a
    bad kind or queue name: then nothing is changed. The rows are read
    ``batch_size`` at a time and locked until the transaction ends; a
    ``dry_run`` does all of it, then rolls it back.
    """
    check_rekind(old_kind, new_kind, queues)
    if batch_size < 1:
        raise ValidationError(f"batch_size must be at least 1, got {batch_size!r}")
    spec = registry.handler_for(new_kind)
    params = {
        "old_kind": old_kind,
        "new_kind": new_kind,
        "queues": list(queues) or None,
        "states": [str(s) for s in JobState.WAITING],
        "in_progress": [str(s) for s in IN_PROGRESS],
    }
    defaults = registry.defaults(new_kind)
    tally = _Rekinding(
        old_kind=old_kind,
        new_kind=new_kind,
        args_cls=None if spec is None else spec.args_cls,
        limit_queue=defaults.queue if defaults.limited else None,
    )
    try:
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            after = 0
            # Bounded: each batch starts past the last id of the one before.
            while True:
                cursor.execute(sql.LOCK_TO_REKIND, {**params, "after": after, "limit": batch_size})
                rows = cursor.fetchall()
                if not rows:
                    break
                after = rows[-1][0]
                tally.rekind(cursor, rows, params)
            # After the batches: a job claimed meanwhile is counted as under way.
            cursor.execute(sql.COUNT_UNDER_WAY, params)
            (in_progress,) = cursor.fetchone()
            tally.find_split(cursor, params)
            if not force:
                tally.refuse(spec)
            if dry_run:
                transaction.set_rollback(True, using=using)
    except IntegrityError as exc:
        # A job of the new kind enqueued after its key was looked for: rolled back.
        raise UniqueConflict(
            f"rekind: a job enqueued while it ran holds a unique key it made for kind "
            f"{new_kind!r}: nothing changed; rekind again ({exc})"
        ) from exc
    if not dry_run:
        logger.info(
            "rekind %s -> %s: %s job(s), %s unique key(s) and %s sequence key(s) remade, "
            "%s with args that do not fit",
            old_kind,
            new_kind,
            tally.changed,
            tally.keys_remade,
            tally.sequence_keys_remade,
            tally.unfit,
        )
    return Rekinded(
        changed=tally.changed,
        in_progress=in_progress,
        declared=spec is not None,
        unfit=tally.unfit,
        unfit_shown=tuple(tally.unfit_shown),
        keys_remade=tally.keys_remade,
        keys_kept=tally.keys_kept,
        sequence_keys_remade=tally.sequence_keys_remade,
        sequence_keys_kept=tally.sequence_keys_kept,
        off_queue=tuple(sorted(tally.off_queue.items())),
        split=tally.split,
        split_shown=tuple(tally.split_shown),
    )


@dataclass(slots=True, kw_only=True)
class _Rekinding:
    """The batches of one rekind, and what they did so far."""

    old_kind: str
    new_kind: str
    args_cls: type[JobArgs] | None  # None: the new kind is not declared here
    limit_queue: str | None  # the queue the new kind's awa.Limit holds on; None: no limit
    changed: int = 0
    unfit: int = 0
    unfit_shown: list[tuple[int, str]] = field(default_factory=list)
    keys_remade: int = 0
    keys_kept: int = 0
    sequence_keys_remade: int = 0
    sequence_keys_kept: int = 0
    off_queue: Counter[str] = field(default_factory=Counter)
    # The sequence keys the rekinded jobs left, and those they joined.
    left_keys: set[str] = field(default_factory=set)
    joined_keys: set[str] = field(default_factory=set)
    split: int = 0
    split_shown: list[tuple[int, str, str]] = field(default_factory=list)

    def rekind(self, cursor: Any, rows: list[tuple[Any, ...]], params: dict[str, Any]) -> None:
        """Rekind one batch of ``LOCK_TO_REKIND``'s locked rows."""
        ids: list[int] = []
        remade: list[bool] = []
        keys: list[str | None] = []
        states: list[str | None] = []
        sequence_keys: list[str | None] = []
        holders: dict[str, int] = {}  # key -> the job of this batch holding it
        for job_id, args_json, state, queue, run_at, has_key, sequence_key in rows:
            if self.limit_queue is not None and queue != self.limit_queue:
                self.off_queue[queue] += 1
            made = self.kind_keys(job_id, args_json, queue, run_at)
            sequence_keys.append(self.sequence_key(sequence_key, made))
            unique = None if made is None else made.unique
            ids.append(job_id)
            remade.append(unique is not None)
            keys.append(None if unique is None else unique[0])
            states.append(None if unique is None else json.dumps(unique[1]))
            if unique is None:
                self.keys_kept += has_key
                continue
            self.keys_remade += 1
            key, held_in = unique
            if state in held_in:
                if key in holders:
                    raise self.shared_key(holders[key], job_id, key)
                holders[key] = job_id
        if holders:
            cursor.execute(
                sql.FIND_UNIQUE_HOLDERS,
                {"ids": list(holders.values()), "unique_keys": list(holders)},
            )
            found = cursor.fetchone()
            if found is not None:
                job_id, holder_id, key = found
                raise self.shared_key(holder_id, job_id, key)
        cursor.execute(
            sql.REKIND_JOBS,
            {
                **params,
                "ids": ids,
                "remade": remade,
                "unique_keys": keys,
                "unique_states": states,
                "sequence_keys": sequence_keys,
            },
        )
        self.changed += cursor.rowcount

    def kind_keys(
        self, job_id: int, args_json: str, queue: str, run_at: dt.datetime
    ) -> KindKeys | None:
        """The unique and sequence keys of the job's args as the new kind's (None where
        the kind is not declared); a job whose args its class cannot decode, as the
        worker decodes them, is counted unfit."""
        if self.args_cls is None:
            return None
        try:
            args = decode_args(self.args_cls, load_json(args_json))
        # What the worker's decoding refuses, or the args' own __post_init__
        # raising: either way a worker fails the job.
        except Exception as exc:  # noqa: BLE001
            self.unfit += 1
            if len(self.unfit_shown) < UNFIT_SHOWN:
                self.unfit_shown.append((job_id, str(exc) or type(exc).__name__))
            return None
        return kind_keys(args, queue=queue, run_at=run_at)

    def sequence_key(self, old: str | None, made: KindKeys | None) -> str | None:
        """The job's new sequence key; None where it keeps the one it has (or none).

        A key given at enqueue wins over the kind's, there as here. One made from
        the old kind is kept where the new kind makes none: the job stays in
        line behind that key's unfinished members, which may be jobs of the old
        kind left running, as it was promised when enqueued.
        """
        from_kind = old is not None and is_kind_sequence_key(old, self.old_kind)
        if old is not None and not from_kind:
            return None
        if made is None or made.sequence is None:
            self.sequence_keys_kept += from_kind
            return None
        self.sequence_keys_remade += 1
        self.joined_keys.add(made.sequence)
        if old is not None:
            self.left_keys.add(old)
        return made.sequence

    def find_split(self, cursor: Any, params: dict[str, Any]) -> None:
        """Find the jobs not rekinded left in a sequence the rekinded jobs left, and
        those under way in one they joined (``sql.FIND_SEQUENCES_SPLIT``)."""
        if not self.joined_keys:
            return
        cursor.execute(
            sql.FIND_SEQUENCES_SPLIT,
            {
                "left_keys": sorted(self.left_keys),
                "joined_keys": sorted(self.joined_keys),
                "in_progress": params["in_progress"],
                "limit": UNFIT_SHOWN,
            },
        )
        rows = cursor.fetchall()
        self.split = rows[0][3] if rows else 0
        self.split_shown = [(job_id, state, key) for job_id, state, key, _ in rows]

    def refuse(self, spec: WorkerSpec | None) -> None:
        """Raise ``ValidationError`` for what ``force`` would let through."""
        if spec is not None and self.unfit:
            raise ValidationError(self.unfit_refusal(spec.args_cls))
        if self.off_queue:
            raise ValidationError(self.off_queue_refusal())
        if self.split:
            raise ValidationError(self.split_refusal())

    def shared_key(self, first: int, second: int, key: str) -> UniqueConflict:
        return UniqueConflict(
            f"rekind: jobs {first} and {second} would both hold the unique key {key} of "
            f"kind {self.new_kind!r} (its awa.Unique): nothing changed; discard or cancel "
            "one of them, then rekind again",
            conflicting_id=first,
        )

    def unfit_refusal(self, args_cls: type[JobArgs]) -> str:
        shown = "; ".join(f"job {i}: {reason}" for i, reason in self.unfit_shown)
        more = (
            f"; and {self.unfit - len(self.unfit_shown):,} more" if self.unfit > UNFIT_SHOWN else ""
        )
        return (
            f"rekind: the args of {self.unfit:,} job(s) of kind {self.old_kind!r} do not fit "
            f"{args_cls.__qualname__} (kind {self.new_kind!r}), so a worker would fail "
            f"them: {shown}{more}. Nothing changed; with --force they are rekinded all the same"
        )

    def off_queue_refusal(self) -> str:
        return (
            f"rekind: kind {self.new_kind!r} has an awa.Limit, which holds on its queue "
            f"{self.limit_queue!r}, so enqueue refuses its jobs on any other; "
            f"{self.off_queue.total():,} job(s) of kind {self.old_kind!r} wait on "
            f"{off_queue_text(sorted(self.off_queue.items()))}. Nothing changed; move them "
            f"to {self.limit_queue!r} first (awa_jobs move --kind {self.old_kind} --queue "
            f"QUEUE --to {self.limit_queue}), or with --force they are rekinded where they "
            "are and run there outside the limit"
        )

    def split_refusal(self) -> str:
        shown = "; ".join(
            f"job {i} ({state}, sequence key {key!r})" for i, state, key in self.split_shown
        )
        more = (
            f"; and {self.split - len(self.split_shown):,} more" if self.split > UNFIT_SHOWN else ""
        )
        return (
            f"rekind: the rekinded jobs would take the sequence key of kind {self.new_kind!r} "
            f"(its sequence=), and could then start before {self.split:,} job(s) of their "
            f"old or new key finish, out of their one-at-a-time order: {shown}{more}. "
            "Nothing changed; rekind again once those are finished (or name their queue "
            "too), or with --force the jobs are rekinded all the same"
        )


def off_queue_text(off_queue: Sequence[tuple[str, int]]) -> str:
    """``Rekinded.off_queue`` for a message: queue(s) 'a' (3 jobs), 'b' (1 job)."""
    return "queue(s) " + ", ".join(f"{queue!r} ({jobs:,} job(s))" for queue, jobs in off_queue)


def parse_operation(name: str) -> Operation:
    try:
        return Operation(name)
    except ValueError:
        names = ", ".join(op.value for op in Operation)
        raise ValidationError(f"unknown bulk operation {name!r}; operations: {names}") from None


def check_arguments(
    operation: Operation, *, queue: str | None = None, priority: int | None = None
) -> None:
    """Raise ``ValidationError`` naming a missing or bad ``queue``/``priority``."""
    if operation == Operation.MOVE:
        if not isinstance(queue, str) or not QUEUE_NAME_RE.match(queue):
            raise ValidationError(
                f"move: the target queue must be 1-128 letters, digits or _.:-, got {queue!r}"
            )
    if operation == Operation.PRIORITY:
        check_priority(priority, "priority")


def pinned_kinds(queue: str) -> dict[str, str]:
    """The kinds whose ``awa.Limit`` holds on another queue than ``queue``, with that
    queue: a job of one moved to ``queue`` would run there beside its limit."""
    return {
        kind: spec.queue
        for kind, spec in registry.workers.items()
        if spec.limit is not None and spec.queue != queue
    }


def check_move(jobs: QuerySet[Job], queue: str) -> None:
    """Raise ``ValidationError`` if ``jobs`` (those a move would take) hold jobs of a
    kind whose ``awa.Limit`` holds on another queue than ``queue``, as enqueue does."""
    pinned = pinned_kinds(queue)
    if not pinned:
        return
    found = dict(
        jobs.filter(kind__in=list(pinned))
        .order_by("kind")
        .values("kind")
        .annotate(n=Count("id"))
        .values_list("kind", "n")
    )
    if found:
        kinds = ", ".join(
            f"{kind!r} ({n:,} job(s); its queue {pinned[kind]!r})" for kind, n in found.items()
        )
        raise ValidationError(
            f"move: kind(s) {kinds} have an awa.Limit, which holds on the kind's queue, so "
            f"enqueue refuses their jobs on any other; moved to {queue!r} they would run "
            f"beside their limit. Nothing changed; leave those kinds out of the jobs to move"
        )


def targets(queryset: QuerySet[Job], operation: Operation) -> QuerySet[Job]:
    """The jobs of ``queryset`` the operation applies to."""
    return queryset.filter(state__in=list(ALLOWED[operation]))


def preview(queryset: QuerySet[Job], operation: Operation) -> Preview:
    """Count the jobs ``run`` would touch now (one read, no lock)."""
    found = targets(queryset, operation).order_by().aggregate(up_to=Max("id"))
    up_to = found["up_to"]
    count = 0 if up_to is None else targets(queryset, operation).filter(id__lte=up_to).count()
    return Preview(operation=operation, count=count, up_to=up_to)


def run(
    queryset: QuerySet[Job],
    operation: Operation,
    *,
    up_to: int | None,
    queue: str | None = None,
    priority: int | None = None,
    reason: str = "",
    batch_size: int = BATCH_SIZE,
    on_batch: Callable[[Result], None] | None = None,
) -> Result:
    """Apply ``operation`` to every job of ``queryset`` in its allowed states with
    ``id <= up_to`` (``Preview.up_to``; None: nothing), a batch per transaction.

    Not for use inside a transaction: each batch commits on its own, so a
    long run never holds locks from its first batch to its last. Raises
    ``ValidationError`` for a bad ``queue``/``priority`` before any write.
    """
    check_arguments(operation, queue=queue, priority=priority)
    if batch_size < 1:
        raise ValidationError(f"batch_size must be at least 1, got {batch_size!r}")
    alias = queryset.db
    result = Result(operation=operation)
    if up_to is None:
        return result
    if operation == Operation.MOVE:
        check_move(targets(queryset, operation).filter(id__lte=up_to), str(queue))
    apply = _BATCH[operation]
    ids_query = targets(queryset, operation).filter(id__lte=up_to)
    # A cancel goes from the newest job back: a job's dependents are newer than
    # it (added after it to its workflow, or enqueued after it), so each batch
    # reaches them before their dependencies, whose cancellation would
    # otherwise release a requires="finished" dependent to run before its own
    # batch came.
    newest_first = operation is Operation.CANCEL
    ids_query = ids_query.order_by("-id" if newest_first else "id")
    last: int | None = None
    # Bounded: each round starts past the last id of the one before, and ids
    # stop at up_to (and at 1).
    while True:
        page = ids_query
        if last is not None:
            page = page.filter(id__lt=last) if newest_first else page.filter(id__gt=last)
        ids = list(page.values_list("id", flat=True)[:batch_size])
        if not ids:
            break
        last = ids[-1]
        started = time.monotonic()
        apply(ids, alias, result, _Args(queue=queue, priority=priority, reason=reason))
        result.batch_seconds.append(time.monotonic() - started)
        if on_batch is not None:
            on_batch(result)
    logger.info(
        "bulk %s: %s job(s) %s, %s unchanged, %s failed, in %s batch(es)",
        operation,
        result.changed,
        PAST[operation],
        result.unchanged,
        len(result.failed),
        len(result.batch_seconds),
    )
    return result


@dataclass(frozen=True, slots=True, kw_only=True)
class _Args:
    queue: str | None
    priority: int | None
    reason: str


def _params(ids: Sequence[int], operation: Operation) -> dict[str, Any]:
    return {"ids": list(ids), "states": [str(s) for s in ALLOWED[operation]]}


def _retry(ids: list[int], alias: str, result: Result, args: _Args) -> None:
    params = _params(ids, Operation.RETRY)
    reopened: list[int] = []
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql.REVIVE_DONE, params)
            cursor.execute(sql.RETRY_JOBS, params)
            jobs = jobs_from_rows(cursor.fetchall(), alias)
            if jobs:
                queues = sorted({job.queue for job in jobs})
                cursor.execute(sql.NOTIFY_QUEUES, {"queues": queues})
                reopened = reopen_all([job.id for job in jobs], alias)
    except IntegrityError:
        # A job's unique key is held by another job now: the batch rolled
        # back; one at a time, only that job is refused.
        _one_by_one(
            ids,
            result,
            JobState.AVAILABLE,
            lambda i: control.retry_with_dependents(i, using=alias),
        )
        return
    result.changed += len(jobs)
    result.dependents += len(reopened)
    result.unchanged += len(ids) - len(jobs)


def _cancel(ids: list[int], alias: str, result: Result, args: _Args) -> None:
    context = Cancelled.given(args.reason)
    params = {
        **_params(ids, Operation.CANCEL),
        "error": context.error_entry,
        "stale_after": awa_settings().stale_after,  # a running handler keeps its key's place
    }
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql.CANCEL_JOBS, params)
            rows = cursor.fetchall()
            jobs = jobs_from_rows([row[1:] for row in rows], alias)
            for (previous, *_), job in zip(rows, jobs, strict=True):
                if previous == JobState.RUNNING:
                    cursor.execute(sql.NOTIFY_CANCEL, {"job_id": str(job.id)})
            for job in jobs:
                dispatch(job, context, alias)
                send_signal(job, context, alias)
            cascaded = after_outcomes(jobs, alias)
    except (FollowupError, IntegrityError):
        # One job's on_cancelled follow-up failed: the batch rolled back; one
        # at a time, only that job stays as it was and is reported.
        _one_by_one(
            ids,
            result,
            JobState.CANCELLED,
            lambda i: control.cancel_with_dependents(i, args.reason, using=alias),
        )
        return
    result.changed += len(jobs)
    result.dependents += len(cascaded)
    result.unchanged += len(ids) - len(jobs)


def _discard(ids: list[int], alias: str, result: Result, args: _Args) -> None:
    params = _params(ids, Operation.DISCARD)
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        # The deletion rule of workflows, as JobQuerySet.delete keeps it: the
        # discarded jobs' dependents are settled in this batch's transaction.
        dependents = deleting(ids, alias)
        cursor.execute(sql.DISCARD_JOBS, params)
        deleted = cursor.fetchone()[0]
        # A finished row maintenance moved into awa_job_done while the DELETE
        # waited for it was not visible to that statement: the next one sees it.
        cursor.execute(sql.DISCARD_JOBS, params)
        deleted += cursor.fetchone()[0]
        cascaded = settle(dependents, alias)
    result.changed += deleted
    result.dependents += len(cascaded)
    result.unchanged += len(ids) - deleted


def _move(ids: list[int], alias: str, result: Result, args: _Args) -> None:
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        params = {**_params(ids, Operation.MOVE), "queue": args.queue,
                  "pinned": list(pinned_kinds(str(args.queue)))}  # fmt: skip
        cursor.execute(sql.MOVE_JOBS, params)
        moved = cursor.rowcount
        if moved:
            cursor.execute(sql.NOTIFY_QUEUES, {"queues": [args.queue]})
    result.changed += moved
    result.unchanged += len(ids) - moved


def _prioritize(ids: list[int], alias: str, result: Result, args: _Args) -> None:
    params = {**_params(ids, Operation.PRIORITY), "priority": args.priority}
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(sql.PRIORITIZE_JOBS, params)
        changed = cursor.rowcount
    result.changed += changed
    result.unchanged += len(ids) - changed


def _one_by_one(
    ids: list[int],
    result: Result,
    done_state: str,
    apply: Callable[[int], tuple[Job, list[int]]],
) -> None:
    """Apply to each job in a transaction of its own: (the job's row, the ids of the
    dependents it moved too)."""
    for job_id in ids:
        try:
            job, dependents = apply(job_id)
        # One job's follow-up function (user code, any exception) or unique
        # key refusing it does not stop the rest; its transaction rolled back.
        except Exception as exc:  # noqa: BLE001
            logger.warning("bulk operation on job %s failed: %s job_id=%s", job_id, exc, job_id)
            result.failed.append((job_id, Truncator(str(exc) or type(exc).__name__).chars(200)))
            continue
        result.dependents += len(dependents)
        if job.state == done_state:
            result.changed += 1
        else:
            result.unchanged += 1


_BATCH: dict[Operation, Callable[[list[int], str, Result, _Args], None]] = {
    Operation.RETRY: _retry,
    Operation.CANCEL: _cancel,
    Operation.DISCARD: _discard,
    Operation.MOVE: _move,
    Operation.PRIORITY: _prioritize,
}
