"""The job row and its companions: queues and pending follow-ups."""

from __future__ import annotations

import json
import json.scanner
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple

from django.db import models, transaction
from django.db.models import F, Q
from django.db.models.base import ModelState
from django.db.models.fields.json import KT
from django.db.models.functions import Now
from django.db.models.signals import post_init, pre_init
from django.utils import timezone

from .codec import UnreadableJSON


class JobState(models.TextChoices):
    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    RUNNING = "running"
    COMPLETED = "completed"
    RETRYABLE = "retryable"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING_EXTERNAL = "waiting_external"
    # Waiting on dependencies (SPEC §11): made available (or scheduled) in the
    # transaction that commits its last dependency's outcome, never by time.
    BLOCKED = "blocked"

    # Groups of states, each the one statement of a rule (set below the class,
    # once the members exist; sql.py builds its fragments from them too).
    # Finished: finalized_at is set, nothing runs again unless retried.
    FINAL: ClassVar[tuple[JobState, ...]]
    # Not finished: what an operator may cancel.
    LIVE: ClassVar[tuple[JobState, ...]]
    # Waiting for their run_at: maintenance makes them available when due.
    DELAYED: ClassVar[tuple[JobState, ...]]
    # Waiting to run (not running, not finished): what a move, a priority
    # change or a rekind may touch; a running attempt keeps what it was claimed with.
    WAITING: ClassVar[tuple[JobState, ...]]
    # What an operator may retry: made available now, attempts reset.
    RETRIABLE: ClassVar[tuple[JobState, ...]]
    # Where a job holds its unique key unless Unique(states=...) says otherwise.
    UNIQUE_HELD: ClassVar[tuple[JobState, ...]]


JobState.FINAL = (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)
JobState.LIVE = (
    JobState.BLOCKED,
    JobState.SCHEDULED,
    JobState.AVAILABLE,
    JobState.RUNNING,
    JobState.RETRYABLE,
    JobState.WAITING_EXTERNAL,
)
JobState.DELAYED = (JobState.SCHEDULED, JobState.RETRYABLE)
JobState.WAITING = (JobState.BLOCKED, JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE)
JobState.RETRIABLE = (JobState.FAILED, JobState.CANCELLED, JobState.RETRYABLE)
JobState.UNIQUE_HELD = (
    JobState.BLOCKED,
    JobState.SCHEDULED,
    JobState.AVAILABLE,
    JobState.RUNNING,
    JobState.RETRYABLE,
    JobState.COMPLETED,
)

# What timestamptz holds that Python can read back: years 1 to 9999 in UTC.
# PostgreSQL itself stores 4713 BC to 294276 AD, so an aware datetime at the
# edge (year 1 at UTC+14) is stored and then cannot be read.
TIMESTAMP_MIN = datetime.min.replace(tzinfo=UTC)
TIMESTAMP_MAX = datetime.max.replace(tzinfo=UTC)
# The columns a caller sets: run_at (enqueue, the ORM), callback_timeout_at
# (register_callback's timeout). Migrations 0005 and 0006 add their checks.
RANGE_CHECKED_COLUMNS = ("run_at", "callback_timeout_at")


def _in_range(column: str) -> models.CheckConstraint:
    return models.CheckConstraint(
        condition=Q(**{f"{column}__gte": TIMESTAMP_MIN, f"{column}__lte": TIMESTAMP_MAX}),
        name=f"awa_job_{column}_range",
    )


# The dead-letter view groups failed jobs by their last error's first line, cut
# at this many characters ("" for a job without error text): ERROR_LINE_SQL, in
# the words of the index awa_job_dead_letter_idx (migration 0013) and of
# sql.DEAD_LETTER_GROUPS, so the planner matches the index.
ERROR_LINE_CHARS = 200
ERROR_LINE_SQL = (
    f"left(split_part(coalesce(errors #>> '{{-1,error}}', ''), E'\\n', 1), {ERROR_LINE_CHARS})"
)


class ErrorLine(models.Func):
    """``ERROR_LINE_SQL`` as an ORM expression: a job's dead-letter group key."""

    template = ERROR_LINE_SQL.replace("errors", "%(expressions)s", 1)
    output_field = models.TextField()

    def __init__(self) -> None:
        super().__init__(F("errors"))


