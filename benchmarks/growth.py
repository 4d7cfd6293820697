#!/usr/bin/env python3
"""Cost growth: drain and claim rates with millions of finished rows vs an empty table.

    python benchmarks/growth.py [--finished-rows 5000000] [--jobs 20000] [--repeats 3]

Two databases on 127.0.0.1 (``awa_growth_empty``, ``awa_growth_full``), both
migrated with ``djbench.settings_awa``; the full one gets ``--finished-rows``
finished jobs (completed, failed and cancelled, with the columns django-awa
leaves on them), then VACUUM ANALYZE. By default (``--fill lifecycle``) they
go in as the engine writes them: enqueued as available rows, then claimed
and finished 100 per transaction, so they lie in the pages as a real queue's
do; ``--fill direct`` inserts them finished in one INSERT ... SELECT. Then
they are moved into ``awa_job_done``, and the indexes of ``awa_job`` they
left large are rebuilt, as a worker's maintenance does (``archive()``, then
``reindex()``, which its leader runs every ten minutes).
Each repeat measures, on the empty table and on the full one in turn:

  drain  enqueue --jobs no-op jobs (awa.enqueue_many, batches of --batch),
         start one default worker (``awa_worker --queue bench``) and time
         until all are completed; rate from worker start, and from the first
         claim to the last completion (database clock, no start-up)
  claim  enqueue --jobs jobs, then call django_awa.producer.claim() (the
         worker's own function, each call its own transaction) at --limit
         (default CLAIM_BATCH_SIZE) until all are claimed; no worker runs

Before each measurement the table goes back to its baseline (TRUNCATE for the
empty one; the previous measurement's rows deleted for the full one), then
VACUUM ANALYZE and CHECKPOINT. It prints medians with min and max, the ratio
full/empty, the relation sizes, and EXPLAIN (ANALYZE, BUFFERS) of the claim
statement with the parameters claim() sends, on both tables. The databases
are dropped at the end. No test asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
VENV = BENCH_DIR / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
RESULTS_DIR = BENCH_DIR / "results"
LOG_DIR = RESULTS_DIR / "logs"
SETTINGS = "djbench.settings_awa"
QUEUE = "bench"
RESULT_PREFIX = "AWA-BENCH-RESULT "
PG_SERVER = "postgresql://postgres@127.0.0.1:5432/"


# --------------------------------------------------------------- environment
def ensure_venv(script: Path) -> None:
    """Re-exec ``script`` in benchmarks/.venv, as run.py does (--no-venv: stay here)."""
    if "--no-venv" in sys.argv or Path(sys.prefix).resolve() == VENV.resolve():
        return
    stale = not VENV_PYTHON.exists()
    if not stale:
        with contextlib.suppress(ImportError, AttributeError):
            import run  # run.py owns the stamp that says when to bootstrap again

            stale = run._needs_bootstrap()
    if stale and "--no-bootstrap" not in sys.argv:
        sys.stderr.write(f"{script.name}: preparing benchmarks/.venv (bootstrap.sh)…\n")
        subprocess.run(["bash", str(BENCH_DIR / "bootstrap.sh")], check=True)
    if not VENV_PYTHON.exists():
        raise SystemExit(f"{script.name}: benchmarks/.venv is missing; run benchmarks/bootstrap.sh")
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(script), *sys.argv[1:]])


def dsn(dbname: str) -> str:
    return PG_SERVER + dbname


def django_env(dbname: str) -> dict[str, str]:
    """The environment of every Django process (producers, workers, migrate)."""
    env = dict(os.environ)
    path = [str(REPO_ROOT), str(BENCH_DIR)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        DJANGO_SETTINGS_MODULE=SETTINGS,
        PYTHONPATH=os.pathsep.join(path),
        BENCH_DB=dbname,
        BENCH_DSN=dsn(dbname),
        PYTHONUNBUFFERED="1",
    )
    return env


def admin_execute(statement: str) -> None:
    import psycopg

    with psycopg.connect(dsn("postgres"), autocommit=True, connect_timeout=10) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


def create_database(dbname: str, template: str | None = None) -> None:
    """``dbname`` made afresh (dropped first if it exists): empty, or a copy of ``template``."""
    drop_database(dbname)
    copy = "" if template is None else f' TEMPLATE "{template}"'
    admin_execute(f'CREATE DATABASE "{dbname}"{copy}')


def drop_database(dbname: str) -> None:
    admin_execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def run_child(script: Path, dbname: str, *args: object, timeout: float) -> dict[str, Any]:
    """Run ``script _child ARGS`` in a Django environment; return its result line."""
    cmd = [sys.executable, str(script), "_child", *map(str, args)]
    try:
        proc = subprocess.run(
            cmd,
            cwd=BENCH_DIR,
            env=django_env(dbname),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(map(str, args))}` timed out after {timeout:.0f}s") from exc
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX) and proc.returncode == 0:
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n    ".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise RuntimeError(f"`{' '.join(map(str, args))}` failed (exit {proc.returncode}):\n    {tail}")


def emit(**result: object) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def single_run_lock(name: str):
    """An exclusive lock: a second run would drop this run's databases."""
    import fcntl

    RESULTS_DIR.mkdir(exist_ok=True)
    handle = open(RESULTS_DIR / f".{name}.lock", "w")  # held until the process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise SystemExit(
            f"{name}: another run is in progress (benchmarks/results/.{name}.lock)"
        ) from exc
    return handle


