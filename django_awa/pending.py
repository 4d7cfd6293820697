"""Pending follow-ups: committed outcomes whose follow-ups are inserted later.

A rescue keeps its ``on_rescued`` follow-ups here, in its own transaction,
and so does a fallback transition whose own follow-ups failed (SPEC §6);
maintenance inserts them (``Maintenance.replay_one``) and retries with
backoff until it can. A ``PendingFollowup`` row holds the trigger's row as
the transition left it (``snapshot``) and the outcome's context
(``context_json``), both as JSON, in the shapes 0.1.0 wrote them: rows kept
by either release are restored by the other.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models.functions import Now

from .codec import UnreadableJSON
from .followups import (
    CONTEXT_PARAMETERS,
    CONTEXTS,
    FollowupError,
    Outcome,
    OutcomeContext,
    RescueReason,
)
from .models import Job, PendingFollowup, jobs_from_rows


def keep_pending(
    row: Job | None, context: OutcomeContext, alias: str, error: str = ""
) -> PendingFollowup:
    """Keep the follow-ups of ``context``'s outcome for ``row``, in the current transaction.

    ``error`` says why they could not be inserted now, if they were tried.
    """
    if row is None:  # pragma: no cover - by construction
        raise RuntimeError("a pending follow-up needs the trigger's row")
    return PendingFollowup.objects.using(alias).create(
        job_id=row.id,
        kind=row.kind,
        outcome=context.outcome.value,
        context=context_json(context),
        snapshot=snapshot(row),
        last_error=error,
        # The database clock, as replay_pending judges it by.
        next_attempt_at=Now(),
        created_at=Now(),
    )


def restore(pending: PendingFollowup, alias: str) -> tuple[Job, OutcomeContext]:
    """The trigger's row and the outcome's context a pending row kept.

    Raises ``FollowupError`` for a row it cannot restore.
    """
    try:
        outcome = Outcome(pending.outcome)
    except ValueError as exc:
        raise FollowupError(f"pending follow-up {pending.id}: {exc}") from exc
    return from_snapshot(pending.snapshot, alias), context_from_json(outcome, pending.context)


def context_json(context: OutcomeContext) -> dict[str, Any]:
    """``context`` as a pending row keeps it: ``{field: value}``, datetimes in ISO format."""
    return {
        name: value.isoformat() if isinstance(value, dt.datetime) else value
        for name, value in context.as_dict().items()
    }


def context_from_json(outcome: Outcome, data: dict[str, Any]) -> OutcomeContext:
    """The context a pending row of ``outcome`` kept (``context_json``, or 0.1.0's dict).

    Raises ``FollowupError`` for a row it cannot restore.
    """
    values: dict[str, Any] = {name: data.get(name) for name in CONTEXT_PARAMETERS[outcome]}
    try:
        if isinstance(values.get("next_run_at"), str):
            values["next_run_at"] = dt.datetime.fromisoformat(values["next_run_at"])
        if outcome is Outcome.RESCUED:
            values["reason"] = RescueReason(values["reason"])
        return CONTEXTS[outcome](**values)
    except (TypeError, ValueError) as exc:
        raise FollowupError(f"the kept {outcome} context cannot be restored: {exc}") from exc


def snapshot(job: Job) -> dict[str, Any]:
    """``job``'s columns as JSON (``{attname: value}``). A value its row holds that
    Python could not read is kept as the text saying so (``UnreadableJSON``)."""
    data = {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}
    for name, value in data.items():
        if isinstance(value, UnreadableJSON):
            data[name] = str(value)
    encoded: dict[str, Any] = json.loads(json.dumps(data, cls=DjangoJSONEncoder))
    return encoded


def from_snapshot(data: dict[str, Any], alias: str) -> Job:
    """The ``Job`` a ``snapshot`` describes, as read on ``alias``."""
    row = []
    for f in Job._meta.concrete_fields:
        value = data.get(f.attname)
        row.append(value if isinstance(value, (dict, list)) else f.to_python(value))
    (job,) = jobs_from_rows([row], alias, json_text=False)
    return job
