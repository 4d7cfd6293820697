"""The drain rate of one awa_worker with OpenTelemetry off, and on with the SDK
exporting to memory (issue 21: on should stay at least 0.85x of off).

    flock /tmp/awa-bench.lock .venv/bin/python benchmarks/otel_overhead.py \\
        --jobs 20000 --repeats 5 [--database NAME]

Runs in the repository's own virtualenv (opentelemetry-sdk is in the dev extra),
against PostgreSQL on 127.0.0.1:5432 (user postgres, trust). The schema is
migrated once into ``<database>_tmpl``; each run gets a fresh ``<database>``
copied from it (no migrate inside the timing loop), enqueues the jobs untimed,
starts ``awa_worker --queue bench`` (concurrency 10, the defaults) and times
from the first finished job to the last: jobs per second. Progress is polled
from the live rows left in ``awa_job`` (completed rows go to ``awa_job_done``),
a count that shrinks, every 50 ms.

A repeat is a pair of runs, off and sdk back to back, in alternating order, so
drift on a shared machine hits both; each pair gives a ratio (sdk / off), and
the result is the median of the ratios, printed with every pair and the load
average. The databases are dropped at the end.

``--on sampled`` keeps one trace in ten; ``--on absent`` runs with the setting
at its default and ``opentelemetry`` not importable (tests/blocked first on the
path), a process without the extra. ``--base DIR`` (a second checkout, e.g.
``git worktree add DIR main``) makes each repeat four runs, off and on with
DIR's django_awa and with this one's, in alternating order: before and after
in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from systems.base import admin_execute

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DB = "awa_bench_otel"
DSN = "postgresql://postgres@127.0.0.1:5432/"
POLL = 0.05


def _env(mode: str, db: str, code: Path = ROOT) -> dict[str, str]:
    """The environment of a process running ``code``'s django_awa (the bench app
    and settings are this checkout's)."""
    # absent: tests/blocked first on the path makes `import opentelemetry` fail.
    blocked = [str(ROOT / "tests" / "blocked")] if mode == "absent" else []
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "djbench.settings_awa_otel",
        "BENCH_DB": db,
        "BENCH_OTEL": mode,
        "PYTHONPATH": os.pathsep.join([*blocked, str(BENCH), str(code)]),
    }


def _django(
    mode: str, db: str, *args: str, code: Path = ROOT, **kwargs: object
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args], cwd=code, env=_env(mode, db, code), **kwargs
    )  # type: ignore[call-overload]


def _admin(*statements: str) -> None:
    for statement in statements:
        admin_execute(statement)


def template(db: str) -> str:
    """A database with the schema migrated, for each run to copy."""
    name = f"{db}_tmpl"
    _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}")
    assert _django("off", name, "migrate", "-v0").wait(300) == 0
    return name


def one_run(mode: str, jobs: int, db: str, tmpl: str, code: Path = ROOT) -> float:
    _admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"CREATE DATABASE {db} TEMPLATE {tmpl}")
    enqueue = (
        "import django; django.setup(); import django_awa as awa; "
        "from djbench.awa_app.jobs import Noop; "
        f"[awa.enqueue_many([Noop(n=i) for i in range(j, min(j + 5000, {jobs}))]) "
        f"for j in range(0, {jobs}, 5000)]"
    )
    done = subprocess.run(
        [sys.executable, "-c", enqueue],
        cwd=code,
        env=_env(mode, db, code),
        check=False,
        timeout=600,
    )
    assert done.returncode == 0
    with psycopg.connect(DSN + db, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE awa_job")
        worker = _django(
            mode, db, "awa_worker", "--queue", "bench", code=code, stdout=subprocess.DEVNULL
        )
        try:
            first = last = None
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                live = conn.execute(
                    "SELECT count(*) FROM ONLY awa_job WHERE state <> 'completed'"
                ).fetchone()[0]
                now = time.monotonic()
                finished = jobs - live
                if finished and first is None:
                    first = (now, finished)
                if finished >= jobs:
                    last = now
                    break
                time.sleep(POLL)
            if first is None or last is None:
                raise RuntimeError(f"{mode}: the drain did not finish in time")
            return (jobs - first[1]) / max(last - first[0], 1e-9)
        finally:
            worker.terminate()
            worker.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--database", default=DB, help=f"the database (default {DB})")
    parser.add_argument(
        "--on",
        choices=("sdk", "sampled", "absent"),
        default="sdk",
        help="the SDK's setup when on: every span kept (sdk) or one trace in ten (sampled); "
        "absent: the default setting with opentelemetry not importable (no extra)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        help="a checkout of the code before (git worktree add DIR main): each repeat also "
        "drains with its django_awa, the four runs alternating",
    )
    options = parser.parse_args()
    db = options.database
    tmpl = template(db)
    on = options.on
    codes = {"this": ROOT} if options.base is None else {"base": options.base, "this": ROOT}
    runs = [(name, mode) for name in codes for mode in ("off", on)]
    rates: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    ratios: dict[str, list[float]] = {name: [] for name in codes}
    try:
        for repeat in range(options.repeats):
            pair = {}
            for name, mode in runs if repeat % 2 == 0 else runs[::-1]:
                pair[name, mode] = one_run(mode, options.jobs, db, tmpl, codes[name])
                rates[name, mode].append(pair[name, mode])
            for name in codes:
                ratios[name].append(pair[name, on] / pair[name, "off"])
            print(
                f"repeat {repeat + 1}: "
                + "; ".join(
                    f"{name} off {pair[name, 'off']:,.0f} jobs/s, {on} {pair[name, on]:,.0f} "
                    f"jobs/s: {ratios[name][-1]:.2f}x"
                    for name in codes
                )
                + f" (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    finally:
        _admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"DROP DATABASE IF EXISTS {tmpl}")
    for name in codes:
        off, with_on = statistics.median(rates[name, "off"]), statistics.median(rates[name, on])
        print(
            f"{name}: median of the pairs' ratios: {statistics.median(ratios[name]):.2f}x "
            f"(range {min(ratios[name]):.2f}-{max(ratios[name]):.2f}); median rates: "
            f"off {off:,.0f} jobs/s, {on} {with_on:,.0f} jobs/s"
        )


if __name__ == "__main__":
    main()
