"""Follow-ups of the test kinds. ``Echo`` rows they enqueue carry a note naming
the function, so tests can count them in SQL."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
from django.db import DataError, connection

import django_awa as awa
from django_awa.db import listen_params
from django_awa.followups import (
    on_cancelled,
    on_completed,
    on_exhausted,
    on_rescued,
    on_retried,
    on_waiting_for_callback,
)

from .jobs import Act, Echo, Forever, Node, Parked, Pay, Poison, base_exception

# Tests flip these to make follow-up functions misbehave.
FAIL = {
    "completed": False,
    "rescued_times": 0,
    "exhausted": False,
    "retried": False,
    "parked_completed": False,
}
CALLS = {"rescued": 0}


def _terminate_own_backend() -> None:
    """Have another session end this thread's connection of ``default``, as a server
    restart or a network cut would, inside the finalize transaction."""
    pid = connection.connection.info.backend_pid
    with psycopg.connect(**listen_params("default"), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


@on_completed(Act)
def act_completed(args: Act, job):
    if args.tag.startswith("slow-followup:") and job.attempt == 1:
        # Stall inside the finalize transaction so a test can kill the worker here.
        Path(args.tag.partition(":")[2]).touch()
        time.sleep(30)
    if args.tag == "drop-connection":
        _terminate_own_backend()  # the follow-ups' INSERT then finds the connection gone
    if args.tag.startswith("db-error"):
        # A query that fails leaves the finalize transaction aborted.
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
        except DataError as exc:
            if args.tag == "db-error-caught":
                raise ValueError(f"no order: {exc}") from None
            raise
    if args.tag == "reads-db":
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    if args.tag.startswith("base:"):  # SystemExit, asyncio.CancelledError... from user code
        raise base_exception(args.tag.removeprefix("base:"))
    if FAIL["completed"] or args.tag == "fail-completed":
        raise RuntimeError("completed follow-up exploded")
    if args.tag == "unique-clash":
        return awa.EnqueueRequest(Echo(n=job.id), unique=awa.Unique(by_args=False))
    if args.tag == "override":
        return awa.EnqueueRequest(
            Echo(n=job.id, note="override"), queue="other", priority=1, max_attempts=7
        )
    if args.tag == "none":
        return None
    return Echo(n=job.id, note="completed-1")


@on_completed(Act)
def act_completed_second(args: Act, job):
    if args.tag in ("fail-completed", "unique-clash", "override", "none"):
        return None
    return Echo(n=job.id, note="completed-2")


@on_retried(Act)
def act_retried(args: Act, job, error, attempt, next_run_at):
    if FAIL["retried"] or args.tag == "fail-all":
        raise RuntimeError("retried follow-up exploded")
    return Echo(n=job.id, note=f"retried:{attempt}:{error[:60]}")


@on_exhausted(Act)
def act_exhausted(args: Act, job, error, attempt):
    if FAIL["exhausted"] or args.tag == "fail-all":
        raise RuntimeError("exhausted follow-up exploded")
    return Echo(n=job.id, note=f"exhausted:{attempt}")


@on_cancelled(Act)
def act_cancelled(args: Act, job, reason):
    return Echo(n=job.id, note=f"cancelled:{reason}")


@on_rescued(Act)
def act_rescued(args: Act, job, reason):
    CALLS["rescued"] += 1
    if FAIL["rescued_times"] > 0:
        FAIL["rescued_times"] -= 1
        raise RuntimeError("rescued follow-up exploded")
    return Echo(n=job.id, note=f"rescued:{reason.value}")


@on_waiting_for_callback(Parked)
def parked_waiting(args: Parked, job):
    return Echo(n=job.id, note=f"waiting:{job.callback_id}")


@on_completed(Parked)
def parked_completed(args: Parked, job):
    exploding = (job.metadata.get("awa_callback_result") or {}) == {"explode": True}
    if exploding or FAIL["parked_completed"]:
        raise RuntimeError("parked completion follow-up exploded")
    return Echo(n=job.id, note="parked-completed")


@on_exhausted(Parked)
def parked_exhausted(args: Parked, job, error, attempt):
    return Echo(n=job.id, note=f"parked-exhausted:{error}")


@on_retried(Parked)
def parked_retried(args: Parked, job, error, attempt, next_run_at):
    return Echo(n=job.id, note=f"parked-retried:{error}:{attempt}")


@on_rescued(Parked)
def parked_rescued(args: Parked, job, reason):
    return Echo(n=job.id, note=f"parked-rescued:{reason.value}")


@on_completed(Pay)
def pay_completed(args: Pay, job):
    if args.reference.startswith("drop-connection"):
        _terminate_own_backend()  # the follow-ups' INSERT then finds the connection gone
    if args.reference.startswith("bad-followup"):
        raise RuntimeError("receipt follow-up exploded")
    return Echo(n=job.id, note=f"receipt:{args.reference}")


@on_retried(Pay)
def pay_retried(args: Pay, job, error, attempt, next_run_at):
    if args.reference.startswith("bad-retry"):
        raise RuntimeError("retry follow-up exploded")
    return None


@on_retried(Poison)
def poison_retried(args: Poison, job, error, attempt, next_run_at):
    return Echo(n=job.id, note=f"poison-retried:{error}")


@on_exhausted(Poison)
def poison_exhausted(args: Poison, job, error, attempt):
    return Echo(n=job.id, note=f"poison-exhausted:{error}")


@on_cancelled(Poison)
def poison_cancelled(args: Poison, job, reason):
    return Echo(n=job.id, note=f"poison-cancelled:{reason}")


@on_completed(Poison)
def poison_completed(args: Poison, job):
    return Echo(n=job.id, note="poison-completed")


@on_rescued(Poison)
def poison_rescued(args: Poison, job, reason):
    return Echo(n=job.id, note=f"poison-rescued:{reason.value}")


@on_completed(Forever)
def forever_next(args: Forever, job):
    return Forever(n=args.n + 1)


@on_completed(Node)
def node_completed(args: Node, job):
    # A step whose follow-up joins its workflow: it waits for the step itself.
    if args.name.startswith("spawn"):
        return awa.EnqueueRequest(Node(name=f"{args.name}-child"), after=[job])
    return None


@on_cancelled(Node)
def node_cancelled(args: Node, job, reason):
    return Echo(n=job.id, note=f"node-cancelled:{args.name}:{reason[:60]}")
