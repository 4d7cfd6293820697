"""Job kinds the test suite runs in real worker processes.

``Act`` does what its ``action`` says, so one kind covers every row of the
handler-result table; every run writes a ``Ledger`` row first.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import connection
from django.utils import timezone

import django_awa as awa
from django_awa.exceptions import TerminalError

from .models import FlowRun, Ledger, Order


@dataclass
class Act(awa.JobArgs):
    action: str = "ok"
    seconds: float = 0.0
    tag: str = ""
    fail_until: int = 0  # raise while attempt <= fail_until


@dataclass
class Echo(awa.JobArgs):
    n: int
    note: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass
class Pay(awa.JobArgs):
    reference: str
    fail: bool = False


@dataclass
class Parked(awa.JobArgs):
    timeout: float = 60.0
    hold: float = 0.0  # seconds to keep running after registering


@dataclass
class Unhandled(awa.JobArgs):
    """A kind with no handler in any process."""

    x: int = 0


@dataclass
class Noop(awa.JobArgs):
    n: int = 0


@dataclass
class Poison(awa.JobArgs):
    """A handler whose outcome holds what PostgreSQL cannot store as it is."""

    action: str


@dataclass
class Bailout(awa.JobArgs):
    """An atomic kind that writes an ``Order``, then raises the BaseException named by ``exc``."""

    reference: str
    exc: str = "SystemExit"


@dataclass
class Severed(awa.JobArgs):
    """An atomic kind whose handler kills its own database session."""

    n: int = 0


class Bail(BaseException):
    """A BaseException of the handler's own: no shutdown, no signal."""


def base_exception(name: str) -> BaseException:
    """A fresh instance of the BaseException subclass ``name``."""
    match name:
        case "KeyboardInterrupt":
            return KeyboardInterrupt()
        case "SystemExit":
            return SystemExit(3)
        case "GeneratorExit":
            return GeneratorExit()
        case "CancelledError":
            return asyncio.CancelledError()
        case "Bail":
            return Bail("bailing out")
        case _:
            raise ValueError(f"unknown BaseException {name!r}")


def _ledger(job: awa.JobContext, note: str = "") -> None:
    Ledger.objects.create(
        job_id=job.id, attempt=job.attempt, run_lease=job.row.run_lease, note=note
    )


@awa.worker(Act, max_attempts=3)
def act(job: awa.JobContext):
    args = job.args
    _ledger(job, args.action)
    if args.fail_until and job.attempt <= args.fail_until:
        raise RuntimeError(f"failing attempt {job.attempt}")
    match args.action:
        case "ok":
            return None
        case "raise":
            raise ValueError(f"boom on attempt {job.attempt}")
        case "terminal":
            raise TerminalError("no point retrying")
        case "retry_after":
            return awa.RetryAfter(args.seconds)
        case "retry_after_td":
            return awa.RetryAfter(timedelta(seconds=args.seconds))
        case "snooze":
            if job.attempt == 1 and not job.metadata.get("snoozed_once"):
                from django_awa.models import Job

                Job.objects.filter(id=job.id).update(metadata={"snoozed_once": True})
                return awa.Snooze(args.seconds)
            return None
        case "cancel":
            return awa.Cancel("not needed any more")
        case "callback":
            token = job.register_callback(timeout=timedelta(seconds=args.seconds or 60))
            return awa.WaitForCallback(token)
        case "sleep":
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                if job.is_cancelled():
                    _ledger(job, "saw-cancel")
                    return None
                time.sleep(0.02)
            return None
        case "progress":
            job.set_progress(40, "working", step=2)
            time.sleep(args.seconds)
            return None
        case "pid":
            _ledger(job, f"pid:{os.getpid()}")
            return None
        case "bad_return":
            return "not a result"
        case "base":
            raise base_exception(args.tag)
        case "stubborn":
            # Ignores cancellation and its deadline: sleeps its whole time.
            time.sleep(args.seconds)
            return None
        case _:
            raise ValueError(f"unknown action {args.action!r}")


