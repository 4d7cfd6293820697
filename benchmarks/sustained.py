#!/usr/bin/env python3
"""Sustained run: enqueue and drain at once for minutes; watch the rate, dead rows and RSS.

    python benchmarks/sustained.py [--minutes 10] [--interval 30] [--rate 5000]
                                   [--completed-retention SECONDS]

A fresh database ``awa_sustained_run`` on 127.0.0.1 (``djbench.settings_awa``),
one default worker (``python -m django awa_worker --queue bench``) and one
producer process enqueueing no-op jobs with awa.enqueue_many in batches of
--batch, paced at --rate jobs/s (--rate 0: as fast as it can), for --minutes.
Completed rows stay (COMPLETED_RETENTION is a day) in awa_job_done's current
segment, which grows all run long, and every job leaves dead row versions
behind in awa_job (insert, claim, the completion's delete). With
--completed-retention the worker's maintenance prunes them that many seconds
after they finished (its prune runs once a minute), so the finished rows'
size shows whether pruning keeps up.

Every --interval seconds it prints a row: jobs enqueued/s and completed/s in
that interval, the backlog, n_live_tup / n_dead_tup and the autovacuum count of
awa_job (pg_stat_user_tables), the table and claim-index sizes, the size of
awa_job_done and its segments (the finished rows, with their indexes and TOAST), the worker
process tree's RSS (from /proc; the interval's largest sample and the kernel's
high-water mark), and EXPLAIN (ANALYZE, BUFFERS) of the claim statement with
the parameters claim() sends (in a transaction that is rolled back). At the end
a summary (first third vs last third of the run, dead rows, RSS at start, end
and peak) and the rows as JSON in benchmarks/results/. The database is dropped
at the end. No test asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from growth import (
    BENCH_DIR,
    QUEUE,
    REPO_ROOT,
    RESULTS_DIR,
    Progress,
    Worker,
    begin_run,
    capture_claim_params,
    create_database,
    django_env,
    django_setup,
    drop_database,
    dsn,
    emit,
    run_child,
)

DBNAME = "awa_sustained_run"
# Completions are counted by finalized_at (the finalize transaction's start) in
# windows that end this long before the sample, so that every transaction that
# started in a window has committed when it is counted.
COMMIT_LAG = 2.0


# --------------------------------------------------------- producer process
def child_produce(rate: float, batch: int, seconds: float) -> None:
    django_setup()
    from django.db import connection, transaction
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    connection.ensure_connection()
    count = 0
    batch = int(batch)
    start = time.perf_counter()
    while not stop:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        if rate > 0:
            # Batch k is due at k * batch / rate: no drift, and a producer that
            # fell behind catches up at once.
            due = count / rate
            if due > elapsed:
                time.sleep(min(due - elapsed, seconds - elapsed, 0.5))
                continue
        with transaction.atomic():
            awa.enqueue_many([Noop(n=count + i) for i in range(batch)])
        count += batch
    emit(count=count, elapsed=time.perf_counter() - start)


def child_main(argv: list[str]) -> None:
    name, *rest = argv
    if name == "produce":
        rate, batch, seconds = (float(a) for a in rest)
        child_produce(rate, int(batch), seconds)
    elif name == "migrate":
        from growth import child_migrate

        child_migrate()
    else:
        raise SystemExit(f"unknown child command {name!r}")


# --------------------------------------------------------------------- /proc
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def tree_memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes, summed over ``pid`` and its descendants."""
    children = _children_map()
    pending, seen = [pid], []
    while pending:
        p = pending.pop()
        seen.append(p)
        pending.extend(children.get(p, []))
    rss = hwm = 0
    for p in seen:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, hwm


# --------------------------------------------------------------- sampling
def _find_node(plan: dict[str, Any], index: str) -> dict[str, Any] | None:
    if plan.get("Index Name") == index:
        return plan
    for child in plan.get("Plans", []):
        found = _find_node(child, index)
        if found is not None:
            return found
    return None


