"""Workflows against the plain drain, side by side in one run (issue 19).

    benchmarks/.venv/bin/python benchmarks/workflows.py            # full sizes
    benchmarks/.venv/bin/python benchmarks/workflows.py --small    # a quick check
    benchmarks/.venv/bin/python benchmarks/workflows.py --plans    # EXPLAIN at 1,000,000 edges

Any Python with this repository's dependencies works (the repository's own
``.venv`` too). Each workload gets a fresh database ``awa_bench_workflows`` on
127.0.0.1:5432 (user postgres), dropped afterwards, and one
``awa_worker --queue bench`` process with the benchmark's default settings
(``benchmarks/djbench/settings_awa.py``):

* ``plain``: drain of N no-op jobs enqueued up front (default 20,000);
* ``workflows``: the same N jobs as N/100 workflows of 100 steps, a chain of
  10 whose last step fans out to 90 (all enqueued up front);
* ``fanin``: M members (default 10,000) and one callback after all of them:
  the members' drain rate, and how long after the last member's outcome
  (its ``finalized_at``, stamped in the transaction that commits it) the
  callback started (``attempted_at``), both by the database clock.

``--workers N`` starts N worker processes instead of one. During every
drain a thread samples ``pg_stat_activity`` every 10 ms: how many of the
benchmark database's sessions waited for a lock (``wait_event_type = 'Lock'``),
printed as ``lock_waits`` (samples taken, samples with a waiter, the most
waiters at once, and the lock types waited for): a lock convoy shows there.

The figures are printed as JSON lines. On a shared machine they are
indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DB = "awa_bench_workflows"
PSQL = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-Atq"]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "djbench.settings_awa",
        "BENCH_DB": DB,
        "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)]),
    }


def _psql(sql: str, db: str = DB) -> str:
    out = subprocess.run([*PSQL, "-d", db, "-c", sql], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _fresh_database() -> None:
    _psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", "postgres")
    _psql(f"CREATE DATABASE {DB}", "postgres")
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], env=_env(), check=True, cwd=BENCH
    )


def _setup_django() -> None:
    os.environ.update(_env())
    sys.path[:0] = [str(BENCH), str(ROOT)]
    import django

    django.setup()


def _enqueue(workload: str, n: int, members: int) -> None:
    """Run in a child process: enqueue the workload's jobs (untimed)."""
    _setup_django()
    from django.db import transaction
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    if workload == "plain":
        for start in range(0, n, 5000):
            awa.enqueue_many([Noop(n=i) for i in range(start, min(n, start + 5000))])
    elif workload == "workflows":
        for w in range(n // 100):
            with transaction.atomic():
                flow = awa.Workflow(f"w{w}")
                step = flow.add(Noop(n=0))
                for i in range(1, 10):
                    step = flow.add(Noop(n=i), after=[step])
                for i in range(90):
                    flow.add(Noop(n=10 + i), after=[step])
                flow.enqueue()
    else:
        with transaction.atomic():
            flow = awa.Workflow("fan-in")
            parts = [flow.add(Noop(n=i)) for i in range(members)]
            flow.add(Noop(n=-1), after=parts, name="callback")
            flow.enqueue()


class LockWaits:
    """Samples pg_stat_activity every ``every`` seconds in a thread, until ``stop``."""

    def __init__(self, every: float = 0.01) -> None:
        self.every = every
        self.samples = 0
        self.waiting_samples = 0
        self.most = 0
        self.types: Counter[str] = Counter()
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", user="postgres", dbname=DB, autocommit=True) as conn:
            while not self.halt.wait(self.every):
                rows = conn.execute(
                    "SELECT wait_event FROM pg_stat_activity "
                    "WHERE datname = %s AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
                    (DB,),
                ).fetchall()
                self.samples += 1
                if rows:
                    self.waiting_samples += 1
                    self.most = max(self.most, len(rows))
                    self.types.update(row[0] for row in rows)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> dict[str, Any]:
        self.halt.set()
        self.thread.join(10)
        return {
            "samples": self.samples,
            "with_waiter": self.waiting_samples,
            "most_waiters": self.most,
            "types": dict(self.types),
        }


def _drain(expected: int, timeout: float, workers: int) -> tuple[float, dict[str, Any]]:
    """Start ``workers`` worker processes, wait until ``expected`` jobs completed.

    Returns the seconds from the first start to the last outcome (database
    clock), and the lock waits sampled meanwhile.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "django", "awa_worker", "--queue", "bench"],
            env=_env(),
            cwd=BENCH,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(workers)
    ]
    waits = LockWaits()
    waits.start()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                done = int(_psql("SELECT count(*) FROM awa_job WHERE state = 'completed'"))
            except subprocess.CalledProcessError:  # a busy server (too many clients): poll again
                done = 0
            if done >= expected:
                break
            time.sleep(0.5)
        else:
            raise SystemExit(f"timed out: {done} of {expected} completed")
    finally:
        lock_waits = waits.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    # By the database clock: first claim to last outcome.
    seconds = float(
        _psql("SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)) FROM awa_job")
    )
    return seconds, lock_waits


def run_workload(
    workload: str, n: int, members: int, timeout: float, workers: int = 1
) -> dict[str, Any]:
    _fresh_database()
    subprocess.run(
        [sys.executable, __file__, "--enqueue", workload, "-n", str(n), "--members", str(members)],
        check=True,
        env=_env(),
    )
    total = members + 1 if workload == "fanin" else n
    seconds, lock_waits = _drain(total, timeout, workers)
    figures: dict[str, Any] = {
        "workload": workload,
        "workers": workers,
        "jobs": total,
        "seconds": round(seconds, 3),
    }
    figures["jobs_per_s"] = round(total / seconds, 1) if seconds else None
    if workload == "fanin":
        row = _psql(
            "SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)), "
            "(SELECT extract(epoch FROM c.attempted_at - max(m.finalized_at)) * 1000 "
            " FROM awa_job c WHERE c.args->>'n' = '-1') "
            "FROM awa_job m WHERE m.args->>'n' <> '-1'"
        ).split("|")
        figures["members_per_s"] = round(members / float(row[0]), 1)
        figures["callback_after_last_member_ms"] = round(float(row[1]), 1)
    figures["lock_waits"] = lock_waits
    figures["load_average"] = [round(x, 2) for x in os.getloadavg()]
    _psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", "postgres")
    return figures


# -- plans at 1,000,000 edges -----------------------------------------------------


def _reads_every_edge(plan: str) -> bool:
    """Whether ``plan`` scans awa_job_dependency sequentially, or one of its indexes
    from end to end (an index scan with no Index Cond reads every edge too)."""
    lines = plan.splitlines()
    for n, line in enumerate(lines):
        if "on awa_job_dependency" not in line:
            continue
        if "Seq Scan" in line:
            return True
        if "Index Scan" in line or "Index Only Scan" in line:
            indent = len(line) - len(line.lstrip(" ->"))
            details = []
            for following in lines[n + 1 :]:
                stripped = following.lstrip(" ")
                if stripped.startswith("->") or len(following) - len(stripped) <= indent:
                    break
                details.append(stripped)
            if not any(d.startswith("Index Cond:") for d in details):
                return True
    return False


def plans() -> None:
    """Fill a database with 1,000,000 edges and print the plan of every statement
    that reads or writes them (dependencies.py, maintenance, the admin, the ORM),
    with representative parameters, each as the engine runs it."""
    _fresh_database()
    _psql("""
        -- 110,000 jobs: 100,000 finished dependencies, 10,000 blocked dependents
        -- (in 100 workflows) with 100 dependencies each: 1,000,000 edges.
        INSERT INTO awa_job (id, kind, queue, state, finalized_at, has_dependents)
        SELECT g, 'noop', 'bench', 'completed', now() - interval '30 days', true
        FROM generate_series(1, 100000) g;
        INSERT INTO awa_job (id, kind, queue, state, workflow_id)
        SELECT g, 'noop', 'bench', 'blocked', md5((g % 100)::text)::uuid
        FROM generate_series(100001, 110000) g;
        INSERT INTO awa_job_dependency (job_id, depends_on_id, position, requires)
        SELECT 100000 + d, (d * 7919 + k * 104729) % 100000 + 1, k, 'completed'
        FROM generate_series(1, 10000) d, generate_series(0, 99) k
        ON CONFLICT DO NOTHING;
        SELECT setval(pg_get_serial_sequence('awa_job', 'id'), 110000);
        ANALYZE awa_job; ANALYZE awa_job_dependency;
    """)
    _setup_django()
    from django.db import connection

    from django_awa import sql
    from django_awa.models import Job

    edges = _psql("SELECT count(*) FROM awa_job_dependency")
    print(f"-- awa_job_dependency rows: {edges}")
    finished = [1, 2, 3, 50000]
    dependents = [100001, 100002, 105000]
    workflow = _psql("SELECT workflow_id FROM awa_job WHERE id = 100001")
    # name: (statement, parameters, planned by index as dependencies.planned_by_index
    # does, or by the statistics alone)
    cases: dict[str, tuple[str, dict[str, Any], bool]] = {
        "DEPENDENTS_OF": (sql.DEPENDENTS_OF, {"ids": finished}, True),
        "DEPENDENTS_TO_JUDGE": (sql.DEPENDENTS_TO_JUDGE, {"ids": finished}, True),
        "DEPENDENTS_TO_JUDGE_COMPLETED": (
            sql.DEPENDENTS_TO_JUDGE_COMPLETED,
            {"ids": finished},
            True,
        ),
        "DOOMED_BY": (sql.DOOMED_BY, {"ids": dependents, "finished": finished}, True),
        "PENDING_OF": (sql.PENDING_OF, {"ids": dependents, "mine": finished}, True),
        "LOCK_DEPENDENTS": (sql.LOCK_DEPENDENTS, {"ids": finished}, True),
        "CANCEL_BY_DEPENDENCY (outcomes)": (
            sql.CANCEL_BY_DEPENDENCY,
            {"ids": dependents, "finished": finished, "prefix": "x"},
            True,
        ),
        "CANCEL_BY_DEPENDENCY (new, retried or orphaned jobs)": (
            sql.CANCEL_BY_DEPENDENCY,
            {"ids": dependents, "finished": None, "prefix": "x"},
            True,
        ),
        "PROMOTE_READY": (sql.PROMOTE_READY, {"ids": dependents}, True),
        "PROMOTE_MET_BY": (sql.PROMOTE_MET_BY, {"ids": finished}, True),
        "INSERT_EDGES": (
            sql.INSERT_EDGES,
            {
                "job_id": [100001],
                "depends_on_id": [99999],
                "position": [100],
                "requires": ["completed"],
            },
            True,
        ),
        "REVIVE_CASCADED": (sql.REVIVE_CASCADED, {"ids": finished}, True),
        "REOPEN_CASCADED": (sql.REOPEN_CASCADED, {"ids": finished}, True),
        "BLOCK_DEPENDENTS_AGAIN": (sql.BLOCK_DEPENDENTS_AGAIN, {"ids": finished}, True),
        "HAS_DEPENDENCIES": (sql.HAS_DEPENDENCIES, {"ids": dependents}, True),
        "MEET_BY_DELETION": (sql.MEET_BY_DELETION, {"completed": finished}, True),
        "ORPHANED_BLOCKED": (sql.ORPHANED_BLOCKED, {"after": 0, "limit": 1000}, True),
        "PRUNE_FINISHED": (
            sql.PRUNE_FINISHED,
            {"states": ["completed"], "retention": 86400, "limit": 1000},
            False,
        ),
        "WORKFLOW_EDGES (admin graph)": (sql.WORKFLOW_EDGES, {"workflow_id": workflow}, False),
    }
    # The ORM's reads (Job.dependencies(), Job.dependents()), as Django sent them.
    from django.test.utils import CaptureQueriesContext

    for name, id_, method in (
        ("Job.dependencies()", 100001, Job.dependencies),
        ("Job.dependents()", 1, Job.dependents),
    ):
        job = Job.objects.get(id=id_)
        with CaptureQueriesContext(connection) as captured:
            method(job)
        for n, query in enumerate(captured.captured_queries, 1):
            cases[f"{name}, query {n}"] = (query["sql"].replace("%", "%%"), {}, False)
    with connection.cursor() as cursor:
        for name, (statement, params, by_index) in cases.items():
            cursor.execute("BEGIN")
            if by_index:
                cursor.execute(sql.PLAN_BY_INDEX)
            cursor.execute(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) " + statement, params
            )
            plan = "\n".join(row[0] for row in cursor.fetchall())
            cursor.execute("ROLLBACK")
            mode = "planned by index" if by_index else "planned by statistics"
            mark = "  WHOLE EDGE TABLE READ" if _reads_every_edge(plan) else ""
            print(f"\n-- {name} ({mode}){mark}\n{plan}")
    _psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)", "postgres")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2,000 jobs, a fan-in of 1,000")
    parser.add_argument("--plans", action="store_true", help="EXPLAIN at 1,000,000 edges")
    parser.add_argument("--workloads", default="plain,workflows,fanin")
    parser.add_argument("-n", type=int, default=20_000, help="jobs of the drains")
    parser.add_argument("--members", type=int, default=10_000, help="members of the fan-in")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--workers", type=int, default=1, help="worker processes of each drain")
    parser.add_argument("--enqueue", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.enqueue:
        _enqueue(args.enqueue, args.n, args.members)
        return
    if args.plans:
        plans()
        return
    n, members = (2000, 1000) if args.small else (args.n, args.members)
    for workload in args.workloads.split(","):
        figures = run_workload(workload, n, members, args.timeout, args.workers)
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