class JobQuerySet(models.QuerySet["Job"]):
    """The filters of the admin's job list and of ``Job.followups()``; deletion."""

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete the jobs, and settle the dependents of those others depend on.

        In one transaction (the caller's, if any): a deleted dependency that
        had not completed cancels its ``requires="completed"`` dependents and
        counts as finished for ``requires="finished"`` ones
        (``dependencies.deleting``). ``Job.delete()`` comes here too.
        """
        from .dependencies import deleting, settle

        alias = self.db
        with transaction.atomic(using=alias):
            ids = list(self.filter(has_dependents=True).values_list("id", flat=True))
            dependents = deleting(ids, alias)
            # Their own dependency edges go with them, as pruning's do.
            Dependency.objects.using(alias).filter(job_id__in=self.values("id")).delete()
            deleted = super().delete()
            settle(dependents, alias)
        return deleted

    def in_queue(self, queue: str) -> JobQuerySet:
        return self.filter(queue=queue)

    def of_kind(self, kind: str) -> JobQuerySet:
        return self.filter(kind=kind)

    def with_error(self, first_line: str) -> JobQuerySet:
        """Jobs whose last error's first line is ``first_line`` (as the dead-letter view
        groups them: cut at ``ERROR_LINE_CHARS``; ``""``: no error text). With the
        state ``failed`` and a queue and kind, read by ``awa_job_dead_letter_idx``."""
        return self.alias(error_line=ErrorLine()).filter(error_line=first_line[:ERROR_LINE_CHARS])

    def followups_of(self, job_id: int) -> JobQuerySet:
        """Jobs enqueued by follow-ups of job ``job_id`` (uses ``awa_job_trigger_idx``)."""
        return (
            self.filter(metadata__has_key="awa_trigger")
            .alias(trigger_job_id=KT("metadata__awa_trigger__job_id"))
            .filter(trigger_job_id=str(job_id))
        )


class StoredJSONField(models.JSONField):
    """A job's JSON column: a stored value Python cannot read (``UnreadableJSON``)
    comes back as that marker, not as an error that fails the whole query (a
    list of jobs in the admin, a user's ``Job.objects`` loop).

    It deconstructs as Django's ``JSONField``: the same column, no migration.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        try:
            return super().from_db_value(value, expression, connection)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is caught above
            return UnreadableJSON(value, exc)

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


class Job(models.Model):
    """One job: a row in ``awa_job``.

    Every column but ``kind``, ``queue`` and ``args`` has a default, so a row
    created with the ORM alone is a valid ``available`` job.
    """

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=255)
    queue = models.CharField(max_length=128, default="default", db_default="default")
    args = StoredJSONField(default=dict, db_default={})
    state = models.CharField(
        max_length=32,
        choices=JobState.choices,
        default=JobState.AVAILABLE,
        db_default=JobState.AVAILABLE,
    )
    priority = models.SmallIntegerField(default=2, db_default=2)
    attempt = models.SmallIntegerField(default=0, db_default=0)
    max_attempts = models.SmallIntegerField(default=25, db_default=25)
    run_lease = models.BigIntegerField(default=0, db_default=0)
    run_at = models.DateTimeField(default=timezone.now, db_default=Now())
    created_at = models.DateTimeField(default=timezone.now, db_default=Now())
    attempted_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    errors = StoredJSONField(default=list, db_default=[], blank=True)
    metadata = StoredJSONField(default=dict, db_default={}, blank=True)
    tags = StoredJSONField(default=list, db_default=[], blank=True)
    progress = StoredJSONField(null=True, blank=True)
    # Unique where set (awa_job_callback_id_uniq): a partial index, so the many
    # rows without a callback add no index entries on each write.
    callback_id = models.UUIDField(null=True, blank=True)
    callback_timeout_at = models.DateTimeField(null=True, blank=True)
    # The run after a Snooze keeps the snoozed run's attempt number.
    snoozed = models.BooleanField(default=False, db_default=False)
    # Uniqueness is enforced by a partial unique index over these two columns.
    # NULL, not "", for "no key": the partial unique index skips NULLs.
    unique_key = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    unique_states = StoredJSONField(null=True, blank=True)
    # What the handler returned (SPEC §11), written with the completion.
    result = StoredJSONField(null=True, blank=True)
    # The workflow whose steps this job is one of (SPEC §11); null for most jobs.
    workflow_id = models.UUIDField(null=True, blank=True)
    # Set (never cleared) when a job is named in another's ``after``: an
    # outcome written for a job without it looks for no dependents, so plain
    # jobs pay nothing for workflows. Set by an UPDATE of the dependency's row
    # at enqueue, so an outcome written concurrently sees it (its guarded
    # UPDATE waits for that row and reads the latest version).
    has_dependents = models.BooleanField(default=False, db_default=False)

    objects = JobQuerySet.as_manager()

    class Meta:
        db_table = "awa_job"
        ordering = ("-id",)
        # save() of a finished row in awa_job_done made live (state changed):
        # its BEFORE UPDATE trigger moves the row into awa_job and skips the
        # update there, so the UPDATE counts 0 rows; Django then checks the row
        # exists rather than INSERT it a second time.
        select_on_save = True
        indexes = [
            # The claim: an index scan in (priority, run_at, id) order over the
            # available rows of one queue, however many finished rows the table holds.
            models.Index(
                fields=["queue", "priority", "run_at", "id"],
                name="awa_job_claim_idx",
                condition=Q(state=JobState.AVAILABLE),
            ),
            # Promotion of due scheduled and retryable jobs.
            models.Index(
                fields=["run_at"],
                name="awa_job_due_idx",
                condition=Q(state__in=JobState.DELAYED),
            ),
            # Rescue of stale heartbeats and of passed deadlines: the running
            # rows are few (the fleet's concurrency at most), so both searches
            # read them through this one index (migration 0017).
            models.Index(
                fields=["heartbeat_at"],
                name="awa_job_running_idx",
                condition=Q(state=JobState.RUNNING),
            ),
            models.Index(
                fields=["callback_timeout_at"],
                name="awa_job_callback_idx",
                condition=Q(state=JobState.WAITING_EXTERNAL),
            ),
            # Pruning finished rows past retention.
            models.Index(
                fields=["state", "finalized_at"],
                name="awa_job_finalized_idx",
                condition=Q(state__in=JobState.FINAL),
            ),
            # A workflow's jobs (workflow_status, the admin's graph).
            models.Index(
                fields=["workflow_id"],
                name="awa_job_workflow_idx",
                condition=Q(workflow_id__isnull=False),
            ),
            # Lineage: follow-ups of a trigger.
            models.Index(
                KT("metadata__awa_trigger__job_id"),
                name="awa_job_trigger_idx",
                condition=Q(metadata__has_key="awa_trigger"),
            ),
            # Sequences: awa_job_sequence_idx, built CONCURRENTLY by migration 0009.
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=1, priority__lte=4), name="awa_job_priority_range"
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1, max_attempts__lte=1000),
                name="awa_job_max_attempts_range",
            ),
            models.CheckConstraint(
                condition=Q(state__in=JobState.values), name="awa_job_state_valid"
            ),
            models.UniqueConstraint(
                fields=["callback_id"],
                condition=Q(callback_id__isnull=False),
                name="awa_job_callback_id_uniq",
            ),
            *(_in_range(column) for column in RANGE_CHECKED_COLUMNS),
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.id} ({self.state})"

    def delete(
        self, using: str | None = None, keep_parents: bool = False
    ) -> tuple[int, dict[str, int]]:
        """Delete this job as ``JobQuerySet.delete`` does: its dependents are settled."""
        alias = using or self._state.db or "default"
        return Job.objects.using(alias).filter(id=self.id).delete()

    # Django 5.2's takes no returning_fields and returns a bool: *more and Any
    # fit both.
    def _do_update(
        self,
        base_qs: models.QuerySet[Job],
        using: str | None,
        pk_val: Any,
        values: Any,
        update_fields: Any,
        forced_update: bool,
        *more: Any,
    ) -> Any:
        """Django's UPDATE for ``save()``; a row the trigger moved counts as updated.

        A finished row in ``awa_job_done`` (or a segment) made live is moved
        into ``awa_job`` with the change by its BEFORE UPDATE trigger, which
        skips the update in its own table: the UPDATE counts 0 rows. Without
        ``update_fields`` ``select_on_save`` then finds the row; with them
        Django would raise ``NotUpdated`` for a change that was made.
        """
        updated = super()._do_update(
            base_qs, using, pk_val, values, update_fields, forced_update, *more
        )
        if updated or not forced_update or not values:
            return updated
        if not base_qs.filter(pk=pk_val).exists():
            return updated  # gone: Django raises, as for any model
        # What Django's select_on_save answers for a row found: updated, no
        # values returned (Django 6), or True (Django 5.2).
        return [()] if isinstance(updated, list) else True

    @property
    def trigger_id(self) -> int | None:
        trigger = (self.metadata or {}).get("awa_trigger")
        job_id = trigger.get("job_id") if isinstance(trigger, dict) else None
        return job_id if isinstance(job_id, int) else None

    def trigger(self) -> Job | None:
        """The job whose outcome enqueued this one, if it still exists."""
        trigger_id = self.trigger_id
        if trigger_id is None:
            return None
        return Job.objects.using(self._state.db).filter(id=trigger_id).first()

    def followups(self) -> JobQuerySet:
        """Jobs enqueued by this job's follow-ups, oldest first.

        Ordered by ``id + 0``, not ``id``: with ``ORDER BY id LIMIT n`` the
        planner walks both tables' primary keys, past every finished row, hoping
        to meet n follow-ups early; by an expression it reads the few rows
        ``awa_job_trigger_idx`` finds and sorts them.
        """
        return Job.objects.using(self._state.db).followups_of(self.id).order_by((F("id") + 0).asc())

    def dependencies(self) -> list[Job]:
        """The jobs this one depends on (each with its ``result``), in ``after`` order."""
        edges = Dependency.objects.using(self._state.db).filter(job_id=self.id)
        order = {e.depends_on_id: e.position for e in edges}
        jobs = Job.objects.using(self._state.db).filter(id__in=order)
        return sorted(jobs, key=lambda job: order[job.id])

    def dependents(self) -> list[Job]:
        """The jobs that depend on this one, by id."""
        ids = Dependency.objects.using(self._state.db).filter(depends_on_id=self.id)
        return list(
            Job.objects.using(self._state.db).filter(id__in=ids.values("job_id")).order_by("id")
        )