class Sampler:
    def __init__(self, params: dict[str, Any], explain: bool) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn(DBNAME), autocommit=True, connect_timeout=10)
        self.params = params
        self.explain = explain
        self.sequence = self.conn.execute(
            "SELECT pg_get_serial_sequence('awa_job', 'id')"
        ).fetchone()[0]

    def close(self) -> None:
        self.conn.close()

    def db_now(self):
        return self.conn.execute("SELECT now()").fetchone()[0]

    def ids_drawn(self) -> int:
        # The producer draws one id per job (RESERVE_IDS) just before inserting
        # it, so this counts enqueued jobs to within one uncommitted batch.
        row = self.conn.execute(
            f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {self.sequence}"  # noqa: S608 - the table's own sequence
        ).fetchone()
        return int(row[0])

    def completed_between(self, lo, hi) -> int:
        return int(
            self.conn.execute(
                "SELECT count(*) FROM awa_job WHERE state = 'completed'"
                " AND finalized_at >= %s AND finalized_at < %s",
                [lo, hi],
            ).fetchone()[0]
        )

    def sample(self) -> dict[str, Any]:
        """Everything a row shows but the rates, read now."""
        conn = self.conn
        row: dict[str, Any] = {}
        row["db_now"] = self.db_now()
        row["ids"] = self.ids_drawn()
        backlog, running = conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'available'),"
            " count(*) FILTER (WHERE state = 'running')"
            " FROM awa_job WHERE queue = %s AND state IN ('available', 'running')",
            [QUEUE],
        ).fetchone()
        row["backlog"], row["running"] = int(backlog), int(running)
        stats = conn.execute(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count, last_autovacuum,"
            " autoanalyze_count, vacuum_count"
            " FROM pg_stat_user_tables WHERE relid = 'awa_job'::regclass"
        ).fetchone()
        (
            row["n_live_tup"],
            row["n_dead_tup"],
            row["autovacuum_count"],
            last_autovacuum,
            row["autoanalyze_count"],
            row["vacuum_count"],
        ) = stats
        row["last_autovacuum"] = last_autovacuum.isoformat() if last_autovacuum else None
        table, claim_idx, total, done = conn.execute(
            "SELECT pg_relation_size('awa_job'), pg_relation_size('awa_job_claim_idx'),"
            " pg_total_relation_size('awa_job'),"
            " (SELECT sum(pg_total_relation_size(t)) FROM ("
            "     SELECT 'awa_job_done'::regclass AS t UNION ALL SELECT inhrelid::regclass"
            "     FROM pg_inherits WHERE inhparent = 'awa_job_done'::regclass) AS d)::bigint"
        ).fetchone()
        row["table_bytes"], row["claim_idx_bytes"], row["total_bytes"] = table, claim_idx, total
        row["done_bytes"] = done
        if self.explain:
            from django_awa import sql

            with conn.transaction(force_rollback=True):
                doc = conn.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.CLAIM, self.params
                ).fetchone()[0]
            top = doc[0]
            plan = top["Plan"]
            scan = _find_node(plan, "awa_job_claim_idx") or {}
            row["claim_ms"] = top["Execution Time"] + top.get("Planning Time", 0.0)
            row["claim_rows"] = plan.get("Actual Rows")
            row["claim_buffers"] = plan.get("Shared Hit Blocks", 0) + plan.get(
                "Shared Read Blocks", 0
            )
            row["claim_index_buffers"] = scan.get("Shared Hit Blocks", 0) + scan.get(
                "Shared Read Blocks", 0
            )
        return row


