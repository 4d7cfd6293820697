"""Dependencies: blocked jobs, their promotion and the cancellation cascade (SPEC §11).

A job enqueued with ``after`` is inserted ``blocked``, with one
``awa_job_dependency`` row per dependency, and the dependencies' rows are
flagged ``has_dependents``. Every path that gives such a job an outcome
(finalize, callback resolution, rescue, ``awa.cancel``, ``awa.retry``, the
admin) calls ``after_outcomes`` in the same transaction: the dependents whose
dependencies all reached what they require become ``available`` (or
``scheduled``), those with a failed or cancelled ``requires="completed"``
dependency are cancelled with their own ``on_cancelled`` follow-ups, and the
cancellation cascades. ``sql.py`` (*Dependencies and workflows*) says how two
transactions finishing the last dependencies at once promote exactly once.

A follow-up enqueued with ``after`` goes through here too (``insert`` in
``enqueueing.py`` hands such jobs over), which is how a follow-up of a
workflow's step joins the workflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

from django.db import DatabaseError, transaction

from . import db, sql, wakeups
from .compat import savepoint_create
from .conf import not_kept_note
from .enqueueing import Inserted, PreparedJob, unique_conflict
from .exceptions import ValidationError
from .followups import Cancelled, FollowupError, Outcome, dispatch, followup_registry, send_signal
from .models import Job, JobState, jobs_from_rows
from .otel import instrumentation
from .pending import keep_pending

logger = logging.getLogger(__name__)

# A cascade goes one level of dependents per round: a bound far above any
# real graph's depth, so a corrupt edge table cannot loop for ever.
MAX_ROUNDS = 100_000


def enqueue_with_dependencies(prepared: PreparedJob, alias: str) -> Job:
    """``awa.enqueue(..., after=...)``: insert one job with dependencies, settle it,
    return its row."""
    inserted = insert_with_dependencies([prepared], alias, ids=True)
    if inserted.skipped:
        raise unique_conflict(prepared, alias)
    return Job.objects.using(alias).get(id=inserted.ids[0])


def insert_with_dependencies(
    prepared: Sequence[PreparedJob],
    alias: str,
    *,
    ids: bool = True,
    where: Callable[[int], str] | None = None,
) -> Inserted:
    """Insert jobs some of which have dependencies, in the caller's transaction.

    ``after`` of each names existing job ids or, for a Workflow's steps, the
    ``id`` drawn beforehand for another new job. Raises ``ValidationError``
    naming an unknown dependency, with nothing written, after ``where`` of the
    position of the first job naming it (``"enqueue_many item 3: "``), if
    given. Returns the ids (in input order, unique duplicates skipped) and the
    skipped positions.
    """
    with transaction.atomic(using=alias), db.cursor(alias) as cursor:
        missing = [p for p in prepared if p.id is None]
        if missing:
            cursor.execute(sql.RESERVE_IDS, {"n": len(missing)})
            for p, (drawn,) in zip(missing, cursor.fetchall(), strict=True):
                p.id = drawn
        mine = {p.id for p in prepared}
        existing = sorted({i for p in prepared for i in p.after if i not in mine})
        found = _flag_existing(cursor, existing)
        # An id drawn just now named no job when the caller wrote `after`: the
        # caller's id for an unknown job (one of another database, say), not
        # the new job it happens to equal.
        drawn_here = {p.id for p in missing}
        unknown = sorted(
            {i for i in existing if i not in found}
            | {i for p in missing for i in p.after if i in drawn_here}
        )
        if unknown:
            position = next(n for n, p in enumerate(prepared) if unknown[0] in p.after)
            raise ValidationError(
                (where(position) if where is not None else "")
                + f"after names job id {unknown[0]}, which does not exist"
                + (f" (nor do {', '.join(map(str, unknown[1:]))})" if len(unknown) > 1 else "")
                + not_kept_note()
            )
        depended_on = {i for p in prepared for i in p.after}
        for p in prepared:
            p.has_dependents = p.id in depended_on
            if p.workflow_id is None:
                # A job made to wait for a workflow's job joins that workflow
                # (a follow-up of a step given after=[job], say).
                p.workflow_id = next((found[i] for i in p.after if found.get(i) is not None), None)
        columns = db.as_columns([p.params() for p in prepared])
        cursor.execute(
            sql.INSERT_STEPS,
            {
                "id": [p.id for p in prepared],
                **columns,
                "blocked": [bool(p.after) for p in prepared],
                "workflow_id": [p.workflow_id for p in prepared],
                "has_dependents": [p.has_dependents for p in prepared],
            },
        )
        rows = cursor.fetchall()
        inserted = {row[0] for row in rows}
        queues = {row[2] for row in rows if row[1] == JobState.AVAILABLE}
        edges = [
            (p.id, dep, position, p.requires)
            for p in prepared
            if p.id in inserted
            for position, dep in enumerate(p.after)
            if dep in inserted or dep not in mine
        ]
        if edges:
            cursor.execute(
                sql.INSERT_EDGES,
                {
                    "job_id": [e[0] for e in edges],
                    "depends_on_id": [e[1] for e in edges],
                    "position": [e[2] for e in edges],
                    "requires": [e[3] for e in edges],
                },
            )
        wakeups.announce(alias, queues, cursor)
        new_ids = [p.id for p in prepared if p.id is not None]
        settle(
            [i for p, i in zip(prepared, new_ids, strict=True) if p.after and i in inserted], alias
        )
    skipped = [n for n, i in enumerate(new_ids) if i not in inserted]
    return Inserted([i for i in new_ids if i in inserted] if ids else [], skipped)


def _flag_existing(cursor: db.Cursor, ids: list[int]) -> dict[int, uuid.UUID | None]:
    """Flag existing dependencies ``has_dependents``: ``{id: workflow_id}`` of those found."""
    if not ids:
        return {}
    cursor.execute(sql.FLAG_DEPENDENCIES, {"ids": ids})
    found = {row[0]: row[2] for row in cursor.fetchall()}
    if len(found) < len(ids):
        # A finished row moved into awa_job_done (or back, by a retry) while
        # the UPDATE waited for it: the new copy was not committed when the
        # statement began. The next statement sees it.
        cursor.execute(sql.FLAG_DEPENDENCIES, {"ids": [i for i in ids if i not in found]})
        found.update({row[0]: row[2] for row in cursor.fetchall()})
    return found


def after_outcomes(jobs: Iterable[Job], alias: str) -> list[int]:
    """Promote or cancel the dependents of jobs whose outcome this transaction wrote.

    Call it in the transaction that writes the outcomes, after writing them,
    with the rows as written (their ``state`` and ``has_dependents``; jobs
    that are not final or have no dependents are passed over). Returns the
    ids of the dependents it cancelled, the cascade's included.
    """
    finished = [j for j in jobs if j.has_dependents and j.state in JobState.FINAL]
    if not finished:
        return []
    return _settle(
        alias,
        finished=[j.id for j in finished],
        candidates=None,
        shared=False,
        completed=all(j.state == JobState.COMPLETED for j in finished),
    )


def after_attempts(outcomes: Sequence[tuple[int, str]], alias: str) -> None:
    """``after_outcomes`` for finalize: (job id, final state written) of attempts that
    were running, which lets dependents that another dependency's outcome will
    settle be locked shared (see ``_lock_to_judge``). When every one completed,
    their dependents are promoted in fewer statements (``sql.PROMOTE_MET_BY``).
    """
    if outcomes:
        _settle(
            alias,
            finished=[job_id for job_id, _ in outcomes],
            candidates=None,
            shared=True,
            completed=all(state == JobState.COMPLETED for _, state in outcomes),
        )


def settle(job_ids: Sequence[int], alias: str) -> list[int]:
    """Judge blocked jobs now (new, or retried ones): promote, cancel, or leave them blocked.

    Returns the ids of the jobs it cancelled, the cascade's included.
    """
    if not job_ids:
        return []
    return _settle(alias, finished=None, candidates=list(job_ids), shared=False, completed=False)


def _settle(
    alias: str,
    *,
    finished: list[int] | None,
    candidates: list[int] | None,
    shared: bool,
    completed: bool,
) -> list[int]:
    # No savepoint of its own: an error here is raised to the caller, whose
    # transaction (the outcome's) rolls back; a savepoint would only cost two
    # round trips per batch of outcomes.
    with (
        transaction.atomic(using=alias, savepoint=False),
        db.cursor(alias) as cursor,
        planned_by_index(cursor),
    ):
        return _settle_rounds(
            cursor,
            alias,
            finished=finished,
            candidates=candidates,
            shared=shared,
            completed=completed,
        )


@contextlib.contextmanager
def planned_by_index(cursor: db.Cursor) -> Iterator[None]:
    """Plan the block's statements by index, whatever the statistics (``sql.PLAN_BY_INDEX``).

    Use it inside the transaction (or savepoint) of the block: the settings
    are put back when the block ends normally; when it raises, the
    transaction or savepoint the caller rolls back takes them back too.
    """
    cursor.execute(sql.PLAN_BY_INDEX)
    row = cursor.fetchone()
    seqscan, jit = (row[0], row[1]) if row else ("on", "on")
    yield
    cursor.execute(sql.PLAN_AS_BEFORE, {"seqscan": seqscan, "jit": jit})


def _settle_rounds(
    cursor: db.Cursor,
    alias: str,
    *,
    finished: list[int] | None,
    candidates: list[int] | None,
    shared: bool,
    completed: bool,
) -> list[int]:
    """``_settle``'s rounds: one level of dependents each, until none is left to judge.
    Returns the ids of the jobs it cancelled.

    ``completed``: every job of ``finished`` completed (the first round only;
    the cascade's rounds are of cancelled jobs). Their dependents with no
    other dependency are promoted at once (``sql.PROMOTE_MET_BY``), and no
    dependent can be cancelled by them.
    """
    cancelled_ids: list[int] = []
    for _ in range(MAX_ROUNDS):
        if candidates is None:
            if not finished:
                return cancelled_ids
            if completed:
                cursor.execute(sql.PROMOTE_MET_BY, {"ids": finished})
                rows = cursor.fetchall()
                _promoted_now(cursor, alias, [row for row in rows if row[0] is not None], finished)
                if all(row[0] is not None for row in rows):
                    return cancelled_ids  # every dependent promoted: none left to judge
            locked = _lock_to_judge(cursor, finished, alias, shared=shared, completed=completed)
        else:
            cursor.execute(sql.LOCK_BLOCKED, {"ids": candidates})
            locked = [row[0] for row in cursor.fetchall()]
        if not locked:
            return cancelled_ids
        if completed:
            # Completed dependencies cancel nothing.
            cancelled_rows, reasons = [], []
        else:
            # A later statement than the lock: its snapshot sees every outcome
            # committed before the lock was granted.
            cursor.execute(
                sql.CANCEL_BY_DEPENDENCY,
                {"ids": locked, "finished": finished, "prefix": "cancelled: dependency "},
            )
            returned = cursor.fetchall()
            cancelled_rows = jobs_from_rows([row[3:] for row in returned], alias)
            reasons = [
                f"dependency {row[0]} ({row[1]}) {row[2]}"
                if row[1]
                else f"dependency {row[0]} {row[2]}"
                for row in returned
            ]
        cancelled = {job.id for job in cancelled_rows}
        cancelled_ids.extend(job.id for job in cancelled_rows)
        rest = [i for i in locked if i not in cancelled]
        if rest:
            cursor.execute(sql.PROMOTE_READY, {"ids": rest})
            _promoted_now(cursor, alias, cursor.fetchall(), finished)
        for job, reason in zip(cancelled_rows, reasons, strict=True):
            _cancelled(job, reason, alias)
        finished = [job.id for job in cancelled_rows if job.has_dependents]
        candidates = None
        shared = False  # cancelled here: they were blocked, not running
        completed = False
    raise RuntimeError(f"dependency cascade deeper than {MAX_ROUNDS} levels")


def _promoted_now(
    cursor: db.Cursor,
    alias: str,
    promoted: list[tuple[int, str, str]],
    finished: list[int] | None = None,
) -> None:
    """After a promoting statement: wake the queues of the jobs it made available
    (``wakeups.announce``: in a worker's transaction, its producers at the commit
    and the others by NOTIFY after it), log each; with the otel extra, link them
    to the attempts of ``finished`` (the outcomes written here) that released them."""
    wakeups.announce(alias, {q for _, state, q in promoted if state == JobState.AVAILABLE}, cursor)
    for job_id, state, _queue in promoted:
        logger.info("job %s -> %s: its dependencies are met", job_id, state)
    if promoted and finished:
        _link_triggers(cursor, [row[0] for row in promoted], finished)


def _link_triggers(cursor: db.Cursor, promoted: list[int], finished: list[int]) -> None:
    """Add to each promoted job's ``awa_trace`` a link to each of its dependencies among
    ``finished`` (SPEC §15: workflow steps link to their trigger): the attempt span
    that ran here, else the trace the dependency recorded when enqueued (its outcome
    written by a callback, ``awa.cancel``, a rescue: ``Instrumentation.trigger_links``).
    Nothing without the otel extra or a tracer provider (no span would record the
    links: not even the query), or for a dependency with neither."""
    tracing = instrumentation()
    if tracing is None or not tracing.traces():
        return
    cursor.execute(sql.TRIGGER_EDGES, {"ids": promoted, "finished": finished})
    edges = cursor.fetchall()
    stored = {
        dependency: {"traceparent": traceparent, "tracestate": tracestate}
        for _, dependency, traceparent, tracestate in edges
    }
    links = tracing.trigger_links(stored)
    per_job: dict[int, list[dict[str, str]]] = {}
    for job_id, dependency, _, _ in edges:
        if dependency in links:
            per_job.setdefault(job_id, []).append(links[dependency])
    if per_job:
        ids = sorted(per_job)
        cursor.execute(
            sql.ADD_TRACE_LINKS,
            {"ids": ids, "links": [json.dumps(per_job[i]) for i in ids]},
        )


# Rounds of sorting dependents into shared and exclusive locks before all are
# taken exclusively (always correct, only less concurrent).
SHARE_ROUNDS = 3


def _lock_to_judge(
    cursor: db.Cursor, finished: list[int], alias: str, *, shared: bool, completed: bool = False
) -> list[int]:
    """Lock the blocked dependents of ``finished``; return those to judge now.

    With ``shared`` (worker outcomes), a dependent with a dependency that is
    neither finished nor running (``sql.PENDING_OF``) is left to that
    dependency's outcome: it gets a KEY SHARE lock, which the many members of
    a fan-in finishing at once share.
    The others get FOR UPDATE and are judged here: the transaction that
    writes the last outcome waits only for the KEY SHARE holders still
    committing, and then sees every outcome. Locks are taken in id order,
    whatever their mode, so two transactions never wait on each other. A
    dependent found shared whose pending dependency finished meanwhile is
    judged after all: the round's locks are released (savepoint) and taken
    again. ``completed``: every job of ``finished`` completed, so none dooms a
    dependent (``sql.DEPENDENTS_TO_JUDGE_COMPLETED``).
    """
    if not shared:
        cursor.execute(sql.DEPENDENTS_OF, {"ids": finished})
        dependents = [row[0] for row in cursor.fetchall()]
        if not dependents:
            return []
        cursor.execute(sql.LOCK_BLOCKED, {"ids": dependents})
        return [row[0] for row in cursor.fetchall()]
    statement = sql.DEPENDENTS_TO_JUDGE_COMPLETED if completed else sql.DEPENDENTS_TO_JUDGE
    cursor.execute(statement, {"ids": finished})
    rows = cursor.fetchall()
    if not rows:
        return []
    dependents = [row[0] for row in rows]
    judged = {row[0] for row in rows if row[1] or not row[2]}
    first = True
    for _ in range(SHARE_ROUNDS):
        if first:
            first = False
        else:
            pending = _pending(cursor, [d for d in dependents if d not in judged], finished, alias)
            judged.update(d for d in dependents if d not in pending)
        sharing = {d for d in dependents if d not in judged}
        if not sharing:
            break
        savepoint = savepoint_create(using=alias)
        locked = _lock_in_order(cursor, dependents, sharing)
        # Under the locks: a pending dependency may have finished meanwhile.
        lost = sharing - set(_pending(cursor, sorted(sharing), finished, alias))
        if not lost:
            transaction.savepoint_commit(savepoint, using=alias)
            return [d for d in locked if d in judged]
        transaction.savepoint_rollback(savepoint, using=alias)
        judged.update(lost)
    cursor.execute(sql.LOCK_BLOCKED, {"ids": dependents})
    return [row[0] for row in cursor.fetchall()]


def _pending(cursor: db.Cursor, ids: list[int], finished: list[int], alias: str) -> list[int]:
    """``sql.PENDING_OF``: those of ``ids`` another dependency's outcome will settle."""
    if not ids:
        return []
    cursor.execute(sql.PENDING_OF, {"ids": ids, "mine": finished})
    return [row[0] for row in cursor.fetchall()]


def _lock_in_order(cursor: db.Cursor, ids: list[int], shared: set[int]) -> list[int]:
    """Lock ``ids`` in id order, KEY SHARE for those in ``shared``, FOR UPDATE the
    others: one statement per run of one mode. Returns those still blocked."""
    locked: list[int] = []
    run: list[int] = []
    mode = None
    for job_id in [*sorted(ids), None]:
        this = None if job_id is None else job_id in shared
        if run and (job_id is None or this != mode):
            cursor.execute(sql.SHARE_BLOCKED if mode else sql.LOCK_BLOCKED, {"ids": run})
            locked.extend(row[0] for row in cursor.fetchall())
            run = []
        if job_id is not None:
            run.append(job_id)
            mode = this
    return locked


def _cancelled(job: Job, reason: str, alias: str) -> None:
    """A job cancelled by its dependency: its ``on_cancelled`` follow-ups and signal.

    The follow-ups go in a savepoint: should they fail, the cascade still
    commits (it is part of another job's outcome) and they are kept as a
    pending follow-up that maintenance retries.
    """
    logger.info(
        "job %s kind=%s -> cancelled: %s",
        job.id, job.kind, reason,
        extra={"job_id": job.id, "kind": job.kind, "queue": job.queue},
    )  # fmt: skip
    context = Cancelled(reason=reason)
    if followup_registry.has(Outcome.CANCELLED, job.kind):
        savepoint = savepoint_create(using=alias)
        try:
            dispatch(job, context, alias)
        except (FollowupError, DatabaseError) as exc:
            transaction.savepoint_rollback(savepoint, using=alias)
            transaction.set_rollback(False, using=alias)
            kept = keep_pending(job, context, alias, str(exc))
            logger.error(
                "on_cancelled follow-ups of job %s kind=%s failed (%s); kept as pending "
                "follow-up %s",
                job.id, job.kind, exc, kept.id,
                extra={"job_id": job.id, "kind": job.kind},
            )  # fmt: skip
        else:
            transaction.savepoint_commit(savepoint, using=alias)
    send_signal(job, context, alias)


def deleting(ids: Sequence[int], alias: str) -> list[int]:
    """Before jobs ``ids`` are deleted, in the deleting transaction: get their
    dependents ready for it; return those to ``settle`` once the rows are gone.

    The rule (README, *Results and workflows*): a deleted dependency that
    completed stays met (``sql.MEET_BY_DELETION`` removes the edges to it, for
    dependents in any state: a retry makes one wait for its dependencies again);
    any other counts as cancelled for ``requires="completed"`` dependents
    (they are cancelled, with their ``on_cancelled`` follow-ups, and the
    cascade goes on) and as finished for ``requires="finished"`` ones.
    Locks the deleted jobs, then their blocked dependents, as an outcome does.
    """
    if not ids:
        return []
    with db.cursor(alias) as cursor, planned_by_index(cursor):
        cursor.execute(sql.DELETING_DEPENDENCIES, {"ids": sorted(ids)})
        rows = cursor.fetchall()
        if not rows:
            return []
        cursor.execute(sql.DEPENDENTS_OF, {"ids": [row[0] for row in rows]})
        dependents = [row[0] for row in cursor.fetchall()]
        if dependents:
            cursor.execute(sql.LOCK_BLOCKED, {"ids": dependents})
            dependents = [row[0] for row in cursor.fetchall()]
        completed = [job_id for job_id, state in rows if state == JobState.COMPLETED]
        if completed:
            # Those not blocked too: a retry makes them wait for it again.
            cursor.execute(sql.MEET_BY_DELETION, {"completed": completed})
    return dependents


def reopen(job: Job, alias: str) -> list[int]:
    """After ``job`` was retried: wait for its dependencies again, and reopen the
    dependents its failure or cancellation cancelled (transitively), blocked again.

    A retried job that has dependencies goes back to ``blocked`` and is
    settled at once: promoted if they are met, cancelled again if one failed.
    The ``requires="finished"`` dependents of the reopened jobs that their
    finishing released and that have not started are ``blocked`` again too.
    """
    return reopen_all([job.id], alias)


def reopen_all(job_ids: Sequence[int], alias: str) -> list[int]:
    """``reopen`` for a batch of retried jobs, set-based (a bulk retry's batch).

    Returns the ids of the dependents it reopened (those settling them did
    not cancel again at once).
    """
    if not job_ids:
        return []
    with transaction.atomic(using=alias), db.cursor(alias) as cursor, planned_by_index(cursor):
        reopened: list[int] = []
        frontier = list(job_ids)
        for _ in range(MAX_ROUNDS):
            if not frontier:
                break
            cursor.execute(sql.REVIVE_CASCADED, {"ids": frontier})
            cursor.execute(sql.REOPEN_CASCADED, {"ids": frontier})
            frontier = [row[0] for row in cursor.fetchall()]
            reopened.extend(frontier)
        dependents = list(reopened)
        cursor.execute(sql.HAS_DEPENDENCIES, {"ids": list(job_ids)})
        waiting = [row[0] for row in cursor.fetchall()]
        if waiting:
            cursor.execute(sql.BLOCK_AGAIN, {"ids": waiting})
            reopened[:0] = waiting
        # Their requires="finished" dependents not started yet wait for them again.
        cursor.execute(sql.BLOCK_DEPENDENTS_AGAIN, {"ids": [*job_ids, *dependents]})
        reopened.extend(row[0] for row in cursor.fetchall())
        if reopened:
            logger.info(
                "%s retried job(s): %s job(s) wait for their dependencies again",
                len(job_ids),
                len(reopened),
            )
            cancelled = set(settle(reopened, alias))
            dependents = [i for i in dependents if i not in cancelled]
    return dependents