def begin_run(name: str, parse: Callable[[list[str]], argparse.Namespace], argv: list[str]):
    """What a script's main does first: its venv, its arguments, the run lock, SIGTERM
    handling and the server's facts. Returns ``(args, lock, facts)``."""
    ensure_venv(Path(sys.argv[0]).resolve())
    args = parse(argv)
    lock = single_run_lock(name)
    sigterm_as_interrupt()
    try:
        facts = server_facts()
    except Exception as exc:  # any failure to connect ends the run here
        raise SystemExit(f"{name}: PostgreSQL at 127.0.0.1:5432 (user postgres): {exc}") from exc
    return args, lock, facts


def sigterm_as_interrupt() -> None:
    """SIGTERM ends the run like Ctrl-C, so the databases and workers are cleaned up."""

    def handler(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------------------- progress
class Progress:
    """A live status line on stderr (one plain line per step when not a tty)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.prefix = ""
        self._last = 0.0

    def step(self, prefix: str) -> None:
        self.prefix = prefix
        if not self.tty:
            sys.stderr.write(f"[{time.monotonic() - self.started:6.0f}s] {prefix}\n")
            sys.stderr.flush()
        self.live("", force=True)

    def live(self, detail: str, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        line = f"[{now - self.started:6.0f}s] {self.prefix}  {detail}"
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns
        except OSError:
            columns = 120
        sys.stderr.write("\r\x1b[K" + line[: columns - 1])
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.write(text.rstrip() + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


# ------------------------------------------------------------------ workers
class Worker:
    """One ``python -m django awa_worker --queue bench`` process, the defaults."""

    def __init__(self, dbname: str, log_name: str) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{log_name}.log"
        with open(self.log_path, "wb") as log:  # this start's output only
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start\n".encode())
            log.flush()
            self.started_at = time.perf_counter()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "django", "awa_worker", "--queue", QUEUE],
                cwd=BENCH_DIR,
                env=django_env(dbname),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"worker exited with code {code}:\n    {self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n    ".join(text.strip().splitlines()[-lines:])

    def stop(self, grace: float = 40.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # and anything it left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


# --------------------------------------------------- inside Django processes
def django_setup() -> None:
    import django

    django.setup()


def capture_claim_params(queue: str, limit: int) -> tuple[str, dict[str, Any]]:
    """The alias and the parameters claim() sends with sql.CLAIM, taken from a real call.

    The call runs in a transaction that is rolled back, so it claims nothing.
    """
    from django.db import transaction

    from django_awa import db, sql
    from django_awa.conf import awa_settings
    from django_awa.producer import claim

    alias = awa_settings().database
    seen: list[dict[str, Any]] = []
    original = db.Cursor.execute

    def recording(self, statement, params=None):
        if statement == sql.CLAIM:
            seen.append(dict(params or {}))
        return original(self, statement, params)

    db.Cursor.execute = recording  # type: ignore[method-assign]
    try:
        with transaction.atomic(using=alias):
            claim(queue, limit, alias)
            transaction.set_rollback(True, using=alias)
    finally:
        db.Cursor.execute = original  # type: ignore[method-assign]
    if not seen:
        raise RuntimeError("claim() did not run sql.CLAIM")
    return alias, seen[0]


def generic_claim_sql(params: dict[str, Any]) -> tuple[str, list[Any]]:
    """sql.CLAIM with $n placeholders (for PREPARE) and the values in that order."""
    from django_awa import sql

    order: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    text = re.sub(r"%\((\w+)\)s", placeholder, sql.CLAIM)
    return text, [params[name] for name in order]


def explain_claim(alias: str, params: dict[str, Any]) -> dict[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the claim, rolled back: the plan a call gets with
    its parameters bound (the first executions of a prepared statement), and the
    generic plan a prepared statement may settle on after five executions."""
    from django.db import connections, transaction
    from psycopg import sql as psql

    from django_awa import sql

    wrapper = connections[alias]
    plans: dict[str, str] = {}
    with transaction.atomic(using=alias):
        raw = wrapper.connection
        with raw.cursor() as cur:
            # Each EXPLAIN in a savepoint rolled back, so both see the same rows.
            cur.execute("SAVEPOINT growth_custom")
            cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql.CLAIM, params)
            plans["custom"] = "\n".join(row[0] for row in cur.fetchall())
            cur.execute("ROLLBACK TO SAVEPOINT growth_custom")
            text, values = generic_claim_sql(params)
            cur.execute("SAVEPOINT growth_generic")
            cur.execute("PREPARE awa_growth_claim AS " + text)
            try:
                cur.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                cur.execute(
                    psql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE awa_growth_claim({})").format(
                        psql.SQL(", ").join(psql.Literal(v) for v in values)
                    )
                )
                plans["generic"] = "\n".join(row[0] for row in cur.fetchall())
            finally:
                cur.execute("ROLLBACK TO SAVEPOINT growth_generic")
                cur.execute("DEALLOCATE awa_growth_claim")
        transaction.set_rollback(True, using=alias)
    return plans


