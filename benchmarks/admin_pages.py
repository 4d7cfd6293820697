"""Every admin page and ``/metrics`` with 1,000,000 jobs, most of them finished
(issue 21: each under 150 ms server side), then a bulk retry of 100,000 failed
jobs over a filter (under 30 s, no batch holding its row locks over a second).

    flock /tmp/awa-bench.lock .venv/bin/python benchmarks/admin_pages.py [--root DIR]
        [--reuse] [--bulk] [--database NAME]

Runs in the repository's own virtualenv with ``tests.settings`` (the admin, its
URLs, a superuser logged in with Django's test client), against PostgreSQL on
127.0.0.1:5432 (user postgres, trust) in a database ``awa_bench_admin`` (or
``--database``) made fresh for the run and dropped afterwards. ``--reuse``
keeps the database and its rows for the next run, and takes the rows a
previous ``--reuse`` run built (migrations still run, so a new index is built
on the million rows as an upgrade would build it). ``--root`` measures another
checkout (e.g. a worktree of main, for the before/after table); its django_awa
is imported instead of this one's.

The rows are made set-based (INSERT ... SELECT generate_series): 1,000,000
jobs over 5 queues and 20 kinds, 10,000 of them live in ``awa_job`` (available,
scheduled, retryable, running, blocked), the rest finished in ``awa_job_done``
(100,000 of them failed, in queue ``q0``: the bulk retry's filter), 5,000 of
them follow-ups of one job, and a workflow of 200 steps; then VACUUM ANALYZE
and one maintenance count (the rollup ``/metrics`` and the queue page read).
The bulk retry (``--bulk``) changes the rows: with ``--reuse`` it puts the
retried jobs back as they were (failed, in ``awa_job_done``) afterwards.

Each page is requested 4 times: the first warms caches and is not counted; the
table shows the median of the other 3, the number of queries and their total
time (of the last request), the slowest query's time, its text and the first
lines of its plan (EXPLAIN, without ANALYZE). A day of the dashboard's rollup
(``awa_stat_minute``, 5 queues) is written before the pages are timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DB = "awa_bench_admin"
# The ids the pages need, kept in the database by a --reuse run (the benchmark's own table).
IDS_TABLE = "bench_admin_ids"
DSN = "postgresql://postgres@127.0.0.1:5432/"
TOTAL = 1_000_000
LIVE = 10_000
FAILED = 100_000
FOLLOWUPS = 5_000
STEPS = 200
LIMIT_MS = 150.0

KINDS = [f"kind_{i:02d}" for i in range(20)]
QUEUES = [f"q{i}" for i in range(5)]

# Set-based rows (the benchmark's own; the package's statements live in sql.py).
ROWS = """
-- finished jobs, straight into awa_job_done: completed, cancelled, and the
-- failed ones of q0 the bulk retry takes
INSERT INTO awa_job_done (id, kind, queue, args, state, attempt, max_attempts, run_at,
                          created_at, attempted_at, finalized_at, errors, tags)
SELECT nextval(pg_get_serial_sequence('awa_job', 'id')),
       'kind_' || lpad((g %% 20)::text, 2, '0'),
       CASE WHEN g <= %(failed)s THEN 'q0' ELSE 'q' || (1 + g %% 4) END,
       jsonb_build_object('n', g),
       CASE WHEN g <= %(failed)s THEN 'failed' WHEN g %% 50 = 0 THEN 'cancelled'
            ELSE 'completed' END,
       CASE WHEN g <= %(failed)s THEN 3 ELSE 1 END, 3,
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       now() - make_interval(secs => g), now() - make_interval(secs => g - 1),
       CASE WHEN g <= %(failed)s THEN
            jsonb_build_array(jsonb_build_object('attempt', 3, 'at', '2026-01-01T00:00:00Z',
                'error', 'ValueError: boom', 'traceback', 'Traceback ...'))
            ELSE '[]'::jsonb END,
       jsonb_build_array('tag' || (g %% 100))
FROM generate_series(1, %(finished)s) AS g;
-- live jobs in awa_job
INSERT INTO awa_job (kind, queue, args, state, attempt, run_at, heartbeat_at, deadline_at)
SELECT 'kind_' || lpad((g %% 20)::text, 2, '0'), 'q' || (g %% 5), jsonb_build_object('n', g),
       (ARRAY['available', 'scheduled', 'retryable', 'running', 'blocked'])[1 + g %% 5],
       CASE WHEN g %% 5 = 3 THEN 1 ELSE 0 END,
       now() + make_interval(secs => (g %% 5 = 1)::int * 3600),
       CASE WHEN g %% 5 = 3 THEN now() END, CASE WHEN g %% 5 = 3 THEN now() + interval '15 min' END
