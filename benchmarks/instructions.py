"""The instructions one awa_worker spends per job, counted by valgrind's callgrind.

    .venv/bin/python benchmarks/instructions.py [--jobs 2000,8000] [--repeats 3] [--base DIR]
                                                [--path]

On a shared machine a drain's time and CPU move by 10 to 30% from one run to the
next. Callgrind counts what the process executes, whatever else the machine is
doing; what still moves the count is how the drain went (how the claims and
the outcome batches fell, and the maintenance thread's periodic work during the
longer drain, which lands in the difference below), so take the median of a
few repeats. A change of some percent in the worker's own work then shows here
when the drain's time cannot show it.

Each run drains N no-op jobs with ``awa_worker --queue bench`` (the defaults)
under ``valgrind --tool=callgrind`` and reads the total it prints. The jobs are
enqueued before the worker starts, by a process outside valgrind; the worker
gets SIGTERM once every job is completed (polled every 0.2 s) and shuts down as
usual. Start-up and shutdown cost the same at any N, so the runs of the two
sizes in ``--jobs`` give the cost of a job as the difference of their totals
divided by the difference of their sizes. Under valgrind the worker runs
about fifty times slower and one thread at a time: the count is the work of the
worker's Python code (and the libraries it calls), not a prediction of its speed.

``--path`` counts the worker's per-job path alone, without its threads: one
process claims batches of 100 (``producer.claim``), runs each job through
``HandlerPool.execute`` as a handler thread does and writes the batch with
``Completer.run_once``, until every job is done (default sizes 600,2600). No
thread switches, timers or maintenance land in it, and ``PYTHONHASHSEED`` is
fixed, so repeats agree to within about 0.5% where the drains above spread by
tens of percent: it shows a change of a few percent in the path. It calls the
engine's internals, so a ``--base`` checkout must have the same ones (code from
2026-12-07 on).

``--base DIR`` (a second checkout, e.g. ``git worktree add DIR main``) runs
DIR's django_awa too, alternating with this checkout's: before and after in one
run. Each checkout runs its own bench project, and each drain gets a fresh
database copied from a template that checkout's migrations made; all are
dropped at the end. Needs valgrind (Debian's package) and PostgreSQL on
127.0.0.1:5432 (user postgres, trust); runs in the benchmarks' virtualenv or the
repository's. No test asserts a figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from growth import create_database, drop_database, dsn

ROOT = Path(__file__).resolve().parent.parent
DB = "awa_bench_instr"
POLL = 0.2
ENQUEUE = """
import sys
import django
django.setup()
from django.db import transaction
import django_awa as awa
from djbench.awa_app.jobs import Noop
n = int(sys.argv[1])
with transaction.atomic():
    for start in range(0, n, 1000):
        awa.enqueue_many([Noop(n=i) for i in range(start, min(n, start + 1000))])
"""


def _env(db: str, code: Path) -> dict[str, str]:
    """A process running ``code``'s django_awa and bench project (``benchmarks/djbench``)."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "djbench.settings_awa",
        "BENCH_DB": db,
        "PYTHONPATH": os.pathsep.join([str(code / "benchmarks"), str(code)]),
    }


def _completed(db: str) -> int:
    with psycopg.connect(dsn(db), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM awa_job WHERE queue = 'bench' AND state = 'completed'"
        ).fetchone()
    return int(row[0]) if row else 0


def drain(code: Path, jobs: int, template: str, timeout: float) -> int:
    """Instructions callgrind counted in a worker of ``code`` draining ``jobs`` jobs."""
    create_database(DB, template)
    env = _env(DB, code)
    subprocess.run([sys.executable, "-c", ENQUEUE, str(jobs)], env=env, cwd=code, check=True)
    worker = subprocess.Popen(
        [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, "-m", "django", "awa_worker", "--queue", "bench",
        ],
        env=env,
        cwd=code,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while _completed(DB) < jobs:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker of {code} did not drain {jobs} jobs")
            time.sleep(POLL)
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=timeout)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    found = re.search(r"Collected : (\d+)", err)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind:\n{err[-2000:]}")
    return int(found.group(1))