def child_migrate() -> None:
    django_setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    emit(ok=True)


def child_enqueue(n: int, batch: int) -> None:
    django_setup()
    from django.db import connection, transaction
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    connection.ensure_connection()
    start = time.perf_counter()
    for lo in range(0, n, batch):
        with transaction.atomic():
            awa.enqueue_many([Noop(n=i) for i in range(lo, min(n, lo + batch))])
    emit(elapsed=time.perf_counter() - start, count=n)


def child_claim(n: int, limit: int, explain: int) -> None:
    django_setup()
    from django.db import connections

    from django_awa.conf import awa_settings
    from django_awa.producer import claim

    limit = limit or awa_settings().claim_batch_size
    alias, params = capture_claim_params(QUEUE, limit)
    plans = explain_claim(alias, params) if explain else {}
    connections[alias].ensure_connection()
    claimed = 0
    calls: list[float] = []
    start = time.perf_counter()
    while claimed < n:
        t = time.perf_counter()
        # As the worker calls it: outside any atomic block, so each call is its
        # own transaction, committed at once.
        jobs = claim(QUEUE, limit, alias)
        calls.append(time.perf_counter() - t)
        if not jobs:
            break
        claimed += len(jobs)
    elapsed = time.perf_counter() - start
    calls.sort()
    emit(
        claimed=claimed,
        limit=limit,
        elapsed=elapsed,
        calls=len(calls),
        call_p50=calls[len(calls) // 2],
        call_p99=calls[min(len(calls) - 1, int(len(calls) * 0.99))],
        plans=plans,
        params={k: v for k, v in params.items()},
    )


def child_archive() -> None:
    """Move the filled finished rows into awa_job_done, as a worker's maintenance does,
    then rebuild the awa_job indexes they left large, as its leader does within ten
    minutes (Maintenance.reindex)."""
    django_setup()
    from django.db import connection

    from django_awa.maintenance import Maintenance

    maintenance = Maintenance()
    moved = 0
    while batch := maintenance.archive():
        moved += batch
    # reindex() weighs the indexes against the larger of the statistics' live rows
    # and the last VACUUM's count, which is the fill's 5,000,000 until a VACUUM
    # counts them gone (in a worker, the leader's or autovacuum's during the drain).
    with connection.cursor() as cursor:
        cursor.execute("VACUUM awa_job")
    emit(moved=moved, rebuilt=maintenance.reindex())


def child_main(argv: list[str]) -> None:
    commands: dict[str, Callable[..., None]] = {
        "migrate": child_migrate,
        "archive": child_archive,
        "enqueue": child_enqueue,
        "claim": child_claim,
    }
    name, *rest = argv
    commands[name](*(int(a) for a in rest))


# ------------------------------------------------------------ finished rows
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/app/django_awa/execute.py", line 212, in run_handler\n'
    "    result = handler(job)\n"
    '  File "/app/shop/jobs.py", line 88, in send_email\n'
    "    response = client.post(url, json=payload, timeout=10)\n"
    '  File "/venv/lib/python3.12/site-packages/httpx/_client.py", line 1145, in post\n'
    "    return self.request(\n"
    "httpx.ConnectTimeout: timed out\n"
)

