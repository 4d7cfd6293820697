"""The procrastinate App the CLI loads (``--app=systems.procrastinate_app.app``).

A module of its own because ``--app`` must name an App instance, built at
import time; the adapter module stays importable without it.
"""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

from systems import _common as common

_pool_size = int(os.environ.get("BENCH_POOL_SIZE", "10"))

app = App(
    connector=PsycopgConnector(
        conninfo=os.environ.get("BENCH_DSN", ""),
        min_size=min(4, _pool_size),
        max_size=_pool_size,
    )
)


@app.task(name="noop", queue=common.QUEUE)
async def noop(n: int = 0, t: float = 0.0) -> None:
    # async: the worker's --concurrency only applies to async tasks.
    common.record_latency(t)


@app.task(name="touch_account", queue=common.QUEUE)
async def touch_account(account: int = 1) -> None:
    # Django's ORM is synchronous: run it on the default thread pool. The
    # ORM workloads' worker runs with DJANGO_SETTINGS_MODULE set (see below).
    import asyncio

    await asyncio.to_thread(common.touch_account, account)


if os.environ.get("DJANGO_SETTINGS_MODULE"):
    common.django_setup()