# ------------------------------------------------------------------- output
COLUMNS = [
    # header, width, row -> text
    ("time s", 6, lambda r: f"{r['t']:.0f}"),
    ("enq/s", 7, lambda r: f"{r['enqueued_per_s']:,.0f}"),
    ("done/s", 7, lambda r: f"{r['completed_per_s']:,.0f}"),
    ("backlog", 8, lambda r: f"{r['backlog']:,}"),
    ("n_live", 10, lambda r: f"{r['n_live_tup']:,}"),
    ("n_dead", 10, lambda r: f"{r['n_dead_tup']:,}"),
    ("autovac", 7, lambda r: f"{r['autovacuum_count']}"),
    ("table MB", 8, lambda r: f"{r['table_bytes'] / 2**20:,.0f}"),
    ("claim idx kB", 12, lambda r: f"{r['claim_idx_bytes'] / 2**10:,.0f}"),
    ("done MB", 7, lambda r: f"{r['done_bytes'] / 2**20:,.0f}"),
    ("RSS MB", 7, lambda r: f"{r['rss'] / 2**20:,.1f}"),
    ("max MB", 7, lambda r: f"{r['rss_max'] / 2**20:,.1f}"),
    ("HWM MB", 7, lambda r: f"{r['hwm'] / 2**20:,.1f}"),
    ("claim ms", 8, lambda r: f"{r['claim_ms']:.2f}" if "claim_ms" in r else "-"),
    ("claim bufs", 10, lambda r: f"{r['claim_buffers']:,}" if "claim_buffers" in r else "-"),
    (
        "idx bufs",
        8,
        lambda r: f"{r['claim_index_buffers']:,}" if "claim_index_buffers" in r else "-",
    ),
]


def header() -> str:
    return " ".join(h.rjust(w) for h, w, _ in COLUMNS)


def format_row(row: dict[str, Any]) -> str:
    return " ".join(fmt(row).rjust(w) for _, w, fmt in COLUMNS)


def thirds(rows: list[dict[str, Any]], total: float) -> tuple[list, list]:
    first = [r for r in rows if (r["t"] - r["dt"] / 2) < total / 3]
    last = [r for r in rows if (r["t"] - r["dt"] / 2) >= 2 * total / 3]
    return first, last


def rate(rows: list[dict[str, Any]], key: str, span_key: str) -> float | None:
    span = sum(r[span_key] for r in rows)
    if not rows or span <= 0:
        return None
    return sum(r[key] for r in rows) / span


