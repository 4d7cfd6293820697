"""External callbacks: resolve a ``waiting_external`` job from any Django process.

``complete_external``, ``fail_external``, ``retry_external`` and
``heartbeat_callback`` lock the job by its callback id, join the caller's
open transaction on ``using`` and insert the outcome's follow-ups in it. A
failing follow-up raises to the caller; the transaction (or the savepoint
these functions open) rolls back, and the job is still ``waiting_external``
with the same callback id, so the sender can try again.

A callback that arrives while the handler is still running (the outside
system answered before the handler returned ``WaitForCallback``) is recorded
on the row and applied when the job parks.

The HTTP receiver (``callback_view``) checks a timestamped HMAC-SHA256
signature of the callback id, the action and the body; ``sign()`` makes the
headers for senders written in Python.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from . import sql, wakeups
from .codec import check_json, require_text
from .conf import awa_settings, callback_timeout
from .dependencies import after_outcomes
from .enqueueing import database_alias
from .exceptions import CallbackNotFound, UniqueConflict, ValidationError
from .followups import (
    COMPLETED,
    Exhausted,
    FollowupError,
    OutcomeContext,
    Retried,
    dispatch,
    dispatch_many,
    send_signal,
)
from .models import Job, JobState, jobs_from_rows
from .sequences import after_finishing

logger = logging.getLogger(__name__)

EARLY_KEY = "awa_early_callback"
RESULT_KEY = "awa_callback_result"


class CallbackAction(enum.StrEnum):
    """What an outside system may do with a callback: the last segment of its URL,
    and part of what a signature covers (SPEC §7)."""

    COMPLETE = "complete"
    FAIL = "fail"
    RETRY = "retry"
    HEARTBEAT = "heartbeat"


# The actions that resolve a callback (a heartbeat only extends it).
RESOLVING = (CallbackAction.COMPLETE, CallbackAction.FAIL, CallbackAction.RETRY)
# The body fields each action takes.
BODY_FIELDS = {
    CallbackAction.COMPLETE: {"payload"},
    CallbackAction.FAIL: {"error"},
    CallbackAction.RETRY: set(),
    CallbackAction.HEARTBEAT: {"timeout"},
}
SIGNATURE_HEADER = "X-Awa-Signature"
TIMESTAMP_HEADER = "X-Awa-Timestamp"
MAX_SKEW = 300
MAX_BODY = 1_000_000
# A receipt outlives every replay of its request that the clock check would let
# through: a timestamp up to MAX_SKEW ahead stays acceptable 2 * MAX_SKEW.
RECEIPT_RETENTION = 2 * MAX_SKEW + 60


def _parse_id(callback_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return callback_id if isinstance(callback_id, uuid.UUID) else uuid.UUID(str(callback_id))
    except ValueError:
        raise CallbackNotFound(f"no job is waiting on callback {callback_id!r}") from None


def _lock(callback_id: uuid.UUID, alias: str) -> Job:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.LOCK_BY_CALLBACK, {"callback_id": callback_id})
        row = cursor.fetchone()
    if row is None:
        raise CallbackNotFound(f"no job is waiting on callback {callback_id}")
    (job,) = jobs_from_rows([row], alias)
    return job


def _early_for(job: Job, callback_id: uuid.UUID | None) -> dict[str, Any] | None:
    """The early callback recorded on ``job`` for ``callback_id``, if any."""
    early = (job.metadata or {}).get(EARLY_KEY)
    if callback_id is None or not isinstance(early, dict):
        return None
    return early if early.get("callback_id") == str(callback_id) else None


def _resolve(
    job: Job,
    action: CallbackAction,
    *,
    payload: Any = None,
    error: str | None = None,
    alias: str,
) -> Job:
    """Apply a resolution to a locked ``waiting_external`` job, with its follow-ups."""
    context: OutcomeContext
    if action == CallbackAction.COMPLETE:
        state, reset, context = JobState.COMPLETED, False, COMPLETED
        metadata, error_entry = {RESULT_KEY: payload}, None
    elif action == CallbackAction.FAIL:
        state, reset = JobState.FAILED, False
        context = Exhausted(error=error or "", attempt=job.attempt)
        metadata, error_entry = {}, error
    elif action == CallbackAction.RETRY:
        state, reset = JobState.AVAILABLE, True
        metadata, error_entry = {}, None
        context = Retried(error="retried externally", attempt=job.attempt)
    else:  # pragma: no cover - callers pass one of the three
        raise ValueError(action)
    with connections[alias].cursor() as cursor:
        try:
            cursor.execute(
                sql.RESOLVE_CALLBACK,
                {
                    "id": job.id,
                    "state": state.value,
                    "reset": reset,
                    "metadata": json.dumps(metadata),
                    "error": error_entry,
                },
            )
        except IntegrityError as exc:
            raise _key_held([job], state) from exc
        (row,) = jobs_from_rows([cursor.fetchone()], alias)
        if state == JobState.AVAILABLE:
            wakeups.announce(alias, [row.queue], cursor)
    context = context.after(row)
    dispatch(row, context, alias)
    send_signal(row, context, alias)
    after_outcomes([row], alias)
    after_finishing([row], alias)
    logger.info(
        "job %s kind=%s attempt=%s -> %s by callback %s (%s)",
        row.id, row.kind, job.attempt, row.state, job.callback_id, action,
        extra={"job_id": row.id, "kind": row.kind, "queue": row.queue, "attempt": job.attempt},
    )  # fmt: skip
    return row


def _key_held(jobs: list[Job], state: JobState) -> UniqueConflict:
    """The error of resolving ``jobs`` into ``state``, a state their unique key is held
    in, when another job holds it: a twin enqueued while they waited on their callback
    (``waiting_external`` does not hold the key by default). Nothing was written."""
    if len(jobs) == 1:
        (job,) = jobs
        what = f"callback {job.callback_id}: job {job.id} (kind {job.kind!r})"
    else:
        what = f"jobs {', '.join(str(job.id) for job in jobs)}: one of them"
    return UniqueConflict(
        f"{what} cannot become {state}: another job holds its unique key, which it did not "
        f"hold while it waited on its callback; it still waits (fail_external ends it)"
    )


def _external(
    callback_id: uuid.UUID | str,
    action: CallbackAction,
    *,
    payload: Any = None,
    error: str | None = None,
    using: str | None,
    savepoint: bool = True,
) -> Job:
    """Resolve the callback in a transaction, or a savepoint of the caller's;
    ``savepoint=False``: in the caller's transaction itself, which rolls back
    whole on an error (the callback receiver's)."""
    alias = database_alias(using)
    cid = _parse_id(callback_id)
    with transaction.atomic(using=alias, savepoint=savepoint):
        job = _lock(cid, alias)
        if job.state == JobState.RUNNING and not _early_for(job, cid):
            # The handler registered the callback and has not returned yet. The
            # record names the callback: one left by an earlier attempt (whose
            # handler then raised, or was rescued) must not resolve this one.
            early = {"callback_id": str(cid), "action": action, "payload": payload, "error": error}
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    sql.RECORD_EARLY_CALLBACK, {"id": job.id, "early": json.dumps(early)}
                )
            job.metadata = {**(job.metadata or {}), EARLY_KEY: early}
            logger.info("callback %s for job %s arrived early; applied when it parks", cid, job.id)
            return job
        if job.state != JobState.WAITING_EXTERNAL:
            raise CallbackNotFound(
                f"callback {cid} is already resolved (job {job.id} is {job.state})"
            )
        return _resolve(job, action, payload=payload, error=error, alias=alias)