# What stress/crash_soak.py --poison mixes in: each outcome holds what
# PostgreSQL cannot store as it is, or a delay no timestamp holds.
POISON_ACTIONS = (
    "nul_error",
    "surrogate_error",
    "nul_cancel",
    "nul_progress",
    "huge_retry",
    "huge_snooze",
    "base:KeyboardInterrupt",
    "base:SystemExit",
    "base:GeneratorExit",
    "base:CancelledError",
    "base:Bail",
)


@awa.worker(Poison, max_attempts=2)
def poison(job: awa.JobContext):
    _ledger(job, job.args.action)
    match job.args.action:
        case "nul_error":
            raise RuntimeError("bad \x00 byte")
        case "surrogate_error":
            raise RuntimeError("bad \udc80")
        case "nul_cancel":
            return awa.Cancel("reason \x00")
        case "nul_progress":
            job.set_progress(50, "msg \x00", note="\udc80")
            return None
        case "huge_retry":
            return awa.RetryAfter(1e13)
        case "huge_snooze":
            return awa.Snooze(1e13)
        case action if action.startswith("base:"):
            raise base_exception(action.removeprefix("base:"))
        case _:
            raise ValueError(f"unknown action {job.args.action!r}")


@awa.worker(Echo, queue="echo", max_attempts=5)
def echo(job: awa.JobContext):
    _ledger(job, f"echo:{job.args.n}")


@awa.worker(Pay, atomic=True, max_attempts=2)
def pay(job: awa.JobContext):
    Order.objects.create(reference=job.args.reference, paid=True)
    _ledger(job, "pay")
    if job.args.fail:
        raise RuntimeError("card declined")


@awa.worker(Parked, max_attempts=2)
def parked(job: awa.JobContext):
    token = job.register_callback(timeout=job.args.timeout)
    _ledger(job, f"callback:{token.id}")
    if job.args.hold:
        time.sleep(job.args.hold)
    return awa.WaitForCallback(token)


@awa.worker(Noop, queue="bulk")
def noop(job: awa.JobContext):
    return None


@awa.worker(Bailout, atomic=True, max_attempts=2)
def bailout(job: awa.JobContext):
    Order.objects.create(reference=job.args.reference, paid=True)
    _ledger(job, "bailout")
    raise base_exception(job.args.exc)


@awa.worker(Severed, atomic=True, max_attempts=1)
def severed(job: awa.JobContext):
    # Its transaction can then neither be rolled back nor committed.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


# -- Flow control (test_flow_control.py): every run records a FlowRun. ----------------


@dataclass
class Span(awa.JobArgs):
    """Sleep ``seconds`` (``first_seconds`` on the first attempt, if given); raise
    while the attempt is at most ``fail_until``."""

    key: str = ""
    n: int = 0
    seconds: float = 0.1
    first_seconds: float = 0.0
    fail_until: int = 0


@dataclass
class KeyedSpan(Span):
    """At most one running per key, fleet-wide."""


@dataclass
class CappedSpan(Span):
    """At most two running, fleet-wide."""


@dataclass
class RatedSpan(Span):
    """At most four starts per key in any second, fleet-wide."""


@dataclass
class SequencedSpan(Span):
    """One at a time per key, in enqueue order."""


def span(job: awa.JobContext):
    args = job.args
    run = FlowRun.objects.create(
        job_id=job.id,
        kind=job.kind,
        queue=job.queue,
        key=args.key,
        n=args.n,
        attempt=job.attempt,
        attempted_at=job.row.attempted_at,
        started_at=timezone.now(),
        pid=os.getpid(),
    )
    time.sleep(args.first_seconds if job.attempt == 1 and args.first_seconds else args.seconds)
    FlowRun.objects.filter(id=run.id).update(ended_at=timezone.now())
    if job.attempt <= args.fail_until:
        raise RuntimeError(f"span {args.key}/{args.n} fails attempt {job.attempt}")


awa.worker(Span, queue="flow", max_attempts=3)(span)
awa.worker(KeyedSpan, queue="bykey", limit=awa.Limit(concurrency=1, by="key"))(span)
awa.worker(CappedSpan, queue="capped", limit=awa.Limit(concurrency=2))(span)
awa.worker(RatedSpan, queue="keyrate", limit=awa.Limit(rate="4/s", by="key"))(span)
awa.worker(SequencedSpan, queue="seq", max_attempts=3, sequence="key")(span)
