"""The completer: the thread that writes attempts' results in batches (``finalize``).

Handler threads put results on the state's results queue; the completer takes
up to ``FINALIZE_BATCH_SIZE`` at a time, writes them in one transaction, and
stops tracking their attempts. Results whose row another session holds locked
are written again after ``LOCKED_RETRY_SOON`` seconds (``LOCKED_RETRY`` when left
out again), on their own, while the rest go on.

The batch's transaction NOTIFYs nothing (``wakeups.after_commit``): the queues
its follow-ups and promoted dependents went to are posted to the worker's
outbox once it commits, which wakes this process's producers at once and the
other workers by a NOTIFY sent from the listener's connection.

Once the outcomes of a limited queue's attempts, or of sequence members, are
written, ``notify_freed`` wakes the claimers waiting for that capacity: this
process's producers at once, every other worker through the outbox. Held-back
jobs start when a slot frees, not at the next poll.

A sequence hands on without a claim (``hand_on``): before writing a batch
that finishes sequence members, the completer reserves free places of their
queues (unlimited ones this worker serves), the transaction that writes the
outcomes claims each sequence's next member into them, and right after the
commit the claimed members go to their queue's handler threads, as a claim's
would. A member costs a handler call and one completer round trip.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
import traceback
from collections.abc import Iterable, Sequence

from . import db, sql, wakeups
from .execute import (
    Attempt,
    AttemptResult,
    attempt_keys,
    errored,
    failed_terminally,
    unstarted,
)
from .finalize import finalize
from .models import ClaimedJob, JobState
from .otel import instrumentation
from .sequences import SEQUENCE_KEY, HandOn
from .state import DB_ERRORS, WorkerState, log_context, reset_connection

logger = logging.getLogger(__name__)

# Most results the completer writes in one transaction. With follow-ups each
# batch pays a BEGIN, a savepoint, a COPY and a COMMIT, so larger
# batches spread that fixed cost over more jobs (benchmarks/: the follow-up drain).
FINALIZE_BATCH_SIZE = 1000
# Seconds before writing again outcomes whose row another session held locked:
# LOCKED_RETRY_SOON the first time, LOCKED_RETRY for those left out again. The
# usual holder is a claimer whose scan met the rows just after another claimer
# started them: FOR UPDATE locks the newest version of a row before it checks
# the row again, and keeps the lock when the check fails, so such a claim holds
# a whole batch of fresh attempts until its statement ends, milliseconds later
# (tens for a keyed claim reading past thousands of rows). In flow_control.py's
# keyed drain, hundreds of outcomes at a time waited the whole LOCKED_RETRY,
# several times a drain, their keys held meanwhile. A longer hold (an
# operator's SELECT ... FOR UPDATE) is met again at LOCKED_RETRY.
LOCKED_RETRY_SOON = 0.02
LOCKED_RETRY = 0.5
# Why an attempt whose retry would take a unique key another job holds failed instead
# (as sql.RESCUE words it).
KEY_HELD = "not retried: another job holds its unique key"


def _attempt(result: AttemptResult) -> tuple[int, int]:
    """The attempt ``result`` is of: its job's id and run_lease."""
    return result.job.id, result.job.run_lease


def first_of_each_attempt(batch: list[AttemptResult]) -> list[AttemptResult]:
    """``batch`` with only the first result of each attempt.

    An attempt has two results when the handler pool recorded it timed out
    and its handler returned just after: the first written wins, a later one
    is stale (guarded by run_lease). Two in one statement would each match
    the row, and which one applied would be left to chance.
    """
    keys = {(r.job.id, r.job.run_lease) for r in batch}
    if len(keys) == len(batch):
        return batch
    seen: set[tuple[int, int]] = set()
    first = []
    for result in batch:
        key = (result.job.id, result.job.run_lease)
        if key not in seen:
            seen.add(key)
            first.append(result)
    return first