def complete_external(
    callback_id: uuid.UUID | str, payload: Any = None, *, using: str | None = None
) -> Job:
    """Complete the job waiting on ``callback_id``; ``payload`` is kept as
    ``metadata["awa_callback_result"]``. Completed follow-ups commit with it.
    Raises ``CallbackNotFound``, ``FollowupError``, ``UniqueConflict`` or ``ValidationError``."""
    return _complete(callback_id, payload, using=using)


def _unstorable(payload: Any) -> str | None:
    """Why a callback's ``payload`` cannot be stored as JSON; ``None`` when it can."""
    try:
        check_json(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        return str(exc)
    return None


def _complete(
    callback_id: uuid.UUID | str, payload: Any, *, using: str | None, savepoint: bool = True
) -> Job:
    if (why := _unstorable(payload)) is not None:
        raise ValidationError(f"complete_external: payload cannot be stored: {why}")
    return _external(
        callback_id, CallbackAction.COMPLETE, payload=payload, using=using, savepoint=savepoint
    )


def complete_external_many(
    callbacks: Iterable[tuple[uuid.UUID | str, Any]], *, using: str | None = None
) -> dict[uuid.UUID, Job | None]:
    """``complete_external`` for many (callback id, payload) pairs, in a few statements.

    For a sender answering callbacks by the hundred: the jobs are locked,
    completed and their Completed follow-ups inserted a statement each for the
    whole batch, in one transaction (a savepoint of the caller's), instead of
    a transaction and several round trips per callback. Returns each callback
    id (as a UUID) with its job as now written, or ``None`` for an unknown or
    already-resolved callback (which ``complete_external`` refuses with
    ``CallbackNotFound``); a callback whose handler still runs is recorded
    and applied when the job parks, as ``complete_external`` does.

    Raises ``ValidationError`` before writing anything for an id that is not a
    UUID, an id given twice, or a payload that cannot be stored; a failing
    follow-up raises ``FollowupError`` and nothing of the batch is written.
    """
    alias = database_alias(using)
    payloads: dict[uuid.UUID, Any] = {}
    for callback_id, payload in callbacks:
        try:
            cid = _parse_id(callback_id)
        except CallbackNotFound:
            message = f"complete_external_many: {callback_id!r} is not a UUID"
            raise ValidationError(message) from None
        if cid in payloads:
            raise ValidationError(f"complete_external_many: callback {cid} given twice")
        if (why := _unstorable(payload)) is not None:
            raise ValidationError(
                f"complete_external_many: the payload for {cid} cannot be stored: {why}"
            )
        payloads[cid] = payload
    results: dict[uuid.UUID, Job | None] = dict.fromkeys(payloads)
    if not payloads:
        return results
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.LOCK_BY_CALLBACKS, {"callback_ids": list(payloads)})
            locked = jobs_from_rows(cursor.fetchall(), alias)
        waiting = [job for job in locked if job.state == JobState.WAITING_EXTERNAL]
        for job in locked:
            if job.state == JobState.RUNNING and job.callback_id is not None:
                # Early (its handler has not returned yet): recorded as one call would,
                # unless an answer is recorded already.
                try:
                    results[job.callback_id] = _external(
                        job.callback_id, CallbackAction.COMPLETE,
                        payload=payloads[job.callback_id], using=alias,
                    )  # fmt: skip
                except CallbackNotFound:
                    pass
        if waiting:
            rows = _complete_waiting(waiting, payloads, alias)
            for row in rows:
                results[row.callback_id] = row  # type: ignore[index]
    return results


