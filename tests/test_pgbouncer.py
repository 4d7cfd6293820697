"""Enqueueing and workers through PgBouncer in transaction pooling mode.

LISTEN and the leader's session lock need a direct session: with
``AWA["DIRECT_DATABASE"]`` naming a direct alias the worker listens there
(NOTIFY sent through the pooler still wakes it); with ``None`` it polls and
takes a transaction-level lock per maintenance tick.
"""

from __future__ import annotations

import datetime as dt
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from django_awa.models import Job, JobState
from tests.conftest import ROOT, wait_for, wait_for_state
from tests.testapp.models import Order

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not os.path.exists(PGBOUNCER) and not os.environ.get("CI"),
        reason="PgBouncer is not installed (apt-get install pgbouncer)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def pooled_url(request, transactional_db) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the test database's server.

    ``@pytest.mark.pool_size(N)``: its server connections per database (40 unless told).
    """
    marker = request.node.get_closest_marker("pool_size")
    pool_size = marker.args[0] if marker else 40
    params = connection.settings_dict
    host = params["HOST"] or "/var/run/postgresql"
    port = params["PORT"] or 5432
    user = params["USER"] or "postgres"
    listen = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="awa-pgbouncer-"))
    workdir.chmod(0o777)
    config = workdir / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
* = host={host} port={port} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = any
pool_mode = transaction
max_client_conn = 500
default_pool_size = {pool_size}
ignore_startup_parameters = extra_float_digits,options
logfile = {workdir}/pgbouncer.log
pidfile = {workdir}/pgbouncer.pid
"""
    )
    config.chmod(0o644)
    # PgBouncer refuses to run as root; -u drops to another user: the owner of
    # the server's socket directory (the embedded server's), else postgres.
    owner = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "postgres"
    run_as = ["-u", owner] if os.geteuid() == 0 else []
    proc = subprocess.Popen([PGBOUNCER, *run_as, str(config)], stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _accepts(listen) or proc.poll() is not None, timeout=10)
        if proc.poll() is not None:
            raise AssertionError(f"pgbouncer exited: {proc.stderr.read().decode()}")
        yield f"postgresql://{user}@127.0.0.1:{listen}/{params['NAME']}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _pooled_env(url: str, **extra: str) -> dict[str, str]:
    return {
        "DJANGO_SETTINGS_MODULE": "tests.pooled_settings",
        "AWA_POOLED_URL": url,
        "AWA_TEST_DB_NAME": connection.settings_dict["NAME"],
        **extra,
    }


def _enqueue_through(url: str, code: str, **extra: str) -> str:
    """Run ``code`` (after django.setup()) in a process whose default alias is the pooler."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **_pooled_env(url, **extra)}
    script = "import django; django.setup()\n" + code
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


ENQUEUE = """
from django.db import transaction
import django_awa as awa
from tests.testapp.jobs import Act
for i in range(30):
    with transaction.atomic():
        awa.enqueue(Act(action="ok", tag=f"single-{i}"))