class Requires(models.TextChoices):
    """What a dependency must reach for its dependent to run (SPEC §11)."""

    # Completed; a failed or cancelled dependency cancels the dependent.
    COMPLETED = "completed"
    # Completed, failed or cancelled: a batch's "all done" callback.
    FINISHED = "finished"


class Dependency(models.Model):
    """An edge of a workflow: job ``job_id`` waits for job ``depends_on_id``.

    No foreign keys: a finished job moves between ``awa_job`` and its child
    ``awa_job_done``, which a foreign key cannot follow. The primary key
    ``(job_id, depends_on_id)`` serves "the dependencies of a job";
    ``awa_dependency_dependents_idx`` serves "the dependents of a job that just
    finished". Both are index scans however many edges there are.
    """

    pk = models.CompositePrimaryKey("job_id", "depends_on_id")
    job_id = models.BigIntegerField()
    depends_on_id = models.BigIntegerField()
    # The dependency's place in ``after``: Job.dependencies() keeps that order.
    position = models.IntegerField(default=0, db_default=0)
    requires = models.CharField(
        max_length=16,
        choices=Requires.choices,
        default=Requires.COMPLETED,
        db_default=Requires.COMPLETED,
    )

    class Meta:
        db_table = "awa_job_dependency"
        indexes = [
            models.Index(fields=["depends_on_id", "job_id"], name="awa_dependency_dependents_idx")
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(requires__in=Requires.values), name="awa_dependency_requires_valid"
            ),
            models.CheckConstraint(
                condition=~Q(job_id=models.F("depends_on_id")), name="awa_dependency_not_self"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} after job {self.depends_on_id} ({self.requires})"


