#!/usr/bin/env python3
"""Benchmark django-awa against pgqueuer, awa-pg, procrastinate, django-tasks-db,
Celery with Redis (prefork and threads pools) and a bare psycopg "ceiling".

    python benchmarks/run.py [--quick] [--repeats 3] [--systems a,b] [--workloads w,x] [--jobs N]
    python benchmarks/run.py --scaling [--scaling-processes 1,2,4] [--scaling-handler orm]

Runs in benchmarks/.venv (made by bootstrap.sh on first use, then re-executed
into). Each repeat runs every system in turn (the order rotates between
repeats), each on a fresh database ``awa_bench_<system>`` on 127.0.0.1 that
is dropped afterwards, through these workloads, with no-op handlers but for
the ORM ones:

  bulk     enqueue N jobs with the system's bulk API, batches of --batch
  drain    start the worker on those N jobs; time until the database shows
           all N finished; peak RSS of the worker processes meanwhile
  latency  an idle worker; a producer enqueues one job every 1/--rate s for
           --latency-seconds; each handler records now - enqueue time
  single   enqueue --single jobs, one transaction each, one client
  orm, orm-best  drain --orm-jobs jobs whose handler reads a row and saves it
           through Django's ORM, at the library's defaults / the best setting;
           jobs/s and p99 time from due to finished
  atomic, atomic-best (django-awa only) the same as an atomic=True worker
  followups (django-awa only) drain N jobs that each have an on_completed
           follow-up

The drain also reports CPU per job of the workers, of the run database's
PostgreSQL backends and (Celery) of redis-server (systems/cpu.py).
--scaling instead drains N jobs with 1, 2 and 4 django-awa worker processes
and prints jobs/s and the CPU split between the workers and PostgreSQL.

It prints a table of medians with min, max and the ratio to django-awa, and
writes every measurement to benchmarks/results/. No test asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
VENV = BENCH_DIR / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
RESULTS_DIR = BENCH_DIR / "results"


# --------------------------------------------------------------- environment
def _stamp_expected() -> dict[str, str]:
    requirements = hashlib.sha256((BENCH_DIR / "requirements.txt").read_bytes()).hexdigest()
    packaging = hashlib.sha256()
    for name in ("setup.cfg", "pyproject.toml", "setup.py"):
        path = REPO_ROOT / name
        if path.exists():
            packaging.update(path.read_bytes())
    return {"requirements": requirements, "packaging": packaging.hexdigest()}


def _needs_bootstrap() -> bool:
    stamp_path = VENV / ".bench-stamp"
    if not VENV_PYTHON.exists() or not stamp_path.exists():
        return True
    stamp = dict(line.split("=", 1) for line in stamp_path.read_text().split() if "=" in line)
    expected = _stamp_expected()
    return any(stamp.get(key) != value for key, value in expected.items())


def ensure_venv() -> None:
    """Re-exec into benchmarks/.venv, bootstrapping it first when needed."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if "--no-bootstrap" not in sys.argv and _needs_bootstrap():
        sys.stderr.write("run.py: preparing benchmarks/.venv (bootstrap.sh)…\n")
        subprocess.run(["bash", str(BENCH_DIR / "bootstrap.sh")], check=True)
    if not VENV_PYTHON.exists():
        raise SystemExit("run.py: benchmarks/.venv is missing; run benchmarks/bootstrap.sh")
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__).resolve()), *sys.argv[1:]])


# ------------------------------------------------------------------ metrics
@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    unit: str
    higher_is_better: bool
    fmt: str  # format spec for one value
    only: str | None = None  # the one system that has it
    ratio_to: str | None = None  # compare with this metric of the reference


