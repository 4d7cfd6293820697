"""Celery 5 with Redis: what most Django teams run today.

- broker and results: Debian's ``redis-server`` (``/usr/bin/redis-server``, or
  ``BENCH_REDIS_SERVER``), started by this adapter for each repeat on a port
  of its own (16379 for the prefork row, 16380 for the threads row; never the
  machine's 6379), in a temporary directory, with no persistence
  (``--save '' --appendonly no``), and stopped by its pid at the end;
- the Celery app is in the benchmark's Django project
  (``djbench/celery_app.py``, settings ``djbench.settings_celery``), so the
  ORM handler runs through the same project as the Django-based systems';
- enqueue: ``noop.apply_async(kwargs=…, queue=…)``, one message each; bulk:
  Celery has no bulk send, so a batch is a loop of ``apply_async`` calls on
  one producer connection;
- worker: ``celery -A djbench.celery_app worker -Q bench`` with the pool
  (``prefork`` or ``threads``), ``--concurrency``, ``--prefetch-multiplier``
  and, with ``lean`` (the drain setting), ``--without-gossip --without-mingle
  --without-heartbeat``, which a single worker does not need;
- finished jobs: results in Redis database 1 (``DBSIZE``): Celery writes
  one key per finished task with the default result backend settings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from systems import _common as common
from systems.base import BENCH_DIR, System, SystemUnavailable

SETTINGS = "djbench.settings_celery"
APP = "djbench.celery_app"


class CeleryPrefork(System):
    name = "celery-prefork"
    module = "celery_redis"
    distribution = "celery"
    redis_port = 16379
    # The fastest drains found on 2 cores (see README).
    settings = {
        "pool": "prefork",
        "concurrency": 4,
        "prefetch_multiplier": 4,
        "lean": True,
        "db_reuse_max": 1000,
    }
    # Celery's own: a child per CPU, prefetch 4, gossip, mingle and heartbeat on.
    defaults = {
        "pool": "prefork",
        "concurrency": os.cpu_count() or 1,
        "prefetch_multiplier": 4,
        "lean": False,
        # Celery's Django fixup closes the connections after every task
        "db_reuse_max": 0,
    }
    orm_best = {"concurrency": 4, "prefetch_multiplier": 16}
    orm_handlers = ("orm",)
    orm_settings_module = SETTINGS

    def __init__(self, overrides: dict[str, str] | None = None) -> None:
        super().__init__(overrides)
        self._redis: subprocess.Popen | None = None
        self._redis_dir: str | None = None
        self._redis_client = None

    def describe(self) -> str:
        return super().describe() + f", redis-server {self.redis_version()} on :{self.redis_port}"

    def redis_version(self) -> str:
        try:
            out = subprocess.run(
                [_redis_server(), "--version"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return "?"
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return "?"

    def env(self, **extra: str) -> dict[str, str]:
        return super().env(
            **{
                "DJANGO_SETTINGS_MODULE": SETTINGS,
                "BENCH_REDIS_PORT": str(self.redis_port),
                **extra,
            }
        )

    def worker_env(self, mode: str) -> dict[str, str]:
        return self.env(BENCH_CELERY_DB_REUSE_MAX=str(self.settings["db_reuse_max"]))

    # ---------------------------------------------------------------- redis
    def setup_db(self) -> None:
        self.start_redis()
        super().setup_db()

    def teardown_db(self) -> None:
        super().teardown_db()
        self.stop_redis()

    def start_redis(self) -> None:
        self.stop_redis()
        self._redis_dir = tempfile.mkdtemp(prefix=f"awa-bench-redis-{self.redis_port}-")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"redis-{self.redis_port}.log", "ab")
        argv = [
            _redis_server(),
            "--port",
            str(self.redis_port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._redis_dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ]
        try:
            self._redis = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            raise SystemUnavailable(f"redis-server: {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                self.redis().ping()
                return
            except Exception as exc:  # not up yet (any error of the client)
                if self._redis.poll() is not None or time.monotonic() > deadline:
                    raise SystemUnavailable(
                        f"redis-server on :{self.redis_port} did not start: {exc}"
                    ) from exc
                time.sleep(0.05)

    def stop_redis(self) -> None:
        if self._redis_client is not None:
            self._redis_client.close()
            self._redis_client = None
        if self._redis is not None:
            if self._redis.poll() is None:
                self._redis.send_signal(signal.SIGTERM)
                try:
                    self._redis.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._redis.kill()
                    self._redis.wait(timeout=5)
            self._redis = None
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None

    def redis(self):
        import redis

        if self._redis_client is None:
            self._redis_client = redis.Redis(host="127.0.0.1", port=self.redis_port, db=1)
        return self._redis_client

    def broker_pids(self) -> list[int]:
        return [self._redis.pid] if self._redis is not None else []

    def count_done(self) -> int:
        return int(self.redis().dbsize())

    def check_succeeded(self) -> None:
        """DBSIZE counts failed tasks' results too: read every result, untimed."""
        client = self.redis()
        keys = list(client.scan_iter(match="celery-task-meta-*", count=5000))
        failed: list[str] = []
        for start in range(0, len(keys), 5000):
            for raw in client.mget(keys[start : start + 5000]):
                meta = json.loads(raw) if raw else {}
                if meta.get("status") != "SUCCESS":
                    failed.append(f"{meta.get('status')}: {meta.get('result')}")
        if failed:
            raise SystemUnavailable(
                f"{len(failed):,} of {len(keys):,} Celery tasks did not succeed; first: {failed[0]}"
            )

    # --------------------------------------------------------------- worker
    def worker_commands(self, mode: str) -> list[list[str]]:
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            APP,
            "worker",
            "--pool",
            str(self.settings["pool"]),
            "--concurrency",
            str(self.settings["concurrency"]),
            "--prefetch-multiplier",
            str(self.settings["prefetch_multiplier"]),
            "--queues",
            common.QUEUE,
            "--loglevel",
            "WARNING",
            "--hostname",
            f"bench-{self.name}@%h",
        ]
        if self.settings["lean"]:
            argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        return [argv]


