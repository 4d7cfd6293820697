"""procrastinate 3.10 (PsycopgConnector, psycopg 3 async pool).

- schema: ``procrastinate --app=systems.procrastinate_app.app schema --apply``;
- enqueue: ``noop.defer_async(n=…)`` (one INSERT, one transaction, through the
  App's pool); bulk: ``noop.batch_defer_async(*kwargs)`` (one multi-row
  INSERT per batch);
- worker: ``procrastinate … worker --queues bench --concurrency 100`` (one
  asyncio process; the task is ``async def``, as concurrency requires);
- finished jobs: rows of ``procrastinate_jobs`` with status ``succeeded``
  (the worker keeps them: ``--delete-jobs`` defaults to never).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from systems import _common as common
from systems.base import System

APP = "systems.procrastinate_app.app"


class Procrastinate(System):
    name = "procrastinate"
    module = "procrastinate"
    distribution = "procrastinate"
    count_done_sql = (
        "SELECT count(*) FROM procrastinate_jobs"
        " WHERE status = 'succeeded' AND queue_name = 'bench'"
    )
    settings = {"processes": 1, "concurrency": 100, "pool_size": 20}
    # the worker's own concurrency (1) and psycopg_pool's size when not given (4)
    defaults = {"processes": 1, "concurrency": 1, "pool_size": 4}
    orm_best: dict[str, object] = {}  # more did not help its no-op drain either
    orm_handlers = ("orm",)

    def worker_env(self, mode: str) -> dict[str, str]:
        return self.orm_env() if mode == "orm" else self.env()

    def enqueue_orm(self, n: int, batch: int, handler: str, accounts: int) -> float:
        result = self.run_client("enqueue-orm", n, batch, accounts, timeout=max(120, n / 20))
        return float(result["elapsed"])

    def env(self, **extra: str) -> dict[str, str]:
        return super().env(**{"BENCH_POOL_SIZE": str(self.settings["pool_size"]), **extra})

    def install_schema(self) -> None:
        self.run_tool(
            [_cli(), f"--app={APP}", "schema", "--apply"],
            "procrastinate schema --apply",
            cwd=common_cwd(),
        )

    def worker_commands(self, mode: str) -> list[list[str]]:
        argv = [
            _cli(),
            f"--app={APP}",
            # No per-job INFO lines (the CLI's default level logs two per job);
            # every system's worker runs at WARNING.
            "--log-level",
            "warning",
            "worker",
            "--queues",
            common.QUEUE,
            "--concurrency",
            str(self.settings["concurrency"]),
        ]
        return [argv for _ in range(int(self.settings["processes"]))]


ADAPTER = Procrastinate


def _cli() -> str:
    """The procrastinate console script of the benchmark environment."""
    return str(Path(sys.executable).with_name("procrastinate"))


def common_cwd() -> str:
    return str(Path(__file__).resolve().parent.parent)


# ------------------------------------------------------------- producer side
def _run(coro_fn) -> object:
    import asyncio

    from systems.procrastinate_app import app

    async def main():
        async with app.open_async():
            return await coro_fn()

    return asyncio.run(main())


def cmd_enqueue_single(n: int) -> None:
    from systems.procrastinate_app import noop

    async def body() -> float:
        deferrer = noop.configure(queue=common.SINGLE_QUEUE)
        start = time.perf_counter()
        for i in range(n):
            await deferrer.defer_async(n=i)
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    from systems.procrastinate_app import noop

    async def body() -> float:
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            await noop.batch_defer_async(*({"n": i} for i in chunk))
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_enqueue_orm(n: int, batch: int, accounts: int) -> None:
    from systems.procrastinate_app import touch_account

    async def body() -> float:
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            await touch_account.batch_defer_async(
                *({"account": common.account_for(i, accounts)} for i in chunk)
            )
        return time.perf_counter() - start

    common.emit(elapsed=_run(body), count=n)


def cmd_pace(rate: float, duration: float) -> None:
    from systems.procrastinate_app import noop

    async def body() -> int:
        count = 0
        async for i in common.apaced(rate, duration):
            await noop.defer_async(n=i, t=time.time())
            count += 1
        return count

    common.emit(count=_run(body))


if __name__ == "__main__":
    common.client_main(
        {
            "enqueue-single": cmd_enqueue_single,
            "enqueue-bulk": cmd_enqueue_bulk,
            "pace": cmd_pace,
            "orm-setup": common.cmd_orm_setup,
            "enqueue-orm": cmd_enqueue_orm,
        }
    )
