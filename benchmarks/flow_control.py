#!/usr/bin/env python3
"""Flow control (SPEC 12): what limits cost, and whether they hold at speed.

    python benchmarks/flow_control.py                     # the full sizes below
    python benchmarks/flow_control.py --small             # a quick check that it runs
    python benchmarks/flow_control.py --workloads unlimited,sequence --baseline-repo /tmp/base

Each workload gets a fresh database (the one ``DATABASE_URL`` names, else
``awa_bench_flow``), migrated, its jobs enqueued untimed (``awa.enqueue_many``),
then ``--processes`` worker processes (``awa_worker --queue <q>=<concurrency>``)
started; it reports the drain rate
from the first attempt's start to the last completion (database clock, so no
start-up time), and the wall time from starting the workers. Handlers are
no-ops. With ``--baseline-repo`` (e.g. a ``git worktree`` of main) every
workload runs on that checkout too, right after this one's: the before and
after of a change in one run, each line with the load average when it ended.

  unlimited  --jobs on an unlimited queue (``djbench.settings_awa``, the kind
             run.py drains); each other workload's rate is also given as a
             multiple of it (the targets: global 0.8x, keyed 0.5x)
  global     --jobs on a queue with ``global_concurrency`` 50 (3 x 20 places)
  keyed      --keys x --per-key jobs of a kind with ``Limit(concurrency=1, by="key")``,
             enqueued interleaved (as events of many accounts arrive)
  keyed_locked  the same, with a queue rate_limit no drain reaches set at runtime:
             claimed under the queue's lock (``CLAIM_LIMITED``, taking the same
             per-key leases) instead of ``CLAIM_KEYED``
  sequence   --sequence jobs of one sequence key
  rate       a queue with ``rate_limit`` --rate per second, for --rate-seconds:
             the starts achieved per second, and the most in any sliding second
  pause      --jobs on the unlimited queue, then on the global_concurrency one:
             ``awa.pause_queue`` once a tenth is claimed, and how long after the
             pause committed the workers' claims stopped (the available count,
             read every 10 ms, last fell), against POLL_INTERVAL

Each drain also reports how long a job held its place: the mean and median of
``finalized_at - attempted_at`` (on a queue claimed under the limits' lock, a rate
or a kind limit, ``attempted_at`` is the claim; elsewhere, ``global_concurrency`` kept
by slot leases too, the handler's start), and for the sequence the gap between a
member's finalize and the next member's start, and the median time from one
member's finalize to the next one's (steadier than the rate, which a few members
stretched by a load spike pull down): where a saturated limit's time goes.

While the limited workloads run, a sampler reads ``pg_stat_activity`` every 100 ms
and reports how many sessions waited on an advisory lock (the limited claim's),
on any other lock, and were active: the evidence that limited claims do not
convoy. Figures are indicative on a shared machine; no test asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# The run's own database, dropped and made again for each workload: the one
# DATABASE_URL names when it is set (each engineer's own), else awa_bench_flow.
DB = os.environ.get("DATABASE_URL", "").rsplit("/", 1)[-1].split("?")[0] or "awa_bench_flow"
SERVER = "postgresql://postgres@127.0.0.1:5432/"
FLOW_SETTINGS = "djbench.settings_flow"
PLAIN_SETTINGS = "djbench.settings_awa"


def django_env(settings: str, repo: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings,
        "BENCH_DB": DB,
        "PYTHONPATH": os.pathsep.join([str(repo), str(BENCH_DIR)]),
        **extra,
    }


def in_django(code: str, settings: str, repo: Path) -> None:
    """Run ``code`` after ``django.setup()`` in a process importing django_awa from ``repo``."""
    script = "import django; django.setup()\n" + code
    subprocess.run(
        [sys.executable, "-c", script], cwd=BENCH_DIR, env=django_env(settings, repo), check=True
    )


def fresh_database(settings: str, repo: Path) -> None:
    with psycopg.connect(SERVER + "postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB}")
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"],
        cwd=BENCH_DIR,
        env=django_env(settings, repo),
        check=True,
    )


def drop_database() -> None:
    with psycopg.connect(SERVER + "postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


class LockSampler(threading.Thread):
    """Every 100 ms: sessions of the benchmark database waiting on an advisory lock,
    on another lock, and active."""

    STATEMENT = """
        SELECT count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'),
               count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event <> 'advisory'),
               count(*) FILTER (WHERE state = 'active')
        FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[int, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(SERVER + DB, autocommit=True) as conn:
            while not self.stop.wait(0.1):
                row = conn.execute(self.STATEMENT, [DB]).fetchone()
                if row:
                    self.samples.append((int(row[0]), int(row[1]), int(row[2])))

    def report(self) -> str:
        if not self.samples:
            return "no samples"
        advisory, other, active = zip(*self.samples, strict=True)
        return (
            f"{len(self.samples)} samples: waiting on the advisory lock mean "
            f"{statistics.mean(advisory):.2f} max {max(advisory)}; on other locks mean "
            f"{statistics.mean(other):.2f} max {max(other)}; active sessions mean "
            f"{statistics.mean(active):.1f}"
        )


def drain(
    queue: str,
    total: int,
    processes: int,
    concurrency: int,
    settings: str,
    repo: Path,
    *,
    sample: bool = False,
    timeout: float = 600,
) -> dict[str, Any]:
    """Start the workers, wait until ``total`` jobs are completed; the rates."""
    env = django_env(settings, repo)
    sampler = LockSampler() if sample else None
    started = time.monotonic()
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "django", "awa_worker", "--queue", f"{queue}={concurrency}"],
            cwd=BENCH_DIR,
            env=env,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(processes)
    ]
    if sampler:
        sampler.start()
    try:
        with psycopg.connect(SERVER + DB, autocommit=True) as conn:
            deadline = started + timeout
            while True:
                row = conn.execute(
                    "SELECT count(*) FROM awa_job WHERE state = 'completed'"
                ).fetchone()
                if row and row[0] >= total:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{queue}: not drained in {timeout}s ({row} done)")
                time.sleep(0.05)
            wall = time.monotonic() - started
            span = conn.execute(
                "SELECT extract(epoch FROM max(finalized_at) - min(attempted_at)) FROM awa_job"
            ).fetchone()
            held = conn.execute(
                """SELECT 1000 * avg(extract(epoch FROM finalized_at - attempted_at)),
                          1000 * percentile_cont(0.5) WITHIN GROUP (
                              ORDER BY extract(epoch FROM finalized_at - attempted_at)),
                          (SELECT 1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY gap)
                           FROM (SELECT extract(epoch FROM attempted_at - lag(finalized_at)
                                        OVER (ORDER BY id)) AS gap FROM awa_job) AS g),
                          (SELECT 1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY cycle)
                           FROM (SELECT extract(epoch FROM finalized_at - lag(finalized_at)
                                        OVER (ORDER BY id)) AS cycle FROM awa_job) AS c)
                   FROM awa_job"""
            ).fetchone()
    finally:
        if sampler:
            sampler.stop.set()
            sampler.join(5)
        stop_workers(workers)
    seconds = float(span[0]) if span and span[0] else wall
    result = {"jobs": total, "seconds": seconds, "rate": total / seconds, "wall": wall}
    if held and held[0] is not None:
        result["held_ms"] = (float(held[0]), float(held[1]))
        result["next_start_ms"] = float(held[2]) if held[2] is not None else None
        result["cycle_ms"] = float(held[3]) if held[3] is not None else None
    if sampler:
        result["locks"] = sampler.report()
    return result