class Queue(models.Model):
    """A queue's operator state. Queues exist without a row; a row records a pause
    or limits set at runtime."""

    name = models.CharField(max_length=128, primary_key=True)
    paused = models.BooleanField(default=False, db_default=False)
    paused_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now, db_default=Now())
    # Limits set by awa.set_queue_limits() or the admin, winning over AWA["QUEUES"]:
    # a key present overrides the setting (null: no limit), a key absent leaves it.
    # {"global_concurrency": N | null, "rate_limit": "N/s" | null,
    #  "rate_count": N, "rate_period": seconds} (the rate as the claim reads it).
    limits = models.JSONField(default=dict, db_default={}, blank=True)

    class Meta:
        db_table = "awa_queue"
        ordering = ("name",)

    def __str__(self) -> str:
        return f"{self.name}{' (paused)' if self.paused else ''}"


class AttemptStart(models.Model):
    """When attempts of a limited queue or rate-limited kind started: the sliding
    window rate limits count (SPEC 12). Insert-only, written by the limited claim
    in its own statement; maintenance deletes rows older than the longest window.

    ``scope`` is ``"q:<queue>"`` or ``"k:<kind>"``; ``key`` the ``Limit(by=)``
    values of a kind's start (JSON text), ``""`` otherwise.
    """

    id = models.BigAutoField(primary_key=True)
    scope = models.CharField(max_length=300)
    key = models.TextField(default="", db_default="", blank=True)
    started_at = models.DateTimeField()

    class Meta:
        db_table = "awa_attempt_start"
        indexes = [models.Index(fields=["scope", "started_at"], name="awa_start_window_idx")]

    def __str__(self) -> str:
        return f"{self.scope} {self.key} {self.started_at}"