# --path: the per-job path in one thread (see the docstring), N jobs in batches of 100.
PATH = """
import sys
import django
django.setup()
from django_awa import handlers
from django_awa.completer import Completer
from django_awa.execute import Attempt
from django_awa.handlers import HandlerPool, HandlerThread, release_connections
from django_awa.producer import claim
from django_awa.state import WorkerState
n, batch = int(sys.argv[1]), 100
state = WorkerState.create({"bench": 10})
runner = state.queues["bench"]
pool, completer = HandlerPool(state), Completer(state)
handler = HandlerThread(runner=runner, name="awa-bench_0")
handlers._thread.handler_thread = True
for _ in range(n // batch):
    attempts = [Attempt(job=job, alias=state.alias) for job in claim("bench", batch, state.alias)]
    assert len(attempts) == batch, len(attempts)
    with state.running_lock:  # what Producer.run_once records of a claim
        for attempt in attempts:
            state.running[attempt.job.id] = attempt
            state.waiting.add(attempt.job.id)
    runner.held += len(attempts)
    for attempt in attempts:
        pool.execute(handler, attempt)
    release_connections()
    assert not completer.run_once()
assert not state.running, len(state.running)
"""


def path(code: Path, jobs: int, template: str, timeout: float) -> int:
    """Instructions callgrind counted in ``code``'s per-job path run for ``jobs`` jobs."""
    create_database(DB, template)
    env = {**_env(DB, code), "PYTHONHASHSEED": "0"}
    subprocess.run([sys.executable, "-c", ENQUEUE, str(jobs)], env=env, cwd=code, check=True)
    run = subprocess.run(
        [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, "-c", PATH, str(jobs),
        ],
        env=env, cwd=code, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"the path of {code} did not run {jobs} jobs:\n{run.stderr[-2000:]}")
    drop_database(DB)
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", help="the two sizes (default 2000,8000; with --path 600,2600)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of drains per checkout")
    parser.add_argument("--base", type=Path, help="a second checkout to count too")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per drain")
    parser.add_argument(
        "--path", action="store_true", help="the per-job path in one thread, not a worker"
    )
    args = parser.parse_args()
    sizes = args.jobs or ("600,2600" if args.path else "2000,8000")
    small, large = sorted(int(n) for n in sizes.split(","))
    count = path if args.path else drain
    if not 0 < small < large or args.repeats < 1 or (args.path and small % 100 + large % 100):
        parser.error(
            "--jobs needs two different positive sizes (multiples of 100 with --path), "
            "--repeats at least 1"
        )
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py needs valgrind (apt-get install valgrind)")
    codes = {"this checkout": ROOT}
    if args.base is not None:
        codes = {f"base ({args.base})": args.base.resolve(), **codes}
    templates = {name: f"{DB}_tmpl{i}" for i, name in enumerate(codes)}
    per_job: dict[str, list[float]] = {name: [] for name in codes}
    try:
        for name, template in templates.items():
            # Compiled first: a run that compiles the modules it imports counts that
            # too, and only the first run of a checkout would (140 to 300 million
            # instructions, most of a job's cost in a --path difference).
            sources = [codes[name] / "django_awa", codes[name] / "benchmarks" / "djbench"]
            subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], check=True)
            create_database(template)
            migrate = [sys.executable, "-m", "django", "migrate", "-v0"]
            env = _env(template, codes[name])
            subprocess.run(migrate, env=env, cwd=codes[name], check=True)
        for repeat in range(args.repeats):
            names = list(codes) if repeat % 2 == 0 else list(reversed(codes))
            for name in names:
                template = templates[name]
                counts = {n: count(codes[name], n, template, args.timeout) for n in (small, large)}
                cost = (counts[large] - counts[small]) / (large - small)
                per_job[name].append(cost)
                print(
                    f"repeat {repeat + 1} {name}: {counts[small]:,} and {counts[large]:,} "
                    f"instructions for {small:,} and {large:,} jobs: {cost:,.0f} a job",
                    flush=True,
                )
    finally:
        for database in (DB, *templates.values()):
            drop_database(database)
    print(f"\nworker instructions per job (median of {args.repeats}):")
    for name, costs in per_job.items():
        print(f"  {name:<40} {statistics.median(costs):>10,.0f}")


if __name__ == "__main__":
    main()