def reserve_hand_on(state: WorkerState, batch: list[AttemptResult]) -> HandOn | None:
    """Reserve places for the next members of the sequences ``batch`` finishes.

    One place per finished member, on its queue, where this worker serves the
    queue, its claims are not under limits (those claim under the queue's lock,
    ``sql.CLAIM_LIMITED``), the worker is not stopping nor its claims paused
    (``ClaimPause``: the heartbeat cannot write), and a place is free now (no
    waiting). ``None`` when there is none to reserve.
    """
    if state.stopping.is_set() or state.claim_pause.holds():
        return None
    wanted: dict[str, int] = {}
    for result in batch:
        job = result.job
        if (
            job.metadata
            and SEQUENCE_KEY in job.metadata
            and result.state in JobState.FINAL
            and not result.locked
        ):
            wanted[job.queue] = wanted.get(job.queue, 0) + 1
    places: dict[str, int] = {}
    for queue, want in wanted.items():
        runner = state.queues.get(queue)
        if runner is not None and not runner.limited:
            taken = runner.take_places(want)
            if taken:
                places[queue] = taken
    return HandOn(places) if places else None


def start_handed_on(state: WorkerState, hand_on: HandOn) -> None:
    """Give back the places ``hand_on`` did not fill; send the members it claimed to
    their queue's handler threads (tracked as running, not started, as a claim's).

    Once the worker is stopping, they are given back instead, without using
    their attempt (as shutdown gives back claimed jobs no handler started): no
    handler may start them, and the drain must not wait for them.
    """
    for queue, left in hand_on.places.items():
        state.queues[queue].give_places(left)
    claimed, hand_on.claimed = hand_on.claimed, []
    if not claimed:
        return
    if state.stopping.is_set():
        give_back_unstarted(state, claimed)
        return
    attempts = [Attempt(job=job, alias=state.alias) for job in claimed]
    with state.running_lock:
        for attempt in attempts:
            state.running[attempt.job.id] = attempt
            state.waiting.add(attempt.job.id)
    debug = logger.isEnabledFor(logging.DEBUG)
    for attempt in attempts:
        job = attempt.job
        if debug:
            logger.debug("handed on to job %s kind=%s attempt=%s", job.id, job.kind,
                         job.attempt, extra=log_context(job, state.name))  # fmt: skip
        state.queues[job.queue].inbox.put(attempt)


def release_held_leases(state: WorkerState, attempts: Sequence[Attempt | AttemptResult]) -> bool:
    """Free the key's places kept (``held_until`` set) for these lost attempts, whose
    handlers returned or never began (``sql.RELEASE_HELD_LEASES``); whether it did.
    A cancelled sequence member's place freed wakes the claimers of its key's next
    member. Should it fail (logged), they free once their ``held_until`` passes, within
    ``STALE_AFTER``."""
    try:
        with db.cursor(state.alias) as cursor:
            cursor.execute(sql.RELEASE_HELD_LEASES, attempt_keys(attempts))
            sequences = {row[0] for row in cursor.fetchall() if row[0] is not None}
    except DB_ERRORS:
        logger.warning(
            "could not free the key's place kept for job(s) %s; it frees within STALE_AFTER",
            ", ".join(f"{a.job.id} kind={a.job.kind} attempt={a.job.attempt}" for a in attempts),
            exc_info=True,
        )
        reset_connection()
        return False
    if sequences:
        wake_freed(state, set(), sequences)
    return True


def give_back_unstarted(state: WorkerState, jobs: list[ClaimedJob]) -> None:
    """Make ``jobs``, claimed for this worker and never started, available again at
    once with their attempt unused; their places are freed. Should the write fail,
    maintenance rescues them."""
    results = [unstarted(job) for job in jobs]
    try:
        with wakeups.after_commit(state.alias, state.outbox):
            finalize(results, state.alias)
        logger.info(
            "gave back %s handed-on sequence member(s) at shutdown: %s",
            len(jobs),
            ", ".join(str(job.id) for job in jobs),
        )
    except DB_ERRORS:
        logger.exception("could not give back handed-on jobs; maintenance will rescue them")
        reset_connection()
    for job in jobs:
        state.queues[job.queue].finished()