def metrics(args: argparse.Namespace) -> list[Metric]:
    n, single, rate = args.jobs, args.single, args.rate
    return [
        Metric(
            "drain", f"drain {n:,} queued jobs (worker start -> all finished)", "s", False, ".2f"
        ),
        Metric(
            "drain_steady",
            "  same, steady: jobs/s from the first job finished to the last (no start-up)",
            "jobs/s",
            True,
            ",.0f",
        ),
        Metric(
            "enqueue_single",
            f"enqueue {single:,} jobs, one transaction each",
            "jobs/s",
            True,
            ",.0f",
        ),
        Metric(
            "enqueue_bulk",
            f"enqueue {n:,} jobs in bulk, batches of {args.batch:,}",
            "jobs/s",
            True,
            ",.0f",
        ),
        Metric("latency_p50", f"pickup latency p50 at {rate:g} jobs/s", "ms", False, ".1f"),
        Metric("latency_p99", f"pickup latency p99 at {rate:g} jobs/s", "ms", False, ".1f"),
        Metric(
            "drain_rss", "peak RSS of the worker processes during the drain", "MB", False, ",.0f"
        ),
        Metric(
            "drain_cpu_worker",
            "worker CPU per job in the drain (worker processes and children)",
            "ms",
            False,
            ".3f",
        ),
        Metric(
            "drain_cpu_db",
            "PostgreSQL CPU per job in the drain (the run's database backends)",
            "ms",
            False,
            ".3f",
        ),
        Metric("drain_cpu_broker", "redis-server CPU per job in the drain", "ms", False, ".3f"),
        *orm_metrics(args),
        Metric(
            "drain_followups",
            f"drain {n:,} jobs, each with an on_completed follow-up",
            "s",
            False,
            ".2f",
            only="django-awa",
            ratio_to="drain",
        ),
    ]


def orm_metrics(args: argparse.Namespace) -> list[Metric]:
    n = args.orm_jobs
    out: list[Metric] = []
    for workload in ORM_WORKLOADS:
        key = workload.replace("-", "_")
        atomic = workload.startswith("atomic")
        what = "atomic=True ORM handler" if atomic else "ORM handler (read a row, update it)"
        where = "best setting" if workload.endswith("-best") else "default settings"
        ratio = ("orm_best_rate" if workload.endswith("-best") else "orm_rate") if atomic else None
        out.append(
            Metric(
                f"{key}_rate",
                f"drain {n:,} jobs, {what}, {where}",
                "jobs/s",
                True,
                ",.0f",
                ratio_to=ratio,
            )
        )
        out.append(
            Metric(
                f"{key}_p99",
                "  same, p99 time from due to finished",
                "s",
                False,
                ".2f",
                ratio_to=ratio and ratio.replace("_rate", "_p99"),
            )
        )
        if workload == "orm-best":
            for part, title in (("worker", "worker"), ("db", "PostgreSQL"), ("broker", "redis")):
                out.append(
                    Metric(f"{key}_cpu_{part}", f"  same, {title} CPU per job", "ms", False, ".3f")
                )
    return out