class QueueSlot(models.Model):
    """A place of a ``global_concurrency`` queue leased by one worker process (SPEC 12).

    Slot numbers run from 1 to the queue's ``global_concurrency``; the unique
    ``(queue, slot)`` is what keeps the fleet to N places. A worker runs at most
    as many handlers of the queue as it holds slots (``slots.py``). A lease lasts
    while its worker's row in ``awa_worker`` is live: a worker that stopped deletes
    its slots, one that died stops renewing that row and its slots are taken over
    once it is ``STALE_AFTER`` old, when its attempts are rescued.
    """

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=255)
    slot = models.IntegerField()
    worker_id = models.UUIDField()
    taken_at = models.DateTimeField(default=timezone.now, db_default=Now())

    class Meta:
        db_table = "awa_queue_slot"
        constraints = [
            models.UniqueConstraint(fields=["queue", "slot"], name="awa_queue_slot_unique")
        ]
        indexes = [models.Index(fields=["worker_id"], name="awa_queue_slot_worker_idx")]

    def __str__(self) -> str:
        return f"{self.queue} #{self.slot} ({self.worker_id})"


class LimitLease(models.Model):
    """A place of one ``awa.Limit(concurrency=...)`` key held by a running attempt (SPEC 12).

    Slot numbers run from 1 to the kind's concurrency; the unique ``(kind, key,
    slot)`` is what keeps a key to that many runs at once when claimers of
    different workers claim at the same instant (``sql.CLAIM_KEYED``). The row
    names the attempt holding it (``job_id``, ``run_lease``); it is deleted in
    the transaction that takes the attempt out of ``running``, and a lease whose
    attempt is no longer running (a write that left it, a job deleted) is stale:
    the next claim of its slot takes it over. Except while ``held_until`` is
    ahead: a cancel or a rescue took the attempt out of ``running`` while its
    handler still ran in a live worker, which renews it until the handler returns.
    """

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=255)
    key = models.TextField()  # the Limit(by=) values as JSON text, '' without by
    slot = models.IntegerField()
    job_id = models.BigIntegerField()
    run_lease = models.BigIntegerField()
    taken_at = models.DateTimeField(default=timezone.now, db_default=Now())
    held_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "awa_limit_lease"
        constraints = [
            models.UniqueConstraint(fields=["kind", "key", "slot"], name="awa_limit_lease_unique")
        ]
        indexes = [models.Index(fields=["job_id"], name="awa_limit_lease_job_idx")]

    def __str__(self) -> str:
        return f"{self.kind} {self.key} #{self.slot} (job {self.job_id})"