def notify_freed(
    state: WorkerState, results: Iterable[AttemptResult], handed_on: frozenset[str] = frozenset()
) -> None:
    """Wake the claimers of the capacity ``results`` (written outcomes) gave back.

    A queue claimed under its lock (its runner says so) is woken whatever the outcome; a
    sequence's next member only once the member before it is finished, and
    not when this worker claimed it (its key is in ``handed_on``). Costs
    nothing for unlimited queues without sequences. The other workers are told
    through the outbox (a NOTIFY outside the outcome's transaction). A failure
    is logged: the claimers' poll still finds the capacity.
    """
    queues: set[str] = set()
    sequences: set[str] = set()
    for result in results:
        job = result.job
        runner = state.queues.get(job.queue)
        if runner is not None and runner.wake_fleet:
            queues.add(job.queue)
        key = job.metadata.get(SEQUENCE_KEY) if job.metadata else None
        if key is not None and result.state in JobState.FINAL and key not in handed_on:
            sequences.add(key)
    if queues or sequences:
        wake_freed(state, queues, sequences)


def wake_freed(state: WorkerState, queues: set[str], sequences: set[str]) -> None:
    """Wake the claimers of ``queues`` and of the next members of ``sequences``
    (``notify_freed``)."""
    # This process's own producers first, without waiting for the round trip
    # below: the outcomes are committed, so the capacity is free now.
    state.wake(queues)
    try:
        with db.cursor(state.alias) as cursor:
            cursor.execute(
                sql.FREED_QUEUES,
                {
                    "queues": sorted(queues),
                    "sequences": sorted(sequences),
                    "local": sorted(state.queues),
                },
            )
            rows = cursor.fetchall()
    except DB_ERRORS as exc:
        logger.warning("could not wake claimers of queues %s (%s)", sorted(queues), exc)
        reset_connection()
        rows = [(queue, True) for queue in queues]
    state.outbox.post({row[0] for row in rows}, {row[0] for row in rows if row[1]})