FROM generate_series(1, %(live)s) AS g;
"""
FOLLOWUP_ROWS = """
INSERT INTO awa_job_done (id, kind, queue, args, state, attempt, finalized_at, metadata)
SELECT nextval(pg_get_serial_sequence('awa_job', 'id')), 'kind_01', 'q1', '{}', 'completed', 1,
       now(),
       jsonb_build_object('awa_trigger', jsonb_build_object(
           'job_id', %(trigger)s, 'kind', 'kind_00', 'outcome', 'completed'))
FROM generate_series(1, %(count)s)
"""

# After the bulk retry: its jobs (q0's first FAILED rows by id, made available
# in awa_job) failed again and back in awa_job_done.
RESTORE_FAILED = """
WITH failed AS (
    UPDATE ONLY awa_job SET state = 'failed', attempt = 3, finalized_at = now()
    WHERE queue = 'q0' AND state = 'available'
      AND id <= (SELECT max(id) FROM awa_job_done WHERE state = 'completed' AND queue <> 'q0')
    RETURNING id
), moved AS (
    DELETE FROM ONLY awa_job WHERE id IN (SELECT id FROM failed) RETURNING *
)
INSERT INTO awa_job_done SELECT * FROM moved
"""

# A day of the dashboard's rollup, as the maintenance leader writes it: a row per
# queue and minute, with outcomes, a wait histogram (17 buckets) and the oldest
# due job's age. Written afresh each run (minutes are relative to now).
ROLLUP = """
DELETE FROM awa_stat_minute;
INSERT INTO awa_stat_minute (queue, minute, completed, failed, retried, wait, oldest_due)
SELECT 'q' || q, date_trunc('minute', now()) - make_interval(mins => m), 600 + m % 50, m % 7,
       m % 11, to_jsonb(ARRAY[5, 40, 120, 200, 150, 80, 40, 20, 10, 5, 2, 1, 0, 0, 0, 0, 0]),
       (m % 30)::float8
FROM generate_series(0, 4) AS q, generate_series(0, 1439) AS m
"""


def _django_env(root: Path, db: str) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["DATABASE_URL"] = DSN + db
    os.environ["AWA_TEST_DB_NAME"] = db
    sys.path[:0] = [str(root), str(ROOT)]


def build() -> dict[str, int]:
    """The rows; returns ids the pages need."""
    from django.db import connection

    import django_awa as awa
    from django_awa.maintenance import Maintenance
    from tests.testapp.jobs import Node

    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute(ROWS, {"finished": TOTAL - LIVE, "failed": FAILED, "live": LIVE})
        cursor.execute("SELECT max(id) FROM awa_job_done WHERE state = 'completed'")
        trigger = cursor.fetchone()[0]
        cursor.execute(FOLLOWUP_ROWS, {"trigger": trigger, "count": FOLLOWUPS})
    flow = awa.Workflow("bench")
    previous = None
    for i in range(STEPS):
        step = flow.add(Node(name=f"s{i}"), after=[previous] if previous else [])
        previous = step
    steps = flow.enqueue()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE awa_job")
        cursor.execute("VACUUM ANALYZE awa_job_done")
        cursor.execute("SELECT count(*) FROM awa_job")
        total = cursor.fetchone()[0]
        cursor.execute("SELECT min(id) FROM awa_job_done WHERE state = 'failed'")
        a_failed = cursor.fetchone()[0]
        cursor.execute("SELECT min(id) FROM ONLY awa_job WHERE state = 'running'")
        running = cursor.fetchone()[0]
    Maintenance().count_jobs()
    print(f"built {total:,} jobs in {time.monotonic() - started:.1f} s", flush=True)
    ids = {
        "trigger": trigger,
        "followup": trigger + 1,
        "failed": a_failed,
        "running": running,
        "step": steps[STEPS // 2].id,
        "workflow": 0,
        "workflow_id": str(steps[0].workflow_id),
    }
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {IDS_TABLE} (name text PRIMARY KEY, value text NOT NULL)")
        for name, value in ids.items():
            cursor.execute(f"INSERT INTO {IDS_TABLE} VALUES (%s, %s)", [name, str(value)])  # noqa: S608
    return ids  # type: ignore[return-value]


def built() -> dict[str, object] | None:
    """The ids of the rows a previous --reuse run built, or None."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [IDS_TABLE])
        if cursor.fetchone()[0] is None:
            return None
        cursor.execute(f"SELECT name, value FROM {IDS_TABLE}")  # noqa: S608
        return {
            name: value if name == "workflow_id" else int(value)
            for name, value in cursor.fetchall()
        }


