"""The drain rate of one awa_worker with OpenTelemetry off, and on with the SDK
exporting to memory (issue 21: on should stay at least 0.85x of off).

    .venv/bin/python benchmarks/otel_overhead.py --jobs 20000 --repeats 3

Runs in the repository's own virtualenv (opentelemetry-sdk is in the dev extra),
against PostgreSQL on 127.0.0.1:5432 (user postgres, trust), in a database
``awa_bench_otel`` made fresh for each run and dropped afterwards. Each run
enqueues the jobs untimed, starts ``awa_worker --queue bench`` (concurrency 10,
the defaults), and times from the first completed job to the last: jobs per
second. The modes alternate, so drift on the machine hits both.
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

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DB = "awa_bench_otel"
DSN = "postgresql://postgres@127.0.0.1:5432/"


def _env(mode: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "djbench.settings_awa_otel",
        "BENCH_DB": DB,
        "BENCH_OTEL": mode,
        "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)]),
    }


def _django(mode: str, *args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args], cwd=ROOT, env=_env(mode), **kwargs
    )  # type: ignore[call-overload]


def one_run(mode: str, jobs: int) -> float:
    with psycopg.connect(DSN + "postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    try:
        assert _django(mode, "migrate", "-v0").wait(300) == 0
        enqueue = (
            "import django; django.setup(); import django_awa as awa; "
            "from djbench.awa_app.jobs import Noop; "
            f"[awa.enqueue_many([Noop(n=i) for i in range(j, min(j + 5000, {jobs}))]) "
            f"for j in range(0, {jobs}, 5000)]"
        )
        assert (
            subprocess.run(
                [sys.executable, "-c", enqueue], cwd=ROOT, env=_env(mode), check=False, timeout=600
            ).returncode
            == 0
        )
        worker = _django(mode, "awa_worker", "--queue", "bench", stdout=subprocess.DEVNULL)
        try:
            first = last = None
            deadline = time.monotonic() + 600
            with psycopg.connect(DSN + DB, autocommit=True) as conn:
                while time.monotonic() < deadline:
                    done = conn.execute(
                        "SELECT count(*) FROM awa_job WHERE state = 'completed'"
                    ).fetchone()[0]
                    now = time.monotonic()
                    if done and first is None:
                        first = (now, done)
                    if done >= jobs:
                        last = now
                        break
                    time.sleep(0.02)
            if first is None or last is None:
                raise RuntimeError(f"{mode}: the drain did not finish in time")
            return (jobs - first[1]) / max(last - first[0], 1e-9)
        finally:
            worker.terminate()
            worker.wait(60)
    finally:
        with psycopg.connect(DSN + "postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "sdk": []}
    for repeat in range(options.repeats):
        for mode in ("off", "sdk") if repeat % 2 == 0 else ("sdk", "off"):
            rate = one_run(mode, options.jobs)
            rates[mode].append(rate)
            print(f"repeat {repeat + 1} {mode:>3}: {rate:,.0f} jobs/s", flush=True)
    off, sdk = statistics.median(rates["off"]), statistics.median(rates["sdk"])
    print(f"median: off {off:,.0f} jobs/s, sdk {sdk:,.0f} jobs/s: {sdk / off:.2f}x")


if __name__ == "__main__":
    main()
