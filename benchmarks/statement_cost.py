"""What each statement of the plain path costs PostgreSQL per job.

    python benchmarks/statement_cost.py [--jobs 20000] [--batch 100] [--without-index NAME]

Enqueues --jobs no-op jobs into a fresh database (``awa_bench_cost``, dropped
afterwards), then runs the worker's statements by hand, batch by batch, as a
worker at the defaults does: CLAIM a batch, COMPLETE it, and every 10 batches
the maintenance's ARCHIVE_FINISHED. Each statement runs under
``EXPLAIN (ANALYZE, BUFFERS, WAL)``, which executes it; the script sums, per
statement, the server's execution time, the WAL records and bytes and the
buffers dirtied, and prints them per job, with the tuples written to each
table (``pg_stat_user_tables``). Works without ``pg_stat_statements`` (the
machine's server does not preload it). Execution time under EXPLAIN ANALYZE
includes the instrumentation's own overhead: compare statements, not absolute
figures across machines. ``--without-index`` (repeatable) drops the named index
after migrating, to show what keeping it costs each job. No test asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
DB = "awa_bench_cost"
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _setup() -> None:
    os.environ["BENCH_DB"] = DB
    os.environ["DJANGO_SETTINGS_MODULE"] = "djbench.settings_awa"
    import django

    django.setup()


PLANS: dict[str, object] = {}


def _explain(cursor: psycopg.Cursor, statement: str, params: dict[str, object]) -> dict:
    cursor.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + statement, params)
    row = cursor.fetchone()
    assert row is not None
    plan = row[0][0] if isinstance(row[0], list) else json.loads(row[0])[0]
    PLANS[statement] = plan
    top = plan["Plan"]
    return {
        "ms": plan["Execution Time"],
        "wal_records": top.get("WAL Records", 0),
        "wal_bytes": top.get("WAL Bytes", 0),
        "dirtied": top.get("Shared Dirtied Blocks", 0),
        "hit": top.get("Shared Hit Blocks", 0),
    }


def _table_writes(cursor: psycopg.Cursor) -> dict[str, tuple[int, int, int, int]]:
    cursor.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"
        " WHERE relname IN ('awa_job', 'awa_job_done')"
    )
    return {row[0]: tuple(row[1:]) for row in cursor.fetchall()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--plans", action="store_true", help="print each statement's last plan")
    parser.add_argument(
        "--without-index",
        action="append",
        default=[],
        metavar="NAME",
        help="drop this index after migrating (what it costs per job)",
    )
    args = parser.parse_args()

    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    try:
        _setup()
        from django.core.management import call_command
        from django.db import transaction

        call_command("migrate", verbosity=0)
        from django.db import connection

        with connection.cursor() as cursor:
            for index in args.without_index:
                cursor.execute(f'DROP INDEX "{index}"')
        from djbench.awa_app.jobs import Noop

        import django_awa as awa
        from django_awa import sql

        for start in range(0, args.jobs, 1000):
            with transaction.atomic():
                awa.enqueue_many([Noop(n=n) for n in range(start, min(start + 1000, args.jobs))])
        from django.db import connections

        connections.close_all()  # its counters flushed before the first snapshot
        totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DB}", autocommit=True) as conn:
            cursor = conn.cursor()
            cursor.execute("VACUUM ANALYZE awa_job")
            time.sleep(1.1)
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            before = _table_writes(cursor)
            claim = {
                "queue": "bench",
                "limit": args.batch,
                "deadlines": "{}",
                "default_deadline": 1800.0,
            }
            for batch in range(args.jobs // args.batch):
                for name, value in _explain(cursor, sql.CLAIM, claim).items():
                    totals["CLAIM"][name] += value
                cursor.execute("SELECT id, run_lease FROM ONLY awa_job WHERE state = 'running'")
                rows = cursor.fetchall()
                done = {
                    "id": "{" + ",".join(str(r[0]) for r in rows) + "}",
                    "run_lease": "{" + ",".join(str(r[1]) for r in rows) + "}",
                    "started_ago": "{" + ",".join("0.001" for _ in rows) + "}",
                }
                for name, value in _explain(cursor, sql.COMPLETE, done).items():
                    totals["COMPLETE"][name] += value
                if batch % 10 == 9:
                    for name, value in _explain(
                        cursor, sql.ARCHIVE_FINISHED, {"limit": 5000}
                    ).items():
                        totals["ARCHIVE_FINISHED"][name] += value
            for name, value in _explain(cursor, sql.ARCHIVE_FINISHED, {"limit": 100000}).items():
                totals["ARCHIVE_FINISHED"][name] += value
            cursor.execute("SELECT pg_stat_force_next_flush()")
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{DB}", autocommit=True) as conn:
            cursor = conn.cursor()
            time.sleep(1.1)  # the other connection's counters are flushed at its close
            after = _table_writes(cursor)
        n = args.jobs
        print(f"{n} jobs, batches of {args.batch}; per job:")
        print(
            f"{'statement':<18} {'server ms':>10} {'WAL rec':>8} {'WAL bytes':>10} {'dirtied':>8}"
        )
        for statement, figures in totals.items():
            print(
                f"{statement:<18} {figures['ms'] / n:>10.4f} {figures['wal_records'] / n:>8.2f}"
                f" {figures['wal_bytes'] / n:>10.1f} {figures['dirtied'] / n:>8.3f}"
            )
        all_ms = sum(f["ms"] for f in totals.values()) / n
        all_wal = sum(f["wal_bytes"] for f in totals.values()) / n
        print(f"{'total':<18} {all_ms:>10.4f} {'':>8} {all_wal:>10.1f}")
        if args.plans:
            for statement, plan in PLANS.items():
                print(statement, json.dumps(plan, indent=1))
        print("tuples per job (inserted, updated, HOT-updated, deleted):")
        for table in ("awa_job", "awa_job_done"):
            b = before.get(table, (0, 0, 0, 0))
            a = after.get(table, (0, 0, 0, 0))
            print(
                f"  {table:<14} "
                + ", ".join(f"{(x - y) / n:.2f}" for x, y in zip(a, b, strict=True))
            )
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


if __name__ == "__main__":
    main()
