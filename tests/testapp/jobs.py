"""Job kinds the test suite runs in real worker processes.

``Act`` does what its ``action`` says, so one kind covers every row of the
handler-result table; every run writes a ``Ledger`` row first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.db import DatabaseError, OperationalError, connection, connections, transaction
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
class Stamp(awa.JobArgs):
    """An atomic kind whose ``Ledger`` row notes its transaction's id."""

    n: int = 0


@dataclass
class Severed(awa.JobArgs):
    """An atomic kind whose handler kills its own database session; ``quiet``: it
    swallows the error and returns, leaving the worker a dead connection."""

    n: int = 0
    quiet: bool = False


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
        case "cancel_none":
            return awa.Cancel(None)  # type: ignore[arg-type]  # a caller with no reason
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
        case "log":
            logging.getLogger("tests.testapp.jobs").warning("handler says %s", args.tag)
            return None
        case "leave_atomic":
            # A transaction entered and never left (a context manager's __exit__ skipped).
            transaction.atomic().__enter__()
            Order.objects.create(reference=f"leaked-{job.id}")
            return None
        case "leave_autocommit":
            transaction.set_autocommit(False)
            Order.objects.create(reference=f"leaked-{job.id}")
            return None
        case "modules":
            # Whether this process imported OpenTelemetry (tests/test_otel.py).
            loaded = any(m.split(".")[0] == "opentelemetry" for m in sys.modules)
            _ledger(job, f"opentelemetry:{loaded}")
            return None
        case "pid":
            _ledger(job, f"pid:{os.getpid()}")
            return None
        case "tracing":
            # The project's SDK set up once the worker runs (tests/otel_settings.py).
            from tests.otel_settings import install_tracer_provider

            install_tracer_provider()
            return None
        case "propagate":
            # An Echo enqueued under the trace context the job recorded, made current
            # as an instrumentation makes an incoming request's (tests/test_otel.py).
            from opentelemetry import context, propagate

            token = context.attach(propagate.extract(job.metadata.get("awa_trace", {})))
            try:
                awa.enqueue(Echo(n=job.id, note="propagated"))
            finally:
                context.detach(token)
            return None
        case "backend_pid":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                _ledger(job, f"backend:{cursor.fetchone()[0]}")
            return None
        case "bad_return":
            return {"a set": {1, 2}}
        case "result":
            return {"order": args.tag or "ok", "total": 1999, "text": "nul \x00 kept"}
        case "bad_sql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
        case "bad_orm":
            # The ORM's write fails (the note is longer than its column): a DataError
            # raised through Django's mark_for_rollback_on_error.
            Ledger.objects.create(
                job_id=job.id, attempt=job.attempt, run_lease=job.row.run_lease, note="x" * 101
            )
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


@awa.worker(Stamp, atomic=True)
def stamp(job: awa.JobContext):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()::text")
        (xid,) = cursor.fetchone()
    _ledger(job, f"xid:{xid}")


@awa.worker(Severed, atomic=True, max_attempts=1)
def severed(job: awa.JobContext):
    # Its transaction can then neither be rolled back nor committed.
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    except OperationalError:
        if not job.args.quiet:
            raise


@dataclass
class AtomicEarlyAnswer(awa.JobArgs):
    """An atomic kind whose outside system answers its callback before it returns."""

    payload: str = "early"
    # Write the job's own row first (its transaction then holds it): no answer is sent.
    touch_row: bool = False


@awa.worker(AtomicEarlyAnswer, atomic=True, max_attempts=1)
def atomic_early_answer(job: awa.JobContext):
    if job.args.touch_row:
        from django_awa.models import Job

        Job.objects.filter(id=job.id).update(tags=["touched"])
        return awa.WaitForCallback(job.register_callback(timeout=60))
    token = job.register_callback(timeout=60)
    answered: list[str] = []

    def outside_system() -> None:  # another thread: a connection, and a session, of its own
        try:
            awa.complete_external(token.id, {"answer": job.args.payload})
            answered.append("accepted")
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            answered.append(type(exc).__name__)
        finally:
            connections.close_all()

    thread = threading.Thread(target=outside_system)
    thread.start()
    thread.join(10)
    _ledger(job, f"answer:{answered}")
    return awa.WaitForCallback(token)