# One statement per chunk of ids. random() after setseed() is deterministic in
# one session (INSERT ... SELECT runs no parallel workers). The mix: 92%
# completed, 5% failed, 3% cancelled; 80% in the bench queue (kind noop), the
# rest in two other queues; finalized_at spread evenly over --span-hours up to
# now (inside COMPLETED_RETENTION, so the worker's pruning leaves them alone);
# the columns as finalize/cancel leave them: heartbeat_at, deadline_at and the
# callback columns NULL, run_lease = attempt, errors one entry per failed
# attempt; 5% are follow-ups (metadata.awa_trigger), as awa_job_trigger_idx sees.
FILL_SQL = """
WITH r AS (
    SELECT g,
           %(start)s::timestamptz + make_interval(secs => (g - 1) * %(step)s::float8) AS fin,
           random() AS u1, random() AS u2, random() AS u3, random() AS u4
    FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g
), s AS (
    SELECT g, fin, u3, u4,
           CASE WHEN u1 < 0.92 THEN 'completed' WHEN u1 < 0.97 THEN 'failed'
                ELSE 'cancelled' END AS state,
           CASE WHEN u2 < 0.80 THEN 'bench' WHEN u2 < 0.92 THEN 'default'
                ELSE 'reports' END AS queue,
           CASE WHEN u3 < 0.10 THEN 1 WHEN u3 < 0.85 THEN 2 WHEN u3 < 0.97 THEN 3
                ELSE 4 END AS priority
    FROM r
), t AS (
    SELECT s.*,
           CASE queue WHEN 'bench' THEN 'noop' WHEN 'default' THEN 'send_email'
                ELSE 'build_report' END AS kind,
           CASE state WHEN 'failed' THEN 3
                      WHEN 'cancelled' THEN CASE WHEN u4 < 0.5 THEN 0 ELSE 1 END
                      ELSE CASE WHEN u4 < 0.95 THEN 1 ELSE 2 END END AS attempt,
           make_interval(secs => 0.002 + u4 * 0.3) AS ran,
           make_interval(secs => 0.01 + u3 * 4) AS waited
    FROM s
)
INSERT INTO awa_job (id, kind, queue, args, state, priority, attempt, max_attempts, run_lease,
                     run_at, created_at, attempted_at, heartbeat_at, deadline_at, finalized_at,
                     errors, metadata, tags, progress, callback_id, callback_timeout_at,
                     snoozed, unique_key, unique_states)
SELECT g, kind, queue,
       CASE kind
           WHEN 'noop' THEN jsonb_build_object('n', g, 't', 0.0)
           WHEN 'send_email' THEN jsonb_build_object(
               'user_id', g %% 100000, 'template', 'order_confirmation', 'locale', 'en')
           ELSE jsonb_build_object('report_id', g, 'format', 'pdf',
                                   'filters', jsonb_build_object('since', '2026-01-01'))
       END,
       state, priority, attempt,
       CASE state WHEN 'failed' THEN 3 ELSE 25 END,
       attempt,
       fin - ran - waited, fin - ran - waited,
       CASE WHEN attempt > 0 THEN fin - ran END,
       NULL, NULL, fin,
       CASE
           WHEN state = 'failed' THEN (
               SELECT jsonb_agg(jsonb_build_object(
                   'attempt', a, 'at', fin - make_interval(secs => (3 - a) * 30),
                   'error', 'httpx.ConnectTimeout: timed out', 'traceback', %(traceback)s::text))
               FROM generate_series(1, 3) AS a)
           WHEN state = 'cancelled' THEN jsonb_build_array(jsonb_build_object(
               'attempt', attempt, 'at', fin, 'error', 'cancelled by operator',
               'traceback', ''))
           WHEN attempt = 2 THEN jsonb_build_array(jsonb_build_object(
               'attempt', 1, 'at', fin - interval '15 seconds',
               'error', 'httpx.ConnectTimeout: timed out', 'traceback', %(traceback)s::text))
           ELSE '[]'::jsonb
       END,
       CASE WHEN g %% 20 = 0 THEN jsonb_build_object('awa_trigger', jsonb_build_object(
           'job_id', g - 1, 'kind', 'noop', 'outcome', 'completed'))
            ELSE '{}'::jsonb END,
       CASE kind WHEN 'send_email' THEN '["email"]'::jsonb ELSE '[]'::jsonb END,
       NULL, NULL, NULL, false, NULL, NULL
FROM t
"""

