#!/usr/bin/env python3
"""Jobs per second against worker processes spread over network-namespace hosts.

    .venv/bin/python benchmarks/hosts_scaling.py                  # 1, 2, 4, 8 workers
    .venv/bin/python benchmarks/hosts_scaling.py --jobs 2000 --workers 1,2

Run as root, in the project's venv. It makes three hosts (``stress/hosts.py``:
network namespaces, each with a veth link to a private PostgreSQL 15 on this
machine), and for each count of worker processes, spread round-robin over
the hosts, enqueues ``--jobs`` no-op jobs (queue ``bulk``), starts the
workers (``--concurrency`` handler threads each), and times from their
start until the database shows every job finished. It prints jobs/s, the
transactions the server committed per second meanwhile, and the share of
the machine's CPU the server's processes used: where that stops growing
with more workers, the database (or the machine) is saturated. Indicative
only: workers and server share one machine, and its cores, here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stress.cluster import stop_process, wait_until  # noqa: E402
from stress.hosts import Hosts, Server  # noqa: E402

DATABASE = "awa_scaling"
COMMITS = "SELECT xact_commit FROM pg_stat_database WHERE datname = %s"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--workers", default="1,2,4,8", help="worker process counts")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per count")
    return parser.parse_args()


def main() -> int:
    opts = parse_args()
    if os.geteuid() != 0:
        print("benchmarks/hosts_scaling.py runs as root (network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    counts = [int(n) for n in opts.workers.split(",")]
    with Hosts(3) as hosts:
        server = Server([hosts.gateway(i) for i in range(3)])
        try:
            server.start()
            return measure(opts, counts, hosts, server)
        finally:
            server.close()


def measure(opts: argparse.Namespace, counts: list[int], hosts: Hosts, server: Server) -> int:
    import psycopg

    with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    env.update(
        DATABASE_URL=server.url(DATABASE),
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--run-syncdb", "-v0"],
        cwd=ROOT, env=env, check=True, timeout=300,
    )  # fmt: skip
    os.environ.update(env)
    import django

    django.setup()
    from django.db import connection

    import django_awa as awa
    from tests.testapp.jobs import Noop

    cores = os.cpu_count() or 1
    print(f"{opts.jobs} no-op jobs per run; {opts.concurrency} handler threads per worker; "
          f"{cores} cores shared by workers and server")  # fmt: skip
    print(f"{'workers':>8} {'jobs/s':>8} {'commits/s':>10} {'server CPU':>11}")
    logdir = Path(tempfile.mkdtemp(prefix="awa-scaling-"))
    for n in counts:
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE awa_job CASCADE")
        for start in range(0, opts.jobs, 5000):
            awa.enqueue_many([Noop(n=i) for i in range(start, min(opts.jobs, start + 5000))])
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [DATABASE]
            )
            commits = cursor.fetchone()[0]
        cpu = server.cpu_seconds()
        procs = []
        started = time.monotonic()
        for w in range(n):
            i = w % 3
            out = (logdir / f"w{n}-{w}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [
                        *hosts.prefix(i),
                        sys.executable,
                        "-m",
                        "django",
                        "awa_worker",
                        "--queue",
                        f"bulk={opts.concurrency}",
                    ],
                    cwd=ROOT,
                    env={**env, "DATABASE_URL": server.url(DATABASE, hosts.gateway(i))},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        try:

            def finished() -> bool:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT count(*) FROM awa_job WHERE kind = 'noop' "
                        "AND state NOT IN ('completed', 'failed', 'cancelled')"
                    )
                    return cursor.fetchone()[0] == 0

            wait_until(finished, opts.timeout, f"{opts.jobs} jobs with {n} workers", 0.1)
            elapsed = time.monotonic() - started
            with connection.cursor() as cursor:
                # From the first claim to the last outcome: worker start-up left out.
                cursor.execute(
                    "SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)) "
                    "FROM awa_job WHERE kind = 'noop'"
                )
                running = float(cursor.fetchone()[0])
        finally:
            for proc in procs:
                stop_process(proc, timeout=30)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [DATABASE]
            )
            commits = cursor.fetchone()[0] - commits
        used = (server.cpu_seconds() - cpu) / elapsed / cores
        print(f"{n:>8} {opts.jobs / running:>8.0f} {commits / elapsed:>10.0f} {used:>10.0%}")
    from django.db import connections

    connections.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
