#!/usr/bin/env python3
"""Failover with nothing lost: django-awa workers on a Patroni cluster, through faults.

    .venv/bin/python stress/ha.py                       # synchronous_mode on, then off
    .venv/bin/python stress/ha.py --sync on --settle 20 # only synchronous, longer
    .venv/bin/python stress/ha.py --short               # the CI version's sizes

Run as root (Patroni runs as the postgres user; the script switches to it).
It brings up ``stress/cluster.py``'s cluster (three PostgreSQL 15 nodes under
Patroni, etcd, HAProxy on 127.0.0.1:15432), creates and migrates a database
through HAProxy, starts ``--workers`` awa_worker processes with
``DATABASE_URL`` pointing at HAProxy, and runs the client workload of
``stress/workload.py`` (unique enqueues, callbacks, a ledger of every
acknowledged write in a local file outside the cluster) through:

* with ``synchronous_mode: true``: a planned switchover (``patronictl
  switchover``), then a SIGKILL of the primary's Patroni and postmaster
  (the killed node rejoins afterwards);
* with ``synchronous_mode: false``: the same SIGKILL while the replicas lag
  (the primary's walsenders SIGSTOPped for ``--lag`` seconds, and
  ``maximum_lag_on_failover`` raised so Patroni promotes a lagging replica),
  showing what asynchronous replication loses.

For each fault it prints seconds until jobs completed again (the longest
pause between completions, on the database clock), how long enqueues
failed, attempts lost to the fault, and at the end the audit against the
new primary: acknowledged enqueues, completions and callbacks missing,
duplicated unique jobs, handler runs duplicated within one attempt, outcome
and follow-up mismatches, and jobs not final. Exit status 1 when a
synchronous run lost or duplicated anything (an asynchronous run's losses
are reported, expected).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stress.cluster import Cluster, stop_process, wait_until  # noqa: E402

DATABASE = "awa_ha"
WORKER_QUEUES = ["--queue", "default=8", "--queue", "echo=4"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)  # noqa: T201


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", choices=["on", "off", "both"], default="both")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=40.0, help="enqueues per second")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load around faults")
    parser.add_argument("--lag", type=float, default=4.0, help="seconds replicas lag (async)")
    parser.add_argument("--drain", type=float, default=240.0, help="seconds to finish all jobs")
    parser.add_argument("--short", action="store_true", help="small sizes (the CI test)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    opts = parser.parse_args(argv)
    if opts.short:
        opts.settle, opts.rate, opts.lag = 4.0, 25.0, 3.0
    return opts


class Workers:
    """awa_worker processes (the project's venv) on ``url``; stopped by pid."""

    def __init__(self, n: int, url: str, logdir: Path, prefix: list[str] | None = None) -> None:
        self.env = worker_env(url)
        self.logdir = logdir
        self.prefix = prefix or []
        self.procs: list[subprocess.Popen[bytes]] = []
        for _ in range(n):
            self.spawn()

    def spawn(self, prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        out = (self.logdir / f"worker{len(self.procs) + 1}.log").open("wb")
        proc = subprocess.Popen(  # noqa: S603 - our interpreter and arguments
            [
                *(self.prefix if prefix is None else prefix),
                sys.executable, "-m", "django", "awa_worker", *WORKER_QUEUES,
            ],
            cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with_suppress(lambda p=proc: os.killpg(p.pid, signal.SIGTERM))
        for proc in self.procs:
            stop_process(proc, timeout=30)


def with_suppress(action: Callable[[], Any]) -> None:
    try:
        action()
    except ProcessLookupError:
        pass


def worker_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    env.update(
        DATABASE_URL=url,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return env


def prepare_database(cluster: Cluster) -> str:
    """Create and migrate the job database through HAProxy; its URL."""
    import psycopg

    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    url = cluster.url(DATABASE)
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--run-syncdb", "-v0"],
        cwd=ROOT, env=worker_env(url), check=True, timeout=300,
    )  # fmt: skip
    return url


def setup_django(url: str) -> None:
    os.environ.update(worker_env(url))
    import django

    django.setup()


def run_mode(opts: argparse.Namespace, synchronous: bool) -> dict[str, Any]:
    """One cluster, its faults, its audit: the results."""
    mode = "synchronous" if synchronous else "asynchronous"
    cluster = Cluster(
        synchronous=synchronous,
        # Asynchronous: let Patroni promote a lagging replica, to show the loss.
        maximum_lag_on_failover=1048576 if synchronous else 1 << 40,
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"awa-ha-{mode}-"))
    results: dict[str, Any] = {"mode": mode, "faults": []}
    workers: Workers | None = None
    workload = None
    try:
        started = time.monotonic()
        cluster.start(timeout=180)
        log(f"{mode}: cluster up in {time.monotonic() - started:.1f}s, leader {cluster.leader()}")
        url = prepare_database(cluster)
        setup_django(url)
        from stress.workload import Ledger, Workload

        ledger = Ledger(workdir / "ledger.jsonl")
        workers = Workers(opts.workers, url, workdir)
        workload = Workload(ledger, rate=opts.rate)
        workload.start()
        wait_until(lambda: workload.ledger_counts()["completed"] >= 20, 120, "jobs completing")
        time.sleep(opts.settle / 2)
        faults: list[tuple[str, Callable[[], str]]]
        if synchronous:
            faults = [("switchover", cluster.switchover), ("kill primary", cluster.kill_primary)]
        else:
            faults = [("kill lagging primary", lambda: kill_lagging(cluster, opts.lag))]
        for name, fault in faults:
            results["faults"].append(run_fault(cluster, name, fault, opts))
        time.sleep(opts.settle / 2)
        workload.stop_enqueuing.set()
        results.update(audit(workload, opts.drain))
        workload.stop()
        for fault in results["faults"]:
            measure(fault, workload)
        results["counts"] = dict(workload.counts)
        # A worker says its outage is over once none of its threads failed for
        # db.OUTAGE_SETTLES (5 s) after the last came back: waited for here, up to
        # 30 s, rather than read at whatever moment the audit ended.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: outages_over(workers.logs()), 30, "the outages said over", 0.5)
        results["logs"] = outage_lines(workers.logs())
        results["ledger"] = str(ledger.path)
        return results
    finally:
        if workload is not None:
            workload.stop()
        if workers is not None:
            workers.stop()
        from django.db import connections

        connections.close_all()
        cluster.stop()


def kill_lagging(cluster: Cluster, lag: float) -> str:
    """Stop the primary's walsenders for ``lag`` seconds of writes, then SIGKILL the primary."""
    leader = cluster.leader()
    if leader is None:
        raise RuntimeError("no leader")
    senders = cluster.walsenders(leader)
    for pid in senders:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(lag)
    old = cluster.kill_primary()
    for pid in senders:  # they must not send what they hold once the primary is gone
        with_suppress(lambda p=pid: os.kill(p, signal.SIGKILL))
    return old


def run_fault(
    cluster: Cluster, name: str, fault: Callable[[], str], opts: argparse.Namespace
) -> dict[str, Any]:
    cluster.wait_ready(180)  # every node back, a sync standby chosen
    log(f"fault: {name} (leader {cluster.leader()})")
    at = time.time()
    old = fault()
    try:
        wait_until(lambda: cluster.leader() not in (None, old), 120, "a new leader", 0.2)
    except TimeoutError:
        log(f"  no new leader: {cluster.members()}")
        raise
    promoted = time.time() - at
    log(f"  new leader {cluster.leader()} after {promoted:.1f}s")
    time.sleep(opts.settle)
    if name.startswith("kill"):
        cluster.rejoin(old, timeout=180)
        log(f"  {old} rejoined as a replica")
    return {"fault": name, "at": at, "until": time.time(), "new_leader_after": round(promoted, 1)}


def audit(workload: Any, drain: float) -> dict[str, Any]:
    """Wait for every job to finish, then check the guarantees against the primary."""
    from django.db import connection

    from django_awa import db
    from stress import audit as checks
    from stress.workflow_soak import audit_workflows

    ids = workload.ids

    def everything_final() -> bool:
        try:
            with connection.cursor() as cursor:
                return not checks.not_final(cursor, ids + checks.followup_ids(cursor, ids))
        except Exception:  # noqa: BLE001 - reconnect and look again
            db.close_thread_connections()
            return False

    try:
        wait_until(everything_final, drain, "every job final", interval=1.0)
    except TimeoutError as exc:
        log(str(exc))
    with connection.cursor() as cursor:
        followups = checks.followup_ids(cursor, ids)
        out: dict[str, Any] = {
            "jobs": len(ids),
            "states": checks.by_state(cursor, ids),
            "lost": workload.check(cursor),
            "handler_runs_duplicated": checks.ledger_duplicates(cursor, ids + followups),
            "outcome_mismatches": checks.outcome_mismatches(cursor, ids),
            "not_final": checks.not_final(cursor, ids + followups),
            # Workflow steps: none ran before its dependency completed, ran twice or
            # was left unfinished (stress/workflow_soak.py's rules).
            "workflow_rules_broken": {
                rule: rows
                for rule, rows in audit_workflows(cursor, workload.workflow_ids).items()
                if rows
            },
        }
    return out


def measure(fault: dict[str, Any], workload: Any) -> None:
    """Add to ``fault`` how long jobs and enqueues stopped, and the attempts it cost."""
    from django.db import connection

    from stress.workload import attempts_lost, flow_gap

    at, until = fault["at"], fault["until"]
    with connection.cursor() as cursor:
        fault["flow_gap"] = round(flow_gap(cursor, at, until), 1)
        fault["attempts_lost"] = attempts_lost(cursor, workload.ids, at, until)
    windows = [end - start for start, end in workload.outages if at <= start <= until]
    fault["enqueue_outage"] = round(max(windows, default=0.0), 1)


def outages_over(text: str) -> bool:
    """Whether every outage the workers logged has its recovery line too."""
    lines = outage_lines(text)
    return sum("unavailable (" in line for line in lines) == sum(
        "available again after" in line for line in lines
    )


def outage_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "django_awa.outage" in line or "leader" in line]


def report(results: dict[str, Any]) -> bool:
    """Print one mode's results; True if a guarantee broke that this mode promises."""
    mode = results["mode"]
    print(f"\n==== {mode} replication ====")  # noqa: T201
    for fault in results["faults"]:
        print(  # noqa: T201
            f"{fault['fault']}: new leader after {fault['new_leader_after']}s; jobs flowed "
            f"again after {fault['flow_gap']}s; enqueues failed for {fault['enqueue_outage']}s; "
            f"attempts lost: {fault['attempts_lost']}"
        )
    lost = results["lost"]
    print(f"jobs: {results['jobs']}, states {results['states']}")  # noqa: T201
    print(f"client counts: {results['counts']}")  # noqa: T201
    for key, values in lost.items():
        print(f"{key}: {len(values)} {values[:10]}")  # noqa: T201
    for key in ("handler_runs_duplicated", "outcome_mismatches", "not_final"):
        print(f"{key}: {len(results[key])} {results[key][:10]}")  # noqa: T201
    print(f"workflow rules broken: {results['workflow_rules_broken'] or 'none'}")  # noqa: T201
    print(f"ledger (outside the cluster) and worker logs: {results['ledger']}")  # noqa: T201
    print("worker outage log lines:")  # noqa: T201
    for line in results["logs"][:40]:
        print("  " + line)  # noqa: T201
    broken = any(
        results[k] for k in ("handler_runs_duplicated", "not_final", "workflow_rules_broken")
    )
    broken |= bool(lost["enqueues_duplicated"])
    if mode == "synchronous":
        broken |= any(lost.values()) or bool(results["outcome_mismatches"])
    return broken


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: every ``finally`` stops what this script started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    _exit_on_sigterm()
    if os.geteuid() != 0:
        print("stress/ha.py runs as root (Patroni runs as postgres)", file=sys.stderr)  # noqa: T201
        return 2
    modes = {"on": [True], "off": [False], "both": [True, False]}[opts.sync]
    all_results = []
    broken = False
    for synchronous in modes:
        if not synchronous and all_results:
            # Django is set up on the first mode's database: a new process for the next.
            again = [*sys.argv[1:], "--sync", "off"]
            if opts.json:
                again += ["--json", str(opts.json.with_suffix(".async.json"))]
            code = subprocess.call([sys.executable, __file__, *again])  # noqa: S603
            broken |= code == 1
            continue
        results = run_mode(opts, synchronous)
        broken |= report(results)
        all_results.append(results)
    if opts.json:
        opts.json.write_text(json.dumps(all_results, indent=1, default=str))
    print("RESULT:", "BROKEN" if broken else "OK")  # noqa: T201
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
