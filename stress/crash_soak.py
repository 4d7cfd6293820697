#!/usr/bin/env python3
"""Crash soak: many jobs, three workers, one SIGKILLed every few seconds. Nothing may be lost.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres \\
        python stress/crash_soak.py --jobs 20000 --timeout 1200

It creates its own database on that server (``awa_soak_<pid>``), migrates it,
enqueues ``--jobs`` jobs of the test kinds (tests/testapp), most of them
succeeding, some failing at random (retried, exhausted, terminal, cancelled),
some parking on a callback that a sender thread answers with
``awa.complete_external`` (or ``fail_external``); every one has follow-ups.
One in twenty is an ``atomic=True`` ``Pay`` job (a fifth of them raising), whose
``Order`` and ``Ledger`` rows commit with its outcome or not at all.
Three ``awa_worker`` processes run them while a controller SIGKILLs a random
worker every ``--kill-every`` seconds (jittered) and starts it again.

With ``--poison FRACTION`` that share of the jobs are poison: handlers
whose errors, cancel reasons or progress hold NUL bytes or lone surrogates,
that return delays no timestamp holds, or that raise ``BaseException``
subclasses; rows written around ``enqueue`` (with the ORM) carry keys the
engine owns; and enqueues with out-of-range dates, reserved metadata keys
and other bad input are tried, each of which must be refused with nothing
written. The poison jobs must end ``failed``, ``cancelled``, ``completed`` or
waiting out their capped delay, with what they raised kept readable, and
they must hold back no other job.

With ``--hosts N`` (as root) the workers run on N "hosts": network
namespaces of ``stress/hosts.py``, each reaching a private PostgreSQL over
its own veth link. Besides the SIGKILLs, every ``--cut-every`` seconds a
host's link is taken down (``ip link set down``) for ``--cut-for`` seconds
and restored, and the workers of the second and third hosts run with their
wall clocks ``--skew`` seconds behind and ahead (an injected offset): leases and
heartbeats are judged on the database clock only, so the skew must change
nothing.

At the end it prints, counted in SQL: jobs by final state, workers killed,
handler runs duplicated within one (job, attempt) (must be 0), triggers whose
follow-ups differ from their committed outcomes (must be 0), atomic jobs
whose writes committed other than once for a completed job and never for
any other (must be 0), and jobs not final. It exits 1 on any of these, or
when ``--timeout`` passes first, and drops its database unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
WORKER_QUEUES = ["--queue", "default=8", "--queue", "echo=4"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds, jittered")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a server to create the soak database on (its path names the maintenance db)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the soak database")
    parser.add_argument(
        "--poison", type=float, default=0.0, help="share of poison jobs, e.g. 0.02 (default 0)"
    )
    parser.add_argument("--hosts", type=int, default=0, help="network-namespace hosts (root)")
    parser.add_argument("--cut-every", type=float, default=15.0, help="seconds between link cuts")
    parser.add_argument("--cut-for", type=float, default=6.0, help="seconds a link stays down")
    parser.add_argument("--skew", type=float, default=40.0, help="clock skew of hosts 2 and 3")
    return parser.parse_args()


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)  # noqa: T201


class Workers:
    """``--workers`` awa_worker processes; ``kill_one`` SIGKILLs one and starts it again.

    ``placement(i)`` gives worker slot ``i`` a command prefix and extra
    environment (its host's namespace, its database URL, its clock skew).
    """

    def __init__(
        self,
        n: int,
        env: dict[str, str],
        logdir: Path,
        placement: Callable[[int], tuple[list[str], dict[str, str]]] | None = None,
    ) -> None:
        self.env = env
        self.logdir = logdir
        self.placement = placement or (lambda i: ([], {}))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = 0
        self.killed = 0
        for i in range(n):
            self.procs.append(self._spawn(i))

    def _spawn(self, slot: int) -> subprocess.Popen[bytes]:
        self.started += 1
        prefix, extra = self.placement(slot)
        out = (self.logdir / f"worker{self.started}.log").open("wb")
        return subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            [*prefix, sys.executable, "-m", "django", "awa_worker", *WORKER_QUEUES],
            cwd=ROOT,
            env={**self.env, **extra},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_one(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.procs))
        proc = self.procs[i]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            self.killed += 1
        self.procs[i] = self._spawn(i)

    def dead(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is not None]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C: every ``finally`` stops what this script started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main() -> int:
    opts = parse_args()
    _exit_on_sigterm()
    sys.path.insert(0, str(ROOT))
    seed = opts.seed if opts.seed is not None else random.randrange(2**32)  # noqa: S311
    rng = random.Random(seed)  # noqa: S311 - reproducible, not secret
    name = f"awa_soak_{os.getpid()}"
    with contextlib.ExitStack() as stack:
        if opts.hosts:
            from stress.hosts import Hosts, Server

            hosts = stack.enter_context(Hosts(opts.hosts))
            server = Server([hosts.gateway(i) for i in range(opts.hosts)])
            stack.callback(server.close)
            server.start()
            opts.database_url = server.url("postgres")
            opts.host_urls = [server.url(name, hosts.gateway(i)) for i in range(opts.hosts)]
            opts.hosts_made = hosts
        return run(opts, seed, rng, name)


def run(opts: argparse.Namespace, seed: int, rng: random.Random, name: str) -> int:
    url = with_db(opts.database_url, name)
    import psycopg

    admin_url = opts.database_url
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    log(f"seed {seed}; database {name}; {opts.jobs} jobs; {opts.workers} workers")
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    env.update(
        DATABASE_URL=url,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    os.environ.update(env)
    os.environ.pop("AWA_TEST_DB_NAME", None)
    try:
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--run-syncdb", "-v0"],
            cwd=ROOT,
            env=env,
            check=True,
        )
        return soak(opts, rng, env)
    finally:
        if not opts.keep:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            log(f"dropped {name}")
        else:
            log(f"kept {name}: {url}")


def soak(opts: argparse.Namespace, rng: random.Random, env: dict[str, str]) -> int:
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection, connections

    import django_awa as awa
    from stress import audit
    from tests.testapp.jobs import POISON_ACTIONS, Act, Parked, Pay, Poison

    # -- enqueue ------------------------------------------------------------------------
    requests = []
    for number in range(opts.jobs):
        roll = rng.random()
        if rng.random() < opts.poison:
            action = rng.choice(POISON_ACTIONS)
            requests.append(awa.EnqueueRequest(Poison(action=action), max_attempts=2))
        elif roll < 0.04:
            requests.append(awa.EnqueueRequest(Act(action="raise"), max_attempts=3))
        elif roll < 0.06:
            requests.append(awa.EnqueueRequest(Act(action="terminal"), max_attempts=10))
        elif roll < 0.08:
            requests.append(awa.EnqueueRequest(Act(action="cancel"), max_attempts=10))
        elif roll < 0.18:
            requests.append(
                awa.EnqueueRequest(Act(action="ok", fail_until=rng.choice([1, 2])), max_attempts=10)
            )
        elif roll < 0.28:
            requests.append(awa.EnqueueRequest(Parked(timeout=120.0), max_attempts=10))
        elif roll < 0.33:
            # atomic=True: its Order and Ledger rows commit with its outcome or not at all.
            fail = rng.random() < 0.2
            requests.append(awa.EnqueueRequest(Pay(reference=f"soak-{number}", fail=fail)))
        else:
            seconds = rng.choice([0.0, 0.0, 0.01, 0.05, 0.2])
            requests.append(
                awa.EnqueueRequest(Act(action="sleep", seconds=seconds), max_attempts=10)
            )
    ids: list[int] = []
    for start in range(0, len(requests), 2000):
        ids.extend(awa.enqueue_many(requests[start : start + 2000]))
    if len(ids) != opts.jobs:
        raise RuntimeError(f"enqueued {len(ids)} of {opts.jobs} jobs")
    log(f"enqueued {len(ids)} jobs")
    refused, accepted = ({}, []) if not opts.poison else try_bad_enqueues(opts, rng)
    if opts.poison:
        ids.extend(write_odd_rows(max(1, int(opts.jobs * opts.poison))))
        log(f"bad enqueues refused: {sum(refused.values())} ({refused}); accepted: {accepted}")

    # -- run ------------------------------------------------------------------------------
    logdir = Path(tempfile.mkdtemp(prefix="awa-soak-"))
    hosts = getattr(opts, "hosts_made", None)
    placement = None
    if hosts is not None:
        from stress.hosts import skew_env

        skews = [0.0, -opts.skew, opts.skew]

        def placement(slot: int) -> tuple[list[str], dict[str, str]]:
            i = slot % opts.hosts
            skew = skews[i % len(skews)]
            extra = {"DATABASE_URL": opts.host_urls[i], **skew_env(skew, env["PYTHONPATH"])}
            return hosts.prefix(i), extra

        log(f"{opts.hosts} hosts; worker clocks skewed by {skews[: opts.hosts]}s")
    workers = Workers(opts.workers, env, logdir, placement)
    cuts = 0
    stop = threading.Event()
    answered = {"complete": 0, "fail": 0, "gone": 0}
    sender_rng = random.Random(rng.random())  # noqa: S311 - one Random per thread

    def sender() -> None:
        # Answers parked jobs as an outside system would, racing kills and rescues.
        while not stop.is_set():
            try:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT callback_id FROM awa_job WHERE kind = 'parked' "
                        "AND state = 'waiting_external' LIMIT 200"
                    )
                    waiting = [row[0] for row in cursor.fetchall()]
                for callback_id in waiting:
                    try:
                        if sender_rng.random() < 0.9:
                            awa.complete_external(callback_id, {"ok": True})
                            answered["complete"] += 1
                        else:
                            awa.fail_external(callback_id, "declined by the outside system")
                            answered["fail"] += 1
                    except awa.CallbackNotFound:
                        answered["gone"] += 1
            except Exception as exc:  # noqa: BLE001 - the soak goes on; shown in the log
                log(f"sender: {type(exc).__name__}: {exc}")
                connection.close()
            stop.wait(0.2)
        connections.close_all()

    def controller() -> None:
        nonlocal cuts
        next_cut = time.monotonic() + opts.cut_every
        while not stop.wait(opts.kill_every * rng.uniform(0.5, 1.5)):
            if hosts is not None and time.monotonic() >= next_cut:
                i = rng.randrange(opts.hosts)
                log(f"cutting host {i + 1}'s link for {opts.cut_for:.0f}s")
                hosts.cut(i)
                try:
                    stop.wait(opts.cut_for)
                finally:
                    hosts.restore(i)
                cuts += 1
                next_cut = time.monotonic() + opts.cut_every
                continue
            workers.kill_one(rng)

    threads = [threading.Thread(target=sender), threading.Thread(target=controller)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + opts.timeout
    started = time.monotonic()
    timed_out = False
    last_report = 0.0
    try:
        while True:
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(1.0)
            try:
                with connection.cursor() as cursor:
                    everything = ids + audit.followup_ids(cursor, ids)
                    left = audit.not_final(cursor, everything)
                if not left:
                    break
                if time.monotonic() - last_report > 10:
                    last_report = time.monotonic()
                    with connection.cursor() as cursor:
                        states = audit.by_state(cursor, everything)
                    log(
                        f"{len(left)} of {len(everything)} not final; {states}; "
                        f"killed {workers.killed}; links cut {cuts}"
                    )
            except Exception as exc:  # noqa: BLE001 - the status loop rides out outages
                log(f"status: {type(exc).__name__}: {exc}")
                connections.close_all()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        workers.stop()
    elapsed = time.monotonic() - started

    # -- audit ---------------------------------------------------------------------------
    with connection.cursor() as cursor:
        followups = audit.followup_ids(cursor, ids)
        states = audit.by_state(cursor, ids)
        followup_states = audit.by_state(cursor, followups)
        dups = audit.ledger_duplicates(cursor, ids + followups)
        mismatches = audit.outcome_mismatches(cursor, ids)
        left = audit.not_final(cursor, ids + followups)
        poison = audit.unreadable_poison(cursor, ids)
        atomic = audit.atomic_effects(cursor, ids)
        cursor.execute(
            "SELECT args ->> 'action' || ' ' || state, count(*) FROM awa_job "
            "WHERE id = ANY(%(ids)s) AND kind = 'poison' GROUP BY 1 ORDER BY 1",
            {"ids": ids},
        )
        poison_by_state = dict(cursor.fetchall())
        cursor.execute("SELECT count(*) FROM awa_job WHERE id = ANY(%(ids)s)", {"ids": ids})
        present = cursor.fetchone()[0]
        cursor.execute(
            "SELECT count(*) FROM awa_job WHERE id = ANY(%(ids)s) AND errors @> "
            """'[{"error": "rescued: stale heartbeat"}]'""",
            {"ids": ids},
        )
        rescued = cursor.fetchone()[0]
    print()  # noqa: T201
    print(f"jobs: {len(ids)} enqueued, {present} present, in {elapsed:.0f}s")  # noqa: T201
    print(f"final states of the jobs: {states}")  # noqa: T201
    print(f"follow-ups: {len(followups)}, states {followup_states}")  # noqa: T201
    print(f"workers killed (SIGKILL): {workers.killed}; started: {workers.started}")  # noqa: T201
    if hosts is not None:
        print(f"hosts: {opts.hosts}; links cut: {cuts}; clock skew ±{opts.skew:.0f}s")  # noqa: T201
    print(f"jobs rescued after a stale heartbeat: {rescued}")  # noqa: T201
    print(f"callbacks answered: {answered}")  # noqa: T201
    print(f"ledger duplicates per (job, attempt): {len(dups)} {dups[:10]}")  # noqa: T201
    print(f"outcome vs follow-up mismatches: {len(mismatches)} {mismatches[:10]}")  # noqa: T201
    print(f"jobs not final: {len(left)} {left[:10]}")  # noqa: T201
    print(f"atomic jobs whose writes are not exactly once: {len(atomic)} {atomic[:10]}")  # noqa: T201
    if opts.poison:
        print(f"poison jobs by action and state: {poison_by_state}")  # noqa: T201
        print(f"poison jobs left wrong or unreadable: {len(poison)} {poison[:10]}")  # noqa: T201
        print(f"bad enqueues refused: {refused}; accepted (must be none): {accepted}")  # noqa: T201
    print(f"worker logs: {logdir}")  # noqa: T201
    lost = (
        present != len(ids)
        or bool(dups)
        or bool(mismatches)
        or bool(left)
        or bool(atomic)
        or bool(poison)
        or bool(accepted)
        or timed_out
    )
    print("RESULT:", "LOSS OR DUPLICATION" if lost else "OK", "(timed out)" if timed_out else "")  # noqa: T201
    connections.close_all()
    return 1 if lost else 0


def try_bad_enqueues(
    opts: argparse.Namespace, rng: random.Random
) -> tuple[dict[str, int], list[str]]:
    """Enqueue what must be refused; returns refusals by kind of input, and what got in."""
    import datetime as dt

    from django.db import connection

    import django_awa as awa
    from tests.testapp.jobs import Act

    east, west = dt.timezone(dt.timedelta(hours=14)), dt.timezone(dt.timedelta(hours=-14))
    bad: dict[str, dict[str, object]] = {
        "run_at year 1 at UTC+14": {"run_at": dt.datetime(1, 1, 1, tzinfo=east)},
        "run_at year 9999 at UTC-14": {"run_at": dt.datetime(9999, 12, 31, 23, tzinfo=west)},
        "metadata awa_original_priority": {"metadata": {"awa_original_priority": "high"}},
        "metadata awa_trigger": {"metadata": {"awa_trigger": {"job_id": 1}}},
        "metadata awa_periodic": {"metadata": {"awa_periodic": "x"}},
        "metadata NUL": {"metadata": {"note": "a\x00b"}},
        "tags dict": {"tags": {"a": 1}},
    }
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM awa_job")
        before = cursor.fetchone()[0]
    refused: dict[str, int] = {}
    accepted: list[str] = []
    for name, options in bad.items():
        for how in ("enqueue", "enqueue_many"):
            try:
                if how == "enqueue":
                    awa.enqueue(Act(action="ok"), **options)  # type: ignore[arg-type]
                else:
                    good = [awa.EnqueueRequest(Act(action="ok")) for _ in range(3)]
                    awa.enqueue_many([*good, awa.EnqueueRequest(Act(action="ok"), **options)])  # type: ignore[arg-type]
            except awa.ValidationError:
                refused[name] = refused.get(name, 0) + 1
            except Exception as exc:  # noqa: BLE001 - reported: anything but a refusal is a bug
                accepted.append(f"{how} {name}: {type(exc).__name__}: {exc}")
            else:
                accepted.append(f"{how} {name}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM awa_job")
        after = cursor.fetchone()[0]
    if after != before:
        accepted.append(f"{after - before} row(s) written by refused enqueues")
    return refused, accepted


def write_odd_rows(n: int) -> list[int]:
    """Runnable jobs written with the ORM around enqueue's checks, holding keys the
    engine owns with values it never writes: they must run, and stop no duty."""
    import datetime as dt

    from django.utils import timezone

    from django_awa.models import Job

    long_ago = timezone.now() - dt.timedelta(hours=1)
    rows = [
        Job(
            kind="act",
            queue="default",
            args={"action": "ok"},
            priority=4,
            run_at=long_ago,
            max_attempts=10,
            metadata={"awa_original_priority": value},
        )
        for value in (["high", 1e30, None, [1]] * n)[:n]
    ]
    return [job.id for job in Job.objects.bulk_create(rows)]


if __name__ == "__main__":
    sys.exit(main())
