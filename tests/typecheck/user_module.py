"""A user's module written against the public API, checked by mypy (strict).

Never imported by the tests: it is here for ``mypy`` (setup.cfg ``files``), so
a change that makes the public names untyped, or typed wrongly for the way a
Django project calls them, fails the type check. Everything a ``jobs.py``,
a ``followups.py`` and a view do: declare kinds, handlers returning each
outcome, enqueue one and many, follow-ups, callbacks, operator controls.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from django.db import transaction

import django_awa as awa
from django_awa.followups import on_cancelled, on_completed, on_exhausted
from django_awa.models import Job


@dataclass
class SendInvoice(awa.JobArgs):
    kind = "typing_send_invoice"
    invoice_id: int
    copies: int = 1


@dataclass
class Archive(awa.JobArgs):
    kind = "typing_archive"
    invoice_id: int


@awa.worker(SendInvoice, queue="email", max_attempts=5, deadline=dt.timedelta(minutes=2))
def send_invoice(job: awa.JobContext) -> awa.RetryAfter | awa.Snooze | awa.Cancel | None:
    args = job.args
    assert isinstance(args, SendInvoice)
    if args.copies > 10:
        return awa.Cancel("too many copies")
    if job.is_cancelled():
        return awa.Snooze(5.0)
    job.set_progress(0.0, "sending", copies=args.copies)
    return None


@awa.worker(Archive, atomic=True, unique=awa.Unique(by_args=True))
def archive(job: awa.JobContext) -> awa.WaitForCallback:
    token: awa.CallbackToken = job.register_callback(timeout=60.0)
    return awa.WaitForCallback(token)


@on_completed(SendInvoice)
def archive_sent(args: SendInvoice, job: Job) -> Archive:
    return Archive(invoice_id=args.invoice_id)


@on_exhausted(SendInvoice)
def report_failure(args: SendInvoice, job: Job, error: str, attempt: int) -> awa.EnqueueRequest:
    return awa.EnqueueRequest(Archive(invoice_id=args.invoice_id), queue="default", priority=1)


@on_cancelled(SendInvoice)
def nothing_to_do(args: SendInvoice, job: Job, reason: str) -> None:
    return None


def place_invoice(invoice_id: int) -> int:
    with transaction.atomic():
        row: Job = awa.enqueue(SendInvoice(invoice_id=invoice_id), priority=2, tags=["invoice"])
    ids: list[int] = awa.enqueue_many(
        [
            SendInvoice(invoice_id=invoice_id + 1),
            awa.EnqueueRequest(Archive(invoice_id=invoice_id), run_at=dt.datetime.now(dt.UTC)),
        ]
    )
    state = awa.JobState(row.state)
    return row.id + len(ids) + (0 if state == awa.JobState.AVAILABLE else 1)


def operate(job_id: int, callback_id: uuid.UUID) -> dict[str, dict[str, object]]:
    awa.complete_external(callback_id, {"tracking": "1Z"})
    awa.cancel(job_id)
    awa.retry(job_id)
    awa.pause_queue("email")
    awa.resume_queue("email")
    try:
        awa.enqueue(SendInvoice(invoice_id=-1))
    except awa.ValidationError as exc:
        message: str = str(exc)
        assert message
    return awa.queue_stats()