def pages(ids: dict[str, object], bulk: bool) -> list[tuple[str, str]]:
    jobs = "/admin/django_awa/job/"
    dead = f"{jobs}?state__exact=failed&queue=q0&kind=kind_00&error=ValueError%3A+boom"
    listed = [
        ("job list", jobs),
        ("job list, page 200", f"{jobs}?p=200"),
        *((f"state={s}", f"{jobs}?state__exact={s}") for s in _states()),
        *((f"queue={q}", f"{jobs}?queue={q}") for q in QUEUES),
        *((f"kind={k}", f"{jobs}?kind={k}") for k in ("kind_00", "kind_05", "kind_19")),
        ("kind + completed", f"{jobs}?kind=kind_05&state__exact=completed"),
        ("kind + failed", f"{jobs}?kind=kind_05&state__exact=failed"),
        ("queue + failed", f"{jobs}?queue=q0&state__exact=failed"),
        ("queue + kind", f"{jobs}?queue=q3&kind=kind_07"),
        ("search kind", f"{jobs}?q=kind_07"),
        ("search queue", f"{jobs}?q=q0"),
        ("search part", f"{jobs}?q=ind_1"),
        ("search no match", f"{jobs}?q=boom"),
        ("search id", f"{jobs}?q={ids['failed']}"),
        ("search tag", f"{jobs}?q=tag:tag42"),
        ("sort id asc", f"{jobs}?o=1"),
        ("sort kind", f"{jobs}?o=2"),
        ("sort kind desc", f"{jobs}?o=-2"),
        ("sort queue", f"{jobs}?o=3"),
        ("sort priority", f"{jobs}?o=-5"),
        ("sort run_at", f"{jobs}?o=-7"),
        ("sort finalized", f"{jobs}?o=8"),
        ("failed by kind", f"{jobs}?state__exact=failed&o=2"),
        ("failed, page 50", f"{jobs}?state__exact=failed&p=50"),
        ("failed, page 200", f"{jobs}?state__exact=failed&p=200"),
        ("follow-ups of", f"{jobs}?trigger={ids['trigger']}"),
        ("dead-letter group", dead),
        ("job: failed", f"{jobs}{ids['failed']}/change/"),
        ("job: 5,000 follow-ups", f"{jobs}{ids['trigger']}/change/"),
        ("job: a follow-up", f"{jobs}{ids['followup']}/change/"),
        ("job: running", f"{jobs}{ids['running']}/change/"),
        ("job: workflow step", f"{jobs}{ids['step']}/change/"),
        ("workflow page", f"{jobs}workflow/{ids['workflow_id']}/"),
        ("queues", "/admin/django_awa/queue/"),
        ("workers", "/admin/django_awa/worker/"),
        ("dead letters", "/admin/django_awa/deadletter/"),
        ("dashboard", "/admin/django_awa/dashboard/"),
        ("dashboard, day", "/admin/django_awa/dashboard/?window=day"),
        ("dashboard data, day", "/admin/django_awa/dashboard/data/?window=day"),
        ("pending follow-ups", "/admin/django_awa/pendingfollowup/"),
        ("schedules", "/admin/django_awa/periodicschedule/"),
        ("/metrics", "/awa/metrics"),
        ("/health", "/awa/health"),
    ]
    if bulk:
        listed.append(("bulk retry preview", f"{jobs}bulk/retry/?state__exact=failed&queue=q0"))
    return listed


def _states() -> list[str]:
    from django_awa.models import JobState

    return [str(s) for s in JobState]


