"""awa-pg 0.6.9: the Python SDK over Awa's Rust core (``import awa``).

- schema: ``AsyncClient.migrate()`` and then ``install_queue_storage()``. The
  migrations alone leave the database on the "canonical" engine, where the
  COPY path refuses to run ("enqueue_many_copy requires an active
  queue_storage backend"); 0.6's tests and benchmarks install and activate
  queue storage (schema ``awa``) right after migrating, and so does this;
- enqueue: ``AsyncClient.insert(args, queue=…)`` (one transaction each);
  bulk: ``enqueue_many_copy(jobs, queue=…)``, the COPY path straight into
  queue storage;
- worker: there is no worker command for Python handlers, so
  ``python -m systems.awa_pg worker`` registers an ``@client.task`` handler
  and calls ``client.start([("bench", 100)])`` (dispatch in Rust, handler
  on the asyncio loop);
- finished jobs: queue storage keeps no per-job "completed" row for long:
  completions land in ``receipt_completion_batches`` (a count per batch) and
  are folded into ``queue_terminal_rollups.pruned_completed_count`` when the
  ring rotates. ``done_entries`` holds completions that went through the
  materialized path. The sum of the three, read in one statement, is the
  number of completed jobs.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

from systems import _common as common
from systems.base import System

SCHEMA = "awa"


class AwaPg(System):
    name = "awa-pg"
    module = "awa_pg"
    distribution = "awa-pg"
    # One statement, so a batch folded into the rollup between two reads is
    # counted once. Schema "awa" (SCHEMA).
    count_done_sql = """
        SELECT
          (SELECT coalesce(sum(pruned_completed_count), 0)
             FROM awa.queue_terminal_rollups WHERE queue = 'bench')
        + (SELECT coalesce(sum(completed_count), 0)
             FROM awa.receipt_completion_batches WHERE queue = 'bench')
        + (SELECT count(*)
             FROM awa.done_entries WHERE queue = 'bench' AND state = 'completed')
    """
    settings = {"processes": 1, "concurrency": 200, "max_connections": 20}
    # start() takes a concurrency per queue (no default); the client's pool is 10
    defaults = {"processes": 1, "concurrency": 200, "max_connections": 10}
    orm_best = {"processes": 2, "concurrency": 20, "max_connections": 10}
    orm_handlers = ("orm",)

    def worker_env(self, mode: str) -> dict[str, str]:
        return self.orm_env() if mode == "orm" else self.env()

    def enqueue_orm(self, n: int, batch: int, handler: str, accounts: int) -> float:
        result = self.run_client("enqueue-orm", n, batch, accounts, timeout=max(120, n / 20))
        return float(result["elapsed"])

    def worker_commands(self, mode: str) -> list[list[str]]:
        argv = self.client_command(
            "worker", self.settings["concurrency"], self.settings["max_connections"], mode
        )
        return [argv for _ in range(int(self.settings["processes"]))]


ADAPTER = AwaPg


# ---------------------------------------------------------- both sides' args
@dataclass
class Noop:
    n: int = 0
    t: float = 0.0


@dataclass
class Touch:
    account: int = 1


def _client(max_connections: int = 10):
    import awa

    return awa.AsyncClient(common.dsn(), max_connections=max_connections)


# --------------------------------------------------------------- worker side
def cmd_worker(concurrency: int, max_connections: int, mode: str = "drain") -> None:
    import asyncio

    if mode == "orm":
        common.django_setup()

    async def main() -> None:
        client = _client(max_connections)

        if mode == "orm":

            @client.task(Touch, queue=common.QUEUE)
            async def touch(job) -> None:
                # Django's ORM is synchronous: run it on the default thread pool.
                await asyncio.to_thread(common.touch_account, job.args.account)

        else:

            @client.task(Noop, queue=common.QUEUE)
            async def noop(job) -> None:
                common.record_latency(job.args.t)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await client.start([(common.QUEUE, concurrency)])
        await stop.wait()
        await client.shutdown(timeout_ms=5000)
        await client.close()

    asyncio.run(main())


# ------------------------------------------------------------- producer side
def _run(body) -> object:
    import asyncio

    async def main():
        client = _client()
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


def cmd_setup() -> None:
    async def body(client) -> None:
        await client.migrate()
        await client.install_queue_storage(schema=SCHEMA)

    _run(body)
    common.emit(ok=True)


def cmd_enqueue_single(n: int) -> None:
    async def body(client) -> float:
        start = time.perf_counter()
        for i in range(n):
            await client.insert(Noop(n=i), queue=common.SINGLE_QUEUE)
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    async def body(client) -> float:
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            await client.enqueue_many_copy([Noop(n=i) for i in chunk], queue=common.QUEUE)
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_enqueue_orm(n: int, batch: int, accounts: int) -> None:
    async def body(client) -> float:
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            jobs = [Touch(account=common.account_for(i, accounts)) for i in chunk]
            await client.enqueue_many_copy(jobs, queue=common.QUEUE)
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_pace(rate: float, duration: float) -> None:
    async def body(client) -> int:
        count = 0
        async for i in common.apaced(rate, duration):
            await client.insert(Noop(n=i, t=time.time()), queue=common.QUEUE)
            count += 1
        return count

    common.emit(count=_run(body))


if __name__ == "__main__":
    common.client_main(
        {
            "setup": cmd_setup,
            "enqueue-single": cmd_enqueue_single,
            "enqueue-bulk": cmd_enqueue_bulk,
            "pace": cmd_pace,
            "worker": cmd_worker,
            "orm-setup": common.cmd_orm_setup,
            "enqueue-orm": cmd_enqueue_orm,
        }
    )