@dataclass
class LeakyAtomic(awa.JobArgs):
    """An atomic kind whose handler enters a transaction it never leaves."""

    reference: str = ""


@awa.worker(LeakyAtomic, atomic=True, max_attempts=1)
def leaky_atomic(job: awa.JobContext):
    transaction.atomic().__enter__()
    Order.objects.create(reference=job.args.reference)


@dataclass
class Unwound(awa.JobArgs):
    """An atomic kind whose handler writes an ``Order``, then returns normally in a
    transaction that cannot commit: ``how`` says how it spoilt it."""

    reference: str = ""
    how: str = "set_rollback"


@awa.worker(Unwound, atomic=True, max_attempts=2)
def unwound(job: awa.JobContext):
    Order.objects.create(reference=job.args.reference)
    if job.args.how == "set_rollback":
        transaction.set_rollback(True)
    elif job.args.how == "orm_error":  # too long for the column, caught
        with contextlib.suppress(DatabaseError):
            Order.objects.create(reference="x" * 101)
    elif job.args.how == "sql_error":
        with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    elif job.args.how == "close":
        connection.close()
    elif job.args.how == "self_cancel":  # in its own transaction, so rolled back with it
        awa.cancel(job.id)


# -- async handlers and timeouts ---------------------------------------------------


@dataclass
class AsyncAct(awa.JobArgs):
    """The async counterpart of ``Act``: each run writes a ``Ledger`` row through the async ORM."""

    action: str = "ok"
    seconds: float = 0.0
    n: int = 0


async def _aledger(job: awa.JobContext, note: str) -> None:
    await Ledger.objects.acreate(
        job_id=job.id or 0, attempt=job.attempt, run_lease=job.row.run_lease, note=note
    )


def _enter_and_order(reference: str) -> None:
    transaction.atomic().__enter__()
    Order.objects.create(reference=reference)


@awa.worker(AsyncAct, max_attempts=3)
async def async_act(job: awa.JobContext):
    args = job.args
    await _aledger(job, f"async:{args.action}")
    match args.action:
        case "ok":
            return None
        case "value":
            await asyncio.sleep(0)
            return {"doubled": args.n * 2}
        case "raise":
            raise ValueError(f"async boom on attempt {job.attempt}")
        case "terminal":
            raise TerminalError("async: no point retrying")
        case "retry_after":
            return awa.RetryAfter(args.seconds)
        case "snooze":
            if job.attempt == 1 and not job.metadata.get("snoozed_once"):
                from django_awa.models import Job

                await Job.objects.filter(id=job.id).aupdate(metadata={"snoozed_once": True})
                return awa.Snooze(args.seconds)
            return None
        case "cancel":
            return awa.Cancel("async: not needed")
        case "callback":
            token = await job.aregister_callback(timeout=60)
            return awa.WaitForCallback(token)
        case "sync_callback":  # the sync form, from the event loop
            return awa.WaitForCallback(job.register_callback(timeout=60))
        case "sync_dependencies":
            return [dependency.result for dependency in job.dependencies()]
        case "progress":
            job.set_progress(60, "async halfway")
            await asyncio.sleep(args.seconds)
            return None
        case "enqueue":
            await awa.aenqueue(Echo(n=args.n, note="from-async-handler"))
            return None
        case "dependencies":
            return [dependency.result for dependency in await job.adependencies()]
        case "leave_atomic":  # its sync part enters a block it never leaves
            await sync_to_async(_enter_and_order)(f"async-leak-{job.id}")
            return None
        case "system_exit":
            raise SystemExit(3)
        case "keyboard_interrupt":
            raise KeyboardInterrupt
        case "own_cancel":
            raise asyncio.CancelledError("my own cancel")
        case "inner_cancel":
            inner = asyncio.ensure_future(asyncio.sleep(60))
            asyncio.get_running_loop().call_soon(inner.cancel)
            await inner  # its CancelledError is the handler's error, not a lost attempt
            return None
        case "sleep":
            try:
                await asyncio.sleep(args.seconds)
            except asyncio.CancelledError:
                await _aledger(job, "async-cancelled")
                raise
            return None
        case "slow_cleanup":
            # Its cleanup holds the thread its sync calls run in (asgiref's, one per
            # handler) for 2 s: the worker's own cleanup of the handler waits behind it.
            try:
                await asyncio.sleep(args.seconds)
            except asyncio.CancelledError:
                await sync_to_async(time.sleep)(2)
                raise
            return None
        case "stubborn":
            # Catches every cancellation and goes on sleeping, for its whole time.
            until = time.monotonic() + args.seconds
            while time.monotonic() < until:
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    continue
            await _aledger(job, "stubborn-done")
            return None
        case _:
            raise ValueError(f"unknown action {args.action!r}")