def _complete_waiting(waiting: list[Job], payloads: dict[uuid.UUID, Any], alias: str) -> list[Job]:
    """Complete the locked ``waiting`` jobs with their payloads, and their follow-ups."""
    with connections[alias].cursor() as cursor:
        try:
            cursor.execute(
                sql.COMPLETE_CALLBACKS,
                {
                    "id": [job.id for job in waiting],
                    "metadata": [
                        json.dumps({RESULT_KEY: payloads[job.callback_id]})  # type: ignore[index]
                        for job in waiting
                    ],
                },
            )
        except IntegrityError as exc:
            raise _key_held(waiting, JobState.COMPLETED) from exc
        rows = jobs_from_rows(cursor.fetchall(), alias)
    outcomes = [(row, COMPLETED.after(row)) for row in rows]
    dispatch_many(outcomes, alias)
    after_outcomes(rows, alias)
    after_finishing(rows, alias)
    for row, context in outcomes:
        send_signal(row, context, alias)
        logger.info(
            "job %s kind=%s attempt=%s -> %s by callback %s (%s)",
            row.id, row.kind, row.attempt, row.state, row.callback_id, CallbackAction.COMPLETE,
            extra={"job_id": row.id, "kind": row.kind, "queue": row.queue, "attempt": row.attempt},
        )  # fmt: skip
    return rows


def fail_external(callback_id: uuid.UUID | str, error: str, *, using: str | None = None) -> Job:
    """Fail the job waiting on ``callback_id`` whatever attempts remain (Exhausted follow-ups)."""
    return _fail(callback_id, error, using=using)


