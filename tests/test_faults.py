"""Faults with real worker processes: nothing is lost, nothing runs twice in one attempt.

(a) every worker connection is terminated (``pg_terminate_backend``) several
    times while 600 jobs run;
(b) one of two workers is SIGKILLed again and again during a run of a few
    hundred jobs with follow-ups;
(c) a private PostgreSQL server, owned by the test, is restarted mid-run.

After each: every job (and every follow-up) is final, no (job, attempt) ran
its handler twice (the ``Ledger``), and each committed outcome has exactly
its follow-ups (``stress/audit.py``, counted in SQL).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

import django_awa as awa
from stress import audit
from tests.conftest import ROOT, wait_for
from tests.testapp.jobs import Act

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def run_audit(ids: list[int], timeout: float) -> dict[str, int]:
    """Wait until the triggers and their follow-ups are final, then check the guarantees."""

    def everything_final() -> bool:
        with connection.cursor() as cursor:
            return not audit.not_final(cursor, ids + audit.followup_ids(cursor, ids))

    def describe() -> str:
        with connection.cursor() as cursor:
            left = audit.not_final(cursor, ids + audit.followup_ids(cursor, ids))
        return f"{len(left)} job(s) not final, e.g. {left[:10]}"

    wait_for(everything_final, timeout=timeout, message=describe)
    with connection.cursor() as cursor:
        assert audit.ledger_duplicates(cursor, ids) == []
        assert audit.outcome_mismatches(cursor, ids) == []
        return audit.by_state(cursor, ids)


def mixed_jobs(n: int, seed: int) -> list[Act]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.05:
            items.append(Act(action="raise"))  # exhausts after 3 attempts
        elif roll < 0.20:
            items.append(Act(action="ok", fail_until=1))
        else:
            items.append(Act(action="sleep", seconds=rng.choice([0.0, 0.01, 0.05])))
    return items


def enqueue_mixed(n: int, seed: int, max_attempts: int = 10) -> list[int]:
    items = mixed_jobs(n, seed)
    requests = [
        awa.EnqueueRequest(a, max_attempts=3 if a.action == "raise" else max_attempts)
        for a in items
    ]
    return awa.enqueue_many(requests)


# -- (a) connections terminated --------------------------------------------------------


def test_terminated_connections_lose_nothing_and_the_worker_reconnects(start_worker):
    ids = enqueue_mixed(600, seed=1)
    worker = start_worker("--queue", "default=8", "--queue", "echo=4")
    terminated = 0
    for _ in range(5):
        wait_for(lambda: "job " in worker.output() or worker.proc.poll() is not None, timeout=20)
        time.sleep(0.6)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            terminated += cursor.fetchone()[0]
    assert worker.proc.poll() is None, worker.output()[-3000:]
    assert terminated >= 5
    states = run_audit(ids, timeout=150)
    assert sum(states.values()) == 600
    assert set(states) <= {"completed", "failed"}
    log = worker.output()
    assert "reconnect" in log.lower(), log[-3000:]


# -- (b) SIGKILL of one of two workers ------------------------------------------------


def test_sigkill_of_one_of_two_workers_repeatedly(start_worker):
    ids = enqueue_mixed(400, seed=2)
    steady = start_worker("--queue", "default=6", "--queue", "echo=4")
    kills = 0
    victim = start_worker("--queue", "default=6", "--queue", "echo=4")
    for _ in range(4):
        # Let it start, claim and run for a moment, then kill it mid-flight. (Not
        # "wait for a job line": once the steady worker has drained the failing
        # jobs, a new victim may never log one.)
        wait_for(lambda v=victim: "starting" in v.output(), timeout=20)
        time.sleep(random.uniform(0.3, 1.2))
        victim.signal(signal.SIGKILL)
        victim.wait()
        kills += 1
        victim = start_worker("--queue", "default=6", "--queue", "echo=4")
    assert kills == 4
    states = run_audit(ids, timeout=180)
    assert sum(states.values()) == 400
    assert steady.proc.poll() is None


# -- (c) restart of a private PostgreSQL server --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateServer:
    """initdb + pg_ctl from the system PostgreSQL 15, on its own port and data dir.

    As root, the server runs as the ``postgres`` system user (initdb refuses root).
    """

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="awa-faults-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nfsync = off\nmax_connections = 100\n"
            )

    def _run(self, *cmd: Any) -> None:
        subprocess.run(
            [*self.as_user, *map(str, cmd)], check=True, capture_output=True, timeout=120
        )

    def start(self) -> None:
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-l", self.dir / "log", "-w", "start")

    def stop(self) -> None:
        self.pg_ctl("stop")

    def pg_ctl(self, action: str) -> None:
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", "fast", "-w", action)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_server() -> Iterator[PrivateServer]:
    if not (PG_BIN / "pg_ctl").exists():
        pytest.skip(f"no PostgreSQL binaries in {PG_BIN}")
    server = PrivateServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


def _django(url: str, *args: str, **popen: Any) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    env.update(
        DATABASE_URL=url,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return subprocess.Popen([sys.executable, "-m", "django", *args], cwd=ROOT, env=env, **popen)


ENQUEUER = r"""
import sys, time, django
django.setup()
from django.db import InterfaceError, OperationalError, connection, transaction
import django_awa as awa
from tests.testapp.jobs import Act
from tests.testapp.models import Order

