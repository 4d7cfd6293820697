"""pgqueuer 1.6 (asyncpg driver).

- schema: ``pgq install`` (libpq environment points it at the run's database);
- enqueue: ``Queries.enqueue(entrypoint, payload)`` on an autocommit asyncpg
  connection (one statement, one transaction); bulk: the same call with lists
  (one multi-row INSERT … SELECT unnest() per batch);
- worker: ``pgqueuer.run("systems.pgqueuer:create_worker")`` on uvloop,
  what ``pgq run`` does (the CLI command itself crashes in 1.6.0, see
  worker_commands), one process, ``max_concurrent_tasks=100, batch_size=10``;
- finished jobs: pgqueuer deletes a finished job from its queue table and logs
  it to ``pgqueuer_log`` with status ``successful``.

The queue is the entrypoint name: workers register only ``bench``, so jobs
sent to ``bench_single`` stay queued.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from systems import _common as common
from systems.base import System


class Pgqueuer(System):
    name = "pgqueuer"
    module = "pgqueuer"
    distribution = "pgqueuer"
    count_done_sql = (
        "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful' AND entrypoint = 'bench'"
    )
    settings = {"processes": 1, "concurrency": 200, "batch_size": 100}
    # pgqueuer.run()'s own: no limit on concurrent tasks (0 here), batches of 10
    defaults = {"processes": 1, "concurrency": 0, "batch_size": 10}
    orm_best = {"processes": 2, "concurrency": 20, "batch_size": 10}
    orm_handlers = ("orm",)

    def worker_env(self, mode: str) -> dict[str, str]:
        return self.orm_env() if mode == "orm" else self.env()

    def enqueue_orm(self, n: int, batch: int, handler: str, accounts: int) -> float:
        result = self.run_client("enqueue-orm", n, batch, accounts, timeout=max(120, n / 20))
        return float(result["elapsed"])

    def install_schema(self) -> None:
        self.run_tool([_pgq(), "install"], "pgq install")

    def worker_commands(self, mode: str) -> list[list[str]]:
        # `pgq run` itself crashes at start-up in 1.6.0 with the typer this
        # resolves to (setup_fancy_logger gets the --log-level as a str and
        # calls .name on it), so the worker uses pgqueuer.run(), the
        # documented "as pgq run does, without the CLI" entry, on uvloop as
        # the CLI would.
        factory = "create_orm_worker" if mode == "orm" else "create_worker"
        argv = self.client_command(
            "worker", self.settings["concurrency"], self.settings["batch_size"], factory
        )
        return [argv for _ in range(int(self.settings["processes"]))]


ADAPTER = Pgqueuer


def _pgq() -> str:
    """The pgq console script of the benchmark environment."""
    return str(Path(sys.executable).with_name("pgq"))


# --------------------------------------------------------------- worker side
@contextlib.asynccontextmanager
async def create_worker():
    """Factory for ``pgq run``: a PgQueuer with one no-op entrypoint.

    1.6 wants an async context manager here; a coroutine returning the
    manager (what the package README still shows) is refused with a TypeError.
    """
    import asyncpg
    from pgqueuer import PgQueuer

    connection = await asyncpg.connect(common.dsn())
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint(common.QUEUE)
    async def noop(job) -> None:
        if job.payload:
            common.record_latency(json.loads(job.payload).get("t", 0))

    try:
        yield pgq
    finally:
        await connection.close()


@contextlib.asynccontextmanager
async def create_orm_worker():
    """The ORM handler: Django set up (djbench.settings_orm), the ORM call in a thread."""
    import asyncio

    import asyncpg
    from pgqueuer import PgQueuer

    common.django_setup()
    connection = await asyncpg.connect(common.dsn())
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint(common.QUEUE)
    async def touch(job) -> None:
        account = json.loads(job.payload)["account"]
        # Django's ORM is synchronous: run it on the default thread pool.
        await asyncio.to_thread(common.touch_account, account)

    try:
        yield pgq
    finally:
        await connection.close()


def cmd_worker(concurrency: int, batch_size: int, factory: str = "create_worker") -> None:
    import pgqueuer
    import uvloop

    uvloop.run(
        pgqueuer.run(
            f"systems.pgqueuer:{factory}",
            max_concurrent_tasks=concurrency or None,
            batch_size=batch_size,
        )
    )


# ------------------------------------------------------------- producer side
async def _queries():
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    connection = await asyncpg.connect(common.dsn())
    return connection, Queries(AsyncpgDriver(connection))


def _payload(n: int, t: float = 0.0) -> bytes:
    return json.dumps({"n": n, "t": t}).encode()


def cmd_enqueue_single(n: int) -> None:
    import asyncio

    async def main() -> float:
        connection, queries = await _queries()
        start = time.perf_counter()
        for i in range(n):
            await queries.enqueue("bench_single", _payload(i))
        elapsed = time.perf_counter() - start
        await connection.close()
        return elapsed

    common.emit(elapsed=asyncio.run(main()), count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    import asyncio

    async def main() -> float:
        connection, queries = await _queries()
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            size = len(chunk)
            await queries.enqueue([common.QUEUE] * size, [_payload(i) for i in chunk], [0] * size)
        elapsed = time.perf_counter() - start
        await connection.close()
        return elapsed

    common.emit(elapsed=asyncio.run(main()), count=n)


def cmd_enqueue_orm(n: int, batch: int, accounts: int) -> None:
    import asyncio

    async def main() -> float:
        connection, queries = await _queries()
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            size = len(chunk)
            payloads = [
                json.dumps({"account": common.account_for(i, accounts)}).encode() for i in chunk
            ]
            await queries.enqueue([common.QUEUE] * size, payloads, [0] * size)
        elapsed = time.perf_counter() - start
        await connection.close()
        return elapsed

    common.emit(elapsed=asyncio.run(main()), count=n)


def cmd_pace(rate: float, duration: float) -> None:
    import asyncio

    async def main() -> int:
        connection, queries = await _queries()
        count = 0
        async for i in common.apaced(rate, duration):
            await queries.enqueue(common.QUEUE, _payload(i, time.time()))
            count += 1
        await connection.close()
        return count

    common.emit(count=asyncio.run(main()))


if __name__ == "__main__":
    common.client_main(
        {
            "enqueue-single": cmd_enqueue_single,
            "enqueue-bulk": cmd_enqueue_bulk,
            "pace": cmd_pace,
            "worker": cmd_worker,
            "orm-setup": common.cmd_orm_setup,
            "enqueue-orm": cmd_enqueue_orm,
        }
    )