class PendingFollowup(models.Model):
    """A committed outcome whose follow-ups are not inserted yet.

    Written in the same transaction as a rescue (or a fallback transition whose
    own follow-ups failed), deleted in the transaction that inserts the
    follow-ups; maintenance retries it with backoff until then.
    """

    id = models.BigAutoField(primary_key=True)
    job_id = models.BigIntegerField()
    kind = models.CharField(max_length=255)
    outcome = models.CharField(max_length=32)
    context = models.JSONField(default=dict)
    # The trigger's row as it stood after the transition.
    snapshot = models.JSONField()
    attempts = models.IntegerField(default=0, db_default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now, db_default=Now())
    last_error = models.TextField(blank=True, default="", db_default="")
    created_at = models.DateTimeField(default=timezone.now, db_default=Now())

    class Meta:
        db_table = "awa_pending_followup"
        ordering = ("next_attempt_at", "id")
        verbose_name = "pending follow-up"
        verbose_name_plural = "pending follow-ups"
        indexes = [models.Index(fields=["next_attempt_at"], name="awa_pending_due_idx")]

    def __str__(self) -> str:
        return f"{self.outcome} follow-ups of {self.kind} #{self.job_id}"


_JOB_FIELDS = Job._meta.concrete_fields
# The columns of a row for jobs_from_rows, in sql.JOB_COLUMNS order.
JOB_ATTNAMES = [f.attname for f in _JOB_FIELDS]
_JSON_FIELDS = frozenset(i for i, f in enumerate(_JOB_FIELDS) if isinstance(f, models.JSONField))


# json's C scanner, called directly: json.loads wraps it in three Python calls
# and two whitespace matches, which cost more than the parse of a small object.
# (typeshed types make_scanner as the class it may fall back to, not as a
# function of a decoder.)
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def load_json(text: str) -> Any:
    """Parse JSON text: the empty list and object (the common case) without the parser.

    The text PostgreSQL gives for jsonb is one value with no surrounding
    space; anything else (or anything invalid) goes through ``json.loads``,
    which accepts the same and raises its own error.
    """
    if text == "[]":
        return []
    if text == "{}":
        return {}
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def jobs_from_rows(
    rows: Iterable[Sequence[Any]], using: str, *, json_text: bool = True
) -> list[Job]:
    """``Job`` instances read on connection ``using``, from rows holding every column
    in ``sql.JOB_COLUMNS`` order: the one way a ``Job`` is built from stored values
    (a statement's rows, enqueue's new row, a pending follow-up's snapshot).

    With ``json_text``, a JSON column given as text is parsed here, as Django
    reads jsonb as text and the Job's JSON fields use no custom decoder
    (empty lists and objects, the common case, without the parser) rather
    than through each field's from_db_value; without it, every JSON column
    holds its value already.
    """
    if json_text:
        rows = [_json_parsed(values) for values in rows]
    if _plain_init():
        return [_job(zip(JOB_ATTNAMES, row, strict=True), using) for row in rows]
    return [Job.from_db(using, JOB_ATTNAMES, row) for row in rows]


class ClaimedJob(NamedTuple):
    """A claimed row as the worker carries it: the ``Job``'s column values, by field.

    Every claimed row is one of these rather than a ``Job``: the producer,
    the handler threads and the completer read a few of its values (id,
    run_lease, kind, queue, args, metadata) and nothing else, and building a
    model instance for each row, then freeing it once its outcome was written,
    cost a no-op job 15% of the worker's instructions
    (``benchmarks/instructions.py``, README).
    A handler that asks for the row (``JobContext.row``) gets a ``Job``, built
    then (``instance``). Its JSON columns hold their parsed values, as a
    ``Job``'s do. Its fields are ``JOB_ATTNAMES``, in order.
    """

    id: int
    kind: str
    queue: str
    args: Any
    state: str
    priority: int
    attempt: int
    max_attempts: int
    run_lease: int
    run_at: datetime
    created_at: datetime
    attempted_at: datetime | None
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    finalized_at: datetime | None
    errors: list[Any]
    metadata: dict[str, Any]
    tags: list[Any]
    progress: Any
    callback_id: uuid.UUID | None
    callback_timeout_at: datetime | None
    snoozed: bool
    unique_key: str | None
    unique_states: list[str] | None
    result: Any
    workflow_id: uuid.UUID | None
    has_dependents: bool

    # Compared and hashed as a Job is, by its id, not by its values (a tuple's
    # way: args may hold a dict, which has no hash).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClaimedJob) and other.id == self.id

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.id)

    def instance(self, using: str) -> Job:
        """This row as a ``Job`` read on connection ``using``."""
        (job,) = jobs_from_rows((self,), using, json_text=False)
        return job


