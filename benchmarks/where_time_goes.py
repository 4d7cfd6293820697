#!/usr/bin/env python3
"""Where a drain's time goes: PostgreSQL's by statement, the worker's by thread and function.

    benchmarks/.venv/bin/python benchmarks/where_time_goes.py [--jobs 50000] [--top 12]
                                                              [--no-py-spy]

Drains ``--jobs`` queued no-op jobs with one ``awa_worker --queue bench`` of the bench
project, as ``run.py``'s drain does (the defaults), against a private PostgreSQL 15
that preloads ``pg_stat_statements`` (``stress/hosts.py``'s ``Server``: initdb in a
temporary directory, listening on 127.0.0.1 only, port 15437, ``autovacuum = off`` as
on the machine's server; removed at the end). The machine's own server is not touched:
preloading the extension would need its restart.

It prints:

- **PostgreSQL, by statement**: each statement's calls, execution (and planning) time
  per job, its share of all statements' time, rows per call and WAL bytes per job,
  from ``pg_stat_statements`` over the drain alone (reset once the jobs are queued).
  Statements are named after their constant in ``django_awa/sql.py`` where the text
  matches one (literals and parameters aside), else by their first words. Beside it,
  the server's CPU per job (its processes, read from ``/proc``): what is not in any
  statement's execution is parsing, the protocol, commits' WAL flushes, the
  checkpointer and the WAL writer.
- **The worker, by thread and function** (``py-spy record --gil --nonblocking``, which
  samples the thread holding the interpreter lock without pausing the process): the
  share of samples in each kind of thread (handler threads, the producer, the
  completer, ...; module imports and Django's set-up apart), and the functions with
  the most samples of their own.

Run as root (the server runs as the ``postgres`` user, ``setpriv``), in the
benchmarks' virtualenv (``run.py`` makes it; ``py-spy`` comes from its
requirements). Needs Debian's ``postgresql-15``. All traffic stays on 127.0.0.1.
Indicative, like every figure here: the sampler and the statistics cost a little
themselves. No test asserts a figure.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from instructions import ENQUEUE  # noqa: E402
from systems.cpu import own_seconds  # noqa: E402

from stress.cluster import stop_process  # noqa: E402
from stress.hosts import Server  # noqa: E402

DATABASE = "awa_where"
PORT = 15437
SETTINGS = {
    "shared_preload_libraries": "'pg_stat_statements'",
    "pg_stat_statements.track_planning": "on",
    "autovacuum": "off",
}
# This script's own poll (left out of the statements' shares): completed jobs are
# not in awa_job's own pages, so it reads what is left there, not 20,000 rows.
POLL = "SELECT NOT EXISTS (SELECT FROM ONLY awa_job WHERE state <> 'completed')"
STATEMENTS = """
SELECT s.query, s.calls, s.total_exec_time, s.total_plan_time, s.rows, s.wal_bytes
FROM pg_stat_statements AS s JOIN pg_database AS d ON d.oid = s.dbid
WHERE d.datname = %s
"""

# What the worker's threads run, by the module of their outermost django_awa frame.
THREAD_KINDS = {
    "handlers.py": "handler threads",
    "producer.py": "producer",
    "completer.py": "completer",
    "heartbeat.py": "heartbeat",
    "listener.py": "listener",
    "maintenance.py": "maintenance",
    "fleet.py": "fleet",
}
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--top", type=int, default=12, help="rows of each table")
    parser.add_argument("--no-py-spy", action="store_true", help="PostgreSQL's side alone")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the drain")
    return parser.parse_args()


def main() -> int:
    opts = parse_args()
    if opts.jobs < 1 or opts.top < 1:
        sys.exit("where_time_goes.py: --jobs and --top must be at least 1")
    if os.geteuid() != 0:
        sys.exit("where_time_goes.py runs as root (its PostgreSQL runs as the postgres user)")
    py_spy = None if opts.no_py_spy else shutil.which("py-spy", path=Path(sys.executable).parent)
    if not opts.no_py_spy and py_spy is None:
        sys.exit(
            "where_time_goes.py: no py-spy beside this Python; run it in benchmarks/.venv "
            "(run.py makes it) or pass --no-py-spy"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server([], port=PORT, settings=SETTINGS)
    try:
        server.start()
        return measure(opts, server, py_spy)
    finally:
        server.close()


def measure(opts: argparse.Namespace, server: Server, py_spy: str | None) -> int:
    import psycopg

    with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    # The bench project on this server, for the processes started here and for this
    # one, which reads the statements' names in sql.py.
    os.environ.update(
        DJANGO_SETTINGS_MODULE="djbench.settings_awa",
        BENCH_DB=DATABASE,
        BENCH_PG_PORT=str(server.port),
        PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]),
    )
    run = {"cwd": ROOT, "check": True, "timeout": 600}
    subprocess.run([sys.executable, "-m", "django", "migrate", "-v0"], **run)
    subprocess.run([sys.executable, "-c", ENQUEUE, str(opts.jobs)], **run)
    url = server.url(DATABASE)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")
    work = Path(tempfile.mkdtemp(prefix="awa-where-"))
    try:
        return drain(opts, server, py_spy, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def drain(opts: argparse.Namespace, server: Server, py_spy: str | None, work: Path) -> int:
    """Drain the queued jobs with one worker (sampled by py-spy unless ``py_spy`` is None)
    and print where the time went."""
    import psycopg

    profile, log = work / "worker.txt", work / "worker.log"
    worker = [sys.executable, "-m", "django", "awa_worker", "--queue", "bench"]
    if py_spy is not None:
        sampler = [py_spy, "record", "--gil", "--nonblocking", "--format", "raw"]
        worker = [*sampler, "--rate", "500", "--output", str(profile), "--", *worker]
    url = server.url(DATABASE)
    cpu = server.cpu_seconds()
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            worker, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        with psycopg.connect(url, autocommit=True) as conn:

            def drained() -> bool:
                row = conn.execute(POLL).fetchone()
                return bool(row and row[0])

            while not drained():
                if proc.poll() is not None or time.monotonic() - started > opts.timeout:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the drain of {opts.jobs:,} jobs did not finish:\n{tail}")
                time.sleep(0.05)
            seconds = time.monotonic() - started
            server_cpu = server.cpu_seconds() - cpu
            pid = _worker_pid(proc, sampled=py_spy is not None)
            worker_cpu = own_seconds(pid) or 0.0
            rows = conn.execute(STATEMENTS, [DATABASE]).fetchall()
        # SIGTERM to the worker alone: py-spy writes its profile once its child exits.
        os.kill(pid, signal.SIGTERM)
        proc.wait(opts.timeout)
    finally:
        stop_process(proc)
    print(
        f"{opts.jobs:,} no-op jobs drained in {seconds:.2f} s by one awa_worker --queue bench"
        f"{' sampled by py-spy' if py_spy else ''}; CPU per job: worker "
        f"{1000 * worker_cpu / opts.jobs:.4f} ms (start-up included), PostgreSQL "
        f"{1000 * server_cpu / opts.jobs:.4f} ms\n"
    )
    print_statements(rows, opts.jobs, server_cpu, opts.top)
    if py_spy is not None:
        print_profile(profile, opts.top)
    return 0


def _worker_pid(proc: subprocess.Popen[bytes], *, sampled: bool) -> int:
    """The worker's pid: ``proc`` itself, or py-spy's one child."""
    if not sampled:
        return proc.pid
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"py-spy (pid {proc.pid}) has children {children}, not one worker")
    return int(children[0])


# -- PostgreSQL's side ---------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    """A statement's words without its literals, parameters and numbers: the shape
    pg_stat_statements' text (constants made ``$n``) and django_awa's (``%(name)s``) share."""
    text = re.sub(r"'(?:[^']|'')*'|%\(\w+\)s|\$\d+|\b\d+(?:\.\d+)?\b", " ", text)
    words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)
    return tuple(w.lower() for w in words if w.upper() not in ("NULL", "TRUE", "FALSE"))


def statement_names() -> dict[tuple[str, ...], str]:
    """django_awa's statements by their words, named after their constants in sql.py
    (which needs Django set up: its statements are made from the models)."""
    import django

    django.setup()
    from django_awa import sql

    named: dict[tuple[str, ...], str] = {}
    for name, value in vars(sql).items():
        if name.isupper() and isinstance(value, str):
            named.setdefault(_words(value), name)
    for plain, releasing in sql.RELEASING.items():
        if plain_name := named.get(_words(plain)):
            named.setdefault(_words(releasing), f"{plain_name} (releasing)")
    return named


def print_statements(rows: list[tuple], jobs: int, server_cpu: float, top: int) -> None:
    named = statement_names()
    merged: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    poll = _words(POLL)
    for query, calls, exec_ms, plan_ms, returned, wal in rows:
        if _words(query) == poll:
            continue
        name = named.get(_words(query)) or " ".join(query.split())[:40]
        totals = merged[name]
        for i, value in enumerate((calls, exec_ms, plan_ms, returned, float(wal))):
            totals[i] += value
    spent = sum(t[1] + t[2] for t in merged.values()) or 1.0
    print(f"PostgreSQL, by statement (pg_stat_statements; per job = over {jobs:,} jobs):")
    print(
        f"  {'statement':<40} {'calls':>7} {'exec ms/job':>12} {'plan ms/job':>12} "
        f"{'share':>6} {'rows/call':>10} {'WAL B/job':>10}"
    )
    ordered = sorted(merged.items(), key=lambda item: -(item[1][1] + item[1][2]))
    for name, (calls, exec_ms, plan_ms, returned, wal) in ordered[:top]:
        print(
            f"  {name:<40} {calls:>7,} {exec_ms / jobs:>12.5f} {plan_ms / jobs:>12.5f} "
            f"{(exec_ms + plan_ms) / spent:>6.0%} {returned / max(calls, 1):>10,.1f} "
            f"{wal / jobs:>10,.1f}"
        )
    if len(ordered) > top:
        rest = ordered[top:]
        share = sum(t[1] + t[2] for _, t in rest) / spent
        print(f"  ({len(rest)} more statements: {share:.0%} of the time)")
    print(
        f"  all statements: {spent / jobs:.5f} ms per job of the server's "
        f"{1000 * server_cpu / jobs:.5f} ms of CPU per job\n"
    )


# -- The worker's side ---------------------------------------------------------------


def _frames(stack: str) -> list[tuple[str, str]]:
    """``(function, file)`` of each frame of a py-spy raw stack, outermost first."""
    frames = []
    for frame in stack.split(";"):
        found = FRAME.match(frame)
        if found:
            frames.append((found["function"], found["file"]))
    return frames


def _thread_kind(frames: list[tuple[str, str]]) -> str:
    if any(function == "_find_and_load" for function, _ in frames):
        return "module imports (start-up)"
    for _, file in frames:
        if "django_awa/" in file:
            kind = THREAD_KINDS.get(file.rsplit("/", 1)[-1])
            if kind is not None:
                return kind
    return "main thread and the rest (Django's set-up, checks)"


def print_profile(profile: Path, top: int) -> None:
    kinds: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = _frames(stack)
        if not frames:
            continue
        n = int(count)
        total += n
        kinds[_thread_kind(frames)] += n
        function, file = frames[-1]
        own[f"{function} ({_short(file)})"] += n
    if not total:
        print("py-spy recorded no samples")
        return
    print(f"The worker, by thread (py-spy, {total:,} samples holding the interpreter lock):")
    for kind, n in kinds.most_common():
        print(f"  {kind:<52} {n / total:>6.0%}")
    print("The worker's functions with the most samples of their own:")
    for function, n in own.most_common(top):
        print(f"  {function:<72} {n / total:>6.0%}")


def _short(file: str) -> str:
    """A source path from its package on (the installation and the checkout left out)."""
    for marker in ("site-packages/", f"{ROOT}/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return re.sub(r"^.*/lib/python3\.\d+/", "", file)


if __name__ == "__main__":
    sys.exit(main())
