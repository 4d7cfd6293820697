#!/usr/bin/env python3
"""ORM handlers at high concurrency, with and without Django's pool: rate, connections, retries.

    python benchmarks/connections.py [--jobs 20000] [--concurrency 10,50,100,200] [--pool-size 20]

A fresh database ``awa_conn_run`` on 127.0.0.1 (``djbench.settings_connections``)
with an application table ``bench_account`` (--accounts rows). For each mode
(``none``: every thread has its own connection, as Django gives it; ``pool``:
Django's pool, ``OPTIONS["pool"]`` with max_size --pool-size) and each
concurrency, it enqueues --jobs jobs whose handler reads one account through
the ORM and saves it (``djbench/conn_app/jobs.py``), starts one worker process
(``awa_worker --queue conn=C``) and waits until every job is finished. Meanwhile
it samples, every 50 ms from a connection to another database, the client
backends connected to the run's database (``pg_stat_activity``). Per run it
prints jobs/s (from worker start, start-up included), the most backends seen,
jobs that needed more than one attempt, failed jobs, and the refused
connections the worker logged. The database is dropped at the end. No test
asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from growth import (
    BENCH_DIR,
    LOG_DIR,
    RESULT_PREFIX,
    RESULTS_DIR,
    Progress,
    begin_run,
    create_database,
    django_env,
    django_setup,
    drop_database,
    dsn,
    emit,
)

DBNAME = "awa_conn_run"
SETTINGS = "djbench.settings_connections"
REFUSED = "PostgreSQL refused a new connection"
# The client backends on the run's database but the sampler's own, and the jobs finished.
SAMPLE = """
SELECT (SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND backend_type = 'client backend'
          AND pid <> pg_backend_pid()),
       (SELECT count(*) FROM awa_job WHERE state IN ('completed', 'failed', 'cancelled'))
"""
RETRIES = """
SELECT count(*) FILTER (WHERE attempt > 1 OR errors <> '[]'::jsonb),
       count(*) FILTER (WHERE state = 'failed')