# What the worker carries for an attempt: a claimed row, or a Job (a job run
# in-process by django_awa.testing.perform_job, or built by hand in a test).
type JobRow = Job | ClaimedJob


def claimed_jobs(rows: Iterable[Sequence[Any]]) -> list[ClaimedJob]:
    """Rows a claim started (every column in ``sql.JOB_COLUMNS`` order, JSON as
    text) as ``ClaimedJob``, in the order given."""
    return [ClaimedJob._make(_json_parsed(values)) for values in rows]


def _json_parsed(values: Sequence[Any]) -> list[Any]:
    """A row's values with its JSON columns given as text parsed (Django reads jsonb
    as text, and the Job's JSON fields use no custom decoder). A value Python
    cannot read is an ``UnreadableJSON``: the rows read with it are not lost."""
    converted = list(values)
    for i in _JSON_FIELDS:
        text = converted[i]
        if isinstance(text, str):
            try:
                converted[i] = load_json(text)
            except (ValueError, RecursionError) as exc:
                converted[i] = UnreadableJSON(text, exc)
    return converted


def _plain_init() -> bool:
    """Whether a ``Job`` may be built without ``Model.__init__``: no init signal receivers."""
    return not (pre_init.has_listeners(Job) or post_init.has_listeners(Job))


def _job(values: Iterable[tuple[str, Any]], using: str) -> Job:
    """A ``Job`` built as unpickling builds one, from ``(attname, value)`` for every column.

    A ``Job`` is built for every row a statement returns (an outcome's, a
    rescue's, a handler's ``job.row``), and ``Model.__init__`` (a ``setattr``
    per field, between two signals) was most of that Python time. Only for
    ``Job`` without ``pre_init``/``post_init`` receivers (``_plain_init``): the
    values go straight into ``__dict__``, with a ``ModelState`` saying where
    the row was read.
    """
    job = Job.__new__(Job)
    job.__dict__.update(values)
    state = job._state = ModelState()
    state.adding = False
    state.db = using
    return job


class PeriodicSchedule(models.Model):
    """A periodic job's firing record: the last fire enqueued."""

    name = models.CharField(max_length=255, primary_key=True)
    cron = models.CharField(max_length=255)
    timezone = models.CharField(max_length=64, default="UTC", db_default="UTC")
    kind = models.CharField(max_length=255)
    last_fire_at = models.DateTimeField(null=True, blank=True)
    next_fire_at = models.DateTimeField(null=True, blank=True)
    paused = models.BooleanField(default=False, db_default=False)

    class Meta:
        db_table = "awa_periodic"
        ordering = ("name",)

    def __str__(self) -> str:
        return f"{self.name} ({self.cron})"


class MaintenanceLease(models.Model):
    """Who runs maintenance, until when: the leader renews it with every write.

    A worker takes the lease when it has run out, which bumps ``term``; the
    leader's writes each check ``(holder, term)`` in their own transaction
    (``sql.RENEW_LEASE``), so a leader that stopped (frozen, cut off) and
    comes back after another took over does nothing more.
    """

    name = models.CharField(max_length=64, primary_key=True)
    holder = models.CharField(max_length=255, default="", db_default="")
    term = models.BigIntegerField(default=0, db_default=0)
    lease_until = models.DateTimeField()
    acquired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "awa_lease"

    def __str__(self) -> str:
        return f"{self.name}: {self.holder or 'nobody'} (term {self.term})"


class CallbackReceipt(models.Model):
    """A signature the callback receiver accepted: a replay of it is refused.

    Written in the transaction that resolves the callback, so a request that
    failed (503) may be sent again as it was.
    """

    signature = models.CharField(max_length=64, primary_key=True)
    received_at = models.DateTimeField(default=timezone.now, db_default=Now())

    class Meta:
        db_table = "awa_callback_receipt"
        indexes = [models.Index(fields=["received_at"], name="awa_receipt_received_idx")]

    def __str__(self) -> str:
        return self.signature


