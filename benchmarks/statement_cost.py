"""What each statement of the plain path costs PostgreSQL per job.

    python benchmarks/statement_cost.py [--jobs 20000] [--batch 100] [--without-index NAME]
                                        [--prune {segments,rows}] [--forget]

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
after migrating, to show what keeping it costs each job. ``--forget`` completes
with the form ``COMPLETED_RETENTION = 0`` runs (``sql.FORGETTING``): the completed
rows deleted, not moved.

Then the jobs' retention passes (``COMPLETED_RETENTION`` 0.5 s) and the script
removes them: ``--prune segments`` (the default) by the maintenance's
``prune()``, which drops the completed jobs' segment whole (migration 0016);
``--prune rows`` as pruning did before it, a DELETE per batch of 1,000 rows
(PRUNE_ROWS below), then the VACUUM those deletes need. The server CPU time of
the backend doing it (``/proc/<pid>/stat``) and the WAL it wrote are printed
per job. No test asserts a figure.
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

from systems.cpu import own_seconds  # noqa: E402 - found through the path above

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
        " WHERE relname IN ('awa_job', 'awa_job_done', 'awa_job_done_current')"
    )
    return {row[0]: tuple(row[1:]) for row in cursor.fetchall()}


# Pruning as it was before migration 0016 (PRUNE_FINISHED then): completed rows
# deleted from awa_job and every child, a batch at a time. For --prune rows.
PRUNE_ROWS = """
WITH gone AS (
    DELETE FROM awa_job WHERE id IN (
        SELECT id FROM awa_job
        WHERE state = 'completed' AND finalized_at < now() - make_interval(secs => 0.5)
        LIMIT 1000
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id
)
SELECT count(*) FROM gone
"""


def _prune(mode: str) -> tuple[int, float, int]:
    """Remove the completed jobs past retention; (how many, server CPU s, WAL bytes)."""
    from django.conf import settings
    from django.db import connection
    from django.test.utils import override_settings

    from django_awa.maintenance import Maintenance

    time.sleep(1.0)  # past COMPLETED_RETENTION
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid(), pg_current_wal_insert_lsn()")
        pid, lsn = cursor.fetchone()
        started = own_seconds(pid) or 0.0
        removed = 0
        if mode == "segments":
            with override_settings(AWA={**settings.AWA, "COMPLETED_RETENTION": 0.5}):
                removed = Maintenance().prune()
        else:
            for _ in range(100_000):
                cursor.execute(PRUNE_ROWS)
                deleted = cursor.fetchone()[0]
                removed += deleted
                if deleted < 1000:
                    break
            cursor.execute("VACUUM awa_job_done, awa_job_done_current")
        cpu = (own_seconds(pid) or 0.0) - started
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [lsn])
        wal = int(cursor.fetchone()[0])
    return removed, cpu, wal


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
    parser.add_argument(
        "--prune",
        choices=("segments", "rows"),
        default="segments",
        help="remove the finished jobs by dropping their segment (default) or row by row",
    )
    parser.add_argument(
        "--forget",
        action="store_true",
        help="complete as COMPLETED_RETENTION = 0 does: the completed rows are not kept",
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
            complete = sql.FORGETTING[sql.COMPLETE] if args.forget else sql.COMPLETE
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
                for name, value in _explain(cursor, complete, done).items():
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
        removed, prune_cpu, prune_wal = _prune(args.prune)
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
        print(
            f"retention ({args.prune}): {removed} jobs removed, server CPU"
            f" {prune_cpu * 1000 / n:.4f} ms and {prune_wal / n:.1f} WAL bytes per job"
        )
        if args.plans:
            for statement, plan in PLANS.items():
                print(statement, json.dumps(plan, indent=1))
        print("tuples per job (inserted, updated, HOT-updated, deleted):")
        for table in ("awa_job", "awa_job_done", "awa_job_done_current"):
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