# --fill lifecycle: the rows FILL_SQL computes (into a temporary table) reach
# awa_job the way the engine writes them, so they lie in its pages as a real
# queue's finished jobs do: enqueued as available rows (smaller than finished
# ones), then, LIFECYCLE_SLICE at a time and each its own transaction as a
# claim and a finalize are, claimed (running) and finished. --fill direct
# inserts them finished: every page then keeps a remainder that fits one new,
# smaller row, a layout the engine does not produce (the worst case).
LIFECYCLE_CHUNK = 20_000
LIFECYCLE_SLICE = 100
STAGE_TABLE = """
CREATE TEMPORARY TABLE fill_stage (LIKE awa_job INCLUDING DEFAULTS);
CREATE INDEX ON fill_stage (id)
"""
STAGE_SQL = FILL_SQL.replace("INSERT INTO awa_job ", "INSERT INTO fill_stage ", 1)
ENQUEUED = """
INSERT INTO awa_job (id, kind, queue, args, state, priority, attempt, max_attempts, run_lease,
                     run_at, created_at, errors, metadata, tags, snoozed)
SELECT id, kind, queue, args, 'available', priority, 0, max_attempts, 0,
       run_at, created_at, '[]', metadata, tags, false
FROM fill_stage ORDER BY id
"""
CLAIMED = """
UPDATE awa_job AS j
SET state = 'running', attempt = s.attempt, run_lease = s.run_lease,
    attempted_at = s.attempted_at, heartbeat_at = s.attempted_at,
    deadline_at = s.attempted_at + interval '15 minutes'
FROM fill_stage AS s
WHERE j.id = s.id AND s.id BETWEEN %(lo)s AND %(hi)s AND s.attempt > 0
"""
FINISHED = """
UPDATE awa_job AS j
SET state = s.state, attempt = s.attempt, run_lease = s.run_lease,
    heartbeat_at = NULL, deadline_at = NULL, finalized_at = s.finalized_at, errors = s.errors
FROM fill_stage AS s
WHERE j.id = s.id AND s.id BETWEEN %(lo)s AND %(hi)s
"""


def fill_finished(
    dbname: str, rows: int, span_hours: float, lifecycle: bool, progress: Progress
) -> None:
    import psycopg

    chunk = LIFECYCLE_CHUNK if lifecycle else 500_000
    with psycopg.connect(dsn(dbname), autocommit=True) as conn:
        conn.execute("SELECT setseed(0.4242)")
        if lifecycle:
            conn.execute(STAGE_TABLE)
        start = conn.execute(
            "SELECT now() - make_interval(secs => %s)", [span_hours * 3600]
        ).fetchone()[0]
        step = span_hours * 3600 / max(1, rows)
        began = time.perf_counter()
        for lo in range(1, rows + 1, chunk):
            hi = min(rows, lo + chunk - 1)
            progress.live(f"filled {lo - 1:,}/{rows:,}  {time.perf_counter() - began:4.0f}s")
            conn.execute(
                STAGE_SQL if lifecycle else FILL_SQL,
                {"start": start, "step": step, "lo": lo, "hi": hi, "traceback": TRACEBACK},
            )
            if lifecycle:
                conn.execute(ENQUEUED)
                for first in range(lo, hi + 1, LIFECYCLE_SLICE):
                    ids = {"lo": first, "hi": min(hi, first + LIFECYCLE_SLICE - 1)}
                    conn.execute(CLAIMED, ids)
                    conn.execute(FINISHED, ids)
                conn.execute("TRUNCATE fill_stage")
        conn.execute("SELECT setval(pg_get_serial_sequence('awa_job', 'id'), %s)", [rows])
        progress.live(f"inserted {rows:,}: VACUUM ANALYZE", force=True)
        conn.execute("VACUUM (ANALYZE) awa_job")
        conn.execute("CHECKPOINT")


# ---------------------------------------------------------- the measurements
class Case:
    """One database: the empty table or the full one."""

    def __init__(self, key: str, dbname: str, finished: int) -> None:
        self.key = key
        self.dbname = dbname
        self.finished = finished  # rows the table holds at rest

    def connect(self):
        import psycopg

        return psycopg.connect(dsn(self.dbname), autocommit=True, connect_timeout=10)

    def reset(self) -> int:
        """Back to the baseline: the finished rows only, vacuumed. Returns the largest id."""
        with self.connect() as conn:
            if self.finished:
                conn.execute("DELETE FROM awa_job WHERE id > %s", [self.finished])
            else:
                conn.execute("TRUNCATE awa_job")
            conn.execute("VACUUM (ANALYZE) awa_job, awa_job_done")
            conn.execute("CHECKPOINT")
            return int(conn.execute("SELECT coalesce(max(id), 0) FROM awa_job").fetchone()[0])

    def sizes(self) -> dict[str, int]:
        """Heap, TOAST and index sizes of awa_job and of awa_job_done, its finished rows."""
        rows: list[tuple[str, int]] = []
        with self.connect() as conn:
            for table in ("awa_job", "awa_job_done"):
                rows += conn.execute(
                    """
                    SELECT 'table ' || %(t)s, pg_relation_size(%(t)s::regclass)
                    UNION ALL
                    SELECT 'toast ' || %(t)s, coalesce(pg_total_relation_size(reltoastrelid), 0)
                    FROM pg_class WHERE oid = %(t)s::regclass
                    UNION ALL
                    SELECT * FROM (
                        SELECT 'index ' || c.relname, pg_relation_size(c.oid)
                        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                        WHERE i.indrelid = %(t)s::regclass ORDER BY c.relname) AS ix
                    UNION ALL
                    SELECT 'total ' || %(t)s || ' (table, toast, indexes)',
                           pg_total_relation_size(%(t)s::regclass)
                    """,
                    {"t": table},
                ).fetchall()
        return {name: int(size) for name, size in rows}

    def mix(self) -> list[tuple[str, str, int]]:
        with self.connect() as conn:
            return [
                (state, queue, int(n))
                for state, queue, n in conn.execute(
                    "SELECT state, queue, count(*) FROM awa_job GROUP BY 1, 2 ORDER BY 1, 2"
                ).fetchall()
            ]