@dataclass
class Timed(awa.JobArgs):
    """Runs ``seconds`` under a 1 s timeout; sync or async by ``asynchronous``."""

    seconds: float = 0.0


@dataclass
class TimedAsync(awa.JobArgs):
    seconds: float = 0.0


@awa.worker(Timed, timeout=1, max_attempts=2)
def timed(job: awa.JobContext):
    _ledger(job, "timed:start")
    time.sleep(job.args.seconds)  # a sync handler cannot be stopped
    _ledger(job, f"timed:end:cancelled={job.is_cancelled()}")


@awa.worker(TimedAsync, timeout=timedelta(seconds=1), max_attempts=2)
async def timed_async(job: awa.JobContext):
    await _aledger(job, "timed-async:start")
    try:
        await asyncio.sleep(job.args.seconds)
    except asyncio.CancelledError:
        await _aledger(job, "timed-async:cancelled")
        raise
    await _aledger(job, "timed-async:end")


@dataclass
class Forever(awa.JobArgs):
    """Its completed follow-up enqueues the next one, for ever (run_jobs' limit)."""

    n: int = 0


@awa.worker(Forever, queue="loop")
def forever(job: awa.JobContext):
    return None


@dataclass
class Touch(awa.JobArgs):
    """Read an ``Order`` through the ORM, keep the connection ``hold`` seconds, update it.

    On database alias ``using`` (tests/test_connections.py gives handlers an
    alias of their own); each run writes a ``Ledger`` row there too.
    """

    reference: str
    hold: float = 0.0
    using: str = "default"


@awa.worker(Touch, queue="orm", max_attempts=5)
def touch(job):
    using = job.args.using
    order = Order.objects.using(using).get(reference=job.args.reference)
    time.sleep(job.args.hold)
    Order.objects.using(using).filter(pk=order.pk).update(paid=True)
    Ledger.objects.using(using).create(
        job_id=job.id, attempt=job.attempt, run_lease=job.row.run_lease, note="touch"
    )


@dataclass
class Nap(awa.JobArgs):
    """Sleep ``seconds`` and touch no database (tests/test_connections.py)."""

    seconds: float = 1.0


@awa.worker(Nap, queue="nap")
def nap(job: awa.JobContext):
    time.sleep(job.args.seconds)


@dataclass
class Node(awa.JobArgs):
    """A step of a test workflow: records its run and returns its name and its
    dependencies' results."""

    name: str
    action: str = "ok"
    seconds: float = 0.0
    fail_until: int = 0


@awa.worker(Node, queue="flow", max_attempts=3)
def node(job: awa.JobContext):
    args = job.args
    _ledger(job, f"node:{args.name}")
    if args.fail_until and job.attempt <= args.fail_until:
        raise RuntimeError(f"{args.name} failing attempt {job.attempt}")
    match args.action:
        case "raise":
            raise RuntimeError(f"{args.name} failed")
        case "terminal":
            raise TerminalError(f"{args.name} failed for good")
        case "cancel":
            return awa.Cancel(f"{args.name} cancelled itself")
        case "sleep":
            time.sleep(args.seconds)
        case "sleep_first" if job.attempt == 1:
            time.sleep(args.seconds)
        case "park":
            token = job.register_callback(timeout=timedelta(seconds=600))
            return awa.WaitForCallback(token)
    return {"name": args.name, "after": [dep.result for dep in job.dependencies()]}


