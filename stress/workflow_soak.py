#!/usr/bin/env python3
"""Workflow crash soak: random DAGs, three workers, one SIGKILLed every few seconds.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres \\
        python stress/workflow_soak.py --dags 200 --timeout 1200

It creates its own database (``awa_wfsoak_<pid>``), migrates it and enqueues
``--dags`` random workflows of the test kind ``Node`` (tests/testapp): 3 to 25
steps, each after a random few earlier ones with ``requires`` "completed" or
now and then "finished"; most steps succeed, some fail for good, raise and
retry, cancel themselves or sleep. ``--workers`` awa_worker processes run them
while a controller SIGKILLs one every ``--kill-every`` seconds (jittered) and
starts it again, so steps are rescued mid-run and outcomes are written by
whichever worker is alive.

Audited in SQL at the end (``audit_workflows``), each must be 0:

* a step that ran before one of its dependencies reached what it requires
  (a handler run recorded before the dependency's last run, or the step's
  attempt started before the dependency finished);
* a step whose final state contradicts its dependencies' (cancelled while
  every required dependency completed; run although a required one failed
  or was cancelled; still blocked);
* a handler run twice in one attempt;
* a job not final (every workflow must reach a final state).

Exits 1 on any of these or when ``--timeout`` passes; drops its database
unless ``--keep``. ``tests/test_workflow_workers.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stress import crash_soak  # noqa: E402
from stress.crash_soak import Workers, log, with_db  # noqa: E402

QUEUES = ["--queue", "flow=6", "--queue", "echo=2"]

# Each row breaks a rule; the audit wants none. %(ids)s: the workflows' job ids.
AUDITS = {
    "ran before a dependency reached what it requires": """
        SELECT e.job_id, e.depends_on_id FROM awa_job_dependency AS e
        JOIN awa_job AS s ON s.id = e.job_id
        JOIN awa_job AS d ON d.id = e.depends_on_id
        WHERE e.job_id = ANY(%(ids)s)
          AND EXISTS (SELECT 1 FROM testapp_ledger WHERE job_id = s.id)
          AND (NOT (CASE WHEN e.requires = 'completed' THEN d.state = 'completed'
                         ELSE d.state IN ('completed', 'failed', 'cancelled') END)
               OR (SELECT min(id) FROM testapp_ledger WHERE job_id = s.id)
                  < (SELECT coalesce(max(id), 0) FROM testapp_ledger WHERE job_id = d.id)
               OR s.attempted_at < d.finalized_at)
    """,
    "cancelled although every required dependency completed": """
        SELECT s.id FROM awa_job AS s
        WHERE s.id = ANY(%(ids)s) AND s.state = 'cancelled'
          AND s.metadata ? 'awa_cancelled_by'
          AND NOT EXISTS (
              SELECT 1 FROM awa_job_dependency AS e JOIN awa_job AS d ON d.id = e.depends_on_id
              WHERE e.job_id = s.id AND e.requires = 'completed'
                AND d.state IN ('failed', 'cancelled'))
    """,
    "ran although a required dependency failed or was cancelled": """
        SELECT s.id FROM awa_job AS s
        WHERE s.id = ANY(%(ids)s)
          AND EXISTS (SELECT 1 FROM testapp_ledger WHERE job_id = s.id)
          AND EXISTS (
              SELECT 1 FROM awa_job_dependency AS e JOIN awa_job AS d ON d.id = e.depends_on_id
              WHERE e.job_id = s.id AND e.requires = 'completed'
                AND d.state IN ('failed', 'cancelled'))
    """,
    "a handler run twice in one attempt": """
        SELECT job_id, attempt FROM testapp_ledger
        WHERE job_id = ANY(%(ids)s) AND note <> 'saw-cancel'
        GROUP BY job_id, attempt, run_lease HAVING count(*) > 1
    """,
    "not final": """
        SELECT id, state FROM awa_job
        WHERE id = ANY(%(ids)s) AND state NOT IN ('completed', 'failed', 'cancelled')
    """,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dags", type=int, default=200)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds, jittered")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    parser.add_argument("--keep", action="store_true")
    return parser.parse_args(argv)


def random_dag(rng: random.Random, awa: Any, node: Any, index: int) -> Any:
    """A Workflow of 3 to 25 ``Node`` steps, each after 0 to 3 earlier ones."""
    flow = awa.Workflow(f"soak-{index}")
    steps: list[Any] = []
    for i in range(rng.randint(3, 25)):
        roll = rng.random()
        if roll < 0.05:
            args = node(name=f"{index}.{i}", action="terminal")
        elif roll < 0.09:
            args = node(name=f"{index}.{i}", action="cancel")
        elif roll < 0.20:
            args = node(name=f"{index}.{i}", fail_until=1)
        else:
            seconds = rng.choice([0.0, 0.0, 0.02, 0.2, 1.0])
            args = node(name=f"{index}.{i}", action="sleep", seconds=seconds)
        after = rng.sample(steps, k=min(len(steps), rng.choice([0, 1, 1, 2, 3]))) if steps else []
        requires = "finished" if after and rng.random() < 0.15 else "completed"
        steps.append(
            flow.add(awa.EnqueueRequest(args, max_attempts=4), after=after, requires=requires)
        )
    return flow


def audit_workflows(cursor: Any, ids: list[int]) -> dict[str, list[tuple[Any, ...]]]:
    """Every rule of ``AUDITS`` over these jobs: the rows that break it."""
    found = {}
    for rule, statement in AUDITS.items():
        cursor.execute(statement, {"ids": ids})
        found[rule] = cursor.fetchall()
    return found


def run(opts: argparse.Namespace) -> int:
    seed = opts.seed if opts.seed is not None else random.randrange(2**32)  # noqa: S311
    rng = random.Random(seed)  # noqa: S311 - reproducible, not secret
    name = f"awa_wfsoak_{os.getpid()}"
    url = with_db(opts.database_url, name)
    import psycopg

    with psycopg.connect(opts.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    log(f"seed {seed}; database {name}; {opts.dags} DAGs; {opts.workers} workers")
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    env.update(
        DATABASE_URL=url,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    saved = dict(os.environ)
    os.environ.update(env)
    os.environ.pop("AWA_TEST_DB_NAME", None)
    try:
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--run-syncdb", "-v0"],
            cwd=ROOT,
            env=env,
            check=True,
        )
        return soak(opts, rng, env, url)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if not opts.keep:
            with psycopg.connect(opts.database_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            log(f"dropped {name}")


def soak(opts: argparse.Namespace, rng: random.Random, env: dict[str, str], url: str) -> int:
    import psycopg

    # The DAGs are enqueued by a child process (this one keeps no Django state,
    # so the short version can run inside a test process).
    code = (
        "import random, sys, django; django.setup();"
        "import django_awa as awa; from tests.testapp.jobs import Node;"
        "from stress.workflow_soak import random_dag;"
        f"rng = random.Random({rng.randrange(2**32)});"
        f"[random_dag(rng, awa, Node, i).enqueue() for i in range({opts.dags})]"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)  # noqa: S603
    with psycopg.connect(url, autocommit=True) as conn:
        ids = [row[0] for row in conn.execute("SELECT id FROM awa_job WHERE kind = 'node'")]
    log(f"enqueued {len(ids)} steps")
    logdir = Path(env.get("AWA_SOAK_LOGDIR") or "/tmp")  # noqa: S108 - local logs only
    crash_soak.WORKER_QUEUES = QUEUES  # what Workers start: the flow queue
    workers = Workers(opts.workers, env | {"AWA_TEST_STALE_AFTER": "2"}, logdir)
    deadline = time.monotonic() + opts.timeout
    next_kill = time.monotonic() + opts.kill_every
    left = len(ids)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM awa_job WHERE id = ANY(%s)"
                    " AND state NOT IN ('completed', 'failed', 'cancelled')",
                    [ids],
                ).fetchone()
                left = row[0] if row else left
                if left == 0:
                    break
                if time.monotonic() >= next_kill:
                    workers.kill_one(rng)
                    next_kill = time.monotonic() + opts.kill_every * rng.uniform(0.5, 1.5)
                # Retries wait their backoff: make them due, so the soak ends sooner.
                conn.execute(
                    "UPDATE awa_job SET run_at = now() WHERE state = 'retryable' AND id = ANY(%s)",
                    [ids],
                )
                time.sleep(0.3)
    finally:
        workers.stop()
    with psycopg.connect(url, autocommit=True) as conn, conn.cursor() as cursor:
        found = audit_workflows(cursor, ids)
        cursor.execute("SELECT state, count(*) FROM awa_job WHERE id = ANY(%s) GROUP BY 1", [ids])
        states = dict(cursor.fetchall())
    log(f"states {states}; workers killed {workers.killed}")
    bad = 0
    for rule, rows in found.items():
        log(f"audit: {rule}: {len(rows)}" + (f" e.g. {rows[:5]}" if rows else ""))
        bad += len(rows)
    if left:
        log(f"timed out with {left} steps not final")
    return 1 if bad or left else 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