def measure_drain(case: Case, args, progress: Progress, label: str) -> dict[str, float]:
    progress.step(f"{label}: reset, enqueue {args.jobs:,}")
    base = case.reset()
    enq = run_child(
        Path(__file__).resolve(),
        case.dbname,
        "enqueue",
        args.jobs,
        args.batch,
        timeout=max(300, args.jobs / 100),
    )
    with case.connect() as conn:
        # Where the new rows landed: packed at the end of an empty table, or
        # one or two a page in the free space a table with churn has.
        pages = conn.execute(
            "SELECT count(DISTINCT (ctid::text::point)[0]) FROM awa_job WHERE id > %s", [base]
        ).fetchone()[0]
    progress.step(f"{label}: drain")
    worker = Worker(case.dbname, f"growth-{case.key}")
    try:
        with case.connect() as conn:
            deadline = worker.started_at + args.timeout
            while True:
                done = conn.execute(
                    "SELECT count(*) FROM awa_job WHERE id > %s AND state = 'completed'", [base]
                ).fetchone()[0]
                now = time.perf_counter()
                if done >= args.jobs:
                    wall = now - worker.started_at
                    break
                worker.check_alive()
                if now > deadline:
                    raise RuntimeError(
                        f"drain timed out after {args.timeout:.0f}s at {done:,}/{args.jobs:,}"
                        f"\n    {worker.log_tail()}"
                    )
                progress.live(f"{done:,}/{args.jobs:,} completed  {now - worker.started_at:5.1f}s")
                time.sleep(0.1)
            span = conn.execute(
                "SELECT extract(epoch FROM max(finalized_at) - min(attempted_at))"
                " FROM awa_job WHERE id > %s",
                [base],
            ).fetchone()[0]
    finally:
        worker.stop()
    return {
        "drain_wall": args.jobs / wall,
        "drain_db": args.jobs / float(span),
        "enqueue": args.jobs / enq["elapsed"],
        "heap_pages": float(pages),
    }


def measure_claim(
    case: Case, args, progress: Progress, label: str, explain: bool
) -> tuple[dict[str, float], dict[str, str]]:
    progress.step(f"{label}: reset, enqueue {args.jobs:,}")
    case.reset()
    run_child(
        Path(__file__).resolve(),
        case.dbname,
        "enqueue",
        args.jobs,
        args.batch,
        timeout=max(300, args.jobs / 100),
    )
    limit = args.limit or "CLAIM_BATCH_SIZE"
    progress.step(f"{label}: claim() at limit {limit}" + (", EXPLAIN" if explain else ""))
    res = run_child(
        Path(__file__).resolve(),
        case.dbname,
        "claim",
        args.jobs,
        args.limit,
        int(explain),
        timeout=args.timeout,
    )
    args.limit_used = res["limit"]
    if res["claimed"] != args.jobs:
        progress.note(f"{label}: claim() took {res['claimed']:,} of {args.jobs:,} jobs")
    values = {
        "claim": res["claimed"] / res["elapsed"],
        "claim_p50": res["call_p50"] * 1000,
        "claim_p99": res["call_p99"] * 1000,
    }
    return values, res["plans"]


# ------------------------------------------------------------------- report
METRICS = [
    # key, title, higher is better, format
    ("drain_db", "drain rate, first claim -> last completion, jobs/s", True, ",.0f"),
    ("drain_wall", "drain rate, worker start -> all completed, jobs/s", True, ",.0f"),
    ("claim", "claim() rate, no worker, jobs/s", True, ",.0f"),
    ("claim_p50", "claim() call, median, ms", False, ".2f"),
    ("claim_p99", "claim() call, p99, ms", False, ".2f"),
    ("enqueue", "bulk enqueue (enqueue_many), jobs/s", True, ",.0f"),
    ("heap_pages", "heap pages the enqueued jobs landed on", None, ",.0f"),
]


