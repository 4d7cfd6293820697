"""Fixtures: real worker processes on the test database, and waiting helpers."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management.color import Style
from django.db import connection
from django.db.backends.postgresql.operations import DatabaseOperations
from django.utils import timezone
from psycopg import sql as pgsql

from django_awa.models import Job
from tests.testapp.followups import CALLS, FAIL

ROOT = Path(__file__).resolve().parent.parent

# The fixtures django-awa ships for its users' own pytest-django suites.
pytest_plugins = ["django_awa.testing.pytest"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``AWA_SLOW_TESTS=0`` skips the tests marked ``slow`` (faults of real workers, handlers
    outlasting ``STALE_AFTER`` or their timeout, soaks, several workers holding a limit
    together, the pooler, the upgrade, the demo and the docs build, several seconds each):
    ``.ci/run`` runs them in the first of its three test runs only. By default they run."""
    if os.environ.get("AWA_SLOW_TESTS", "1") != "0":
        return
    skip = pytest.mark.skip(reason="slow: AWA_SLOW_TESTS=0 (.ci/run runs it in its first run)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Of the tables Django's flush names: the rows post_migrate writes back after each flush
# (content types, permissions: a hundred or so) are deleted; the tables written since the
# last flush (a page on disk, dead rows included, in the table or one inheriting from it,
# as awa_job_done and its segments do from awa_job) are truncated, with the listed tables
# referencing them. Empty tables are left alone: truncating a table rebuilds (and syncs to
# disk) each of its indexes, which made the flush of every table most of the cost of a
# transactional test's teardown.
FLUSH_WRITTEN_TABLES = """
DO $flush$
DECLARE
    written text;
    refilled_table regclass;
BEGIN
    WITH RECURSIVE listed(oid) AS (
        SELECT unnest(ARRAY[%(tables)s]::regclass[])
    ), refilled(oid) AS (
        SELECT unnest(ARRAY[%(refilled)s]::regclass[])
    ), descendant(head, oid) AS (
        SELECT oid, oid FROM listed
        UNION
        SELECT descendant.head, inherits.inhrelid
        FROM pg_inherits inherits JOIN descendant ON inherits.inhparent = descendant.oid
    ), flushed(oid) AS (
        SELECT head FROM descendant
        WHERE pg_relation_size(oid) > 0 AND head NOT IN (SELECT oid FROM refilled)
        UNION
        SELECT constraint_.conrelid
        FROM pg_constraint constraint_ JOIN flushed ON constraint_.confrelid = flushed.oid
        WHERE constraint_.contype = 'f' AND constraint_.conrelid IN (SELECT oid FROM listed)
    )
    SELECT string_agg(oid::regclass::text, ', ') INTO written FROM flushed;
    IF written IS NOT NULL THEN
        EXECUTE 'TRUNCATE ' || written%(cascade)s;
    END IF;
    FOREACH refilled_table IN ARRAY ARRAY[%(refilled)s]::regclass[] LOOP
        EXECUTE format('DELETE FROM %%s', refilled_table);
    END LOOP;
END
$flush$
"""


@pytest.fixture(autouse=True, scope="session")
def _flush_written_tables_only() -> Iterator[None]:
    """Each transactional test ends with Django's flush: it leaves the tables as Django's
    own does (every row gone, none of the awa tables with a dead row, sequences untouched,
    ``post_migrate`` emitted after), in a fraction of the time."""
    django_sql_flush = DatabaseOperations.sql_flush
    # Referencing tables first: their foreign keys are checked as each DELETE ends.
    refilled = [Permission._meta.db_table, ContentType._meta.db_table]

    def sql_flush(
        ops: DatabaseOperations,
        style: Style,
        tables: list[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or not set(refilled) <= set(tables):
            return django_sql_flush(
                ops, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )

        def literals(names: list[str]) -> str:
            return ", ".join("'{}'".format(ops.quote_name(n).replace("'", "''")) for n in names)

        return [
            FLUSH_WRITTEN_TABLES
            % {
                "tables": literals(tables),
                "refilled": literals(refilled),
                "cascade": " || ' CASCADE'" if allow_cascade else "",
            }
        ]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DatabaseOperations, "sql_flush", sql_flush)
        yield


class WorkerProcess:
    """``python -m django awa_worker`` on the test database; reaped at teardown."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "django", "awa_worker", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed whole in close()
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 20) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float = 20) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker did not exit in {timeout}s:\n{self.output()}") from None

    def close(self) -> None:
        # An --reload worker runs in a session of its own, out of this group.
        children = children_of(self.proc.pid)
        self.kill()
        # --processes children too, should any outlive their supervisor.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self._log.close()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def start_worker(transactional_db: Any, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "tests.settings"),
            "AWA_TEST_DB_NAME": connection.settings_dict["NAME"],
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        }
        worker = WorkerProcess(
            list(args) or ["--queue", "default"], full_env, tmp_path / f"worker{len(started)}.log"
        )
        started.append(worker)
        return worker

    yield start
    for i, worker in enumerate(started):
        worker.close()
        # Shown by pytest only when the test failed.
        print(f"--- worker {i} (pid {worker.pid}) output ---\n{worker.output()[-6000:]}")  # noqa: T201


def connect_to(dbname: str, user: str | None = None) -> psycopg.Connection[Any]:
    """A psycopg connection to ``dbname`` on the test server, in autocommit (as
    ``user``, else the tests' own)."""
    s = connection.settings_dict
    django_only = {"isolation_level", "server_side_binding", "pool", "assume_role"}
    options = {k: v for k, v in s["OPTIONS"].items() if k not in django_only}
    return psycopg.connect(
        dbname=dbname,
        host=s["HOST"] or None,
        port=s["PORT"] or None,
        user=user or s["USER"] or None,
        password=None if user else s["PASSWORD"] or None,
        autocommit=True,
        **options,
    )


@contextlib.contextmanager
def scratch_database(suffix: str) -> Iterator[str]:
    """A new empty database on the test server, named after the test database and
    ``suffix``; dropped afterwards."""
    name = f"{connection.settings_dict['NAME']}_{suffix}"
    ident = pgsql.Identifier(name)
    with connect_to(connection.settings_dict["NAME"]) as admin:
        admin.execute(pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(ident))
    try:
        yield name
    finally:
        with connect_to(connection.settings_dict["NAME"]) as admin:
            admin.execute(pgsql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def wait_for(
    predicate: Callable[[], Any], timeout: float = 15, message: str | Callable[[], str] = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s waiting: {text}")
        time.sleep(0.05)


def wait_for_state(job_id: int, state: str | tuple[str, ...], timeout: float = 15) -> Job:
    """Poll until job ``job_id`` is in ``state``; fail showing its last state and errors."""
    states = (state,) if isinstance(state, str) else state
    last: dict[str, Job | None] = {"job": None}

    def check() -> Job | None:
        job = Job.objects.filter(id=job_id).first()
        last["job"] = job
        return job if job is not None and job.state in states else None

    def describe() -> str:
        job = last["job"]
        if job is None:
            return f"job {job_id} does not exist"
        return f"job {job_id} is {job.state} (wanted {states}), errors={job.errors}"

    return wait_for(check, timeout, describe)


@pytest.fixture(autouse=True)
def _reset_followup_switches() -> Iterator[None]:
    saved = dict(FAIL)
    yield
    FAIL.clear()
    FAIL.update(saved)
    CALLS["rescued"] = 0


def make_job(**fields: Any) -> Job:
    """A row in any state, e.g. ``make_job(state="running", heartbeat_at=old)``."""
    fields.setdefault("kind", "act")
    fields.setdefault("queue", "default")
    fields.setdefault("args", {"action": "ok"})
    return Job.objects.create(**fields)


def due_job(**fields: Any) -> Job:
    """An available job due a second ago: in a test's transaction, now() is when it began."""
    return make_job(run_at=timezone.now() - dt.timedelta(seconds=1), **fields)


def as_prepared(statement: str) -> tuple[str, list[str]]:
    """``statement`` as psycopg prepares it, ``$n`` for each ``%(name)s``, and the names
    in the order of their numbers."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    for number, name in enumerate(names, 1):
        statement = statement.replace(f"%({name})s", f"${number}")
    return statement, names


def generic_plan(statement: str, params: dict[str, Any]) -> str:
    """``EXPLAIN`` of ``statement`` prepared and planned for any parameters (the plan
    PostgreSQL may keep for a prepared statement after its fifth run)."""
    text, names = as_prepared(statement)
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute("PREPARE awa_generic AS " + text)
            cursor.execute(
                f"EXPLAIN EXECUTE awa_generic({', '.join(['%s'] * len(names))})",
                [params[name] for name in names],
            )
            return "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE awa_generic")
            cursor.execute("RESET plan_cache_mode")