ok = refused = 0
other = []
deadline = time.monotonic() + float(sys.argv[1])
n = 0
while time.monotonic() < deadline:
    n += 1
    try:
        with transaction.atomic():
            order = Order.objects.create(reference=f"ref-{n}")
            awa.enqueue(Act(action="ok", tag=f"order:{order.id}"), max_attempts=10)
        ok += 1
    except (OperationalError, InterfaceError):
        refused += 1
        connection.close()
        time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - reported, makes the test fail
        other.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
        connection.close()
    time.sleep(0.005)
print(f"RESULT ok={ok} refused={refused} other={len(other)}")
for line in other[:20]:
    print("OTHER", line)
"""


def test_postgresql_restart_mid_run(private_server: PrivateServer, tmp_path: Path) -> None:
    url = private_server.url("awa_restart")
    with psycopg.connect(private_server.url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE awa_restart")
    # tests.testapp has no migrations: --run-syncdb creates its tables (Ledger, Order).
    migrate = _django(
        url, "migrate", "--run-syncdb", "-v0", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out, _ = migrate.communicate(timeout=120)
    assert migrate.returncode == 0, out.decode(errors="replace")

    with psycopg.connect(url, autocommit=True) as conn:
        # 500 jobs before the worker starts, inserted directly (the test's own
        # Django connection points at the shared server, not this one).
        conn.execute(
            "INSERT INTO awa_job (kind, queue, args, max_attempts) "
            "SELECT 'act', 'default', jsonb_build_object('action', 'sleep', 'seconds', 0.02), 10 "
            "FROM generate_series(1, 500)"
        )
    log = (tmp_path / "worker.log").open("wb")
    worker = _django(
        url,
        "awa_worker",
        "--queue",
        "default=8",
        "--queue",
        "echo=4",
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    enqueuer_out = tmp_path / "enqueuer.log"
    try:
        enqueuer = subprocess.Popen(
            [sys.executable, "-c", ENQUEUER, "12"],
            cwd=ROOT,
            env={
                **{k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"},
                "DATABASE_URL": url,
                "DJANGO_SETTINGS_MODULE": "tests.settings",
            },
            stdout=enqueuer_out.open("wb"),
            stderr=subprocess.STDOUT,
        )

        def completed() -> int:
            with psycopg.connect(url) as conn:
                return conn.execute(
                    "SELECT count(*) FROM awa_job WHERE state = 'completed'"
                ).fetchone()[0]

        wait_for(lambda: completed() >= 50, timeout=60)
        # Down for a couple of seconds, in the middle of the run, while the
        # enqueuer keeps writing orders with their jobs.
        private_server.pg_ctl("stop")
        time.sleep(2.0)
        private_server.start()
        enqueuer.wait(timeout=60)
        result = enqueuer_out.read_text(errors="replace")
        assert "RESULT" in result and "other=0" in result, result
        refused = int(result.split("refused=")[1].split()[0])
        assert refused > 0, result  # it saw the outage as OperationalError/InterfaceError
        print(f"enqueuer during the restart: {result.strip()}")  # noqa: T201

        def left() -> int:
            with psycopg.connect(url) as conn:
                return conn.execute(
                    "SELECT count(*) FROM awa_job "
                    "WHERE state NOT IN ('completed', 'failed', 'cancelled')"
                ).fetchone()[0]

        wait_for(lambda: left() == 0, timeout=120, message=lambda: f"{left()} jobs not final")
        with psycopg.connect(url) as conn:
            cur = conn.cursor()
            # Every order has its job and every enqueued job its order: never half-written.
            orphans = cur.execute(
                "SELECT count(*) FROM testapp_order o WHERE NOT EXISTS (SELECT 1 FROM awa_job j "
                "WHERE j.kind = 'act' AND j.args ->> 'tag' = 'order:' || o.id)"
            ).fetchone()[0]
            jobless = cur.execute(
                "SELECT count(*) FROM awa_job j WHERE j.args ->> 'tag' LIKE 'order:%%' "
                "AND NOT EXISTS (SELECT 1 FROM testapp_order o "
                "WHERE j.args ->> 'tag' = 'order:' || o.id)"
            ).fetchone()[0]
            assert (orphans, jobless) == (0, 0)
            ids = [r[0] for r in cur.execute("SELECT id FROM awa_job WHERE kind = 'act'")]
            assert audit.ledger_duplicates(cur, ids) == []
            assert audit.outcome_mismatches(cur, ids) == []
            states = audit.by_state(cur, ids)
        assert states.get("completed", 0) >= 500
        assert worker.poll() is None
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        log.close()
        print((tmp_path / "worker.log").read_text(errors="replace")[-4000:])  # noqa: T201
    text = (tmp_path / "worker.log").read_text(errors="replace").lower()
    assert "reconnect" in text or "lost" in text