def time_pages(ids: dict[str, object], bulk: bool) -> list[dict[str, object]]:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", password=None
    )
    client = Client()
    client.force_login(user)
    results = []
    for name, url in pages(ids, bulk):
        client.get(url)  # warm
        times, captured = [], None
        for _ in range(3):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                response = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
            captured = queries.captured_queries
        assert captured is not None
        slowest = max(captured, key=lambda q: float(q["time"]), default=None)
        plan = ""
        if slowest is not None and slowest["sql"].lstrip().upper().startswith(("SELECT", "WITH")):
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN " + slowest["sql"])
                plan = " / ".join(row[0].strip() for row in cursor.fetchall()[:3])
        results.append(
            {
                "page": name,
                "status": response.status_code,
                "ms": statistics.median(times),
                "queries": len(captured),
                "sql_ms": sum(float(q["time"]) for q in captured) * 1000,
                "slowest_ms": float(slowest["time"]) * 1000 if slowest else 0.0,
                "slowest_sql": " ".join(slowest["sql"].split())[:70] if slowest else "",
                "plan": plan,
            }
        )
        print(f"  {name:<22} {statistics.median(times):8.1f} ms", file=sys.stderr, flush=True)
        if response.status_code not in (200, 503):  # /health: 503 without a leader
            print(f"  {name}: status {response.status_code}", file=sys.stderr, flush=True)
    return results


def bulk_retry(restore: bool) -> None:
    from django.db import connection

    from django_awa import bulk
    from django_awa.maintenance import Maintenance
    from django_awa.models import Job

    jobs = Job.objects.filter(state="failed", queue="q0")
    started = time.monotonic()
    found = bulk.preview(jobs, bulk.Operation.RETRY)
    previewed = time.monotonic() - started
    started = time.monotonic()
    result = bulk.run(jobs, bulk.Operation.RETRY, up_to=found.up_to)
    took = time.monotonic() - started
    seconds = sorted(result.batch_seconds)
    print()
    print(
        f"bulk retry of the failed jobs of q0: {result.changed:,} of {found.count:,} retried "
        f"in {took:.1f} s (preview {previewed * 1000:.0f} ms), {len(seconds)} batches of "
        f"{bulk.BATCH_SIZE:,}"
    )
    print(
        "  batch transaction (row locks held): "
        f"median {statistics.median(seconds) * 1000:.0f} ms, "
        f"p95 {seconds[int(len(seconds) * 0.95) - 1] * 1000:.0f} ms, "
        f"max {seconds[-1] * 1000:.0f} ms"
    )
    if restore:
        # The retried jobs back as they were, for the next --reuse run.
        with connection.cursor() as cursor:
            cursor.execute(RESTORE_FAILED)
            cursor.execute("VACUUM ANALYZE awa_job")
            cursor.execute("VACUUM ANALYZE awa_job_done")
        Maintenance().count_jobs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument(
        "--reuse", action="store_true", help="keep the rows, and take those a --reuse run built"
    )
    parser.add_argument("--bulk", action="store_true", help="then time a bulk retry")
    parser.add_argument("--database", default=DB, help=f"the database (default {DB})")
    options = parser.parse_args()
    db = options.database
    if not options.reuse:
        with psycopg.connect(DSN + "postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            admin.execute(f"CREATE DATABASE {db}")
    _django_env(options.root.resolve(), db)
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    import django_awa

    print(f"measuring {Path(django_awa.__file__).parent}; load {os.getloadavg()}", flush=True)
    has_bulk = (Path(django_awa.__file__).parent / "bulk.py").exists()
    try:
        started = time.monotonic()
        call_command("migrate", verbosity=0)
        print(f"migrated in {time.monotonic() - started:.1f} s", flush=True)
        ids = (built() if options.reuse else None) or build()
        with connection.cursor() as cursor:
            cursor.execute(ROLLUP)
        results = time_pages(ids, has_bulk)
        print()
        print(
            f"{'page':<22} {'status':>6} {'ms':>8} {'queries':>7} {'SQL ms':>7} {'slowest':>8}"
            + "  the slowest query; its plan"
        )
        for r in results:
            flag = " !" if float(r["ms"]) > LIMIT_MS else "  "  # type: ignore[arg-type]
            print(
                f"{r['page']:<22} {r['status']:>6} {r['ms']:>8.1f}{flag}{r['queries']:>6} "
                f"{r['sql_ms']:>7.1f} {r['slowest_ms']:>8.1f}  {r['slowest_sql']}; "
                f"{str(r['plan'])[:120]}"
            )
        over = [r["page"] for r in results if float(r["ms"]) > LIMIT_MS]  # type: ignore[arg-type]
        print(f"\n{len(over)} of {len(results)} pages over {LIMIT_MS:.0f} ms: {', '.join(over)}")
        if has_bulk and options.bulk:
            bulk_retry(restore=options.reuse)
        print(f"load {os.getloadavg()}")
    finally:
        from django.db import connections

        connections.close_all()
        if not (options.keep or options.reuse):
            with psycopg.connect(DSN + "postgres", autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


if __name__ == "__main__":
    main()