def render(values: dict[str, dict[str, list[float]]], args, full_label: str) -> str:
    def cell(vals: list[float], fmt: str) -> str:
        if not vals:
            return "n/a"
        med = format(statistics.median(vals), fmt)
        if len(vals) == 1:
            return med
        return f"{med} [{format(min(vals), fmt)} - {format(max(vals), fmt)}]"

    rows = [["", "empty table", full_label, "full/empty"]]
    for key, title, higher, fmt in METRICS:
        if key in ("claim_p50", "claim_p99"):
            title = title.replace("claim() call", f"claim() call at limit {args.limit_used}")
        if key == "enqueue":
            title = title.replace("enqueue_many)", f"enqueue_many, batches of {args.batch:,})")
        empty = values["empty"].get(key, [])
        full = values["full"].get(key, [])
        ratio = ""
        if empty and full:
            r = statistics.median(full) / statistics.median(empty)
            ratio = f"{r:.2f}"
            if higher is not None:
                within = r >= 0.9 if higher else r <= 1.1
                ratio += "  within 10%" if within else "  NOT within 10%"
        rows.append([title, cell(empty, fmt), cell(full, fmt), ratio])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                [row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2]), row[3]]
            ).rstrip()
        )
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def render_sizes(sizes: dict[str, dict[str, int]], full_label: str) -> str:
    names = list(dict.fromkeys([*sizes.get("empty", {}), *sizes.get("full", {})]))
    width = max(len(n) for n in names)
    lines = [f"{'':{width}}  {'empty':>10}  {full_label:>12}"]
    for name in names:
        e = sizes.get("empty", {}).get(name)
        f = sizes.get("full", {}).get(name)
        lines.append(f"{name:{width}}  {_mb(e):>10}  {_mb(f):>12}")
    return "\n".join(lines)


def _mb(value: int | None) -> str:
    if value is None:
        return "n/a"
    if value < 10 * 2**20:
        return f"{value / 2**10:,.0f} kB"
    return f"{value / 2**20:,.1f} MB"


def server_facts() -> dict[str, str]:
    import psycopg

    with psycopg.connect(dsn("postgres"), autocommit=True, connect_timeout=10) as conn:
        facts = {"version": conn.execute("SHOW server_version").fetchone()[0]}
        for name in ("shared_buffers", "autovacuum", "max_wal_size"):
            facts[name] = conn.execute(f"SHOW {name}").fetchone()[0]
    return facts