class Worker(models.Model):
    """A live worker process, as it last said (``fleet.py``): registered at start,
    renewed with each heartbeat, deleted when it stops.

    A worker that died without stopping (SIGKILL, a lost host) stops renewing
    its row: it is no longer listed once ``last_seen_at`` is ``STALE_AFTER``
    old, and the maintenance leader deletes it.
    """

    id = models.UUIDField(primary_key=True)
    name = models.CharField(max_length=255)  # host:pid, as in its logs and the lease
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    queues = models.JSONField(default=dict)  # {name: concurrency}
    concurrency = models.IntegerField(default=0)
    version = models.CharField(max_length=64, blank=True, default="")
    started_at = models.DateTimeField(default=timezone.now, db_default=Now())
    last_seen_at = models.DateTimeField(default=timezone.now, db_default=Now())
    # Ids of the jobs whose handlers run there now (as of last_seen_at).
    running_ids = models.JSONField(default=list, blank=True)
    running = models.IntegerField(default=0)
    # When this worker, as the maintenance leader, last ran a maintenance tick.
    maintained_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "awa_worker"
        ordering = ("host", "pid")

    def __str__(self) -> str:
        return self.name


class JobCount(models.Model):
    """Jobs per queue and state in ``awa_job`` (live jobs, and finished ones not yet
    moved to ``awa_job_done``), counted by the maintenance leader; what
    ``/metrics`` reports without counting per scrape."""

    queue = models.CharField(max_length=128)
    state = models.CharField(max_length=32)
    count = models.BigIntegerField()
    # The oldest run_at of the queue's available jobs (state available only).
    oldest_run_at = models.DateTimeField(null=True, blank=True)
    counted_at = models.DateTimeField()

    class Meta:
        db_table = "awa_job_count"
        constraints = [
            models.UniqueConstraint(fields=["queue", "state"], name="awa_job_count_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.queue}/{self.state}: {self.count}"


class StatDelta(models.Model):
    """Outcomes one worker counted since its last heartbeat (``dashboard.Tally``).

    Insert-only: each heartbeat adds rows of its own (one per queue with
    news), the maintenance leader takes them all and folds them into
    ``StatMinute``. No row is shared between workers, so no finalize waits
    on another's counter.
    """

    id = models.BigAutoField(primary_key=True)
    worker = models.CharField(max_length=300)
    queue = models.CharField(max_length=128)
    minute = models.DateTimeField()  # the database clock's minute of the flush
    completed = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    retried = models.BigIntegerField(default=0)
    # Attempts started, counted per wait bucket (dashboard.WAIT_BOUNDS).
    wait = models.JSONField(default=list)

    class Meta:
        db_table = "awa_stat_delta"

    def __str__(self) -> str:
        return f"{self.worker} {self.queue} {self.minute:%H:%M}"


class StatMinute(models.Model):
    """One queue's outcomes in one minute, written by the maintenance leader only.

    What the admin dashboard draws. Kept for a day and an hour
    (``dashboard.KEEP_SECONDS``), pruned by maintenance: at most one row per
    queue and minute.
    """

    queue = models.CharField(max_length=128)
    minute = models.DateTimeField()
    completed = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    retried = models.BigIntegerField(default=0)
    wait = models.JSONField(default=list)
    # Seconds the queue's oldest available job had been due, the most seen in
    # this minute by the leader's count (None: none was due).
    oldest_due = models.FloatField(null=True, blank=True)

    class Meta:
        db_table = "awa_stat_minute"
        constraints = [
            models.UniqueConstraint(fields=["minute", "queue"], name="awa_stat_minute_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.queue} {self.minute:%Y-%m-%d %H:%M}"


class Dashboard(Job):
    """The admin's live dashboard (``dashboard.py``): a proxy of ``Job`` only so the
    admin lists it; it has no rows of its own."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"


class DeadLetter(Job):
    """Failed jobs (attempts exhausted), as the admin's dead-letter view groups them."""

    class Meta:
        proxy = True
        verbose_name = "dead letter (failed job)"
        verbose_name_plural = "dead letters (failed jobs)"