# ----------------------------------------------------------------- progress
class Progress:
    """One live status line on stderr (a plain log line per step when not a tty)."""

    def __init__(self, total_steps: int) -> None:
        self.total = max(1, total_steps)
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.prefix = ""
        self.started = time.monotonic()
        self._last = 0.0

    def step(self, prefix: str) -> None:
        self.prefix = prefix
        if not self.tty:
            elapsed = time.monotonic() - self.started
            sys.stderr.write(f"[{self.done}/{self.total} {elapsed:5.0f}s] {prefix}\n")
            sys.stderr.flush()
        self.live("")

    def live(self, detail: str, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 20
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        elapsed = now - self.started
        line = f"[{bar}] {self.done}/{self.total} {elapsed:4.0f}s  {self.prefix}  {detail}"
        columns = _terminal_columns()
        sys.stderr.write("\r\x1b[K" + line[: columns - 1])
        sys.stderr.flush()

    def finish_step(self) -> None:
        self.done += 1
        self.live("", force=True)

    def note(self, text: str) -> None:
        """A line that stays (errors, skips), above the live line."""
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.write(text.rstrip() + "\n")
        sys.stderr.flush()
        self.live("", force=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        return 120


# ---------------------------------------------------------------- workloads
@dataclass
class Results:
    # system -> metric key -> values, one per repeat
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)

    def add(self, system: str, key: str, value: float) -> None:
        self.values.setdefault(system, {}).setdefault(key, []).append(value)

    def error(self, system: str, message: str) -> None:
        self.errors.setdefault(system, []).append(message)

    def note(self, system: str, message: str) -> None:
        notes = self.notes.setdefault(system, [])
        if message not in notes:
            notes.append(message)


def tree_rss(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for member in family:
            with contextlib.suppress(psutil.Error):
                total += member.memory_info().rss
    return total


def wait_done(
    system,
    target: int,
    timeout: float,
    progress: Progress,
    label: str,
    rss: bool = False,
    cpu: dict | None = None,
):
    """Poll count_done() until it reaches target; returns (seconds since worker start, peak RSS).

    With ``cpu`` (a dict), CPU is sampled at every poll (systems/cpu.py) and
    ``cpu`` gets the per-job figures of the window from the first poll that
    saw a finished job to the one that saw the last: the steady drain, without
    the worker's start-up. A drain that finishes within one poll falls back to
    the window from the worker's start.
    """
    from systems.base import SystemUnavailable
    from systems.cpu import CpuMeter, per_job

    group = system.workers
    peak = 0
    deadline = time.perf_counter() + timeout
    interval = 0.05
    meter = CpuMeter(system) if cpu is not None else None
    base = system.count_done()
    start_sample = meter.sample(base) if meter else None
    first_sample = None
    while True:
        done = system.count_done()
        sample = meter.sample(done) if meter else None
        now = time.perf_counter()
        if sample is not None and first_sample is None and done > base:
            first_sample = sample
        if rss:
            peak = max(peak, tree_rss(group.pids()))
        if done >= target:
            if cpu is not None and sample is not None:
                window = per_job(first_sample, sample) if first_sample is not None else None
                if window is None or window["jobs"] < (target - base) / 2:
                    # Most jobs finished before the first poll saw one: too
                    # few in the window; take it from the worker's start.
                    window = per_job(start_sample, sample)
                    if window:
                        window["with_startup"] = 1
                cpu.update(window or {})
            return now - group.started_at, peak
        dead = group.dead()
        if dead:
            raise SystemUnavailable(f"{label}: {dead}\n    {system.worker_log_tail()}")
        if now > deadline:
            raise SystemUnavailable(
                f"{label}: timed out after {timeout:.0f}s with {done:,}/{target:,} finished\n"
                f"    {system.worker_log_tail()}"
            )
        progress.live(f"{label} {done:,}/{target:,}  {now - group.started_at:5.1f}s")
        time.sleep(interval)


def add_cpu(results: Results, system, prefix: str, cpu: dict) -> None:
    """Record a drain's CPU per job: worker, PostgreSQL, and a broker when it has one."""
    if not cpu:
        return
    results.add(system.name, f"{prefix}_cpu_worker", cpu["worker_ms"])
    if cpu["database_ms"] or not system.broker_pids():
        # (Celery's no-op drain never touches PostgreSQL: no row rather than 0.)
        results.add(system.name, f"{prefix}_cpu_db", cpu["database_ms"])
    if system.broker_pids():
        results.add(system.name, f"{prefix}_cpu_broker", cpu["broker_ms"])
    if cpu.get("with_startup"):
        results.note(
            system.name, f"{prefix} CPU per job includes the worker's start-up (short drain)"
        )
    if cpu["sessions"] > cpu["jobs"] / 10:
        results.note(
            system.name,
            f"{prefix}: {cpu['sessions']:,.0f} database connections opened for {cpu['jobs']:,.0f}"
            " jobs: backends that lived between two CPU samples are not in its PostgreSQL CPU",
        )


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def run_drain(system, args, progress: Progress, results: Results, mode: str = "drain") -> float:
    base = system.count_done()
    cpu: dict = {}
    system.start_worker(mode)
    try:
        seconds, peak = wait_done(
            system,
            base + args.jobs,
            args.timeout,
            progress,
            mode,
            rss=(mode == "drain"),
            cpu=cpu if mode == "drain" else None,
        )
    finally:
        system.stop_worker()
    system.check_succeeded()
    if mode == "drain":
        results.add(system.name, "drain", seconds)
        results.add(system.name, "drain_rss", peak / 2**20)
        if cpu and not cpu.get("with_startup"):
            results.add(system.name, "drain_steady", cpu["jobs_per_s"])
        add_cpu(results, system, "drain", cpu)
    return seconds


# workload -> (handler, settings profile); the handler's jobs run at the profile
ORM_WORKLOADS = {
    "orm": ("orm", "defaults"),
    "orm-best": ("orm", "best"),
    "atomic": ("atomic", "defaults"),
    "atomic-best": ("atomic", "best"),
}


def run_orm(system, args, progress: Progress, results: Results, workload: str) -> None:
    """Drain --orm-jobs jobs whose handler reads and updates a row through the ORM.

    Jobs/s from the worker's start to the last one finished; the p99 of each
    job's time from due (the worker's start: every job is queued before it)
    to its handler's return.
    """
    from systems.base import SystemUnavailable

    handler, profile = ORM_WORKLOADS[workload]
    n = args.orm_jobs
    if not getattr(system, "_orm_ready", False):
        progress.live(f"{workload}: filling {args.accounts:,} accounts (not timed)", force=True)
        system.prepare_orm(args.accounts)
        system._orm_ready = True
    progress.live(f"{workload}: enqueueing (not timed)", force=True)
    system.enqueue_orm(n, args.batch, handler, args.accounts)
    key = workload.replace("-", "_")
    with tempfile.TemporaryDirectory(prefix="awa-bench-orm-") as tmp:
        base = system.count_done()
        cpu: dict = {}
        with system.profile(profile):
            system.start_worker(handler, finish_dir=Path(tmp))
        started_wall = system.workers.started_wall
        try:
            seconds, _ = wait_done(system, base + n, args.timeout, progress, workload, cpu=cpu)
        finally:
            system.stop_worker()
        system.check_succeeded()
        finished: list[float] = []
        for path in Path(tmp).glob("finish-*.txt"):
            finished.extend(float(line) - started_wall for line in path.read_text().split())
    if len(finished) < n:
        raise SystemUnavailable(f"{workload}: {len(finished)} handler records for {n} jobs")
    finished.sort()
    results.add(system.name, f"{key}_rate", n / seconds)
    results.add(system.name, f"{key}_p99", percentile(finished, 99))
    add_cpu(results, system, key, cpu)
    setting = ", ".join(f"{k}={v}" for k, v in system.profile_settings(profile).items())
    results.note(system.name, f"{workload} at {setting}")


def run_latency(system, args, progress: Progress, results: Results) -> None:
    from systems.base import SystemUnavailable

    with tempfile.TemporaryDirectory(prefix="awa-bench-latency-") as tmp:
        base = system.count_done()
        system.start_worker("latency", latency_dir=Path(tmp))
        try:
            # One unrecorded job (t=0) proves the worker is up and claiming;
            # then it idles a moment before the paced producer starts.
            system.enqueue_bulk(1, 1)
            wait_done(system, base + 1, args.timeout, progress, "latency: worker start-up")
            time.sleep(1.0)
            progress.live(
                f"latency: enqueue at {args.rate:g}/s for {args.latency_seconds:g}s", force=True
            )
            sent = system.pace(args.rate, args.latency_seconds)
            wait_done(system, base + 1 + sent, 120, progress, "latency: finishing")
        finally:
            system.stop_worker()
        values: list[float] = []
        for path in Path(tmp).glob("latency-*.txt"):
            values.extend(float(line) for line in path.read_text().split())
    if len(values) < sent:
        raise SystemUnavailable(f"latency: {len(values)} handler records for {sent} jobs")
    values.sort()
    results.add(system.name, "latency_p50", percentile(values, 50) * 1000)
    results.add(system.name, "latency_p99", percentile(values, 99) * 1000)


def run_followups(system, args, progress: Progress, results: Results) -> None:
    from systems.base import SystemUnavailable

    progress.live("follow-ups: enqueueing (not timed)", force=True)
    system.enqueue_bulk(args.jobs, args.batch)
    before = system.count_followups()
    seconds = run_drain(system, args, progress, results, mode="followups")
    made = system.count_followups() - before
    if made != args.jobs:
        raise SystemUnavailable(
            f"follow-ups: {made:,} follow-up jobs for {args.jobs:,} completions"
        )
    results.add(system.name, "drain_followups", seconds)


COMMON_WORKLOADS = ("bulk", "drain", "latency", "single")
# followups: a system's extra_workloads; the ORM ones: its orm_handlers
WORKLOADS = (*COMMON_WORKLOADS, *ORM_WORKLOADS, "followups")


def workloads_for(system, chosen: Sequence[str]) -> list[str]:
    """The workloads of ``chosen`` that the system runs, in the order they run."""
    orm = [w for w, (handler, _) in ORM_WORKLOADS.items() if handler in system.orm_handlers]
    return [w for w in (*COMMON_WORKLOADS, *orm, *system.extra_workloads) if w in chosen]


def run_system(system, args, progress: Progress, results: Results, rep: int) -> bool:
    """All workloads of one system in one repeat; False if the system failed."""
    import psycopg
    from systems.base import SystemUnavailable

    steps = workloads_for(system, args.workloads)
    first_step = progress.done
    label = f"rep {rep + 1}/{args.repeats} {system.name}"
    try:
        progress.step(f"{label}: setup")
        try:
            system.setup_db()
        except SystemUnavailable as exc:
            raise SystemUnavailable(f"setup: {exc}") from exc
        progress.finish_step()
        for workload in steps:
            progress.step(f"{label}: {workload}")
            if workload == "bulk":
                elapsed = system.enqueue_bulk(args.jobs, args.batch)
                results.add(system.name, "enqueue_bulk", args.jobs / elapsed)
            elif workload == "drain":
                if "bulk" not in steps:  # the drain takes the jobs the bulk step enqueued
                    progress.live("drain: enqueueing (not timed)", force=True)
                    system.enqueue_bulk(args.jobs, args.batch)
                run_drain(system, args, progress, results)
            elif workload == "latency":
                run_latency(system, args, progress, results)
            elif workload == "single":
                elapsed = system.enqueue_single(args.single)
                results.add(system.name, "enqueue_single", args.single / elapsed)
            elif workload == "followups":
                run_followups(system, args, progress, results)
            elif workload in ORM_WORKLOADS:
                run_orm(system, args, progress, results, workload)
            progress.finish_step()
        return True
    except Exception as exc:  # noqa: BLE001 - one system's failure must not end the run
        if isinstance(exc, (SystemUnavailable, psycopg.Error, OSError)):
            detail = str(exc)
        else:  # a bug in an adapter: keep where it happened
            detail = "".join(traceback.format_exception(exc)[-6:]).rstrip()
        message = (
            f"{system.name} (repeat {rep + 1}, {progress.prefix.rsplit(': ', 1)[-1]}): {detail}"
        )
        results.error(system.name, message)
        progress.note(f"SKIP {message}")
        return False
    finally:
        progress.done = first_step + 1 + len(steps)
        system.teardown_db()
        system._orm_ready = False


# -------------------------------------------------------------------- table
def render_table(results: Results, systems: list, args: argparse.Namespace) -> str:
    from systems import REFERENCE

    names = [s.name for s in systems]
    rows: list[list[str]] = []
    header = ["", "median", "min", "max", f"vs {REFERENCE}"]
    lines: list[str] = []
    for metric in metrics(args):
        present = [
            n
            for n in names
            if results.values.get(n, {}).get(metric.key)
            and (metric.only is None or metric.only == n)
        ]
        if not present:
            continue
        better = "higher is better" if metric.higher_is_better else "lower is better"
        rows.append([f"{metric.title}, {metric.unit} ({better})"])
        ref_values = results.values.get(REFERENCE, {}).get(metric.ratio_to or metric.key)
        ref = statistics.median(ref_values) if ref_values else None
        for name in present:
            values = results.values[name][metric.key]
            med = statistics.median(values)
            if ref:
                ratio = f"{med / ref:.2f}x"
                if metric.ratio_to:
                    ratio += f" of its {metric.ratio_to}"
            else:
                ratio = "n/a"
            rows.append(
                [
                    f"  {name}",
                    format(med, metric.fmt),
                    format(min(values), metric.fmt),
                    format(max(values), metric.fmt),
                    ratio,
                ]
            )
    widths = [0] * len(header)
    for row in [header, *rows]:
        if len(row) == 1:
            continue
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt_row(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = [cell.rjust(widths[i + 1]) for i, cell in enumerate(row[1:])]
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(fmt_row(header))
    lines.append(fmt_row(header))
    lines.append(rule)
    for row in rows:
        lines.append(row[0] if len(row) == 1 else fmt_row(row))
    lines.append(rule)
    lines.append(f"vs {REFERENCE}: the system's median divided by {REFERENCE}'s median.")
    return "\n".join(lines)


def render_footer(results: Results, systems: list, args: argparse.Namespace, load: tuple) -> str:
    lines = ["", "Systems (version; drain setting):"]
    for s in systems:
        lines.append(f"  {s.name:<16} {s.version():<8} {s.describe()}")
    lines.append(
        f"Repeats: {args.repeats}, interleaved (system order rotates each repeat); "
        f"a fresh database per system per repeat on 127.0.0.1."
    )
    lines.append(
        f"Machine: {os.cpu_count()} CPUs shared with PostgreSQL; load average "
        f"{load[0][0]:.1f} at start, {load[1][0]:.1f} at end."
    )
    chosen_orm = [w for w in ORM_WORKLOADS if w in args.workloads]
    for s in systems:
        if chosen_orm and not s.orm_handlers:
            lines.append(f"Note ({s.name}): ORM-handler workloads n/a: {s.orm_unavailable}")
    for name, notes in results.notes.items():
        for note in notes:
            lines.append(f"Note ({name}): {note}")
    if results.errors:
        lines.append("Skipped or failed:")
        for messages in results.errors.values():
            for message in messages:
                lines.append("  " + message.replace("\n", "\n  "))
    return "\n".join(lines)


# ------------------------------------------------------------------ scaling
SCALING_COLUMNS = (
    ("rate", "jobs/s", ",.0f"),
    ("steady", "steady jobs/s", ",.0f"),
    ("worker_ms", "worker ms/job", ".3f"),
    ("database_ms", "PG ms/job", ".3f"),
    ("worker_cores", "worker cores", ".2f"),
    ("database_cores", "PG cores", ".2f"),
)


def run_scaling(systems: list, args: argparse.Namespace, progress: Progress) -> dict:
    """Drain --jobs jobs with 1, 2, 4… worker processes; CPU split per process count.

    Returns {system: {processes: {column: [values]}}}.
    """
    from systems.base import SystemUnavailable

    out: dict = {}
    handler = args.scaling_handler
    for rep in range(args.repeats):
        for system in systems:
            for processes in args.scaling_processes:
                label = f"rep {rep + 1}/{args.repeats} {system.name} processes={processes}"
                progress.step(label)
                try:
                    system.setup_db()
                    if handler == "orm":
                        system.prepare_orm(args.accounts)
                        system.enqueue_orm(args.jobs, args.batch, "orm", args.accounts)
                    else:
                        system.enqueue_bulk(args.jobs, args.batch)
                    base = system.count_done()
                    cpu: dict = {}
                    saved = system.settings
                    system.settings = {**saved, "processes": processes}
                    try:
                        system.start_worker("orm" if handler == "orm" else "drain")
                    finally:
                        system.settings = saved
                    try:
                        seconds, _ = wait_done(
                            system, base + args.jobs, args.timeout, progress, label, cpu=cpu
                        )
                    finally:
                        system.stop_worker()
                    system.check_succeeded()
                    if not cpu:
                        raise SystemUnavailable("no CPU sample covered the drain")
                    row = out.setdefault(system.name, {}).setdefault(processes, {})
                    values = {
                        "rate": args.jobs / seconds,
                        "steady": cpu["jobs_per_s"],
                        **{k: cpu[k] for k in ("worker_ms", "database_ms")},
                        **{k: cpu[k] for k in ("worker_cores", "database_cores")},
                    }
                    for key, value in values.items():
                        row.setdefault(key, []).append(value)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    progress.note(f"SKIP {label}: {exc}")
                finally:
                    system.teardown_db()
                    progress.finish_step()
    return out


def render_scaling(data: dict, args: argparse.Namespace) -> str:
    handler = "ORM handler" if args.scaling_handler == "orm" else "no-op handler"
    lines = [
        f"Scaling: drain {args.jobs:,} queued jobs ({handler}) with 1..N worker processes;"
        f" medians of {args.repeats} repeat(s)",
    ]
    header = ["system", "processes", *(title for _, title, _ in SCALING_COLUMNS)]
    rows = []
    for name, by_processes in data.items():
        for processes in sorted(by_processes):
            row = by_processes[processes]
            rows.append(
                [
                    name,
                    str(processes),
                    *(
                        format(statistics.median(row[key]), fmt) if row.get(key) else "-"
                        for key, _, fmt in SCALING_COLUMNS
                    ),
                ]
            )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                [row[0].ljust(widths[0]), *(c.rjust(widths[i + 1]) for i, c in enumerate(row[1:]))]
            )
        )
    lines += [
        "jobs/s: from the worker's start to the last job finished (start-up included);",
        "steady jobs/s and the CPU columns: from the first poll that saw a finished job to the",
        "last (systems/cpu.py). ms/job: CPU time per finished job of the worker processes",
        "(children included) and of the run database's PostgreSQL backends. cores: the same CPU",
        "divided by wall time. When worker + PG cores reach the machine's CPUs, more processes",
        "cannot help; the PG share of it is what the database costs per job at that rate.",
        f"Machine: {os.cpu_count()} CPUs, shared with PostgreSQL.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    from systems import SYSTEMS

    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Systems: " + ", ".join(SYSTEMS),
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated, of " + ", ".join(WORKLOADS) + " (default: all)",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="jobs to drain and to bulk-enqueue (default 20000)"
    )
    parser.add_argument(
        "--single", type=int, default=None, help="jobs enqueued one per transaction (default 2000)"
    )
    parser.add_argument("--batch", type=int, default=1000, help="bulk batch size (default 1000)")
    parser.add_argument(
        "--orm-jobs",
        type=int,
        default=None,
        help="jobs in each ORM-handler drain (default 5000; --quick 2000)",
    )
    parser.add_argument(
        "--accounts",
        type=int,
        default=10_000,
        help="rows the ORM handler spreads its updates over (default 10000)",
    )
    parser.add_argument(
        "--rate", type=float, default=50.0, help="pickup-latency enqueue rate, jobs/s (default 50)"
    )
    parser.add_argument(
        "--latency-seconds", type=float, default=None, help="pickup-latency duration (default 10)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds a drain may take (default 600)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads: 5,000 jobs, 500 single enqueues, 5 s of latency",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SYSTEM.KEY=VALUE",
        help="override a drain setting, e.g. --set pgqueuer.batch_size=20 (repeatable)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the measurements (default benchmarks/results/bench-<time>.json)",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="instead of the comparison: drain --jobs jobs with 1, 2 and 4 worker processes "
        "(--scaling-processes) and print jobs/s and the CPU split between the workers and "
        "PostgreSQL (--systems defaults to django-awa here; ceiling also takes it)",
    )
    parser.add_argument(
        "--scaling-processes",
        default="1,2,4",
        help="worker process counts for --scaling (default 1,2,4)",
    )
    parser.add_argument(
        "--scaling-handler",
        choices=("noop", "orm"),
        default="noop",
        help="--scaling's handler: the no-op (default) or the ORM handler",
    )
    parser.add_argument("--no-bootstrap", action="store_true", help="never run bootstrap.sh")
    args = parser.parse_args(argv)
    quick = args.quick
    args.jobs = args.jobs or (5_000 if quick else 20_000)
    args.orm_jobs = args.orm_jobs or (2_000 if quick else 5_000)
    args.single = args.single or (500 if quick else 2_000)
    args.latency_seconds = args.latency_seconds or (5.0 if quick else 10.0)
    args.timeout = args.timeout or (300.0 if quick else 600.0)
    if (
        min(args.repeats, args.jobs, args.single, args.batch, args.orm_jobs, args.accounts) < 1
        or args.rate <= 0
    ):
        parser.error(
            "--repeats, --jobs, --single, --batch, --orm-jobs, --accounts and --rate"
            " must be positive"
        )
    try:
        args.scaling_processes = [int(p) for p in args.scaling_processes.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--scaling-processes: not a list of integers: {args.scaling_processes!r}")
    if not args.scaling_processes or min(args.scaling_processes) < 1:
        parser.error("--scaling-processes: give one or more counts of at least 1")
    if args.scaling and "--systems" not in " ".join(argv):
        args.systems = "django-awa"
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        parser.error(
            f"--workloads: unknown {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(WORKLOADS)}"
        )
    return args


def single_run_lock():
    """Hold an exclusive lock for the run: two runs would drop each other's databases."""
    import fcntl

    RESULTS_DIR.mkdir(exist_ok=True)
    handle = open(RESULTS_DIR / ".run.lock", "w")  # held until the run ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise SystemExit(
            "run.py: another benchmark run is in progress (benchmarks/results/.run.lock)"
        ) from exc
    return handle


def byte_compile() -> None:
    """Write the bytecode of the code run from source: django-awa and the adapters.

    pip compiles what it installs from a wheel, so the peers start from
    bytecode. Code imported from a source tree is compiled on first import,
    and again at every start where PYTHONDONTWRITEBYTECODE is set (as on some
    CI machines): about 50 ms of every django-awa worker's start-up. Compiled
    here once, every system starts from bytecode.
    """
    import compileall

    for tree in (REPO_ROOT / "django_awa", BENCH_DIR / "systems", BENCH_DIR / "djbench"):
        if tree.is_dir():
            compileall.compile_dir(tree, quiet=1)


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does: workers, redis-server and databases go."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str]) -> int:
    ensure_venv()
    _interrupt_on_sigterm()
    sys.path.insert(0, str(BENCH_DIR))
    from systems import REFERENCE, SYSTEMS, load, resolve
    from systems.base import admin_execute

    args = parse_args(argv)
    try:
        chosen = [resolve(n) for n in args.systems.split(",") if n.strip()]
    except KeyError as exc:
        raise SystemExit(f"--systems: unknown system {exc} (known: {', '.join(SYSTEMS)})") from exc
    overrides: dict[str, dict[str, str]] = {}
    for item in args.set:
        target, _, value = item.partition("=")
        system_name, _, key = target.partition(".")
        try:
            overrides.setdefault(resolve(system_name), {})[key] = value
        except KeyError as exc:
            raise SystemExit(f"--set {item}: unknown system") from exc
    # The reference first, then the peers in the registry's order.
    chosen = sorted(dict.fromkeys(chosen), key=list(SYSTEMS).index)
    systems = [load(name, overrides.get(name)) for name in chosen]

    lock = single_run_lock()
    byte_compile()
    try:
        admin_execute("SELECT 1")
    except Exception as exc:
        raise SystemExit(
            f"run.py: PostgreSQL at 127.0.0.1:5432 (user postgres) is not reachable: {exc}"
        ) from exc

    if args.scaling:
        return main_scaling(systems, args, lock)

    if args.scaling:
        return main_scaling(systems, args, lock)

    total = sum((1 + len(workloads_for(s, args.workloads))) * args.repeats for s in systems)
    progress = Progress(total)
    results = Results()
    load_start = os.getloadavg()
    failed: set[str] = set()
    started = time.strftime("%Y%m%d-%H%M%S")
    try:
        for rep in range(args.repeats):
            shift = rep % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system.name in failed:
                    progress.done += 1 + len(workloads_for(system, args.workloads))
                    continue
                if not run_system(system, args, progress, results, rep):
                    # Skip it in later repeats too: what failed once (a
                    # missing engine, a crash at start-up) fails again, and
                    # each try can cost a whole drain timeout.
                    failed.add(system.name)
    except KeyboardInterrupt:
        progress.note("interrupted: printing what was measured")
    finally:
        progress.close()
        for system in systems:
            with contextlib.suppress(Exception):
                system.teardown_db()
    load_end = os.getloadavg()
    if "django-awa" in failed or REFERENCE not in chosen:
        results.note(REFERENCE, "no reference measurements: ratios are n/a where it is missing")

    table = render_table(results, systems, args)
    footer = render_footer(results, systems, args, (load_start, load_end))
    sys.stdout.write(table + "\n" + footer + "\n")

    RESULTS_DIR.mkdir(exist_ok=True)
    payload = {
        "started": started,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "systems": {s.name: {"version": s.version(), "settings": s.settings} for s in systems},
        "values": results.values,
        "errors": results.errors,
        "load_average": {"start": load_start, "end": load_end},
    }
    out = args.json or RESULTS_DIR / f"bench-{started}.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    sys.stdout.write(f"Measurements: {out}\n")
    lock.close()
    return 0 if results.values else 1


def main_scaling(systems: list, args: argparse.Namespace, lock) -> int:
    unfit = [s.name for s in systems if "processes" not in s.settings]
    if unfit:
        raise SystemExit(f"--scaling: {', '.join(unfit)} has no processes setting")
    if args.scaling_handler == "orm":
        unfit = [s.name for s in systems if "orm" not in s.orm_handlers]
        if unfit:
            raise SystemExit(f"--scaling-handler orm: {', '.join(unfit)} has no ORM handler")
    progress = Progress(len(systems) * len(args.scaling_processes) * args.repeats)
    load_start = os.getloadavg()
    started = time.strftime("%Y%m%d-%H%M%S")
    data: dict = {}
    try:
        data = run_scaling(systems, args, progress)
    except KeyboardInterrupt:
        progress.note("interrupted")
    finally:
        progress.close()
        for system in systems:
            with contextlib.suppress(Exception):
                system.teardown_db()
    load_end = os.getloadavg()
    sys.stdout.write(render_scaling(data, args) + "\n")
    for s in systems:
        sys.stdout.write(f"  {s.name} {s.version()}: {s.describe()} (processes varied)\n")
    sys.stdout.write(f"Load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end.\n")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = args.json or RESULTS_DIR / f"scaling-{started}.json"
    payload = {
        "started": started,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "values": {name: {str(p): v for p, v in rows.items()} for name, rows in data.items()},
        "load_average": {"start": load_start, "end": load_end},
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    sys.stdout.write(f"Measurements: {out}\n")
    lock.close()
    return 0 if data else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