def summary(rows: list[dict[str, Any]], args, totals: dict[str, Any]) -> tuple[list[str], dict]:
    total = rows[-1]["t"] if rows else 0.0
    first, last = thirds(rows, total)
    done_first = rate(first, "completed", "window")
    done_last = rate(last, "completed", "window")
    enq_first = rate(first, "enqueued", "dt")
    enq_last = rate(last, "enqueued", "dt")
    peak_dead = max(rows, key=lambda r: r["n_dead_tup"])
    rss_start, rss_end = rows[0]["rss"], rows[-1]["rss"]
    rss_peak = max(r["rss_max"] for r in rows)
    hwm_end = rows[-1]["hwm"]
    data = {
        "completed_per_s_first_third": done_first,
        "completed_per_s_last_third": done_last,
        "enqueued_per_s_first_third": enq_first,
        "enqueued_per_s_last_third": enq_last,
        "max_n_dead_tup": peak_dead["n_dead_tup"],
        "max_n_dead_tup_at": peak_dead["t"],
        "autovacuum_runs": rows[-1]["autovacuum_count"] - totals["autovacuum_count_start"],
        "rss_first_row": rss_start,
        "rss_end": rss_end,
        "rss_peak_sampled": rss_peak,
        "rss_high_water_mark": hwm_end,
        **totals,
    }

    def r(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.0f}/s"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{b / a:.2f}" if a and b is not None else "n/a"

    lines = [
        f"Summary ({total:.0f} s; thirds by interval midpoint: {len(first)} and {len(last)} rows):",
        f"  completed  first third {r(done_first)}, last third {r(done_last)}: "
        f"last/first {ratio(done_first, done_last)}",
        f"  enqueued   first third {r(enq_first)}, last third {r(enq_last)}: "
        f"last/first {ratio(enq_first, enq_last)}",
        f"  jobs: {totals['enqueued']:,} enqueued, {totals['completed']:,} completed, "
        f"{totals['backlog_end']:,} still available at the end",
        f"  n_dead_tup: max {peak_dead['n_dead_tup']:,} (at {peak_dead['t']:.0f} s), "
        f"{rows[-1]['n_dead_tup']:,} at the end; n_live_tup {rows[-1]['n_live_tup']:,} at "
        f"the end; autovacuum ran {data['autovacuum_runs']} time(s) on awa_job"
        + (f", last at {rows[-1]['last_autovacuum']}" if rows[-1]["last_autovacuum"] else ""),
        f"  awa_job: {rows[0]['total_bytes'] / 2**20:,.0f} MB after the first interval, "
        f"{rows[-1]['total_bytes'] / 2**20:,.0f} MB at the end (table, toast, indexes); "
        f"awa_job_claim_idx {rows[0]['claim_idx_bytes'] / 2**10:,.0f} kB -> "
        f"{rows[-1]['claim_idx_bytes'] / 2**10:,.0f} kB",
        f"  worker RSS: {rss_start / 2**20:,.1f} MB at the first row, "
        f"{rss_end / 2**20:,.1f} MB at the end ({(rss_end - rss_start) / 2**20:+,.1f} MB), "
        f"peak sampled {rss_peak / 2**20:,.1f} MB; kernel high-water mark "
        f"{hwm_end / 2**20:,.1f} MB",
    ]
    if "claim_ms" in rows[0]:
        claim_first = [x["claim_ms"] for x in first] or [rows[0]["claim_ms"]]
        claim_last = [x["claim_ms"] for x in last] or [rows[-1]["claim_ms"]]
        bufs_first = [x["claim_index_buffers"] for x in first] or [0]
        bufs_last = [x["claim_index_buffers"] for x in last] or [0]
        data.update(
            claim_ms_first_third=sum(claim_first) / len(claim_first),
            claim_ms_last_third=sum(claim_last) / len(claim_last),
            claim_ms_max=max(x["claim_ms"] for x in rows),
        )
        lines.append(
            f"  claim statement (EXPLAIN ANALYZE, limit {args.claim_limit}): mean "
            f"{data['claim_ms_first_third']:.2f} ms first third, "
            f"{data['claim_ms_last_third']:.2f} ms last third, max {data['claim_ms_max']:.2f} ms;"
            f" claim-index buffers mean {sum(bufs_first) / len(bufs_first):,.0f} -> "
            f"{sum(bufs_last) / len(bufs_last):,.0f}"
        )
    return lines, data


# --------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="run length (default 10)")
    parser.add_argument(
        "--interval", type=float, default=30.0, help="seconds between rows (default 30)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=5000.0,
        help="jobs/s the producer enqueues; 0: as fast as it can (default 5000)",
    )
    parser.add_argument("--batch", type=int, default=100, help="enqueue_many batch (default 100)")
    parser.add_argument(
        "--completed-retention",
        type=float,
        default=None,
        help="the worker's COMPLETED_RETENTION in seconds (default: the setting's, a day)",
    )
    parser.add_argument(
        "--no-explain",
        action="store_true",
        help="skip the EXPLAIN ANALYZE of the claim at each row (it briefly locks up to "
        "CLAIM_BATCH_SIZE available jobs, then rolls back)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the rows (default benchmarks/results/sustained-<time>.json)",
    )
    parser.add_argument(
        "--no-venv", action="store_true", help="run with this interpreter, not benchmarks/.venv"
    )
    parser.add_argument("--no-bootstrap", action="store_true", help="never run bootstrap.sh")
    args = parser.parse_args(argv)
    args.claim_limit = None  # CLAIM_BATCH_SIZE, read once Django is set up
    if args.minutes <= 0 or args.interval <= 0 or args.rate < 0 or args.batch < 1:
        parser.error("--minutes, --interval and --batch must be positive, --rate at least 0")
    return args


