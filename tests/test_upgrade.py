"""Rolling upgrades: the previous release and this one on one database.

The previous release comes from git history (``git archive`` of its commit),
so these tests need a full clone. On a database of its own, created and
dropped here:

1. the previous release migrates, enqueues a mix of jobs and starts a worker;
2. while that worker runs live jobs (running, available, scheduled and
   retryable ones), this release's ``migrate`` runs, bounded by a timeout,
   and the old worker keeps going, through this release's enqueues too;
3. a worker of this release starts beside it, a column and an index are added
   to ``awa_job`` under both (what an additive migration does), and both
   releases enqueue more: failing, retried, exhausted, cancelled, snoozed,
   parked and atomic jobs with follow-ups, and unique jobs the other release
   must refuse as duplicates; the new worker is stopped mid-job and the old one
   retries the attempts it interrupted;
4. the old worker is stopped with SIGTERM while it runs jobs of this release,
   which it gives back; a worker of this release takes its place and finishes
   everything.

Counted in SQL at the end: every job and follow-up final, no handler run twice
in one attempt, every committed outcome with exactly its follow-ups
(``stress/audit.py``), each worker ran jobs the other release enqueued and
retried attempts the other started. Handler runs are attributed to a release
by the ``application_name`` of the connection that wrote the ``Ledger`` row.

``test_migrations_since_the_previous_release_are_online`` checks the SQL of
every migration added since that release against what a rolling upgrade can
take (no drops, renames, type changes, table scans under an exclusive lock).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.contrib.postgres.functions import RandomUUID
from django.contrib.postgres.operations import AddIndexConcurrently
from django.core.management import call_command
from django.db import connection, migrations, models
from django.db.migrations.loader import MigrationLoader
from django.db.models.functions import Now

from django_awa import sql
from stress import audit
from tests.conftest import ROOT, WorkerProcess, connect_to, scratch_database, wait_for

PREVIOUS_RELEASE = "0.1.0"
PREVIOUS_COMMIT = "2526d2ee4cace4998d05fa39d0525ec7e14e2f59"

OLD, NEW = "awa-old", "awa-new"  # application_name of each release's connections
WORKER_ARGS = ("--queue", "default=4", "--queue", "echo=4", "--shutdown-timeout", "0.5")
MIGRATE_TIMEOUT = 60.0
DATABASE_TROUBLE = re.compile(
    r"psycopg|OperationalError|ProgrammingError|InterfaceError|DatabaseError|IntegrityError"
    r"|reconnect|cached plan",
    re.IGNORECASE,
)


# -- the previous release, from git ------------------------------------------------------


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.fail("the upgrade tests need git, to read the previous release from history")


def _require_previous_commit() -> None:
    found = _git("cat-file", "-e", f"{PREVIOUS_COMMIT}^{{commit}}")
    if found.returncode != 0:
        pytest.fail(
            f"release {PREVIOUS_RELEASE} (commit {PREVIOUS_COMMIT}) is not in this "
            f"repository's history: the upgrade tests need a full clone, not a shallow "
            f"one (git fetch --unshallow). git said: "
            f"{found.stderr.decode(errors='replace').strip()}"
        )


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's django_awa, tests and stress, extracted from git."""
    _require_previous_commit()
    archive = _git("archive", "--format=tar", PREVIOUS_COMMIT, "django_awa", "tests", "stress")
    assert archive.returncode == 0, archive.stderr.decode(errors="replace")
    target = tmp_path_factory.mktemp(f"awa-{PREVIOUS_RELEASE}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    return target


def _migration_names(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("[0-9][0-9][0-9][0-9]_*.py"))


# -- processes of one release --------------------------------------------------------------

ENQUEUE = r"""
import json, sys
from datetime import timedelta
import django
django.setup()
from django.db import transaction
from django.utils import timezone
import django_awa as awa
import tests.settings
from tests.testapp.jobs import Act, Parked, Pay

KINDS = {"act": Act, "parked": Parked, "pay": Pay}

def options(item):
    opts = dict(item.get("options", {}))
    if "delay" in opts:
        opts["run_at"] = timezone.now() + timedelta(seconds=opts.pop("delay"))
    if opts.pop("unique", False):
        opts["unique"] = awa.Unique(by_args=True)
    return opts

result = []
for group in json.load(sys.stdin):
    jobs = [(KINDS[i["kind"]](**i["args"]), options(i)) for i in group["items"]]
    if group.get("single"):
        with transaction.atomic():
            result.append([awa.enqueue(args, **opts).id for args, opts in jobs])
    else:
        result.append(awa.enqueue_many([awa.EnqueueRequest(a, **o) for a, o in jobs]))
print(json.dumps({"ids": result, "code": [awa.__file__, tests.settings.__file__]}))
"""


@dataclass(frozen=True)
class Release:
    """Run Django commands with one release's code on the upgrade database."""

    name: str  # also the application_name of its connections
    root: Path  # holds its django_awa, tests and stress
    database: str

    def env(self, role: str = "") -> dict[str, str]:
        """Environment of its processes; only its workers connect as ``self.name``."""
        url = os.environ["DATABASE_URL"]
        app = f"{self.name}-{role}" if role else self.name
        return {
            **os.environ,
            # Only this release's tree on the path: PYTHONSAFEPATH keeps the
            # working directory (this checkout) off sys.path.
            "PYTHONPATH": str(self.root),
            "PYTHONSAFEPATH": "1",
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "AWA_TEST_DB_NAME": self.database,
            "DATABASE_URL": f"{url}{'&' if '?' in url else '?'}application_name={app}",
        }

    def run(self, what: str, *args: str, stdin: str = "", timeout: float = 120) -> str:
        """``python ARGS`` with this release's code; its stdout. Fails on an error or timeout."""
        try:
            done = subprocess.run(
                [sys.executable, *args],
                cwd=self.root,
                env=self.env(role=what),
                input=stdin.encode(),
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            pytest.fail(
                f"{self.name}: {what} did not finish in {timeout}s:\n"
                f"{out.decode(errors='replace')[-4000:]}"
            )
        output = done.stdout.decode(errors="replace")
        errors = done.stderr.decode(errors="replace")
        assert done.returncode == 0, f"{self.name}: {what} failed:\n{output}\n{errors[-4000:]}"
        return output

    def start(self, role: str, *args: str) -> subprocess.Popen[bytes]:
        """``python ARGS`` with this release's code, in the background; its output, stdout
        and stderr together, read by ``communicate()``."""
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=self.root,
            env=self.env(role=role),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def migrate(self, timeout: float = 120) -> float:
        """``migrate`` (plus the test app's tables); returns how long it took."""
        started = time.monotonic()
        self.run(
            "migrate",
            "-m",
            "django",
            "migrate",
            "--run-syncdb",
            "--no-input",
            "-v0",
            timeout=timeout,
        )
        return time.monotonic() - started

    def enqueue(self, *groups: dict[str, Any]) -> list[list[int]]:
        """Enqueue groups of jobs (``{"items": [...], "single": bool}``); ids per group."""
        output = self.run("enqueue", "-c", ENQUEUE, stdin=json.dumps(list(groups)))
        result = json.loads(output.strip().splitlines()[-1])
        for path in result["code"]:  # this release's code, not the other's
            assert Path(path).resolve().is_relative_to(self.root.resolve()), result["code"]
        return result["ids"]

    def worker(self, start_worker: Callable[..., WorkerProcess], *more: str) -> WorkerProcess:
        return start_worker(*WORKER_ARGS, *more, env=self.env())


# -- the jobs ----------------------------------------------------------------------------


def act(n: int, options: dict[str, Any] | None = None, **args: Any) -> list[dict[str, Any]]:
    return [{"kind": "act", "args": args, "options": options or {}} for _ in range(n)]


def mix(batch: str, *, sleepers: int, delay: float) -> dict[str, Any]:
    """Every kind of outcome, with follow-ups. Failures come first so that they are
    claimed first and wait in ``retryable`` while the sleepers keep the queue busy."""
    return {
        "items": [
            *act(6, action="ok", fail_until=1, tag=batch),  # retried once, then completed
            *act(3, action="raise", tag=batch),  # exhausted after three attempts
            *act(2, action="cancel", tag=batch),
            *act(2, action="snooze", seconds=1, tag=batch),  # two runs in one attempt
            *act(3, {"delay": delay}, action="ok", tag=batch),  # scheduled
            *[{"kind": "parked", "args": {"timeout": 1}} for _ in range(2)],  # rescued twice
            *[{"kind": "pay", "args": {"reference": f"{batch}-{i}"}} for i in range(3)],
            {"kind": "pay", "args": {"reference": f"{batch}-declined", "fail": True}},
            *act(sleepers, action="sleep", seconds=0.1, tag=batch),
        ]
    }


def singles(batch: str) -> dict[str, Any]:
    """Jobs through ``awa.enqueue`` in one transaction (``mix`` uses ``enqueue_many``)."""
    return {"single": True, "items": act(2, action="ok", fail_until=1, tag=f"{batch}-single")}


def unique(owner: str) -> dict[str, Any]:
    """Two unique jobs; enqueued again by the other release, both are duplicates."""
    return {
        "items": [
            {"kind": "act", "args": {"tag": f"unique-{owner}-{i}"}, "options": {"unique": True}}
            for i in range(2)
        ]
    }


# -- the upgrade database ----------------------------------------------------------------


@pytest.fixture
def upgrade_db(transactional_db: Any) -> Iterator[str]:
    """A database of its own (the test database has this release's schema already)."""
    with scratch_database("upgrade") as name:
        yield name


class Upgrade:
    """Questions asked in SQL of the upgrade database."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def execute(self, statement: str) -> None:
        self.conn.execute(statement)

    def rows(self, statement: str, **params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(statement, params).fetchall()

    def value(self, statement: str, **params: Any) -> Any:
        return self.rows(statement, **params)[0][0]

    def snoozers(self, ids: list[int]) -> list[int]:
        return [
            r[0]
            for r in self.rows(
                "SELECT id FROM awa_job WHERE id = ANY(%(ids)s) AND args ->> 'action' = 'snooze'",
                ids=ids,
            )
        ]

    def move_finished(self) -> int:
        """Move finished rows into awa_job_done, as this release's maintenance does."""
        return self.conn.execute(sql.ARCHIVE_FINISHED, {"limit": 100_000}).rowcount

    def moved(self, ids: list[int]) -> int:
        return self.value("SELECT count(*) FROM ONLY awa_job_done WHERE id = ANY(%(ids)s)", ids=ids)

    def applied(self) -> list[str]:
        return sorted(
            r[0] for r in self.rows("SELECT name FROM django_migrations WHERE app = 'django_awa'")
        )

    def states(self, ids: list[int]) -> dict[str, int]:
        return audit.by_state(self.conn.cursor(), ids)

    def not_final(self, ids: list[int], followups: bool = False) -> list[tuple[Any, ...]]:
        cursor = self.conn.cursor()
        return audit.not_final(cursor, ids + (audit.followup_ids(cursor, ids) if followups else []))

    def failed_once(self, ids: list[int]) -> int:
        return self.value(
            "SELECT count(*) FROM awa_job WHERE id = ANY(%(ids)s) AND errors <> '[]'", ids=ids
        )

    def claiming(self, release: str) -> int:
        """Connections of ``release``'s worker that have queried awa_job (claims, say)."""
        return self.value(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(release)s "
            "AND datname = current_database() AND query LIKE '%%awa_job%%'",
            release=release,
        )

    def last_run(self) -> int:
        return self.value("SELECT coalesce(max(id), 0) FROM testapp_ledger")

    def runs(self, release: str, ids: list[int] | None = None, after: int = 0) -> int:
        """Handler runs by ``release``'s worker (of jobs ``ids``; after run ``after``)."""
        return self.value(
            "SELECT count(*) FROM testapp_ledger WHERE release = %(release)s AND id > %(after)s "
            "AND (%(ids)s::bigint[] IS NULL OR job_id = ANY(%(ids)s::bigint[]))",
            release=release,
            ids=ids,
            after=after,
        )

    def running_on(self, release: str, ids: list[int]) -> int:
        """Jobs of ``ids`` running now, in an attempt ``release``'s worker started."""
        return self.value(
            "SELECT count(*) FROM awa_job AS j JOIN testapp_ledger AS l "
            "ON l.job_id = j.id AND l.attempt = j.attempt "
            "WHERE j.id = ANY(%(ids)s) AND j.state = 'running' AND l.release = %(release)s",
            ids=ids,
            release=release,
        )

    def handovers(self, first: str, then: str) -> int:
        """Jobs with an attempt run by ``first``'s worker and the next by ``then``'s."""
        return self.value(
            "SELECT count(DISTINCT a.job_id) FROM testapp_ledger AS a JOIN testapp_ledger AS b "
            "ON b.job_id = a.job_id AND b.attempt = a.attempt + 1 "
            "WHERE a.release = %(first)s AND b.release = %(then)s",
            first=first,
            then=then,
        )


# -- the rolling upgrade -----------------------------------------------------------------


@pytest.mark.slow
def test_previous_release_and_this_one_share_a_live_database(
    previous_release: Path, upgrade_db: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    old = Release(OLD, previous_release, upgrade_db)
    new = Release(NEW, ROOT, upgrade_db)
    began = time.monotonic()
    with connect_to(upgrade_db) as conn:
        db = Upgrade(conn)
        by_old: list[int] = []  # ids of the jobs each release enqueued
        by_new: list[int] = []

        # 1. The previous release: its schema, its jobs, its worker.
        old.migrate()
        assert db.applied() == _migration_names(previous_release / "django_awa" / "migrations")
        # Who ran each handler: the application_name (OLD or NEW) of the connection.
        db.execute(
            "ALTER TABLE testapp_ledger "
            "ADD COLUMN release text DEFAULT current_setting('application_name')"
        )
        a_single, a_mix, old_unique = old.enqueue(
            singles("A"), mix("A", sleepers=100, delay=8), unique("old")
        )
        assert len(old_unique) == 2
        by_old += a_single + a_mix + old_unique
        # The old worker alone serves the handover queue until it is replaced (step 4).
        old_worker = old.worker(start_worker, "--queue", "handover=4")

        def live() -> dict[str, int] | None:
            states = db.states(by_old)
            busy = states.get("running", 0) and states.get("available", 0)
            waiting = states.get("scheduled", 0) + states.get("retryable", 0)
            return states if busy and waiting else None

        before = wait_for(live, 30, lambda: f"never live at once: {db.states(by_old)}")

        # 2. This release's migrate, under the old worker and its live jobs.
        took = new.migrate(timeout=MIGRATE_TIMEOUT)
        after = db.states(by_old)
        assert old_worker.proc.poll() is None, old_worker.output()[-3000:]
        assert db.applied() == _migration_names(ROOT / "django_awa" / "migrations")
        mark = db.last_run()
        b_single, b_mix, new_unique = new.enqueue(
            singles("B"), mix("B", sleepers=20, delay=2), unique("new")
        )
        assert len(new_unique) == 2
        by_new += b_single + b_mix + new_unique
        # Only the old worker runs: it takes this release's jobs, failures included.
        wait_for(
            lambda: db.runs(OLD, by_new, after=mark) >= 20 and db.failed_once(by_new),
            30,
            lambda: (
                f"old worker after migrate: {db.runs(OLD, after=mark)} runs; "
                f"jobs of this release: {db.states(by_new)}"
            ),
        )

        # 3. A worker of this release beside the old one.
        new_worker = new.worker(start_worker)
        wait_for(lambda: db.claiming(NEW), 30, "the new worker did not start claiming")
        # What an additive migration does, under both running workers (and their
        # prepared statements): a column neither release knows, an index built concurrently.
        db.execute("SET lock_timeout = '10s'")
        db.execute("ALTER TABLE awa_job ADD COLUMN upgrade_probe bigint DEFAULT 0 NOT NULL")
        db.execute("CREATE INDEX CONCURRENTLY awa_job_upgrade_probe ON awa_job (upgrade_probe)")
        probe = db.last_run()
        # Finished rows move into awa_job_done under both workers, as this release's
        # maintenance moves them: its worker leads by the lease while the old one leads
        # by its advisory lock, and may have moved them already. The old release reads
        # and prunes them there, through awa_job.
        db.move_finished()
        assert db.moved(by_old + by_new) > 0
        # Each release enqueues more, and refuses the other's unique jobs as duplicates.
        c_single, c_mix, c_dupes = old.enqueue(
            singles("C"), mix("C", sleepers=40, delay=2), unique("new")
        )
        d_single, d_mix, d_dupes = new.enqueue(
            singles("D"), mix("D", sleepers=40, delay=2), unique("old")
        )
        assert (c_dupes, d_dupes) == ([], [])
        by_old += c_single + c_mix
        by_new += d_single + d_mix

        def mixed() -> str:
            return (
                f"old ran {db.runs(OLD, by_new)} runs of new jobs, {db.runs(OLD, after=probe)} "
                f"since the probe; new ran {db.runs(NEW, by_old)} of old jobs, "
                f"{db.runs(NEW, after=probe)} since the probe; retries old->new "
                f"{db.handovers(OLD, NEW)}, new->old {db.handovers(NEW, OLD)}"
            )

        wait_for(
            lambda: (
                db.runs(NEW, by_old) and db.runs(OLD, after=probe) and db.runs(NEW, after=probe)
            ),
            30,
            mixed,
        )

        # The new worker is stopped mid-job (a restart during the rollout): the
        # attempts it interrupts, of jobs the old release enqueued, are retried by the
        # old worker, then running alone. Eight 2 s jobs: the old worker, with four
        # slots on the queue, leaves some to the new one.
        handback = old.enqueue({"items": act(8, action="progress", seconds=2, tag="handback")})[0]
        by_old += handback
        wait_for(lambda: db.running_on(NEW, handback), 20, mixed)
        new_worker.signal(signal.SIGTERM)
        assert new_worker.wait(30) == 0, new_worker.output()[-3000:]
        wait_for(lambda: db.handovers(NEW, OLD) and not db.not_final(handback), 30, mixed)

        # 4. Replace the old worker: SIGTERM it while it runs jobs of this release in a
        # queue only it serves (attempts it gives back), then start a worker of this
        # release serving every queue in its place.
        handover = new.enqueue(
            {"items": act(8, {"queue": "handover"}, action="progress", seconds=2, tag="handover")}
        )[0]
        by_new += handover
        wait_for(lambda: db.running_on(OLD, handover), 20, mixed)
        old_worker.signal(signal.SIGTERM)
        assert old_worker.wait(30) == 0, old_worker.output()[-3000:]
        replacement = new.worker(start_worker, "--queue", "handover=4")

        # The new worker finishes everything.
        everything = by_old + by_new
        wait_for(
            lambda: not db.not_final(everything, followups=True),
            60,
            lambda: f"not final: {db.not_final(everything, followups=True)[:10]}",
        )
        assert replacement.stop(30) == 0, replacement.output()[-3000:]
        # No database error on any side: schema changes under running workers (a
        # stale prepared plan, a lock) would show here even if a reconnect hid them.
        for worker in (old_worker, new_worker, replacement):
            assert not DATABASE_TROUBLE.search(worker.output()), worker.output()[-6000:]

        finished_by_new = _audit(db, everything, handover)
        summary = {
            "live before migrate": before,
            "after migrate": after,
            "migrate seconds": round(took, 2),
            "handler runs": dict(
                db.rows("SELECT release, count(*) FROM testapp_ledger GROUP BY 1")
            ),
            "old ran new-enqueued": db.runs(OLD, by_new),
            "new ran old-enqueued": db.runs(NEW, by_old),
            "retries old->new": db.handovers(OLD, NEW),
            "retries new->old": db.handovers(NEW, OLD),
            "given back by old, finished by new": finished_by_new,
            "jobs": db.states(everything),
            "in awa_job_done": db.moved(everything),
            "seconds": round(time.monotonic() - began, 1),
        }
        print(f"upgrade {PREVIOUS_RELEASE} -> this checkout: {summary}")  # noqa: T201
        assert all(
            summary[key]
            for key in (
                "old ran new-enqueued",
                "new ran old-enqueued",
                "retries old->new",
                "retries new->old",
            )
        )


# -- going back under running workers ----------------------------------------------------

# The last migration before completions went into segments (0016): where the
# README's "Going back" takes the schema.
BEFORE_SEGMENTS = "0015"


@pytest.mark.slow
def test_going_back_before_segments_under_this_releases_worker(
    upgrade_db: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    """``migrate django_awa 0015`` run while a worker of this release keeps going, as
    a rollback does before the workers are replaced: the worker's completions (written
    into ``awa_job_done_current``, which going back takes away) still commit, each
    job run once and completed at its first attempt; and the same again when the
    migrations are applied once more under it."""
    new = Release(NEW, ROOT, upgrade_db)
    with connect_to(upgrade_db) as conn:
        db = Upgrade(conn)
        new.migrate()
        worker = new.worker(start_worker)
        ids: list[int] = []

        def flow(tag: str) -> list[int]:
            batch = new.enqueue({"items": act(30, action="sleep", seconds=0.05, tag=tag)})[0]
            ids.extend(batch)
            return batch

        def settled() -> str:
            return f"{db.states(ids)}, not final: {db.not_final(ids, followups=True)[:5]}"

        flow("before")
        wait_for(lambda: db.last_run() >= 5, 30, settled)
        new.run(
            "migrate back",
            "-m",
            "django",
            "migrate",
            "django_awa",
            BEFORE_SEGMENTS,
            "--no-input",
            "-v0",
        )
        assert db.applied()[-1].startswith(BEFORE_SEGMENTS)
        assert (
            db.value("SELECT count(*) FROM pg_inherits WHERE inhparent = 'awa_job_done'::regclass")
            == 0
        )
        after_back = flow("after going back")
        wait_for(lambda: not db.not_final(ids, followups=True), 60, settled)
        # Completed where the earlier build reads finished rows: awa_job_done itself.
        assert db.moved(after_back) == len(after_back)

        new.migrate()  # forward again, under the same worker
        again = flow("forward again")
        wait_for(lambda: not db.not_final(ids, followups=True), 60, settled)
        assert db.value(
            "SELECT count(*) FROM awa_job "
            "WHERE id = ANY(%(ids)s) AND tableoid = 'awa_job_done_current'::regclass",
            ids=again,
        ) == len(again)
        assert worker.stop(30) == 0, worker.output()[-3000:]

        cursor = conn.cursor()
        everything = ids + audit.followup_ids(cursor, ids)
        assert db.states(everything) == {"completed": len(everything)}, worker.output()[-3000:]
        assert db.failed_once(everything) == 0, db.rows(
            "SELECT id, errors -> -1 ->> 'error' FROM awa_job "
            "WHERE id = ANY(%(ids)s) AND errors <> '[]' LIMIT 5",
            ids=everything,
        )
        assert audit.ledger_duplicates(cursor, everything) == []
        assert audit.outcome_mismatches(cursor, ids) == []
        assert not DATABASE_TROUBLE.search(worker.output()), worker.output()[-6000:]


@pytest.mark.slow
def test_going_back_keeps_a_completion_committed_while_it_runs(upgrade_db: str) -> None:
    """A completion written into ``awa_job_done_current`` while going back before 0016
    copies that table's rows out, and committed before it drops the table, is kept:
    going back locks each table before copying it, so the write is in the copy (it
    was lost with the table, the job and its follow-ups gone)."""
    new = Release(NEW, ROOT, upgrade_db)
    new.migrate()
    # Going back past 0017 first: its CREATE INDEX CONCURRENTLY would wait for the
    # completion's transaction by itself.
    new.run("back", "-m", "django", "migrate", "django_awa", "0016", "--no-input", "-v0")
    (job_id,) = new.enqueue({"items": act(1, action="ok", tag="late")})[0]
    with connect_to(upgrade_db) as conn, connect_to(upgrade_db) as writer:
        db = Upgrade(conn)
        # What a worker's completion does (sql.COMPLETE), left open.
        writer.autocommit = False
        writer.execute(
            "UPDATE awa_job SET state = 'completed', finalized_at = now() WHERE id = %(id)s",
            {"id": job_id},
        )
        writer.execute(
            "WITH gone AS (DELETE FROM ONLY awa_job WHERE id = %(id)s RETURNING *) "
            "INSERT INTO awa_job_done_current SELECT * FROM gone",
            {"id": job_id},
        )
        going_back = new.start(
            "back", "-m", "django", "migrate", "django_awa", BEFORE_SEGMENTS, "--no-input", "-v0"
        )
        try:
            # Going back waits for the completion's lock (before the fix: to drop
            # the table, having copied it without the uncommitted row).
            wait_for(
                lambda: (
                    db.value(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(app)s "
                        "AND wait_event_type = 'Lock'",
                        app=f"{NEW}-back",
                    )
                    or going_back.poll() is not None
                ),
                30,
                "going back never waited for the completion's lock",
            )
            writer.commit()
            out, _ = going_back.communicate(timeout=60)
        finally:
            if going_back.poll() is None:
                going_back.kill()
                going_back.wait()
        assert going_back.returncode == 0, out.decode(errors="replace")
        assert db.applied()[-1].startswith(BEFORE_SEGMENTS)
        assert db.rows(
            "SELECT tableoid::regclass::text, state FROM awa_job WHERE id = %(id)s", id=job_id
        ) == [("awa_job_done", "completed")]


@pytest.mark.slow
def test_an_index_build_interrupted_and_run_again_is_valid(upgrade_db: str) -> None:
    """``migrate`` interrupted while it builds an index ``CONCURRENTLY`` (0013's first,
    here, cancelled while it waits for a transaction writing ``awa_job_done``) and run
    again, as the README says to, leaves every index valid: the build leaves an
    invalid index of that name behind, which ``IF NOT EXISTS`` alone took for built
    (the migration recorded as applied, the index never used)."""
    new = Release(NEW, ROOT, upgrade_db)
    new.run("to 0012", "-m", "django", "migrate", "django_awa", "0012", "--no-input", "-v0")
    with connect_to(upgrade_db) as conn, connect_to(upgrade_db) as writer:
        db = Upgrade(conn)
        writer.autocommit = False
        writer.execute("INSERT INTO awa_job_done SELECT * FROM ONLY awa_job WHERE false")
        interrupted = new.start(
            "0013", "-m", "django", "migrate", "django_awa", "0013", "--no-input"
        )
        try:
            wait_for(
                lambda: db.value(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(app)s "
                    "AND wait_event_type = 'Lock' AND query LIKE 'CREATE INDEX CONCURRENTLY%%'",
                    app=f"{NEW}-0013",
                ),
                30,
                "the index build never waited for the writing transaction",
            )
            db.rows(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %(app)s",
                app=f"{NEW}-0013",
            )
            out, _ = interrupted.communicate(timeout=60)
        finally:
            if interrupted.poll() is None:
                interrupted.kill()
                interrupted.wait()
            writer.rollback()
        assert interrupted.returncode != 0, out.decode(errors="replace")
        assert db.rows("SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid")

        new.migrate()  # run again
        assert db.applied()[-1] == _migration_names(ROOT / "django_awa" / "migrations")[-1]
        assert db.rows("SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid") == []


def _audit(db: Upgrade, ids: list[int], handover: list[int]) -> int:
    """Check the run in SQL; return how many given-back jobs the new worker finished."""
    cursor = db.conn.cursor()
    followups = audit.followup_ids(cursor, ids)
    # A snoozed job runs twice in its one attempt (the run after a Snooze keeps the
    # number), whichever release snoozed it and whichever claimed it again.
    snoozed = db.snoozers(ids)
    assert (
        db.rows(
            "SELECT j.id, j.state, j.attempt, array_agg(l.attempt ORDER BY l.id) "
            "FROM awa_job j LEFT JOIN testapp_ledger l ON l.job_id = j.id "
            "WHERE j.id = ANY(%(ids)s) GROUP BY j.id "
            "HAVING NOT coalesce(j.state = 'completed' AND j.attempt = 1 "
            "                    AND array_agg(l.attempt ORDER BY l.id) = ARRAY[1, 1], false)",
            ids=snoozed,
        )
        == []
    )
    once = [i for i in ids + followups if i not in set(snoozed)]
    assert audit.ledger_duplicates(cursor, once) == []

    # The previous release gives back an attempt interrupted at shutdown with an
    # errors entry but no outcome, hence no follow-up (this release commits it as a
    # retry, with its follow-ups); the shared audit reads that entry as a retry
    # missing its follow-up. Allow exactly that, only on the jobs the old worker gave
    # back (which never fail by themselves).
    given_back = dict(
        db.rows(
            "SELECT id, (SELECT count(*) FROM jsonb_array_elements(errors) AS e "
            "            WHERE e ->> 'error' NOT LIKE 'rescued:%%') "
            "FROM awa_job WHERE id = ANY(%(ids)s)",
            ids=handover,
        )
    )
    unexplained = [
        m
        for m in audit.outcome_mismatches(cursor, ids)
        if not (m[0] in given_back and m[2:7] == (m[7], m[8] + given_back[m[0]], *m[9:12]))
    ]
    assert unexplained == []

    # Atomic jobs: one order and one receipt per payment, none for a declined one.
    assert (
        db.rows(
            "SELECT * FROM ("
            "  SELECT j.id, j.state, coalesce((j.args ->> 'fail')::boolean, false) AS declined,"
            "    (SELECT count(*) FROM testapp_order AS o "
            "     WHERE o.reference = j.args ->> 'reference') AS orders,"
            "    (SELECT count(*) FROM awa_job AS f WHERE f.metadata ? 'awa_trigger' "
            "     AND f.metadata #>> '{awa_trigger,job_id}' = j.id::text) AS receipts"
            "  FROM awa_job AS j WHERE j.id = ANY(%(ids)s) AND j.kind = 'pay') AS p "
            "WHERE NOT ((declined AND state = 'failed' AND orders = 0 AND receipts = 0) "
            "        OR (NOT declined AND state = 'completed' AND orders = 1 AND receipts = 1))",
            ids=ids,
        )
        == []
    )

    # The old worker's given-back attempt 1, finished in attempt 2 by the new worker.
    finished_by_new = db.value(
        "SELECT count(*) FROM awa_job AS j WHERE j.id = ANY(%(ids)s) AND j.state = 'completed' "
        "AND EXISTS (SELECT 1 FROM testapp_ledger AS l WHERE l.job_id = j.id "
        "            AND l.attempt = 1 AND l.release = %(old)s) "
        "AND EXISTS (SELECT 1 FROM testapp_ledger AS l WHERE l.job_id = j.id "
        "            AND l.attempt = 2 AND l.release = %(new)s)",
        ids=handover,
        old=OLD,
        new=NEW,
    )
    assert finished_by_new >= 1, given_back
    return finished_by_new


# -- migrations a rolling upgrade can take -----------------------------------------------

_JOB_TABLE = r'(?:ONLY\s+)?"?awa_job"?(?![\w"])'

# Checked on each statement of ``sqlmigrate`` output, whitespace collapsed. The
# previous release's workers keep reading and writing every table and column it
# knows while a migration runs and after; awa_job is hot and can be large.
_UNSAFE_SQL = [
    (r"\bDROP\s+TABLE\b", "drops a table the previous release uses"),
    (r"\bDROP\s+COLUMN\b", "drops a column the previous release reads or writes"),
    (r"\bRENAME\b", "renames something the previous release names"),
    (r"\bDROP\s+INDEX\b", "drops an index the previous release may rely on"),
    (
        r"\bALTER\s+COLUMN\s+\S+\s+(?:SET\s+DATA\s+)?TYPE\b",
        "changes a column type (a rewrite or a scan under an exclusive lock)",
    ),
    (r"\bSET\s+NOT\s+NULL\b", "SET NOT NULL scans the table under an exclusive lock"),
    (
        r"\bDROP\s+DEFAULT\b",
        "drops a default the previous release's inserts rely on (use db_default=, not default=)",
    ),
    (
        r"\bADD\s+COLUMN\b(?!.*\bDEFAULT\b).*\bNOT\s+NULL\b",
        "adds a NOT NULL column without a DEFAULT (the previous release's inserts fail)",
    ),
    (
        r"\bADD\s+COLUMN\b.*\bDEFAULT\s*\(*\s*(?:gen_random_uuid|random|clock_timestamp|"
        r"timeofday|nextval|uuid_generate_\w+)\s*\(",
        "adds a column with a volatile default (rewrites the table)",
    ),
    (
        rf"\bCREATE\s+(?:UNIQUE\s+)?INDEX\s+(?!CONCURRENTLY\b).*\bON\s+{_JOB_TABLE}",
        "builds an index on awa_job without CONCURRENTLY (blocks writes meanwhile)",
    ),
    (
        rf"\bALTER\s+TABLE\s+{_JOB_TABLE}.*\bADD\s+COLUMN\b.*\b(?:UNIQUE|PRIMARY\s+KEY)\b",
        "adds a unique column to awa_job (builds its index under an exclusive lock)",
    ),
    (
        rf"\bALTER\s+TABLE\s+{_JOB_TABLE}.*\bADD\s+CONSTRAINT\b"
        r"(?!.*\b(?:NOT\s+VALID|USING\s+INDEX)\b)",
        "adds a constraint to awa_job checked under an exclusive lock (use NOT VALID)",
    ),
    (
        rf"^(?:UPDATE\s+{_JOB_TABLE}|DELETE\s+FROM\s+{_JOB_TABLE})",
        "rewrites awa_job rows under the workers (locks every row it touches)",
    ),
    (r"\bLOCK\s+TABLE\b", "locks a table"),
]
_UNSAFE = [(re.compile(p, re.IGNORECASE), why) for p, why in _UNSAFE_SQL]

# Indexes a migration since the previous release drops on purpose, each checked
# to serve nothing the previous release needs, and dropped CONCURRENTLY.
_DROPPED_ON_PURPOSE = {
    # 0017. The previous release read it in one place, its rescue's search for
    # running rows past their deadline, written as this release writes it
    # (state = 'running' AND deadline_at < now()): it reads them through
    # awa_job_running_idx, of the same rows (test_plans.py checks the plan).
    "awa_job_deadline_idx",
}
_DROP_ON_PURPOSE = re.compile(
    rf"^DROP INDEX CONCURRENTLY IF EXISTS ({'|'.join(_DROPPED_ON_PURPOSE)})$", re.IGNORECASE
)


# What every index build runs first (migrations/_invalid_index.py): the plain
# DROP INDEX runs only for an index an interrupted build left invalid, which
# no query uses, under a lock limit.
_DROP_IF_INVALID = re.compile(
    r"^DO \$\$ BEGIN IF EXISTS \(SELECT 1 FROM pg_index WHERE indexrelid = "
    r"to_regclass\('(\w+)'\) AND NOT indisvalid\) THEN SET LOCAL lock_timeout = '5s'; "
    r"DROP INDEX \1; END IF; END \$\$$"
)


def online_unsafe(migration_sql: str) -> list[str]:
    """What in ``sqlmigrate`` output a rolling upgrade cannot take: one line per problem."""
    problems = []
    if "CANNOT BE WRITTEN AS SQL" in migration_sql:
        problems.append("an operation that is not SQL (RunPython) cannot be checked")
    code = "\n".join(
        line for line in migration_sql.splitlines() if not line.lstrip().startswith("--")
    )
    for statement in re.split(r";\s*$", code, flags=re.MULTILINE):
        flat = " ".join(statement.split())
        if _DROP_ON_PURPOSE.match(flat) or _DROP_IF_INVALID.match(flat):
            continue
        problems += [f"{why}: {flat}" for pattern, why in _UNSAFE if pattern.search(flat)]
    return problems


@pytest.mark.django_db(transaction=True)  # sqlmigrate of a CONCURRENTLY migration needs it
def test_migrations_since_the_previous_release_are_online() -> None:
    _require_previous_commit()
    listing = _git("ls-tree", "--name-only", PREVIOUS_COMMIT, "django_awa/migrations/")
    assert listing.returncode == 0, listing.stderr.decode(errors="replace")
    shipped = sorted(
        Path(p).stem
        for p in listing.stdout.decode().split()
        if re.fullmatch(r"\d{4}_\w+\.py", Path(p).name)
    )
    current = _migration_names(ROOT / "django_awa" / "migrations")
    assert shipped, f"no migrations found in {PREVIOUS_COMMIT}"
    # A shipped migration is applied in databases out there: never removed or renamed.
    assert [name for name in shipped if name not in current] == []
    problems = {}
    for name in current:
        if name in shipped:
            continue
        out = io.StringIO()
        call_command("sqlmigrate", "django_awa", name, stdout=out)
        if found := online_unsafe(out.getvalue()):
            problems[name] = found
    assert problems == {}


def _sample_sql(*operations: Any, atomic: bool = True) -> str:
    """What ``sqlmigrate`` would print for a django_awa migration of ``operations``."""
    state = MigrationLoader(connection).project_state()
    migration = type("Migration", (migrations.Migration,), {"atomic": atomic})(
        "9999_sample", "django_awa"
    )
    migration.operations = list(operations)
    with connection.schema_editor(collect_sql=True, atomic=atomic) as editor:
        migration.apply(state, editor, collect_sql=True)
    return "\n".join(editor.collected_sql)


def _index() -> models.Index:
    return models.Index(fields=["kind"], name="awa_job_kind_idx")


# Sample operations (id: operation, the problem the check must name; None: safe).
_SAMPLES: dict[str, tuple[Callable[[], Any], str | None]] = {
    "remove field": (lambda: migrations.RemoveField("job", "progress"), "drops a column"),
    "rename field": (lambda: migrations.RenameField("job", "tags", "labels"), "renames"),
    "change type": (
        lambda: migrations.AlterField("job", "kind", models.TextField()),
        "changes a column type",
    ),
    "make not null": (
        lambda: migrations.AlterField("job", "progress", models.JSONField()),
        "SET NOT NULL",
    ),
    "python default": (
        lambda: migrations.AddField("job", "w", models.IntegerField(default=1)),
        "drops a default",
    ),
    "not null, no default": (
        lambda: migrations.AddField("job", "w", models.IntegerField()),
        "NOT NULL column without a DEFAULT",
    ),
    "volatile default": (
        lambda: migrations.AddField("job", "w", models.UUIDField(db_default=RandomUUID())),
        "volatile default",
    ),
    "unique column": (
        lambda: migrations.AddField(
            "job", "w", models.CharField(max_length=9, null=True, unique=True)
        ),
        "adds a unique column",
    ),
    "plain index": (lambda: migrations.AddIndex("job", _index()), "without CONCURRENTLY"),
    "check constraint": (
        lambda: migrations.AddConstraint(
            "job", models.CheckConstraint(condition=models.Q(attempt__gte=0), name="awa_job_w")
        ),
        "adds a constraint",
    ),
    "delete model": (lambda: migrations.DeleteModel("callbackreceipt"), "drops a table"),
    "remove index": (lambda: migrations.RemoveIndex("job", "awa_job_due_idx"), "drops an index"),
    "backfill": (
        lambda: migrations.RunSQL("UPDATE awa_job SET priority = 2"),
        "rewrites awa_job rows",
    ),
    "run python": (lambda: migrations.RunPython(migrations.RunPython.noop), "not SQL"),
    "db_default": (
        lambda: migrations.AddField("job", "w", models.IntegerField(db_default=1)),
        None,
    ),
    "nullable": (lambda: migrations.AddField("job", "w", models.TextField(null=True)), None),
    "db_default now": (
        lambda: migrations.AddField("job", "w", models.DateTimeField(db_default=Now())),
        None,
    ),
    "concurrent index": (lambda: AddIndexConcurrently("job", _index()), None),
    "new model": (
        lambda: migrations.CreateModel(
            "Sample",
            [
                ("id", models.BigAutoField(primary_key=True)),
                ("job_id", models.BigIntegerField(db_index=True)),
            ],
        ),
        None,
    ),
}


@pytest.mark.django_db(transaction=True)  # CONCURRENTLY refuses to run in a transaction
@pytest.mark.parametrize(("operation", "problem"), _SAMPLES.values(), ids=_SAMPLES.keys())
def test_the_online_check_tells_unsafe_migrations(
    operation: Callable[[], Any], problem: str | None
) -> None:
    """The check above is not vacuous: it judges the real Django SQL of sample
    operations (collected, never applied) as a rolling upgrade needs."""
    op = operation()
    migration_sql = _sample_sql(op, atomic=not isinstance(op, AddIndexConcurrently))
    assert migration_sql.strip()
    found = online_unsafe(migration_sql)
    if problem is None:
        assert found == [], migration_sql
    else:
        assert any(problem in line for line in found), f"{migration_sql}\n-> {found}"