FROM awa_job
"""
POOL_TIMEOUT = "no connection came free in Django's pool"


def env_for(pool: int) -> dict[str, str]:
    env = django_env(DBNAME)
    env.update(DJANGO_SETTINGS_MODULE=SETTINGS, BENCH_POOL=str(pool))
    return env


# --------------------------------------------------------- inside Django processes
def child_migrate() -> None:
    django_setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", interactive=False, verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_account ("
            " id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0,"
            " touched integer NOT NULL DEFAULT 0)"
        )
    emit(ok=True)


def child_fill(jobs: int, accounts: int) -> None:
    """Empty the job tables, reset the accounts, enqueue ``jobs`` jobs over them."""
    django_setup()
    from django.db import connection, transaction
    from djbench.conn_app.jobs import Touch

    import django_awa as awa

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE awa_job, bench_account")
        cursor.execute("INSERT INTO bench_account (id) SELECT generate_series(1, %s)", [accounts])
    for lo in range(0, jobs, 1000):
        with transaction.atomic():
            awa.enqueue_many(
                [Touch(account=1 + i % accounts) for i in range(lo, min(jobs, lo + 1000))]
            )
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE awa_job")
        cursor.execute("VACUUM ANALYZE bench_account")
    emit(count=jobs)


def child_main(argv: list[str]) -> None:
    name, *rest = argv
    if name == "migrate":
        child_migrate()
    elif name == "fill":
        child_fill(int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown child command {name!r}")


def child(*args: object) -> None:
    """Run ``connections.py _child ARGS`` in the run's Django settings (no pool)."""
    command = [sys.executable, str(Path(__file__).resolve()), "_child", *map(str, args)]
    done = subprocess.run(
        command, cwd=BENCH_DIR, env=env_for(0), capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0 or RESULT_PREFIX not in done.stdout:
        tail = "\n    ".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(map(str, args))}` failed:\n    {tail}")


# --------------------------------------------------------------------- a run
def measure(mode: str, concurrency: int, args, progress: Progress) -> dict[str, object]:
    import psycopg

    pool = args.pool_size if mode == "pool" else 0
    label = f"pool={pool or 'none'} concurrency={concurrency}"
    progress.step(f"{label}: enqueue {args.jobs:,} jobs")
    child("fill", args.jobs, args.accounts)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"connections-{mode}-{concurrency}.log"
    most = 0
    with (
        # Opened before the worker starts, so a server out of connections
        # cannot refuse it; it does not count itself.
        psycopg.connect(dsn(DBNAME), autocommit=True) as watch,
        open(log_path, "wb") as log,
    ):
        started = time.perf_counter()
        worker = subprocess.Popen(
            [sys.executable, "-m", "django", "awa_worker", "--queue", f"conn={concurrency}"],
            cwd=BENCH_DIR,
            env=env_for(pool),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        finished = 0
        timed_out = False
        try:
            deadline = started + args.timeout
            while True:
                backends, finished = watch.execute(SAMPLE).fetchone()
                most = max(most, backends)
                if time.perf_counter() >= deadline:
                    timed_out = True
                    break
                if worker.poll() is not None:
                    raise RuntimeError(f"the worker exited with code {worker.returncode}")
                progress.live(f"{finished:,}/{args.jobs:,} finished, {most} backends at most")
                if finished >= args.jobs:
                    break
                time.sleep(0.05)
            elapsed = time.perf_counter() - started
            retried, failed = watch.execute(RETRIES).fetchone()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(40)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, 9)
    text = log_path.read_text(errors="replace")
    return {
        "mode": mode,
        "pool": pool,
        "concurrency": concurrency,
        "jobs": args.jobs,
        "finished": finished,
        "timed_out": timed_out,
        "seconds": round(elapsed, 2),
        "jobs_per_s": round(finished / elapsed, 1),
        "most_backends": most,
        "retried": retried,
        "failed": failed,
        "refused_logged": text.count(REFUSED) + text.count(POOL_TIMEOUT),
        "warned": "(awa.W101)" in text,
    }


# --------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--accounts", type=int, default=1000)
    parser.add_argument("--concurrency", default="10,50,100,200")
    parser.add_argument("--modes", default="none,pool", help="none, pool or both (the default)")
    parser.add_argument("--pool-size", type=int, default=20, help="the pool's max_size")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument("--no-venv", action="store_true", help="run in this interpreter")
    parser.add_argument("--no-bootstrap", action="store_true")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = args.modes.split(",")
    return args


def render(rows: list[dict[str, object]]) -> str:
    head = (
        f"{'pool':>6} {'conc':>5} {'jobs/s':>8} {'seconds':>8} {'backends':>9} "
        f"{'retried':>8} {'failed':>7} {'refused':>8}  note"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        note = []
        if row["timed_out"]:
            note.append(f"timed out: {row['finished']:,} of {row['jobs']:,} finished")
        if row["warned"]:
            note.append("awa.W101 at start-up")
        lines.append(
            f"{row['pool'] or 'none':>6} {row['concurrency']:>5} {row['jobs_per_s']:>8} "
            f"{row['seconds']:>8} {row['most_backends']:>9} {row['retried']:>8} "
            f"{row['failed']:>7} {row['refused_logged']:>8}  {'; '.join(note)}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        child_main(argv[1:])
        return 0
    args, lock, facts = begin_run("connections", parse_args, argv)
    import psycopg

    with psycopg.connect(dsn("postgres"), autocommit=True) as conn:
        max_connections = conn.execute("SHOW max_connections").fetchone()[0]
    progress = Progress()
    rows: list[dict[str, object]] = []
    load_start = os.getloadavg()
    error = None
    try:
        progress.step(f"setup {DBNAME}: create, migrate")
        create_database(DBNAME)
        child("migrate")
        for mode in args.modes:
            for concurrency in args.concurrency:
                rows.append(measure(mode, concurrency, args, progress))
    except KeyboardInterrupt:
        progress.note("interrupted: printing what was measured")
    except RuntimeError as exc:
        error = str(exc)
        progress.note(f"FAILED: {error}")
    finally:
        progress.step(f"dropping {DBNAME}")
        with contextlib.suppress(Exception):
            drop_database(DBNAME)
        progress.close()
    out = [
        f"ORM handlers (read one bench_account row, save it) in one worker process, "
        f"{args.jobs:,} jobs per run",
        f"PostgreSQL {facts['version']}, max_connections {max_connections}; "
        f"pool: Django's pool, max_size {args.pool_size}",
        "backends: most client backends on the run's database (pg_stat_activity, every 50 ms); "
        "retried: jobs with more than one attempt or an error; refused: refusals and pool "
        "timeouts the worker logged",
        "",
        render(rows),
        "",
        f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end",
    ]
    if error:
        out.append(f"FAILED: {error}")
    print("\n".join(out))
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"connections-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"args": vars(args), "facts": facts, "rows": rows}, indent=2)
    )
    del lock
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