ids = awa.enqueue_many([Act(action="ok", tag=f"bulk-{i}") for i in range(120)])
print(len(ids))
"""


@pytest.mark.slow
def test_enqueue_and_work_through_pgbouncer_with_a_direct_listen_connection(
    pooled_url, start_worker
):
    assert _enqueue_through(pooled_url, ENQUEUE).strip() == "120"
    assert Job.objects.filter(kind="act").count() == 150
    # A long poll interval: only NOTIFY (sent through the pooler, heard on the
    # direct connection) can wake the worker quickly.
    worker = start_worker(
        "--queue", "default=4", env=_pooled_env(pooled_url, AWA_TEST_POLL_INTERVAL="30")
    )
    wait_for(
        lambda: Job.objects.filter(kind="act", state=JobState.COMPLETED).count() == 150, timeout=60
    )
    wait_for(lambda: "is now the maintenance leader" in worker.output(), timeout=10)
    started = time.monotonic()
    _enqueue_through(
        pooled_url, ENQUEUE.replace("range(30)", "range(1)").replace("range(120)", "range(0)")
    )
    newest = Job.objects.filter(kind="act").order_by("-id").first()
    wait_for_state(newest.id, JobState.COMPLETED, timeout=10)
    assert time.monotonic() - started < 10  # not the 30 s poll
    assert "LISTENs through the pooler" not in worker.output()


def test_a_listener_left_on_the_pooler_is_warned_about(pooled_url, start_worker):
    worker = start_worker(
        "--queue", "default=2", env=_pooled_env(pooled_url, AWA_TEST_DIRECT="pooler")
    )
    wait_for(lambda: "listening for new jobs" in worker.output(), timeout=30)
    assert "the listener LISTENs through the pooler in front of database 'default'" in (
        worker.output()
    )
    assert "AWA['DIRECT_DATABASE']" in worker.output()


@pytest.mark.slow
def test_without_a_direct_connection_the_worker_polls_and_still_maintains(pooled_url, start_worker):
    _enqueue_through(pooled_url, ENQUEUE)
    worker = start_worker(
        "--queue",
        "default=4",
        env=_pooled_env(pooled_url, AWA_TEST_DIRECT="none", AWA_TEST_POLL_INTERVAL="0.3"),
    )
    wait_for(
        lambda: Job.objects.filter(kind="act", state=JobState.COMPLETED).count() == 150, timeout=60
    )
    assert "polling every 0.3s instead of LISTEN" in worker.output()
    # Maintenance runs under a per-tick transaction lock: a scheduled job is promoted.
    _enqueue_through(
        pooled_url,
        "import django_awa as awa, datetime as dt\n"
        "from django.utils import timezone\n"
        "from tests.testapp.jobs import Act\n"
        "print(awa.enqueue(Act(action='ok', tag='later'),"
        " run_at=timezone.now() + dt.timedelta(seconds=1)).id)",
    )
    later = Job.objects.get(args__tag="later")
    assert later.state == JobState.SCHEDULED and later.run_at > timezone.now() - dt.timedelta(1)
    wait_for_state(later.id, JobState.COMPLETED, timeout=15)


@pytest.mark.slow
@pytest.mark.pool_size(10)
def test_orm_handlers_share_the_poolers_server_connections(pooled_url, start_worker):
    # 30 handler threads and 4 engine threads reading and updating rows
    # through the pooler, whose 10 server connections they share.
    Order.objects.bulk_create([Order(reference=f"o{i}") for i in range(120)])
    code = (
        "import django_awa as awa\n"
        "from tests.testapp.jobs import Touch\n"
        "awa.enqueue_many([Touch(reference=f'o{i}', hold=0.05) for i in range(120)])"
    )
    _enqueue_through(pooled_url, code)
    worker = start_worker("--queue", "orm=30", env=_pooled_env(pooled_url))
    name = connection.settings_dict["NAME"]
    most = 0

    def finished() -> bool:
        nonlocal most
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [name])
            most = max(most, cursor.fetchone()[0])
        return Job.objects.filter(kind="touch", state=JobState.COMPLETED).count() == 120

    wait_for(finished, timeout=60)
    assert set(Job.objects.filter(kind="touch").values_list("attempt", flat=True)) == {1}
    assert Order.objects.filter(paid=True).count() == 120
    # The pooler's 10, the worker's LISTEN connection and this test's own.
    assert most <= 12, most
    port = pooled_url.rsplit(":", 1)[1].split("/")[0]
    assert (
        "up to 35 connections (30 handler threads + 4 for the engine + 1 LISTEN), to a "
        f"pooler in front of the server (port {port}; the server's is " in worker.output()
    )


# Flow control through the pooler: the limited claim's advisory lock is
# transaction-scoped, so it holds however PgBouncer hands out server sessions.


@pytest.mark.slow
def test_global_concurrency_holds_through_pgbouncer(pooled_url, start_worker):
    from tests.test_flow_control import FLOW_ENV, run_global_concurrency

    def start(*args: str, env: dict[str, str] | None = None):
        return start_worker(*args, env={**_pooled_env(pooled_url), **FLOW_ENV, **(env or {})})

    run_global_concurrency(start)


@pytest.mark.slow
def test_rate_limit_holds_through_pgbouncer(pooled_url, start_worker):
    from tests.test_flow_control import FLOW_ENV, run_rate_limit

    def start(*args: str, env: dict[str, str] | None = None):
        return start_worker(*args, env={**_pooled_env(pooled_url), **FLOW_ENV, **(env or {})})

    run_rate_limit(start)


def test_a_sequence_hands_on_member_after_member_through_pgbouncer(pooled_url, start_worker):
    # The statement that writes a member's outcome claims the next one, without
    # prepared statements (AWA["PREPARED_STATEMENTS"] off, as PgBouncer 1.18 needs).
    from tests.test_flow_control import run_sequence_hand_on

    def start(*args: str, env: dict[str, str] | None = None):
        return start_worker(*args, env={**_pooled_env(pooled_url), **(env or {})})

    run_sequence_hand_on(start)


@pytest.mark.slow
@pytest.mark.pool_size(3)
def test_a_callback_registered_apart_leaves_no_setting_on_the_poolers_sessions(
    pooled_url, start_worker
):
    # An atomic handler's callback id is stored apart, on a connection of its own
    # through the pooler, waiting at most a second for the row. Set for the session,
    # that lock_timeout stayed on the server connection PgBouncer then handed to every
    # other client: their statements gave up on any lock after a second.
    worker = start_worker("--queue", "default=2", env=_pooled_env(pooled_url))
    out = _enqueue_through(
        pooled_url,
        "import django_awa as awa\n"
        "from tests.testapp.jobs import AtomicEarlyAnswer\n"
        "print(awa.enqueue(AtomicEarlyAnswer(touch_row=True)).id)",
    )
    wait_for_state(int(out), JobState.WAITING_EXTERNAL, timeout=30)
    assert worker.stop() == 0
    # Each of the pooler's 3 server connections, held at once by a client's transaction.
    clients = [psycopg.connect(pooled_url, autocommit=False) for _ in range(3)]
    try:
        seen = [c.execute("SHOW lock_timeout").fetchone()[0] for c in clients]
    finally:
        for client in clients:
            client.close()
    assert seen == ["0", "0", "0"], seen


@pytest.mark.slow
@pytest.mark.pool_size(2)
def test_atomic_handlers_registering_callbacks_do_not_wait_on_the_poolers_sessions(
    pooled_url, start_worker
):
    # Two atomic handlers, each in a transaction holding one of the pooler's two server
    # connections, store their callback ids apart: through the pooler each waited for a
    # server connection the other held (PgBouncer's query_wait_timeout, 2 minutes), and
    # the worker's heartbeat and completer with them. They go to DIRECT_DATABASE now.
    worker = start_worker("--queue", "default=2", env=_pooled_env(pooled_url))
    wait_for(lambda: "listening for new jobs" in worker.output(), timeout=30)
    _enqueue_through(
        pooled_url,
        "import django_awa as awa\n"
        "from tests.testapp.jobs import AtomicEarlyAnswer\n"
        "awa.enqueue_many([AtomicEarlyAnswer(touch_row=True) for _ in range(2)])",
    )
    wait_for(lambda: Job.objects.filter(state=JobState.WAITING_EXTERNAL).count() == 2, timeout=20)
    assert set(Job.objects.values_list("attempt", flat=True)) == {1}