def _fail(
    callback_id: uuid.UUID | str, error: str, *, using: str | None, savepoint: bool = True
) -> Job:
    if not isinstance(error, str) or not error:
        # As the HTTP receiver asks: a failure says why (it is the job's errors entry).
        raise ValidationError(f"fail_external: error must be a non-empty string, got {error!r}")
    require_text(error, "fail_external: error")
    return _external(
        callback_id, CallbackAction.FAIL, error=error, using=using, savepoint=savepoint
    )


def retry_external(callback_id: uuid.UUID | str, *, using: str | None = None) -> Job:
    """Make the job waiting on ``callback_id`` available now with its attempts reset.

    Retried follow-ups get ``error="retried externally"``, the attempt before
    the reset and ``next_run_at`` now."""
    return _external(callback_id, CallbackAction.RETRY, using=using)


def heartbeat_callback(
    callback_id: uuid.UUID | str, timeout: float | dt.timedelta, *, using: str | None = None
) -> Job:
    """Push the callback's timeout to ``timeout`` from now (1 second to 365 days).
    Raises ``CallbackNotFound`` or ``ValidationError``."""
    seconds = callback_timeout(timeout, "heartbeat_callback: timeout")
    alias = database_alias(using)
    cid = _parse_id(callback_id)
    with transaction.atomic(using=alias):
        job = _lock(cid, alias)
        if job.state not in (JobState.WAITING_EXTERNAL, JobState.RUNNING):
            raise CallbackNotFound(
                f"callback {cid} is already resolved (job {job.id} is {job.state})"
            )
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.EXTEND_CALLBACK, {"id": job.id, "timeout": seconds})
            (extended,) = jobs_from_rows([cursor.fetchone()], alias)
            return extended


def apply_early(row: Job, alias: str) -> Job | None:
    """After a job parked: apply a callback that arrived while its handler ran.

    Runs inside finalize's transaction, in a savepoint: if the resolution's
    follow-ups fail, the job stays parked on the same callback id, which a
    later call may still resolve, until the callback times out and is rescued.
    Only a record naming the callback the job parked on is applied.
    """
    early = _early_for(row, row.callback_id)
    if early is None:
        return None
    action = early.get("action")
    if action not in RESOLVING:
        logger.error("job %s: ignoring an early callback with action %r", row.id, action)
        return None
    try:
        with transaction.atomic(using=alias):
            return _resolve(
                row,
                CallbackAction(action),
                payload=early.get("payload"),
                error=early.get("error"),
                alias=alias,
            )
    except (FollowupError, DatabaseError, UniqueConflict):
        # Caught, not raised: finalize's transaction must still commit the park
        # (the savepoint above rolled back only the resolution). Re-raising
        # would make the worker write the same batch again, forever.
        logger.exception(
            "job %s kind=%s: the early callback %s could not be applied; the job waits on it",
            row.id,
            row.kind,
            row.callback_id,
            extra={"job_id": row.id, "kind": row.kind, "queue": row.queue},
        )
        return None


# -- the HTTP receiver ------------------------------------------------------------


def prune_receipts(using: str | None = None) -> int:
    """Delete receipts of accepted requests too old to be replayed; returns how many.

    For maintenance's prune duty: without it ``awa_callback_receipt`` keeps one
    row per accepted request for ever.
    """
    alias = database_alias(using)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.PRUNE_RECEIPTS, {"keep": RECEIPT_RETENTION})
        deleted: int = cursor.rowcount
        return deleted