# --------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--finished-rows",
        type=int,
        default=5_000_000,
        help="finished rows in the full table (default 5000000)",
    )
    parser.add_argument(
        "--jobs", type=int, default=20_000, help="jobs per drain and per claim run (default 20000)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    parser.add_argument("--batch", type=int, default=1000, help="enqueue_many batch (default 1000)")
    parser.add_argument(
        "--limit",
        type=int,
        default=0,
        help="claim() limit (default: AWA['CLAIM_BATCH_SIZE'], the most a worker's claim takes)",
    )
    parser.add_argument(
        "--span-hours",
        type=float,
        default=20.0,
        help="finished rows' finalized_at spread over this many hours up to now; keep it "
        "under COMPLETED_RETENTION (1 day) so the worker prunes none (default 20)",
    )
    parser.add_argument(
        "--fill",
        choices=("lifecycle", "direct"),
        default="lifecycle",
        help="how the finished rows get in: enqueued, claimed and finished as the engine "
        "writes them (lifecycle, the default), or inserted finished (direct: new rows then "
        "land one per page, a worst case)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one drain may take (default 900)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the measurements (default benchmarks/results/growth-<time>.json)",
    )
    parser.add_argument(
        "--no-venv", action="store_true", help="run with this interpreter, not benchmarks/.venv"
    )
    parser.add_argument("--no-bootstrap", action="store_true", help="never run bootstrap.sh")
    args = parser.parse_args(argv)
    if min(args.finished_rows, args.jobs, args.repeats, args.batch) < 1 or args.limit < 0:
        parser.error(
            "--finished-rows, --jobs, --repeats and --batch must be positive, and --limit "
            "positive or 0 (CLAIM_BATCH_SIZE)"
        )
    args.limit_used = args.limit
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        child_main(argv[1:])
        return 0
    args, lock, facts = begin_run("growth", parse_args, argv)

    cases = {
        "empty": Case("empty", "awa_growth_empty", 0),
        "full": Case("full", "awa_growth_full", args.finished_rows),
    }
    full_label = f"{args.finished_rows:,} finished"
    values: dict[str, dict[str, list[float]]] = {"empty": {}, "full": {}}
    plans: dict[str, dict[str, str]] = {}
    sizes: dict[str, dict[str, int]] = {}
    mix: list[tuple[str, str, int]] = []
    progress = Progress()
    load_start = os.getloadavg()
    started = time.strftime("%Y%m%d-%H%M%S")
    script = Path(__file__).resolve()
    interrupted = False
    error: str | None = None
    try:
        for case in cases.values():
            progress.step(f"setup {case.dbname}: create, migrate")
            create_database(case.dbname)
            run_child(script, case.dbname, "migrate", timeout=300)
        progress.step(f"fill awa_growth_full with {args.finished_rows:,} finished rows")
        fill_finished(
            cases["full"].dbname,
            args.finished_rows,
            args.span_hours,
            args.fill == "lifecycle",
            progress,
        )
        # A worker's maintenance moves finished rows into awa_job_done within
        # a tick of their outcome; a table that has run for a while has them there.
        progress.step("move the finished rows into awa_job_done (as maintenance does)")
        archived = run_child(script, cases["full"].dbname, "archive", timeout=3600)
        progress.note(
            f"moved {archived['moved']:,} finished rows into awa_job_done; rebuilt the "
            f"indexes of awa_job they left large: {', '.join(archived['rebuilt']) or 'none'}"
        )
        for case in cases.values():
            case.reset()
            sizes[case.key] = case.sizes()
        mix = cases["full"].mix()

        for rep in range(args.repeats):
            order = ["empty", "full"] if rep % 2 == 0 else ["full", "empty"]
            for key in order:
                label = f"rep {rep + 1}/{args.repeats} {key}"
                for name, value in measure_drain(cases[key], args, progress, label).items():
                    values[key].setdefault(name, []).append(value)
            for key in order:
                label = f"rep {rep + 1}/{args.repeats} {key}"
                got, case_plans = measure_claim(
                    cases[key], args, progress, label, explain=key not in plans
                )
                for name, value in got.items():
                    values[key].setdefault(name, []).append(value)
                if case_plans:
                    plans[key] = case_plans
        with cases["full"].connect() as conn:
            kept = conn.execute(
                "SELECT count(*) FROM awa_job WHERE id <= %s", [args.finished_rows]
            ).fetchone()[0]
        if kept != args.finished_rows:
            progress.note(
                f"note: {args.finished_rows - kept:,} finished rows were pruned during the run"
            )
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: printing what was measured")
    except RuntimeError as exc:  # a child or the worker failed
        error = str(exc)
        progress.note(f"FAILED: {error}")
    finally:
        progress.step("dropping the databases")
        for case in cases.values():
            with contextlib.suppress(Exception):
                drop_database(case.dbname)
        progress.close()
    load_end = os.getloadavg()

    out: list[str] = [
        f"Cost growth of django-awa: an empty awa_job table vs one holding {full_label} rows "
        f"(--fill {args.fill})",
        f"{args.jobs:,} no-op jobs per measurement; {args.repeats} repeat(s), empty and full "
        "alternating; median [min - max]",
        "",
        render(values, args, full_label),
        "",
        "Relation sizes at rest (after VACUUM ANALYZE):",
        render_sizes(sizes, full_label) if sizes else "  n/a",
    ]
    if mix:
        total = sum(n for *_, n in mix)
        out += ["", f"Finished rows in the full table ({total:,}, state / queue):"]
        out += [f"  {state:<10} {queue:<8} {n:>12,}  {n / total:6.1%}" for state, queue, n in mix]
    for key in ("empty", "full"):
        for kind, title in (
            ("custom", "parameters bound, as claim() sends them"),
            ("generic", "generic plan (plan_cache_mode = force_generic_plan)"),
        ):
            if key in plans and kind in plans[key]:
                out += [
                    "",
                    f"EXPLAIN (ANALYZE, BUFFERS) of sql.CLAIM, {key} table "
                    f"({args.jobs:,} available jobs), {title}:",
                ]
                out += ["  " + line for line in plans[key][kind].splitlines()]
    out += [
        "",
        "Worker: python -m django awa_worker --queue bench (the defaults; settings "
        "djbench.settings_awa). claim(): django_awa.producer.claim('bench', limit, alias), "
        "each call its own transaction, as the worker calls it.",
        f"PostgreSQL {facts['version']} at 127.0.0.1: shared_buffers {facts['shared_buffers']}, "
        f"autovacuum {facts['autovacuum']}, max_wal_size {facts['max_wal_size']}.",
        f"Machine: {os.cpu_count()} CPUs shared with PostgreSQL; load average "
        f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end.",
    ]
    sys.stdout.write("\n".join(out) + "\n")

    RESULTS_DIR.mkdir(exist_ok=True)
    target = args.json or RESULTS_DIR / f"growth-{started}.json"
    payload = {
        "started": started,
        "interrupted": interrupted,
        "error": error,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "values": values,
        "sizes": sizes,
        "mix": mix,
        "plans": plans,
        "server": facts,
        "load_average": {"start": load_start, "end": load_end},
    }
    target.write_text(json.dumps(payload, indent=2) + "\n")
    sys.stdout.write(f"Measurements: {target}\n")
    lock.close()
    return 0 if values["empty"] and values["full"] and error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
