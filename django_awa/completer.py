"""The completer: the thread that writes attempts' results in batches (``finalize``).

Handler threads put results on the state's results queue; the completer takes
up to ``FINALIZE_BATCH_SIZE`` at a time, writes them in one transaction, and
stops tracking their attempts. Results whose row another session holds locked
are written again after ``LOCKED_RETRY`` seconds, on their own, while the rest
go on.

Once the outcomes of a limited queue's attempts, or of sequence members, are
written, ``notify_freed`` wakes the claimers waiting for that capacity: this
process's producers at once, every other worker by NOTIFY. Held-back jobs
start when a slot frees, not at the next poll.
"""

from __future__ import annotations

import logging
import queue as queue_module
import time
import traceback
from collections.abc import Iterable

from . import db, sql
from .dependencies import take_promoted_queues
from .execute import AttemptResult, errored
from .finalize import finalize
from .models import JobState
from .state import DB_ERRORS, WorkerState, log_context, reset_connection

logger = logging.getLogger(__name__)

# Most results the completer writes in one transaction. With follow-ups each
# batch pays a BEGIN, a savepoint, a COPY, a NOTIFY and a COMMIT, so larger
# batches spread that fixed cost over more jobs (benchmarks/: the follow-up drain).
FINALIZE_BATCH_SIZE = 1000
# Seconds before writing again an outcome whose row another session held locked.
LOCKED_RETRY = 0.5


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


def notify_freed(state: WorkerState, results: Iterable[AttemptResult]) -> None:
    """Wake the claimers of the capacity ``results`` (written outcomes) gave back.

    A queue under limits (its runner says so) is woken whatever the outcome; a
    sequence's next member only once the member before it is finished. Costs
    nothing for unlimited queues without sequences. A failure is logged: the
    claimers' poll still finds the capacity.
    """
    queues: set[str] = set()
    sequences: set[str] = set()
    for result in results:
        job = result.job
        runner = state.queues.get(job.queue)
        if runner is not None and runner.limited:
            queues.add(job.queue)
        key = job.metadata.get("awa_sequence") if job.metadata else None
        if key is not None and result.state in JobState.FINAL:
            sequences.add(key)
    if not queues and not sequences:
        return
    # This process's own producers first, without waiting for the round trip
    # below: the outcomes are committed, so the capacity is free now.
    state.wake(queues)
    try:
        with db.cursor(state.alias) as cursor:
            cursor.execute(
                sql.NOTIFY_FREED,
                {
                    "queues": sorted(queues),
                    "sequences": sorted(sequences),
                    "local": sorted(state.queues),
                },
            )
            woken = {row[0] for row in cursor.fetchall()}
    except DB_ERRORS as exc:
        logger.warning("could not wake claimers of queues %s (%s)", sorted(queues), exc)
        reset_connection()
        woken = queues
    state.wake(woken)


class Completer:
    """Batched finalize: ``run`` is the thread body, ``run_once`` writes what is queued now."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.results = state.results
        self.reconnect = db.Reconnect("completer", state.alias, state.halt)

    def run(self) -> None:
        """Write results in batches until told to stop (``None`` on the results queue)."""
        done = False
        deferred: list[AttemptResult] = []  # left out: their row was locked
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
                    retry_at = time.monotonic() + LOCKED_RETRY
                logger.info(
                    "%s outcome(s) wait for a row lock another session holds (jobs %s); "
                    "writing them again in %.1fs",
                    len(deferred) - waiting,
                    ", ".join(str(r.job.id) for r in deferred[waiting : waiting + 20]),
                    max(0.0, retry_at - time.monotonic()),
                )
        for result in deferred:
            logger.warning(
                "job %s: its outcome could not be written before shutdown (the row stays "
                "locked by another session); maintenance will rescue it",
                result.job.id,
                extra=log_context(result.job, self.state.name),
            )
            self.state.forget(result.job)

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
        self.write_batch(first_of_each_attempt(batch))
        promoted = take_promoted_queues()
        if promoted:
            # Dependents this batch made available: this worker's producers
            # claim them now, not when the NOTIFY comes back (the others do then).
            self.state.wake(promoted)
        notify_freed(self.state, (result for result in batch if not result.locked))
        forget = self.state.forget
        for result in batch:
            if result.locked:
                result.locked = False
                deferred.append(result)
            else:
                forget(result.job)

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

    def write_batch(self, batch: list[AttemptResult]) -> None:
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
                applied = finalize(batch, self.state.alias)
                self.reconnect.succeeded()
                self.state.tally.record(applied, self.state.running)
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
            self.write_batch(batch[:half])
            self.write_batch(batch[half:])
        else:
            self.write_unstorable(batch[0], error)

    def write_unstorable(self, result: AttemptResult, exc: Exception) -> None:
        """Record ``result``'s attempt as failed, naming why its outcome could not be written."""
        job = result.job
        error = (
            f"the attempt's outcome ({result.state}) could not be stored: "
            f"{type(exc).__name__}: {exc}"
        )
        logger.error(
            "job %s kind=%s attempt=%s: %s; recording a failed attempt instead",
            job.id, job.kind, job.attempt, error, extra=log_context(job, self.state.name),
        )  # fmt: skip
        fallback = errored(job, error, "".join(traceback.format_exception(exc)))
        try:
            self.state.tally.record(finalize([fallback], self.state.alias), self.state.running)
        except Exception:  # the job's heartbeat stops, and rescue takes it back
            logger.exception(
                "job %s: not even the failed attempt could be recorded; it will be rescued",
                job.id,
                extra=log_context(job, self.state.name),
            )
            reset_connection()
        result.locked = fallback.locked
