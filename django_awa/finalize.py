"""Writing outcomes: the guarded UPDATE and its follow-ups in one transaction.

``finalize()`` takes a batch of attempt results. Results whose (outcome,
kind) has no follow-ups are written by one statement. The others are written
together with their follow-up INSERTs inside a savepoint; if any follow-up
function raises or its insert fails, the savepoint is rolled back, that job
is finalized instead as if its handler had raised (``_fallback``), and the
rest of the batch is written again without it. So each committed outcome has
exactly its follow-ups, and one bad follow-up never rolls back another job's
outcome.

Jobs that others depend on have their dependents promoted or cancelled in
the same transaction (``dependencies.after_attempts``). The queues that got
jobs to run are woken by ``wakeups.announce``: after the commit when the
caller runs it inside ``wakeups.after_commit`` (the completer, an atomic
handler), by a NOTIFY in the transaction otherwise (``testing.run_jobs``).

``dispatch()`` is the same follow-up step for callers that change state
themselves (callback resolution, ``awa.cancel``): it raises to the caller.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import DatabaseError, connections, transaction

from . import db, sql
from .callbacks import apply_early
from .compat import savepoint_create
from .conf import awa_settings
from .dependencies import after_attempts
from .enqueueing import PreparedJob, insert
from .exceptions import ValidationError
from .execute import (
    Attempt,
    AttemptResult,
    JobContext,
    attempt_keys,
    errored,
    from_exception,
    from_value,
    handler_raised,
)
from .followups import (
    OUTCOME_SIGNALS,
    FollowupError,
    FollowupSpec,
    Outcome,
    OutcomeContext,
    build,
    followup_registry,
    send_signal,
)
from .kinds import JobArgs, WorkerSpec, registry
from .logs import log_context
from .models import ClaimedJob, JobState, claimed_jobs, jobs_from_rows
from .pending import keep_pending
from .sequences import (
    HAS_DEPENDENTS_COLUMN,
    ID_COLUMN,
    HandOn,
    claim_params,
    finished_keys,
    hand_off,
    places_of,
)

logger = logging.getLogger(__name__)


class _FollowupsFailed(Exception):
    def __init__(self, failures: dict[int, tuple[AttemptResult, Exception]]) -> None:
        super().__init__(f"{len(failures)} follow-up failure(s)")
        self.failures = failures


def _has_followups(result: AttemptResult) -> bool:
    outcome = result.outcome  # a property: read once, for every result of a batch
    return outcome is not None and followup_registry.has(outcome, result.job.kind)


def _heard(outcomes: Iterable[Outcome | None]) -> set[Outcome]:
    """Those of ``outcomes`` whose signal has receivers: asked once per outcome, not per job."""
    heard: set[Outcome] = set()
    for outcome in set(outcomes):
        if outcome is None:
            continue
        signal = OUTCOME_SIGNALS.get(outcome)
        if signal is not None and signal.has_listeners():
            heard.add(outcome)
    return heard


def _started_ago(results: Sequence[AttemptResult]) -> str:
    """Each result's ``started_ago`` as a batch's ``%(started_ago)s::float8[]``, the
    clock read once for the batch rather than once a job."""
    now = time.monotonic()
    return db.float_array([r.started_ago(now) for r in results])


def _wants_rows(results: Sequence[AttemptResult]) -> bool:
    if JobState.WAITING_EXTERNAL in {result.state for result in results}:
        return True  # to see a callback that arrived early
    return bool(_heard({result.outcome for result in results}))


# The statements _write runs, by (every outcome a plain completion, one outcome
# written alone): the form for a transaction, the standalone one (autocommit,
# jobs with dependents left out), and the one returning whole rows.
_FORMS = {
    (True, False): (sql.COMPLETE, sql.COMPLETE_STANDALONE, sql.COMPLETE_RETURNING_ROWS),
    (True, True): (sql.COMPLETE_ONE, sql.COMPLETE_ONE_STANDALONE, sql.COMPLETE_ONE_RETURNING_ROWS),
    (False, False): (sql.FINALIZE, sql.FINALIZE_STANDALONE, sql.FINALIZE_RETURNING_ROWS),
    (False, True): (sql.FINALIZE_ONE, sql.FINALIZE_ONE_STANDALONE, sql.FINALIZE_ONE_RETURNING_ROWS),
}


def _write(
    results: Sequence[AttemptResult], alias: str, *, rows: bool, standalone: bool = False
) -> list[AttemptResult]:
    """One guarded UPDATE for all ``results``; returns those that applied.

    ``standalone``: the statement is its own transaction, so it leaves out
    jobs with dependents (whose dependents must be settled in the outcome's
    transaction); they come back with ``has_dependents`` set and not locked.
    """
    if not results:
        return []
    by_id = {r.job.id: r for r in results}
    leased = _holds_leases(results)
    plain = _completions(results)
    # An atomic handler's outcome, or a batch of one: the prepared form for one.
    one = len(results) == 1 and not leased
    in_transaction, alone, with_rows = _FORMS[plain, one]
    statement = with_rows if rows else alone if standalone else in_transaction
    params: dict[str, Any]
    if one:
        (only,) = results
        params = (
            {"id": only.job.id, "run_lease": only.job.run_lease, "started_ago": only.started_ago()}
            if plain
            else only.params()
        )
    elif plain:
        params = {
            "id": db.int_array([r.job.id for r in results]),
            "run_lease": db.int_array([r.job.run_lease for r in results]),
            "started_ago": _started_ago(results),
        }
    else:
        now = time.monotonic()
        params = db.as_columns([result.params(now) for result in results])
    if plain:
        statement = _kept_or_forgotten(statement)
    if leased:
        statement = sql.RELEASING[statement]
    with db.cursor(alias) as cursor:
        cursor.execute(statement, params)
        returned = cursor.fetchall()
        if len(returned) < len(results):
            _mark_locked(cursor, results, {row[0] for row in returned}, standalone=standalone)
    applied = [by_id[row[0]] for row in returned]
    if rows:
        for result, job in zip(applied, jobs_from_rows(returned, alias), strict=True):
            result.row = job
            result.has_dependents = job.has_dependents
    else:
        for result, row in zip(applied, returned, strict=True):
            result.has_dependents = row[1]
    return applied


def _kept_or_forgotten(statement: str) -> str:
    """One of COMPLETE's forms, or its ``sql.FORGETTING`` form (if it has one) when
    completed jobs are not kept (``COMPLETED_RETENTION = 0``)."""
    if awa_settings().completed_retention == 0:
        return sql.FORGETTING.get(statement, statement)
    return statement


def _holds_leases(results: Iterable[AttemptResult]) -> bool:
    """Whether any of ``results`` is of a kind whose attempts hold a per-key lease
    (``awa.Limit(concurrency=...)``): its outcome must release it."""
    leased = registry.leased_kinds()
    return bool(leased) and any(r.job.kind in leased for r in results)


def _hold_leases(results: Sequence[AttemptResult], alias: str) -> None:
    """Keep the key's lease of attempts whose abandoned handler still runs, before
    their outcome is written (which then keeps it: ``sql._released``). Should the
    outcome's write fail, the lease is held all the same (committed first when
    finalize runs in autocommit, as the completer's does), renewed while the
    handler runs and freed when it returns."""
    if results:
        with db.cursor(alias) as cursor:
            cursor.execute(
                sql.HOLD_LEASES,
                {**attempt_keys(results), "stale_after": awa_settings().stale_after},
            )


def _mark_locked(
    cursor: db.Cursor, results: Sequence[AttemptResult], written: set[int], *, standalone: bool
) -> None:
    """Flag the results left out only because another session held their row locked,
    or (a standalone statement) because the job has dependents.

    Their attempt still holds the row, so the completer writes them again
    later (or finalize at once, in a transaction); the others left out were
    stale and are dropped.
    """
    missing = [r for r in results if r.job.id not in written]
    cursor.execute(
        sql.STILL_HELD,
        {
            "id": db.int_array(r.job.id for r in missing),
            "run_lease": db.int_array(r.job.run_lease for r in missing),
        },
    )
    held = dict(cursor.fetchall())
    for result in missing:
        if standalone and held.get(result.job.id):
            # Left out for its dependents, not for a lock: written again at once.
            result.has_dependents = True
            result.locked = False
        else:
            result.locked = result.job.id in held


def _complete_handing_on(
    results: Sequence[AttemptResult], alias: str, hand_on: HandOn | None
) -> tuple[list[AttemptResult], list[ClaimedJob]]:
    """Write completions (``sql.COMPLETE``'s kind of batch) and hand their sequences
    on in one statement, its own transaction (``sql.COMPLETE_HAND_ON``).

    Returns the results that applied and the next members claimed into
    ``hand_on``'s places (the caller records them: the statement committed).
    Results left out are flagged as ``sql.COMPLETE_STANDALONE``'s are: locked,
    or (``has_dependents``) to be written again in a transaction.
    """
    keys = finished_keys(results)
    by_id = {r.job.id: r for r in results}
    places = places_of(keys, hand_on)
    if len(results) == 1:
        # A saturated sequence's every member: the prepared statement for one.
        (only,) = results
        ((key, _),) = keys
        statement = sql.COMPLETE_HAND_ON_ONE
        params: dict[str, Any] = {
            "id": only.job.id,
            "run_lease": only.job.run_lease,
            "started_ago": only.started_ago(),
            "key": key,
            "place": places[0],
        }
    else:
        statement = sql.COMPLETE_HAND_ON
        params = {
            "id": db.int_array(r.job.id for r in results),
            "run_lease": db.int_array(r.job.run_lease for r in results),
            "started_ago": _started_ago(results),
            "keys": [key for key, _ in keys],
            "places": places,
        }
    with db.cursor(alias) as cursor:
        cursor.execute(_kept_or_forgotten(statement), {**params, **claim_params()})
        rows = cursor.fetchall()
        done = [row for row in rows if not row[0]]
        if len(done) < len(results):
            _mark_locked(cursor, results, {row[1 + ID_COLUMN] for row in done}, standalone=True)
    applied = []
    for row in done:
        result = by_id[row[1 + ID_COLUMN]]
        result.has_dependents = row[1 + HAS_DEPENDENTS_COLUMN]
        applied.append(result)
    return applied, claimed_jobs(row[1:] for row in rows if row[0])


def _settle_dependents(applied: Sequence[AttemptResult], alias: str) -> None:
    """Promote or cancel the dependents of the finished jobs among ``applied``
    (inside the transaction that wrote them)."""
    after_attempts(
        [(r.job.id, r.state) for r in applied if r.has_dependents and r.state in JobState.FINAL],
        alias,
    )


def followup_context(result: AttemptResult) -> OutcomeContext:
    """The context of a written result's outcome, as its row now stands."""
    if result.context is None or result.row is None:  # pragma: no cover - by construction
        raise RuntimeError(f"job {result.job.id}: follow-ups without an outcome or row")
    return result.context.after(result.row)


def _insert_followups(
    batch: Sequence[tuple[AttemptResult, list[tuple[FollowupSpec, PreparedJob]]]], alias: str
) -> dict[int, tuple[AttemptResult, Exception]]:
    """Insert every prepared follow-up in one statement; report refused triggers."""
    flat = [(result, spec, job) for result, items in batch for spec, job in items]
    if not flat:
        return {}
    inserted = insert([job for _, _, job in flat], alias, ids=False)
    failures: dict[int, tuple[AttemptResult, Exception]] = {}
    for position in inserted.skipped:
        result, spec, job = flat[position]
        if result.job.id not in failures:
            failures[result.job.id] = (
                result,
                FollowupError(
                    f"follow-up {spec.name} failed: UniqueConflict: a job of kind "
                    f"{job.kind!r} with the same unique key is already held",
                    spec=spec,
                ),
            )
    return failures


def _apply_with_followups(results: Sequence[AttemptResult], alias: str) -> list[AttemptResult]:
    """Write results and their follow-ups; raise ``_FollowupsFailed`` naming bad triggers."""
    applied = _write(results, alias, rows=True)
    failures: dict[int, tuple[AttemptResult, Exception]] = {}
    batch = []
    for result in applied:
        row, context = result.row, result.context
        if row is None or context is None:  # pragma: no cover - by construction
            raise RuntimeError(f"job {result.job.id}: follow-ups without an outcome or row")
        try:
            batch.append((result, build(row, context.after(row))))
        except FollowupError as exc:
            failures[result.job.id] = (result, exc)
            if db.transaction_failed(alias):
                # A query of the function failed and aborted the transaction: the
                # other jobs' functions would fail in it too. They are written
                # again once it is rolled back.
                break
    if not failures:
        failures = _insert_followups(batch, alias)
    if failures:
        raise _FollowupsFailed(failures)
    return applied


def _write_with_followups(results: Sequence[AttemptResult], alias: str) -> list[AttemptResult]:
    pending = list(results)
    applied: list[AttemptResult] = []
    while pending:
        savepoint = savepoint_create(using=alias)
        try:
            done = _apply_with_followups(pending, alias)
        except _FollowupsFailed as exc:
            _rollback_to(savepoint, alias)
            for result, error in exc.failures.values():
                applied.extend(_fallback(result, error, alias))
            pending = [r for r in pending if r.job.id not in exc.failures]
            continue
        # ValidationError: a follow-up's after= names a job that does not exist.
        except (DatabaseError, ValidationError) as exc:
            if isinstance(exc, DatabaseError) and db.connection_lost(alias):
                # Not the follow-ups' failure: the transaction is gone, nothing of it
                # committed. The caller writes the outcomes again once reconnected.
                raise
            _rollback_to(savepoint, alias)
            if len(pending) == 1:
                applied.extend(_fallback(pending[0], exc, alias))
            else:
                # Find the culprit: one savepoint per job.
                for result in pending:
                    applied.extend(_write_with_followups([result], alias))
            break
        transaction.savepoint_commit(savepoint, using=alias)
        applied.extend(done)
        break
    return applied


def _first_error(failure: Exception) -> Exception:
    """The error to record for a failed follow-up step: the first function's, or the database's."""
    if isinstance(failure, _FollowupsFailed):
        return next(iter(failure.failures.values()))[1]
    return failure


def _rollback_to(savepoint: str, alias: str) -> None:
    """Roll back to ``savepoint`` and clear the mark an inner ``atomic(savepoint=False)``
    (``enqueueing.insert``) leaves after a database error: the transaction is usable again."""
    transaction.savepoint_rollback(savepoint, using=alias)
    transaction.set_rollback(False, using=alias)


def _error_text(exc: Exception, result: AttemptResult | None = None) -> str:
    if isinstance(exc, FollowupError):
        return str(exc)
    if result is not None and db.is_unique_key_held(exc):
        # Not a follow-up's failure (their inserts skip a held key): the outcome's
        # own write, into a state its key is held in, which a twin enqueued while
        # it ran (a state its key is not held in) holds.
        return (
            f"the attempt's outcome ({result.state}) was not stored: another job holds "
            f"its unique key"
        )
    return f"follow-up insert failed: {type(exc).__name__}: {exc}"


def _fallback(result: AttemptResult, exc: Exception, alias: str) -> list[AttemptResult]:
    """Finalize ``result``'s job as if its handler had raised ``exc`` (a follow-up failure).

    The fallback's own follow-ups go in the same transaction; should they fail
    too, the fallback still commits and its follow-ups are kept as a
    ``PendingFollowup`` row that maintenance retries.
    """
    error = _error_text(exc, result)
    tb = "".join(traceback.format_exception(exc))
    if result.error:
        # The outcome whose follow-up failed was itself an error (a retry or an
        # exhaustion): both go in the attempt's one errors entry.
        error = f"{error}; the attempt's own error: {result.error}"
        if result.traceback:
            tb = f"{result.traceback}\nThen its follow-up failed:\n{tb}"
    fallback = errored(result.job, error, tb)
    fallback.progress = result.progress
    logger.warning(
        "follow-up failed for job %s kind=%s outcome=%s: %s; recording it as %s",
        result.job.id,
        result.job.kind,
        result.outcome,
        error,
        fallback.state,
        extra=log_context(result.job),
    )
    if not _has_followups(fallback):
        return _write([fallback], alias, rows=True)
    savepoint = savepoint_create(using=alias)
    try:
        applied = _apply_with_followups([fallback], alias)
    except (_FollowupsFailed, DatabaseError, ValidationError) as failure:
        if isinstance(failure, DatabaseError) and db.connection_lost(alias):
            raise  # the connection, not the follow-ups: nothing of it committed
        _rollback_to(savepoint, alias)
        second = _first_error(failure)
        applied = _write([fallback], alias, rows=True)
        for done in applied:
            kept = keep_pending(done.row, followup_context(done), alias, _error_text(second))
            logger.error(
                "follow-ups of job %s kind=%s outcome=%s could not be inserted (%s); "
                "kept as pending follow-up %s for maintenance to retry",
                done.job.id,
                done.job.kind,
                done.outcome,
                second,
                kept.id,
                extra=log_context(done.job),
            )
        return applied
    transaction.savepoint_commit(savepoint, using=alias)
    return applied


def _apply_early_callbacks(applied: Sequence[AttemptResult], alias: str) -> None:
    for result in applied:
        if result.state == JobState.WAITING_EXTERNAL and result.row is not None:
            apply_early(result.row, alias)


def _send_signals(applied: Sequence[AttemptResult], alias: str) -> None:
    heard = _heard(result.outcome for result in applied)
    for result in applied:
        if result.outcome in heard and result.row is not None:
            send_signal(result.row, followup_context(result), alias)


def finalize(
    results: Sequence[AttemptResult], alias: str, hand_on: HandOn | None = None
) -> list[AttemptResult]:
    """Write a batch of attempt results in one transaction; return those that applied.

    A result whose attempt is stale (its run_lease no longer running) is left
    out and inserts nothing. With ``hand_on``, the next members of the
    sequences the batch finishes are claimed into its places where they can
    start (``sequences.hand_off``); once committed, they are added to
    ``hand_on.claimed`` and their places taken off ``hand_on.places``.
    """
    if not results:
        return []
    _hold_leases([r for r in results if r.keeps_lease], alias)
    plain: list[AttemptResult] = []
    special: list[AttemptResult] = []
    if followup_registry.all:
        for result in results:
            (special if _has_followups(result) else plain).append(result)
    else:
        plain.extend(results)  # no follow-up declared in this process: nothing to ask a job
    rows = _wants_rows(plain)
    dependents = any([r.job.has_dependents for r in plain])
    handing_on = bool(finished_keys(plain))
    if (
        handing_on
        and not (special or rows or dependents or _holds_leases(plain))
        and _completions(plain)
    ):
        # Completions that hand sequences on: one statement writes them, hands
        # on and claims the next members (_complete_handing_on).
        applied, claimed = _complete_handing_on(plain, alias, hand_on)
        applied.extend(_again_with_dependents(plain, applied, alias))
        if hand_on is not None:
            hand_on.took(claimed)
        _log_all(applied)
        return applied
    # A job whose row said it has dependents when it was claimed goes straight
    # to the transaction that settles them; a sequence member that finishes, to
    # the one that hands its sequence on (sequences.hand_off).
    if special or rows or dependents or handing_on:
        with transaction.atomic(using=alias):
            applied = _write(plain, alias, rows=rows)
            applied.extend(_write_with_followups(special, alias))
            _settle_dependents(applied, alias)
            _, claimed = hand_off(finished_keys(applied), alias, hand_on)
            _apply_early_callbacks(applied, alias)
            _send_signals(applied, alias)
        if hand_on is not None:  # committed: the claimed members are this worker's now
            hand_on.took(claimed)
    else:
        # One statement and nothing else to write with it: it is its own
        # transaction, without a BEGIN and a COMMIT round trip around it.
        # Jobs with dependents are left out of it and written here again, in
        # a transaction that settles their dependents too.
        applied = _write(plain, alias, rows=False, standalone=True)
        applied.extend(_again_with_dependents(plain, applied, alias))
    _log_all(applied)
    return applied


def _completions(results: Sequence[AttemptResult]) -> bool:
    """Whether every result is a completion without progress or result (sql.COMPLETE's)."""
    # Over a batch, this module's per-job passes are comprehensions, not generator
    # expressions: a comprehension runs inline (PEP 709), where a generator is
    # resumed once per job.
    completed = JobState.COMPLETED  # read once: an enum member is no plain attribute
    return all([r.state == completed and r.progress is None and r.result is None for r in results])


def _again_with_dependents(
    results: Sequence[AttemptResult], applied: Sequence[AttemptResult], alias: str
) -> list[AttemptResult]:
    """Write, in a transaction that settles their dependents (and hands their
    sequences on), the ``results`` a standalone statement left out for their
    dependents; return those that applied."""
    flagged = [r for r in results if r.has_dependents and not r.locked]
    if flagged:  # (rare: the set of those written is made only then)
        written = {r.job.id for r in applied}
        flagged = [r for r in flagged if r.job.id not in written]
    if not flagged:
        return []
    with transaction.atomic(using=alias):
        again = _write(flagged, alias, rows=False)
        _settle_dependents(again, alias)
        hand_off(finished_keys(again), alias)
    return again


def _log_all(applied: Sequence[AttemptResult]) -> None:
    # Completed jobs are logged at INFO only: whether it is on is asked once a batch.
    info = logger.isEnabledFor(logging.INFO)
    completed = JobState.COMPLETED  # read once: an enum member is no plain attribute
    for result in applied:
        if info or result.state != completed:
            _log(result)


def finalize_atomic(result: AttemptResult, alias: str) -> bool:
    """Finalize an ``atomic=True`` attempt inside its handler's open transaction on ``alias``.

    A follow-up that fails raises ``_FollowupsRolledBack``: the transaction
    rolls back whole, the handler's writes with the transition, and
    ``run_atomic_attempt`` writes the fallback in a transaction of its own.
    """
    if not _has_followups(result):
        applied = _write([result], alias, rows=_wants_rows([result]))
    else:
        try:
            applied = _apply_with_followups([result], alias)
        except (_FollowupsFailed, DatabaseError, ValidationError) as failure:
            if isinstance(failure, DatabaseError) and db.connection_lost(alias):
                # The connection, not the follow-ups: the handler's transaction is
                # lost whole, and the caller records the attempt as not finalized.
                raise
            raise _FollowupsRolledBack(result, _first_error(failure)) from failure
    _after_atomic(applied, alias)
    return bool(applied)


def _after_atomic(applied: Sequence[AttemptResult], alias: str) -> None:
    """What follows an atomic attempt's write, in its transaction: dependents
    settled, sequences handed on, early callbacks, signals, the log line."""
    _settle_dependents(applied, alias)
    hand_off(finished_keys(applied), alias)
    _apply_early_callbacks(applied, alias)
    _send_signals(applied, alias)
    for done in applied:
        _log(done)


class StaleAttempt(Exception):
    """The attempt's guarded finalize matched no row: roll its writes back."""


class _HandlerRaised(Exception):
    """Leaves an atomic attempt's transaction, rolling the handler's writes back,
    for its outcome (``result``, a retry or a failure) to be written in a
    transaction of its own."""

    def __init__(self, result: AttemptResult) -> None:
        super().__init__(result)
        self.result = result


class _FollowupsRolledBack(Exception):
    """An atomic attempt's follow-ups failed (``error``): its transaction rolls back,
    the handler's writes with it, and the fallback is written in a new one."""

    def __init__(self, result: AttemptResult, error: Exception) -> None:
        super().__init__(result, error)
        self.result = result
        self.error = error


def run_atomic_attempt(attempt: Attempt, spec: WorkerSpec, args: JobArgs) -> AttemptResult | None:
    """Run an ``atomic=True`` handler inside the transaction that finalizes it.

    The handler's writes, the state change and its follow-ups commit together.
    If the handler raises (a ``BaseException`` too, see ``handler_raised``),
    its transaction rolls back, its writes with it, and the retry is recorded
    in a transaction of its own; so is the fallback when the follow-ups of
    either fail. The handler runs in the transaction itself, not in a
    savepoint: no subtransaction for its writes, and one round trip less.
    Returns the written result, or ``None`` when the attempt was stale.
    """
    alias = attempt.alias
    context = JobContext(attempt, args, flush_progress=lambda _a: None)
    returned = False
    try:
        try:
            with transaction.atomic(using=alias):
                try:
                    value = spec.handler(context)
                except BaseException as exc:  # the handler boundary, as run_attempt's
                    if not handler_raised(exc):
                        raise  # the transaction rolls back as it leaves atomic()
                    raise _HandlerRaised(
                        attempt.timed_out or from_exception(attempt.job, exc)
                    ) from exc
                if attempt.timed_out is not None:
                    # It passed its timeout holding its key's place (handlers.time_out):
                    # its result is ignored, its writes rolled back.
                    raise _HandlerRaised(attempt.timed_out)
                if (unusable := _unusable_transaction(alias)) is not None:
                    # Its outcome cannot commit with its writes: both roll back,
                    # and the attempt's error says why.
                    raise _HandlerRaised(errored(attempt.job, unusable))
                returned = True
                return _finalize_atomic_attempt(attempt, from_value(attempt, value))
        except _HandlerRaised as raised:
            with transaction.atomic(using=alias):
                return _finalize_atomic_attempt(attempt, raised.result)
    except StaleAttempt as stale:
        if returned and not stale.args:
            return _own_row_changed(attempt)
        return None
    except _FollowupsRolledBack as failed:
        with transaction.atomic(using=alias):
            applied = _fallback(failed.result, failed.error, alias)
            _after_atomic(applied, alias)
        # The fallback (a retry, or a failure on the last attempt) is what was
        # written, not the outcome its follow-ups refused: the caller counts it.
        return applied[0] if applied else None


def _unusable_transaction(alias: str) -> str | None:
    """Why the transaction an atomic handler returned in cannot commit, if it cannot.

    Without this, a handler that called ``transaction.set_rollback(True)`` had
    its outcome rolled back with its writes as ``atomic()`` exited, unseen: the
    job stayed running until rescue. One that went on after a database error
    in the transaction, or closed the connection, got the error of the
    outcome's write ("current transaction is aborted") instead of its own.
    """
    wrapper = connections[alias]
    if wrapper.closed_in_transaction:
        return (
            "the atomic handler closed its database connection inside its transaction: "
            "its writes were rolled back"
        )
    if wrapper.needs_rollback:
        return (
            "the atomic handler's transaction was marked for rollback "
            "(transaction.set_rollback(True), or an ORM database error it caught "
            "outside a nested transaction.atomic()): its writes were rolled back"
        )
    if db.transaction_failed(alias):
        return (
            "the atomic handler went on after a database error in its transaction, "
            "which PostgreSQL then aborted: its writes were rolled back (catch such "
            "errors around a nested transaction.atomic(), which rolls back to a savepoint)"
        )
    return None


def _own_row_changed(attempt: Attempt) -> AttemptResult | None:
    """After a returned handler's outcome found its row no longer the attempt's.

    Cancelled, rescued or claimed again by another session, the row stays so
    and the attempt is lost (None). But the handler may have changed its own
    job's row in its transaction (``awa.cancel(job.id)``, ``awa.retry``): the
    rollback undid that, and the job, still running, was left to the rescue at
    ``STALE_AFTER``. The attempt is then written failed, in a transaction of
    its own, with an error that says so.
    """
    result = errored(
        attempt.job,
        "the atomic handler changed its own job's row in its transaction (awa.cancel or "
        "awa.retry of its own job, say), which its outcome could not follow: its writes "
        "were rolled back (return awa.Cancel(...) to cancel it)",
    )
    try:
        with transaction.atomic(using=attempt.alias):
            return _finalize_atomic_attempt(attempt, result)
    except StaleAttempt:
        return None


def _finalize_atomic_attempt(attempt: Attempt, result: AttemptResult) -> AttemptResult:
    """Write ``result``, ``attempt``'s outcome, in the open transaction; raise
    ``StaleAttempt`` (rolling it back) when the attempt is no longer the row's."""
    result.progress = attempt.progress
    result.started = attempt.started
    if not _finalize_atomic_waiting(result, attempt.alias):
        raise StaleAttempt
    return result


# Waits, in seconds, before writing an atomic attempt's outcome again when its
# row was locked by another session (the heartbeat thread's HEARTBEAT or
# MARK_STARTED lock rows for one statement; an operator's SELECT ... FOR UPDATE
# for longer). About a second in all; the handler's transaction stays open.
ATOMIC_LOCKED_RETRIES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def _finalize_atomic_waiting(result: AttemptResult, alias: str) -> bool:
    """``finalize_atomic``, written again while the row is only locked, not stale.

    FINALIZE skips locked rows (so a batch never waits on one): for the one row
    of an atomic attempt, a skipped row is written again after a short wait,
    not taken for a stale attempt, which would roll the handler's work back
    and leave the job running until rescue.
    """
    for wait in (*ATOMIC_LOCKED_RETRIES, None):
        if finalize_atomic(result, alias):
            return True
        if not result.locked:
            return False  # stale: rescued, cancelled or claimed again
        result.locked = False
        if wait is None:
            job = result.job
            logger.warning(
                "job %s kind=%s attempt=%s: its row stayed locked by another session for "
                "%.1fs; the atomic attempt is rolled back and the job will be rescued",
                job.id, job.kind, job.attempt, sum(ATOMIC_LOCKED_RETRIES),
                extra={"job_id": job.id, "kind": job.kind, "queue": job.queue,
                       "attempt": job.attempt},
            )  # fmt: skip
            raise StaleAttempt("locked")
        time.sleep(wait)
    return False  # pragma: no cover - the loop returns


def _log(result: AttemptResult) -> None:
    job = result.job
    if result.state == JobState.RETRYABLE:
        # The backoff is drawn by the database; the row, when read back, says when.
        if result.delay is not None:
            when = f"in {result.delay:.1f}s"
        elif result.row is not None:
            when = f"at {result.row.run_at.isoformat()}"
        else:
            when = "after a backoff"
        logger.warning(
            "job %s kind=%s attempt=%s failed, retrying %s: %s",
            job.id, job.kind, job.attempt, when, result.error or "RetryAfter",
            extra=log_context(job),
        )  # fmt: skip
    elif result.outcome is Outcome.EXHAUSTED:
        logger.error(
            "job %s kind=%s attempt=%s failed for good: %s\n%s",
            job.id, job.kind, job.attempt, result.error, result.traceback,
            extra=log_context(job),
        )  # fmt: skip
    elif logger.isEnabledFor(logging.INFO):
        logger.info(
            "job %s kind=%s attempt=%s -> %s",
            job.id, job.kind, job.attempt, result.state,
            extra=log_context(job),
        )  # fmt: skip
