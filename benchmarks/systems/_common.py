"""Helpers for the code that runs *inside* the benchmark subprocesses.

Producers (enqueue commands) and workers import this module; the
orchestrator (run.py) does not. Everything is configured through the
environment the orchestrator sets:

- ``BENCH_DSN``: libpq URL of this run's database (always on 127.0.0.1).
- ``BENCH_LATENCY_DIR``: when set, handlers that get a job whose ``t``
  argument is non-zero append ``time.time() - t`` (seconds) to a file of
  their own in that directory, one value a line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator

QUEUE = "bench"  # the queue (or entrypoint) the workers run
SINGLE_QUEUE = "bench_single"  # enqueue-single target; no worker runs it

_latency_fd: int | None = None
_latency_pid: int | None = None


def dsn() -> str:
    return os.environ["BENCH_DSN"]


def record_latency(enqueued_at: float) -> None:
    """Record the pickup latency of one job, from inside its handler.

    One file per process (workers may fork), opened lazily, written with a
    single O_APPEND write per value so concurrent handlers never interleave.
    """
    global _latency_fd, _latency_pid
    if not enqueued_at:
        return
    latency = time.time() - enqueued_at
    directory = os.environ.get("BENCH_LATENCY_DIR")
    if not directory:
        return
    pid = os.getpid()
    if _latency_fd is None or _latency_pid != pid:
        path = os.path.join(directory, f"latency-{pid}.txt")
        _latency_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _latency_pid = pid
    os.write(_latency_fd, f"{latency:.6f}\n".encode())


def batches(total: int, size: int) -> Iterator[range]:
    for start in range(0, total, size):
        yield range(start, min(start + size, total))


def _schedule(rate: float, duration: float) -> Iterator[tuple[int, float]]:
    """``(i, seconds until i is due)`` on an absolute schedule of ``rate`` per second.

    Each delay is measured when the caller asks for the next value, so a slow
    enqueue does not shift the later ones (no drift); if the producer falls
    behind, the overdue values come back to back until it is on schedule again.
    """
    interval = 1.0 / rate
    start = time.perf_counter()
    for i in range(round(rate * duration)):
        yield i, start + i * interval - time.perf_counter()


def paced(rate: float, duration: float) -> Iterator[int]:
    """Yield 0, 1, 2… on schedule; the caller enqueues one job per value."""
    for i, delay in _schedule(rate, duration):
        if delay > 0:
            time.sleep(delay)
        yield i


async def apaced(rate: float, duration: float) -> AsyncIterator[int]:
    """paced() for asyncio producers."""
    import asyncio

    for i, delay in _schedule(rate, duration):
        if delay > 0:
            await asyncio.sleep(delay)
        yield i


def django_setup() -> None:
    """For the Django systems' producer commands."""
    import django

    django.setup()


def cmd_django_migrate() -> None:
    """The Django systems' ``setup`` command: migrate the run's database."""
    django_setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    emit(ok=True)


def emit(**result: object) -> None:
    """Print the command's result as the last stdout line (read by run.py)."""
    sys.stdout.write("BENCH-RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def client_main(commands: dict[str, Callable[..., object]], argv: list[str] | None = None) -> None:
    """Dispatch ``python -m systems.<name> COMMAND [ARGS…]``.

    Integer-looking arguments are passed as ints, others as floats or strings.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in commands:
        sys.stderr.write(f"usage: COMMAND [ARGS…], COMMAND one of {', '.join(commands)}\n")
        raise SystemExit(2)
    name, raw = args[0], args[1:]
    values: list[object] = []
    for item in raw:
        try:
            values.append(int(item))
        except ValueError:
            try:
                values.append(float(item))
            except ValueError:
                values.append(item)
    commands[name](*values)


# ------------------------------------------------------------ ORM workloads
# The ORM handler: read one row of djbench.handler_app's HandlerAccount and
# update it, through Django's ORM. Job i touches account i % accounts + 1.
ORM_ACCOUNTS = 10_000

_finish_fd: int | None = None
_finish_pid: int | None = None


def record_finish() -> None:
    """Append time.time() to this process's file in BENCH_FINISH_DIR (if set).

    The ORM workloads' handlers call it as they return; run.py takes each
    value less the worker's start (every job was due by then).
    """
    global _finish_fd, _finish_pid
    directory = os.environ.get("BENCH_FINISH_DIR")
    if not directory:
        return
    now = time.time()
    pid = os.getpid()
    if _finish_fd is None or _finish_pid != pid:
        path = os.path.join(directory, f"finish-{pid}.txt")
        _finish_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _finish_pid = pid
    os.write(_finish_fd, f"{now:.6f}\n".encode())


def touch_account(account: int) -> None:
    """The ORM handler's body: read a row, change it, save it (Django set up)."""
    from djbench.handler_app.models import HandlerAccount

    row = HandlerAccount.objects.get(pk=account)
    row.balance += 1
    row.touched += 1
    row.save(update_fields=["balance", "touched"])
    record_finish()


def account_for(i: int, accounts: int) -> int:
    return i % accounts + 1


def cmd_orm_setup(accounts: int) -> None:
    """Migrate (the handler app among the rest) and fill ``accounts`` rows."""
    django_setup()
    from django.core.management import call_command
    from djbench.handler_app.models import HandlerAccount

    call_command("migrate", interactive=False, verbosity=0)
    HandlerAccount.objects.all().delete()
    HandlerAccount.objects.bulk_create(
        HandlerAccount(id=i, balance=0, touched=0) for i in range(1, accounts + 1)
    )
    emit(ok=True)