def setup_django_here() -> tuple[str, dict[str, Any], int]:
    """Django in this process, for the claim statement and the parameters claim() sends."""
    os.environ.update(django_env(DBNAME))
    for path in (str(BENCH_DIR), str(REPO_ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    django_setup()
    from django.db import connections

    from django_awa.conf import awa_settings

    limit = awa_settings().claim_batch_size
    alias, params = capture_claim_params(QUEUE, limit)
    connections.close_all()
    return alias, params, limit


def wait_for_worker(sampler: Sampler, worker: Worker, timeout: float = 60.0) -> None:
    """Until the worker has a session on the database (it connects once set up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.check_alive()
        n = sampler.conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()[0]
        if n:
            time.sleep(0.5)
            return
        time.sleep(0.1)
    raise RuntimeError(
        f"the worker did not connect within {timeout:.0f}s:\n    {worker.log_tail()}"
    )


class Producer:
    def __init__(self, rate: float, batch: int, seconds: float) -> None:
        from growth import LOG_DIR

        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.out_path = LOG_DIR / "sustained-producer.out"
        self.log_path = LOG_DIR / "sustained-producer.log"
        with open(self.out_path, "wb") as out, open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "_child",
                    "produce",
                    str(rate),
                    str(batch),
                    str(seconds),
                ],
                cwd=BENCH_DIR,
                env=django_env(DBNAME),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                start_new_session=True,
            )

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code not in (None, 0):
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-12:]
            raise RuntimeError(f"producer exited with code {code}:\n    " + "\n    ".join(tail))

    def finish(self, timeout: float) -> int | None:
        """Wait for the producer to end (SIGTERM after timeout); its enqueued count."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        for line in reversed(self.out_path.read_text(errors="replace").splitlines()):
            if line.startswith("AWA-BENCH-RESULT "):
                return int(json.loads(line.split(" ", 1)[1])["count"])
        return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        child_main(argv[1:])
        return 0
    args, lock, facts = begin_run("sustained", parse_args, argv)
    if args.completed_retention is not None:  # read by djbench.settings_awa
        os.environ["BENCH_COMPLETED_RETENTION"] = str(args.completed_retention)

    seconds = args.minutes * 60
    progress = Progress()
    rows: list[dict[str, Any]] = []
    totals: dict[str, Any] = {}
    started = time.strftime("%Y%m%d-%H%M%S")
    load_start = os.getloadavg()
    interrupted = False
    error: str | None = None
    worker: Worker | None = None
    producer: Producer | None = None
    sampler: Sampler | None = None

    rate_text = f"{args.rate:,.0f} jobs/s" if args.rate else "as fast as it can"
    intro = [
        f"Sustained run of django-awa: {args.minutes:g} min, one producer ({rate_text}, "
        f"enqueue_many batches of {args.batch}) and one default worker at once; "
        f"a row every {args.interval:g} s",
        f"PostgreSQL {facts['version']}: autovacuum {facts['autovacuum']}, shared_buffers "
        f"{facts['shared_buffers']}",
    ]
    if facts["autovacuum"] != "on":
        intro.append(
            "NOTE: autovacuum is off on this server: nothing reclaims dead row versions "
            "during the run (a worst case; production servers run autovacuum)."
        )

    def out(line: str) -> None:
        if progress.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        progress.step(f"setup {DBNAME}: create, migrate")
        create_database(DBNAME)
        run_child(Path(__file__).resolve(), DBNAME, "migrate", timeout=300)
        _alias, params, limit = setup_django_here()
        args.claim_limit = limit
        sampler = Sampler(params, explain=not args.no_explain)
        start_stats = sampler.sample()
        totals["autovacuum_count_start"] = start_stats["autovacuum_count"]

        progress.step("starting the worker")
        worker = Worker(DBNAME, "sustained-worker")
        wait_for_worker(sampler, worker)
        progress.step(f"running for {args.minutes:g} min")
        for line in intro:
            out(line)
        out("")
        out(header())
        ids = sampler.ids_drawn()
        producer = Producer(args.rate, args.batch, seconds)
        # The clock starts with the producer's first batch, not its imports.
        deadline = time.monotonic() + 60
        while sampler.ids_drawn() == ids:
            producer.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("the producer enqueued nothing within 60 s")
            time.sleep(0.02)
        cut = sampler.db_now()
        ids = sampler.ids_drawn()
        t0 = time.perf_counter()
        prev_t = 0.0
        next_row = args.interval
        rss_max = 0
        while True:
            now = time.perf_counter() - t0
            rss, hwm = tree_memory(worker.pid)
            rss_max = max(rss_max, rss)
            if now >= next_row or now >= seconds:
                row = sampler.sample()
                new_cut = row["db_now"] - dt.timedelta(seconds=COMMIT_LAG)
                completed = sampler.completed_between(cut, new_cut)
                window = (new_cut - cut).total_seconds()
                t = time.perf_counter() - t0
                row.update(
                    t=t,
                    dt=t - prev_t,
                    window=window,
                    enqueued=row["ids"] - ids,
                    completed=completed,
                    enqueued_per_s=(row["ids"] - ids) / (t - prev_t),
                    completed_per_s=completed / window if window > 0 else 0.0,
                    rss=rss,
                    rss_max=rss_max,
                    hwm=hwm,
                )
                row["db_now"] = row["db_now"].isoformat()
                rows.append(row)
                out(format_row(row))
                cut, ids, prev_t, rss_max = new_cut, row["ids"], t, 0
                next_row += args.interval
                if now >= seconds:
                    break
            worker.check_alive()
            producer.check_alive()
            progress.live(
                f"{now:5.0f}/{seconds:.0f}s  next row in {max(0.0, next_row - now):3.0f}s",
            )
            time.sleep(max(0.05, min(1.0, next_row - (time.perf_counter() - t0))))
        progress.step("stopping the producer and the worker")
        enqueued = producer.finish(timeout=30)
        producer = None
        worker.stop()
        worker = None
        conn = sampler.conn
        totals["enqueued"] = enqueued if enqueued is not None else sampler.ids_drawn()
        totals["completed"] = int(
            conn.execute("SELECT count(*) FROM awa_job WHERE state = 'completed'").fetchone()[0]
        )
        totals["backlog_end"] = int(
            conn.execute("SELECT count(*) FROM awa_job WHERE state = 'available'").fetchone()[0]
        )
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: printing what was measured")
    except RuntimeError as exc:
        error = str(exc)
        progress.note(f"FAILED: {error}")
    finally:
        if producer is not None:
            producer.finish(timeout=0)
        if worker is not None:
            worker.stop()
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.close()
        progress.step(f"dropping {DBNAME}")
        with contextlib.suppress(Exception):
            drop_database(DBNAME)
        progress.close()
    load_end = os.getloadavg()

    data: dict[str, Any] = {}
    if rows:
        totals.setdefault("enqueued", rows[-1]["ids"])
        totals.setdefault("completed", sum(r["completed"] for r in rows))
        totals.setdefault("backlog_end", rows[-1]["backlog"])
        totals.setdefault("autovacuum_count_start", 0)
        lines, data = summary(rows, args, totals)
        if interrupted or error:
            lines[0] = lines[0].replace("Summary", "Summary (the run ended early)", 1)
        out("")
        for line in lines:
            out(line)
    out(
        "Columns: enq/s from the job id sequence; done/s from finalized_at of completed rows; "
        "backlog = available jobs; n_live/n_dead/autovac of awa_job from pg_stat_user_tables; "
        "done MB = awa_job_done, the finished rows, in all; RSS of the "
        "worker process tree from /proc (RSS now, largest 1 s sample in the interval, VmHWM); "
        "claim ms/bufs = EXPLAIN (ANALYZE, BUFFERS) of sql.CLAIM, rolled back (idx bufs: its "
        "awa_job_claim_idx scan)."
    )
    out(
        f"Machine: {os.cpu_count()} CPUs shared with PostgreSQL; load average "
        f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end."
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    target = args.json or RESULTS_DIR / f"sustained-{started}.json"
    payload = {
        "started": started,
        "interrupted": interrupted,
        "error": error,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "server": facts,
        "rows": rows,
        "summary": data,
        "load_average": {"start": load_start, "end": load_end},
    }
    target.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    out(f"Rows: {target}")
    lock.close()
    return 0 if rows and error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