class CeleryThreads(CeleryPrefork):
    name = "celery-threads"
    redis_port = 16380
    settings = {
        "pool": "threads",
        "concurrency": 4,
        "prefetch_multiplier": 4,
        "lean": True,
        "db_reuse_max": 1000,
    }
    defaults = {**CeleryPrefork.defaults, "pool": "threads"}
    orm_best = {"concurrency": 8, "prefetch_multiplier": 16}


ADAPTER = CeleryPrefork


def _redis_server() -> str:
    return os.environ.get("BENCH_REDIS_SERVER", "/usr/bin/redis-server")


# ------------------------------------------------------------- producer side
def _tasks():
    common.django_setup()
    sys.path.insert(0, str(BENCH_DIR))
    from djbench.celery_app import app
    from djbench.celery_tasks.tasks import noop, touch_account

    return app, noop, touch_account


def cmd_enqueue_single(n: int) -> None:
    app, noop, _ = _tasks()
    with app.producer_or_acquire() as producer:
        noop.apply_async(kwargs={"n": -1}, queue=common.SINGLE_QUEUE, producer=producer)
        start = time.perf_counter()
        for i in range(n):
            noop.apply_async(kwargs={"n": i}, queue=common.SINGLE_QUEUE, producer=producer)
        common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    app, noop, _ = _tasks()
    with app.producer_or_acquire() as producer:
        start = time.perf_counter()
        for chunk in common.batches(n, batch):
            for i in chunk:
                noop.apply_async(kwargs={"n": i}, queue=common.QUEUE, producer=producer)
        common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_orm(n: int, batch: int, handler: str, accounts: int) -> None:
    app, _, touch_account = _tasks()
    with app.producer_or_acquire() as producer:
        start = time.perf_counter()
        for i in range(n):
            touch_account.apply_async(
                kwargs={"account": common.account_for(i, accounts)},
                queue=common.QUEUE,
                producer=producer,
            )
        common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_pace(rate: float, duration: float) -> None:
    app, noop, _ = _tasks()
    with app.producer_or_acquire() as producer:
        count = 0
        for i in common.paced(rate, duration):
            noop.apply_async(
                kwargs={"n": i, "t": time.time()}, queue=common.QUEUE, producer=producer
            )
            count += 1
        common.emit(count=count)


if __name__ == "__main__":
    common.client_main(
        {
            "setup": common.cmd_django_migrate,
            "orm-setup": common.cmd_orm_setup,
            "enqueue-single": cmd_enqueue_single,
            "enqueue-bulk": cmd_enqueue_bulk,
            "enqueue-orm": cmd_enqueue_orm,
            "pace": cmd_pace,
        }
    )