def signature(body: bytes, secret: str, timestamp: str, callback_id: str, action: str) -> str:
    """HMAC-SHA256 of ``"{timestamp}.{callback_id}.{action}."`` and the raw body (SPEC §7):
    good for one callback and one action only."""
    signed = f"{timestamp}.{callback_id}.{action}.".encode() + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(
    body: bytes | str,
    secret: str,
    *,
    callback_id: uuid.UUID | str,
    action: str,
    timestamp: int | None = None,
) -> dict[str, str]:
    """The two headers a sender adds to a callback request with this ``body``, to
    ``POST <prefix>/callbacks/<callback_id>/<action>``.

    Raises ``ValueError`` for an id that is not a UUID or an unknown action.
    """
    if action not in CallbackAction:
        raise ValueError(f"action must be one of {', '.join(CallbackAction)}, got {action!r}")
    cid = str(callback_id if isinstance(callback_id, uuid.UUID) else uuid.UUID(str(callback_id)))
    raw = body.encode() if isinstance(body, str) else body
    stamp = str(int(time.time()) if timestamp is None else int(timestamp))
    return {TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: signature(raw, secret, stamp, cid, action)}


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def _verify(
    request: HttpRequest, body: bytes, callback_id: uuid.UUID, action: str
) -> str | JsonResponse:
    """The request's signature if it is good for this callback and action, else a 403."""
    stamp = request.headers.get(TIMESTAMP_HEADER, "")
    given = request.headers.get(SIGNATURE_HEADER, "")
    if not stamp or not given:
        return _error(403, f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
    return _check_signature(body, callback_id, action, stamp, given)


def _check_signature(
    body: bytes, callback_id: uuid.UUID, action: str, stamp: str, given: str
) -> str | JsonResponse:
    """The signature ``given`` with ``stamp`` if good for this body, callback and action
    (normalised: the receipt's key), else a 403."""
    secret = awa_settings().callback_secret
    if not secret:
        return _error(403, "callbacks are disabled: AWA['CALLBACK_SECRET'] is not set")
    try:
        skew = abs(time.time() - int(stamp))
    except ValueError:
        return _error(403, f"{TIMESTAMP_HEADER} must be Unix seconds")
    if skew > MAX_SKEW:
        return _error(403, "stale or future timestamp")
    expected = signature(body, secret, stamp, str(callback_id), action)
    if not hmac.compare_digest(expected.encode(), given.strip().lower().encode()):
        return _error(403, "bad signature")
    return expected


class _IntegerTooLong(ValueError):
    pass


def _parse_int(text: str) -> int:
    # json.loads hands each integer's digits here; int() refuses more than
    # sys.get_int_max_str_digits() (4,300) with a ValueError, which would read
    # as malformed JSON.
    try:
        return int(text)
    except ValueError:
        digits = len(text.lstrip("-"))
        raise _IntegerTooLong(f"an integer in the body is too large ({digits} digits)") from None


def _parse(action: CallbackAction, body: bytes) -> dict[str, Any] | JsonResponse:
    try:
        data = json.loads(body or b"{}", parse_int=_parse_int)
    except _IntegerTooLong as exc:
        return _error(400, str(exc))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return _error(400, "body must be a JSON object")
    if not isinstance(data, dict):
        return _error(400, "body must be a JSON object")
    extra = set(data) - BODY_FIELDS[action]
    if extra:
        return _error(400, f"unexpected field(s) for {action}: {', '.join(sorted(extra))}")
    error = data.get("error")
    if action == CallbackAction.FAIL and (not isinstance(error, str) or not error):
        return _error(400, 'fail needs {"error": "<non-empty string>"}')
    if action == CallbackAction.HEARTBEAT:
        try:
            callback_timeout(data.get("timeout"), 'heartbeat: {"timeout": <seconds>}')
        except ValidationError as exc:
            return _error(400, str(exc))
    return data


def _read_body(request: HttpRequest) -> bytes | JsonResponse:
    """The request's body, or a 400 or 413 for a bad length or one over MAX_BODY."""
    length = request.headers.get("Content-Length") or "0"
    if not (length.isascii() and length.isdigit()):  # "-1", "²", "1e3": not a length
        return _error(400, f"bad Content-Length header {length[:40]!r}")
    # Compared as text first: int() refuses more than 4,300 digits.
    if len(length.lstrip("0")) > len(str(MAX_BODY)) or int(length) > MAX_BODY:
        return _error(413, f"body over {MAX_BODY} bytes")
    try:
        body = request.body
    except RequestDataTooBig:  # DATA_UPLOAD_MAX_MEMORY_SIZE is below MAX_BODY
        return _error(413, "body over DATA_UPLOAD_MAX_MEMORY_SIZE")
    if not body and length == "0" and "wsgi.input" in request.META:
        chunked = _chunked_body(request)
        if chunked is not None:
            return chunked
    if len(body) > MAX_BODY:  # no Content-Length (chunked, ASGI): judged once read
        return _error(413, f"body over {MAX_BODY} bytes")
    return body


def _chunked_body(request: HttpRequest) -> bytes | JsonResponse | None:
    """The body of a chunked request under WSGI, which Django does not read: without a
    Content-Length it takes the body as empty, and the signature, made over the real
    one, would be refused as bad. None if the request is not chunked."""
    if "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
        return None
    if not request.META.get("wsgi.input_terminated"):
        # The server does not promise that the input ends with the body: reading
        # past it could wait for ever.
        return _error(411, "this server cannot read a chunked body: send a Content-Length header")
    limit = min(MAX_BODY, settings.DATA_UPLOAD_MAX_MEMORY_SIZE or MAX_BODY)
    body: bytes = request.META["wsgi.input"].read(limit + 1)
    if len(body) > limit:
        return _error(413, f"body over {limit} bytes")
    return body


def _posted_body(request: HttpRequest) -> bytes | JsonResponse:
    """The body of a POST, or the answer to another method (405) or to a body too large."""
    if request.method != "POST":
        response = _error(405, "use POST")
        response["Allow"] = "POST"
        return response
    return _read_body(request)


@csrf_exempt
def callback_view(request: HttpRequest, callback_id: uuid.UUID, action: str) -> JsonResponse:
    """``POST <prefix>/callbacks/<uuid>/{complete,fail,retry,heartbeat}``."""
    if action not in CallbackAction:
        return _error(404, f"unknown action {action!r}")
    action = CallbackAction(action)
    body = _posted_body(request)
    if isinstance(body, JsonResponse):
        return body
    verified = _verify(request, body, callback_id, action)
    if isinstance(verified, JsonResponse):
        return verified
    data = _parse(action, body)
    if isinstance(data, JsonResponse):
        return data
    alias = database_alias(None)
    try:
        # The endpoint's own transaction: the queues it makes jobs available in
        # are woken after its commit, not by a NOTIFY inside it (wakeups.py).
        with wakeups.after_commit(alias), transaction.atomic(using=alias):
            # A replayed request is refused; the receipt commits only with success.
            # The signature covers timestamp, callback, action and body: it
            # names the request.
            with connections[alias].cursor() as cursor:
                cursor.execute(sql.RECORD_RECEIPT, {"signature": verified})
                if cursor.fetchone() is None:
                    return _error(403, "replayed request")
            # Resolved in this transaction itself, without a savepoint: an error
            # rolls it back whole, the receipt with it.
            if action == CallbackAction.COMPLETE:
                job = _complete(callback_id, data.get("payload"), using=alias, savepoint=False)
            elif action == CallbackAction.FAIL:
                job = _fail(callback_id, data["error"], using=alias, savepoint=False)
            elif action == CallbackAction.RETRY:
                job = _external(callback_id, action, using=alias, savepoint=False)
            else:
                job = heartbeat_callback(callback_id, data["timeout"], using=alias)
    except CallbackNotFound as exc:
        return _error(404, str(exc))
    except ValidationError as exc:
        return _error(400, str(exc))
    except FollowupError as exc:
        logger.warning("callback %s %s: follow-up failed: %s", callback_id, action, exc)
        return _error(503, "a follow-up failed; the job is unchanged, try again")
    except UniqueConflict as exc:
        logger.warning("callback %s %s refused: %s", callback_id, action, exc)
        return _error(409, str(exc))
    return JsonResponse({"id": job.id, "state": job.state})


# At most this many callbacks in one request to the batch receiver.
MAX_BATCH = 500


def _batch_entries(body: bytes) -> list[dict[str, Any]] | JsonResponse:
    """The batch body's entries, or a 400 saying what is wrong with it."""
    try:
        data = json.loads(body or b"{}", parse_int=_parse_int)
    except (ValueError, RecursionError):  # _IntegerTooLong is a ValueError
        return _error(400, 'body must be {"callbacks": [...]}')
    entries = data.get("callbacks") if isinstance(data, dict) else None
    if not isinstance(entries, list) or set(data) != {"callbacks"}:
        return _error(400, 'body must be {"callbacks": [...]}')
    if len(entries) > MAX_BATCH:
        return _error(400, f"at most {MAX_BATCH} callbacks a request")
    fields = {"id", "timestamp", "signature", "body"}
    for position, entry in enumerate(entries):
        if not (
            isinstance(entry, dict)
            and set(entry) == fields
            and all(isinstance(value, str) for value in entry.values())
        ):
            return _error(
                400, f"callbacks[{position}] must have the strings {', '.join(sorted(fields))}"
            )
    return entries


def _batch_check(entry: dict[str, Any]) -> tuple[uuid.UUID, str, Any] | JsonResponse:
    """An entry's (callback id, signature, payload) if it is what the one-callback
    receiver would accept for ``complete``, else its error."""
    try:
        cid = uuid.UUID(entry["id"])
    except ValueError:
        return _error(404, f"no job is waiting on callback {entry['id'][:40]!r}")
    raw = entry["body"].encode()
    verified = _check_signature(
        raw, cid, CallbackAction.COMPLETE, entry["timestamp"], entry["signature"]
    )
    if isinstance(verified, JsonResponse):
        return verified
    data = _parse(CallbackAction.COMPLETE, raw)
    if isinstance(data, JsonResponse):
        return data
    if (why := _unstorable(data.get("payload"))) is not None:
        return _error(400, f"complete_external: payload cannot be stored: {why}")
    return cid, verified, data.get("payload")


def _result(cid: Any, response: JsonResponse) -> dict[str, Any]:
    return {"id": str(cid), "status": response.status_code, **json.loads(response.content)}


@csrf_exempt
def callback_batch_view(request: HttpRequest) -> JsonResponse:
    """``POST <prefix>/callbacks/complete``: many ``complete`` callbacks in one request.

    Each entry of ``{"callbacks": [{"id", "timestamp", "signature", "body"}, ...]}``
    is one callback's ``POST <prefix>/callbacks/<id>/complete``: its raw body
    (``{"payload": ...}``, as text) and its two headers' values, signed as that
    request is, and judged as it would be (403, 404, 400); the good ones are
    completed in one transaction (``complete_external_many``). Answers 200 with
    ``{"results": [{"id", "status", "state" or "error"}, ...]}`` in the entries'
    order, or 503 if a follow-up failed (nothing written: the sender retries).
    """
    body = _posted_body(request)
    if isinstance(body, JsonResponse):
        return body
    entries = _batch_entries(body)
    if isinstance(entries, JsonResponse):
        return entries
    checked = [_batch_check(entry) for entry in entries]
    good = {c[1]: c for c in checked if not isinstance(c, JsonResponse)}
    alias = database_alias(None)
    results: dict[uuid.UUID, Job | None] = {}
    try:
        with wakeups.after_commit(alias), transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute(sql.RECORD_RECEIPTS, {"signatures": list(good)})
                new = {row[0] for row in cursor.fetchall()}
            taken: set[uuid.UUID] = set()
            gone: list[str] = []
            for position, check in enumerate(checked):
                if isinstance(check, JsonResponse):
                    continue
                cid, verified, _ = check
                if verified not in new:  # replayed (or this very entry given twice)
                    checked[position] = _error(403, "replayed request")
                elif cid in taken:  # resolved by an entry before it
                    checked[position] = _error(404, f"callback {cid} is already resolved")
                    gone.append(verified)
                else:
                    taken.add(cid)
                new.discard(verified)
            todo = [c for c in checked if not isinstance(c, JsonResponse)]
            results = complete_external_many([(c[0], c[2]) for c in todo], using=alias)
            gone += [c[1] for c in todo if results[c[0]] is None]
            if gone:  # as the one-callback receiver: a 404 keeps no receipt
                with connections[alias].cursor() as cursor:
                    cursor.execute(sql.FORGET_RECEIPTS, {"signatures": gone})
    except FollowupError as exc:
        logger.warning("callbacks batch: follow-up failed: %s", exc)
        return _error(503, "a follow-up failed; no job changed, try again")
    except UniqueConflict as exc:
        logger.warning("callbacks batch refused: %s", exc)
        return _error(409, f"{exc}; no job changed")
    out = []
    for entry, check in zip(entries, checked, strict=True):
        if isinstance(check, JsonResponse):
            out.append(_result(entry["id"], check))
            continue
        job = results.get(check[0])
        if job is None:
            out.append(_result(check[0], _error(404, f"no job is waiting on callback {check[0]}")))
        else:
            out.append({"id": str(check[0]), "status": 200, "job": job.id, "state": job.state})
    return JsonResponse({"results": out})