def enqueue(code: str, settings: str = FLOW_SETTINGS, repo: Path = REPO_ROOT) -> None:
    in_django("import django_awa as awa\n" + code, settings, repo)


def unlimited(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    fresh_database(PLAIN_SETTINGS, repo)
    enqueue(
        "from djbench.awa_app.jobs import Noop\n"
        f"for s in range(0, {args.jobs}, 1000):\n"
        f"    awa.enqueue_many([Noop(n=i) for i in range(s, min(s + 1000, {args.jobs}))])\n",
        PLAIN_SETTINGS,
        repo,
    )
    return drain("bench", args.jobs, args.processes, args.concurrency, PLAIN_SETTINGS, repo)


def enqueue_noops(queue: str, total: int, repo: Path) -> None:
    """``total`` FlowNoop jobs on ``queue``, in batches of 1,000."""
    enqueue(
        "from djbench.flow_app.jobs import FlowNoop\n"
        f"for s in range(0, {total}, 1000):\n"
        f"    awa.enqueue_many([awa.EnqueueRequest(FlowNoop(n=i), queue={queue!r})\n"
        f"                      for i in range(s, min(s + 1000, {total}))])\n",
        repo=repo,
    )


def global_limit(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    fresh_database(FLOW_SETTINGS, repo)
    enqueue_noops("glob", args.jobs, repo)
    return drain(
        "glob", args.jobs, args.processes, args.concurrency, FLOW_SETTINGS, repo, sample=True
    )


def keyed(args: argparse.Namespace, repo: Path, *, locked: bool = False) -> dict[str, Any]:
    fresh_database(FLOW_SETTINGS, repo)
    # keyed_locked: a queue rate no drain reaches puts the same jobs under the
    # queue's lock (LOCK_LIMITS + CLAIM_LIMITED) instead of the keyed claim.
    rate = 'awa.set_queue_limits("keyed", rate_limit="1000000/s")\n' if locked else ""
    enqueue(
        "from djbench.flow_app.jobs import KeyedNoop\n"
        f"{rate}"
        f"for i in range({args.per_key}):\n"
        f"    awa.enqueue_many([KeyedNoop(key=k, n=i) for k in range({args.keys})])\n",
        repo=repo,
    )
    total = args.keys * args.per_key
    return drain("keyed", total, args.processes, args.concurrency, FLOW_SETTINGS, repo, sample=True)


def keyed_locked(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    return keyed(args, repo, locked=True)


def sequence(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    fresh_database(FLOW_SETTINGS, repo)
    enqueue(
        "from djbench.flow_app.jobs import SeqNoop\n"
        f"awa.enqueue_many([SeqNoop(key=1, n=i) for i in range({args.sequence})])\n",
        repo=repo,
    )
    return drain(
        "seq", args.sequence, args.processes, args.concurrency, FLOW_SETTINGS, repo, sample=True
    )


def rate(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    fresh_database(FLOW_SETTINGS, repo)
    total = int(args.rate * args.rate_seconds)
    enqueue_noops("rated", total, repo)
    os.environ["BENCH_RATE"] = f"{args.rate}/s"
    result = drain(
        "rated",
        total,
        args.processes,
        args.concurrency,
        FLOW_SETTINGS,
        repo,
        sample=True,
        timeout=args.rate_seconds * 3 + 60,
    )
    with psycopg.connect(SERVER + DB, autocommit=True) as conn:
        # Starts in the whole seconds from the first start (a sliding window lets
        # N start at once, then the next N a second later: whole seconds count
        # each burst once), and the busiest sliding second.
        row = conn.execute(
            """WITH s AS (SELECT attempted_at AS at FROM awa_job),
                    f AS (SELECT min(at) AS t0,
                                 floor(extract(epoch FROM max(at) - min(at))) AS k FROM s)
               SELECT (SELECT count(*) FROM s, f
                       WHERE s.at < f.t0 + make_interval(secs => f.k)),
                      f.k,
                      (SELECT max(n) FROM (SELECT count(*) OVER (ORDER BY at RANGE BETWEEN
                              CURRENT ROW AND interval '0.999999 seconds' FOLLOWING) AS n
                              FROM s) AS w)
               FROM f"""
        ).fetchone()
    if row and row[1]:
        result["achieved_per_s"] = float(row[0]) / float(row[1])
        result["busiest_second"] = int(row[2])
    result["limit_per_s"] = args.rate
    return result


def pause_one(queue: str, args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    """Drain ``queue`` with the workers, pause it once a tenth is claimed; when claims stopped."""
    fresh_database(FLOW_SETTINGS, repo)
    enqueue_noops(queue, args.jobs, repo)
    enqueue(f"awa.pause_queue({queue!r})\nawa.resume_queue({queue!r})\n", repo=repo)
    env = django_env(FLOW_SETTINGS, repo)
    command = [
        sys.executable,
        "-m",
        "django",
        "awa_worker",
        "--queue",
        f"{queue}={args.concurrency}",
    ]
    workers = [
        subprocess.Popen(
            command, cwd=BENCH_DIR, env=env, stdout=subprocess.DEVNULL, start_new_session=True
        )
        for _ in range(args.processes)
    ]
    available = "SELECT count(*), clock_timestamp() FROM awa_job WHERE state = 'available'"
    try:
        with psycopg.connect(SERVER + DB, autocommit=True) as conn:
            deadline = time.monotonic() + 120
            while (row := conn.execute(available).fetchone()) and row[0] > args.jobs * 9 // 10:
                if time.monotonic() > deadline:
                    raise SystemExit(f"pause: {queue} not started in 120s")
                time.sleep(0.01)
            # What awa.pause_queue writes to the row made before the workers
            # started (a process of its own would start too late); the database
            # clock read after its commit, an upper bound of when it took effect.
            conn.execute(
                "UPDATE awa_queue SET paused = true, paused_at = now(), updated_at = now() "
                "WHERE name = %s",
                [queue],
            )
            paused_row = conn.execute("SELECT clock_timestamp()").fetchone()
            paused_at = paused_row[0] if paused_row else None
            last_count, last_change = None, None
            watch_until = time.monotonic() + 3.0
            while time.monotonic() < watch_until:
                row = conn.execute(available).fetchone()
                if row and row[0] != last_count:
                    last_count, last_change = row[0], row[1]
                time.sleep(0.01)
    finally:
        stop_workers(workers)
    after = (last_change - paused_at).total_seconds() if last_change and paused_at else None
    return {"queue": queue, "claims_stopped_after_s": after, "left_available": last_count}


def stop_workers(workers: list[subprocess.Popen[Any]]) -> None:
    """SIGTERM the workers this script started, then wait (killing one that outstays 60 s)."""
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()


def pause(args: argparse.Namespace, repo: Path) -> dict[str, Any]:
    unlimited_queue = pause_one("bench", args, repo)
    limited_queue = pause_one("glob", args, repo)
    return {"rate": 0.0, "wall": 0.0, "pause": [unlimited_queue, limited_queue]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small sizes: a check that it runs")
    parser.add_argument("--workloads", default="unlimited,global,keyed,sequence,rate")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--per-key", type=int, default=20)
    parser.add_argument("--sequence", type=int, default=2000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--rate-seconds", type=int, default=30)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument(
        "--baseline-repo",
        type=Path,
        help="run every workload on this checkout too, right after this one's (before/after)",
    )
    args = parser.parse_args()
    if args.small:
        args.jobs, args.keys, args.per_key, args.sequence = 2000, 50, 20, 300
        args.rate, args.rate_seconds = 100, 4
    results: dict[str, Any] = {}
    try:
        for workload in args.workloads.split(","):
            run = {
                "unlimited": unlimited,
                "global": global_limit,
                "keyed": keyed,
                "keyed_locked": keyed_locked,
                "sequence": sequence,
                "rate": rate,
                "pause": pause,
            }[workload]
            results[workload] = run(args, REPO_ROOT)
            print(f"{workload}: {results[workload]} (load {os.getloadavg()[0]:.1f})", flush=True)
            if args.baseline_repo:
                name = f"{workload} (baseline)"
                results[name] = run(args, args.baseline_repo)
                print(f"{name}: {results[name]} (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        drop_database()
    base = results.get("unlimited", {}).get("rate")
    print("\nflow control benchmark (indicative):")
    for name, result in results.items():
        own = results.get("unlimited (baseline)", {}).get("rate") if "baseline" in name else base
        ratio = (
            f" ({result['rate'] / own:.2f}x unlimited)"
            if own and not name.startswith("unlimited")
            else ""
        )
        if "pause" in result:
            for entry in result["pause"]:
                print(
                    f"  {name:22} queue {entry['queue']}: claims stopped "
                    f"{entry['claims_stopped_after_s']}s after the pause committed "
                    f"({entry['left_available']} left available)"
                )
            continue
        line = f"  {name:22} {result['rate']:9.0f} jobs/s{ratio}  wall {result['wall']:.1f}s"
        if "achieved_per_s" in result:
            line += (
                f"; achieved {result['achieved_per_s']:.1f}/s of {result['limit_per_s']}/s, "
                f"busiest second {result['busiest_second']}"
            )
        if "held_ms" in result:
            mean, median = result["held_ms"]
            line += f"; a job held its place {mean:.1f} ms (median {median:.1f})"
            if name.startswith("sequence") and result.get("next_start_ms") is not None:
                line += f", next member started {result['next_start_ms']:.1f} ms after"
                if result.get("cycle_ms") is not None:
                    # Load spikes stretch a few members a lot: the median is steadier.
                    line += f"; median member {result['cycle_ms']:.1f} ms"
        print(line)
        if "locks" in result:
            print(f"  {'':22} {result['locks']}")


if __name__ == "__main__":
    main()