@dataclass
class AtomicNode(awa.JobArgs):
    name: str
    fail: bool = False


@awa.worker(AtomicNode, queue="flow", atomic=True, max_attempts=1)
def atomic_node(job: awa.JobContext):
    _ledger(job, f"atomic:{job.args.name}")
    if job.args.fail:
        raise TerminalError("atomic node failed")
    return {"atomic": job.args.name}


# -- Flow control (test_flow_control.py): every run records a FlowRun. ----------------


@dataclass
class Span(awa.JobArgs):
    """Sleep ``seconds`` (``first_seconds`` on the first attempt, if given); raise
    while the attempt is at most ``fail_until``. With ``gate``, the first attempt
    then returns only once it could take that advisory lock (a test holds it)."""

    key: str = ""
    n: int = 0
    seconds: float = 0.1
    first_seconds: float = 0.0
    fail_until: int = 0
    gate: int = 0


@dataclass
class KeyedSpan(Span):
    """At most one running per key, fleet-wide."""


@dataclass
class CappedSpan(Span):
    """At most two running, fleet-wide."""


@dataclass
class PairedSpan(Span):
    """At most two running per key, fleet-wide."""


@dataclass
class RatedSpan(Span):
    """At most four starts per key in any second, fleet-wide."""


@dataclass
class TimedKeyedSpan(Span):
    """At most one running per key, fleet-wide; an attempt times out after a second."""


@dataclass
class DeadlineKeyedSpan(Span):
    """At most one running per key, fleet-wide; an attempt's deadline is two seconds."""


@dataclass
class TimedSpan(Span):
    """On a queue of global_concurrency 2; an attempt times out after a second."""


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
        attempted_at=job.row.heartbeat_at,  # the claim's stamp (attempted_at: the handler's)
        started_at=timezone.now(),
        pid=os.getpid(),
    )
    time.sleep(args.first_seconds if job.attempt == 1 and args.first_seconds else args.seconds)
    if args.gate and job.attempt == 1:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [args.gate])
            cursor.execute("SELECT pg_advisory_unlock(%s)", [args.gate])
    FlowRun.objects.filter(id=run.id).update(ended_at=timezone.now())
    if job.attempt <= args.fail_until:
        raise RuntimeError(f"span {args.key}/{args.n} fails attempt {job.attempt}")


awa.worker(Span, queue="flow", max_attempts=3)(span)
awa.worker(KeyedSpan, queue="bykey", limit=awa.Limit(concurrency=1, by="key"))(span)
awa.worker(CappedSpan, queue="capped", limit=awa.Limit(concurrency=2))(span)
awa.worker(PairedSpan, queue="paired", limit=awa.Limit(concurrency=2, by="key"))(span)
awa.worker(RatedSpan, queue="keyrate", limit=awa.Limit(rate="4/s", by="key"))(span)
awa.worker(TimedKeyedSpan, queue="timedkey", timeout=1, limit=awa.Limit(concurrency=1, by="key"))(
    span
)
awa.worker(
    DeadlineKeyedSpan,
    queue="deadkey",
    deadline=2,
    max_attempts=3,
    limit=awa.Limit(concurrency=1, by="key"),
)(span)
awa.worker(TimedSpan, queue="timedglob", timeout=1, max_attempts=3)(span)
awa.worker(SequencedSpan, queue="seq", max_attempts=3, sequence="key")(span)


@dataclass
class RowProbe(awa.JobArgs):
    """Its handler keeps what ``job.row`` gave it, twice (``ROWS_SEEN``)."""

    n: int = 0


# (job.row, job.row) for each RowProbe attempt run in this process.
ROWS_SEEN: list[tuple[object, object]] = []


@awa.worker(RowProbe, queue="probe")
def row_probe(job: awa.JobContext):
    ROWS_SEEN.append((job.row, job.row))


@dataclass
class Receipt(awa.JobArgs):
    """A kind with an ``awa.Unique``: one receipt per order waiting or running."""

    order_id: int
    copies: int = 1


@awa.worker(Receipt, queue="receipts", unique=awa.Unique())
def receipt(job: awa.JobContext):
    _ledger(job, f"receipt:{job.args.order_id}")