class Completer:
    """Batched finalize: ``run`` is the thread body, ``run_once`` writes what is queued now."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.results = state.results
        self.reconnect = db.Reconnect("completer", state.alias, state.halt)
        # Set once the thread holds its connection (db.hold_connection): the
        # worker starts its handlers only then, so none takes the server's last slot.
        self.connected = threading.Event()

    def run(self) -> None:
        """Write results in batches until told to stop (``None`` on the results queue)."""
        db.hold_connection(self.reconnect)
        self.connected.set()
        done = False
        deferred: list[AttemptResult] = []  # left out: their row was locked
        retried: set[tuple[int, int]] = set()  # of those, the attempts left out before
        retry_at = 0.0
        while not done:
            timeout = max(0.0, retry_at - time.monotonic()) if deferred else None
            batch, done = self.next_batch(timeout)
            if deferred:
                # An attempt's first result waits for its row: a later one of the
                # same attempt (a timed-out handler's own) is stale, as in one batch.
                waiting_for = {(r.job.id, r.job.run_lease) for r in deferred}
                batch = [r for r in batch if (r.job.id, r.job.run_lease) not in waiting_for]
            if deferred and (done or time.monotonic() >= retry_at):
                batch.extend(deferred)
                deferred = []
            if not batch:
                continue
            waiting = len(deferred)
            self.write(batch, deferred)
            db.release(self.state.alias)  # pooled: held only while it writes
            if len(deferred) > waiting:
                # Only outcomes newly left out set the time: while results keep
                # coming, pushing it on at every batch would never write again
                # those already waiting.
                if not waiting:
                    again = any(_attempt(r) in retried for r in deferred)
                    wait = LOCKED_RETRY if again else LOCKED_RETRY_SOON
                    retry_at = time.monotonic() + wait
                logger.info(
                    "%s outcome(s) wait for a row lock another session holds (jobs %s); "
                    "writing them again in %.2fs",
                    len(deferred) - waiting,
                    ", ".join(str(r.job.id) for r in deferred[waiting : waiting + 20]),
                    max(0.0, retry_at - time.monotonic()),
                )
            retried = {_attempt(r) for r in deferred}
        for result in deferred:
            logger.warning(
                "job %s: its outcome could not be written before shutdown (the row stays "
                "locked by another session); maintenance will rescue it",
                result.job.id,
                extra=log_context(result.job, self.state.name),
            )
            self.state.forget(result.job)
        tracing = instrumentation()
        if tracing is not None:
            tracing.record_pending()  # what the last attempts left

    def run_once(self) -> list[AttemptResult]:
        """Write the results queued now (one batch, without waiting for any).

        Returns those whose row another session held locked: still tracked,
        their outcome not written.
        """
        deferred: list[AttemptResult] = []
        batch, _ = self.next_batch(0)
        if batch:
            self.write(batch, deferred)
        return deferred

    def write(self, batch: list[AttemptResult], deferred: list[AttemptResult]) -> None:
        """Write ``batch``, forget its attempts; add those whose row was locked to ``deferred``."""
        hand_on = reserve_hand_on(self.state, batch)
        results = first_of_each_attempt(batch)
        # Read before finalize reads them: a handler that returns clears the flag.
        keeping = [result for result in results if result.keeps_lease]
        try:
            # Follow-ups and promoted dependents: this worker's producers claim
            # them as the batch commits, the others hear after (wakeups.py).
            with wakeups.after_commit(self.state.alias, self.state.outbox):
                self.write_batch(results, hand_on)
        finally:
            handed_on = (
                frozenset(job.metadata[SEQUENCE_KEY] for job in hand_on.claimed if job.metadata)
                if hand_on
                else frozenset()
            )
            if hand_on is not None:
                start_handed_on(self.state, hand_on)
        notify_freed(self.state, [result for result in batch if not result.locked], handed_on)
        written = []
        for result in batch:
            if result.locked:
                result.locked = False
                deferred.append(result)
            else:
                written.append(result.job)
        self.state.forget_all(written)
        if keeping:
            self.free_returned_keys(keeping)
        tracing = instrumentation()  # None without the otel extra
        if tracing is not None:
            tracing.record_pending()  # the attempts' histogram values (otel.py)

    def free_returned_keys(self, results: list[AttemptResult]) -> None:
        """Free the key's places that ``results``, outcomes of abandoned handlers written
        keeping their lease (``AttemptResult.keeps_lease``), kept for a handler that
        returned meanwhile.

        A handler that returns frees its key itself (``HandlerPool.execute``), but
        while its outcome is being written there may be nothing to free yet: the
        lease is held (``sql.HOLD_LEASES``), and kept by the outcome, only once
        those commit. So both look, under ``running_lock``, once done: the handler
        takes its attempt out of ``WorkerState.kept`` and frees the lease after;
        this, after the writes, frees those of attempts no longer there. Whichever
        looks last frees it, whatever the order; and only once the handler returned.
        """
        with self.state.running_lock:
            kept = self.state.kept
            returned = [r for r in results if (r.job.id, r.job.run_lease) not in kept]
        if returned:
            release_held_leases(self.state, returned)

    def next_batch(self, timeout: float | None) -> tuple[list[AttemptResult], bool]:
        """Up to ``FINALIZE_BATCH_SIZE`` results, waiting up to ``timeout`` for the first
        (``None``: for ever); and whether the stop marker was seen."""
        batch: list[AttemptResult] = []
        try:
            first = self.results.get(timeout=timeout)
        except queue_module.Empty:
            return batch, False
        if first is None:
            return batch, True
        batch.append(first)
        while len(batch) < FINALIZE_BATCH_SIZE:
            try:
                item = self.results.get_nowait()
            except queue_module.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def write_batch(self, batch: list[AttemptResult], hand_on: HandOn | None = None) -> None:
        """Finalize ``batch``; a member that cannot be stored is recorded as a failed attempt.

        A lost connection (or another transient error) is waited out and the
        whole batch written again: finalize is guarded by run_lease, so
        writing it again after a lost commit acknowledgement changes nothing
        twice. Any other error is about what one member holds, so the batch
        is split in halves until the member that fails is alone, and the
        others commit.
        """
        while True:
            try:
                applied = finalize(batch, self.state.alias, hand_on)
                self.reconnect.succeeded()
                self.state.count_outcomes(applied, self.state.running)
                self.free_stale_sequences(batch, applied)
                return
            except Exception as exc:  # noqa: BLE001 - one bad outcome must not stop the completer
                if isinstance(exc, DB_ERRORS) and db.is_transient(exc):
                    if self.state.halt.is_set():
                        return
                    self.reconnect.failed(exc)
                    continue
                reset_connection()
                error = exc
                break
        if len(batch) > 1:
            half = len(batch) // 2
            self.write_batch(batch[:half], hand_on)
            self.write_batch(batch[half:], hand_on)
        else:
            self.write_unstorable(batch[0], error)

    def free_stale_sequences(
        self, batch: list[AttemptResult], applied: list[AttemptResult]
    ) -> None:
        """Free the key's places kept for the sequence members of ``batch`` whose
        outcome was stale (cancelled while they ran): their handlers returned.

        The handler frees its place itself once it knows of the cancel
        (``HandlerPool.release_held_lease``); one that returned before the cancel's
        NOTIFY reached it knows nothing, and its key would wait ``STALE_AFTER``.
        Costs nothing for batches without sequence members."""
        members = [r for r in batch if r.job.metadata and SEQUENCE_KEY in r.job.metadata]
        if not members:
            return
        written = {id(r) for r in applied}
        stale = [r for r in members if not r.locked and id(r) not in written]
        if stale:
            release_held_leases(self.state, stale)

    def write_unstorable(self, result: AttemptResult, exc: Exception) -> None:
        """Record ``result``'s attempt as failed, naming why its outcome could not be written.

        An outcome that would take the job's unique key, held by a twin enqueued
        while it ran in a state its key is not held in (``Unique(states=...)``
        without ``running``), is recorded as the failed attempt it is, retried
        unless its retry would take the key too: then it fails, as rescue does.
        """
        job = result.job
        tb = "".join(traceback.format_exception(exc))
        if db.is_unique_key_held(exc) and result.state == JobState.RETRYABLE:
            # Its retry is what took the key: retrying it as failed would too.
            fallbacks = [failed_terminally(job, f"{result.error}; {KEY_HELD}", result.traceback)]
        else:
            error = (
                f"the attempt's outcome ({result.state}) could not be stored: "
                f"{type(exc).__name__}: {exc}"
            )
            fallbacks = [errored(job, error, tb)]
            if fallbacks[0].state != JobState.FAILED:
                # Should its retry take a unique key another job holds.
                fallbacks.append(failed_terminally(job, f"{error}; {KEY_HELD}", tb))
        logger.error(
            "job %s kind=%s attempt=%s: its outcome (%s) could not be stored: %s: %s; "
            "recording a failed attempt instead",
            job.id, job.kind, job.attempt, result.state, type(exc).__name__, exc,
            extra=log_context(job, self.state.name),
        )  # fmt: skip
        for fallback in fallbacks:
            try:
                self.state.count_outcomes(
                    finalize([fallback], self.state.alias), self.state.running
                )
            except Exception as again:
                reset_connection()
                if fallback is not fallbacks[-1] and db.is_unique_key_held(again):
                    continue
                # The job's heartbeat stops, and rescue takes it back.
                logger.exception(
                    "job %s: not even the failed attempt could be recorded; it will be rescued",
                    job.id,
                    extra=log_context(job, self.state.name),
                )
            result.locked = fallback.locked
            return
