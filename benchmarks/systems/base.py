"""The common interface every benchmarked system implements.

An adapter (one module per system in this package) runs on the orchestrator
side and touches the system only through subprocesses:

- producers: ``python -m systems.<module> COMMAND …`` (setup, enqueue-single,
  enqueue-bulk, pace), each printing one ``BENCH-RESULT {json}`` line; the
  elapsed time is measured inside the producer, around the enqueue loop only
  (not interpreter start-up, imports or connecting);
- workers: the system's own worker command (``pgq run``, ``procrastinate
  worker``, ``manage.py db_worker``, ``awa_worker``…) or, where the system has
  none for Python handlers, a small script that starts its worker runtime.

The orchestrator itself only reads the database (``count_done``), so one
process can compare systems that each need their own Django settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = BENCH_DIR.parent
PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_USER = "postgres"


class SystemUnavailable(Exception):
    """The system cannot be measured in this run (it failed to install or start)."""


def dsn_for(dbname: str) -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{dbname}"


def admin_execute(sql: str) -> None:
    with psycopg.connect(dsn_for("postgres"), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)


@dataclass
class WorkerGroup:
    """Worker processes of one system, each the leader of its own session."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    log_path: Path | None = None
    started_at: float = 0.0
    started_wall: float = 0.0  # time.time() at the start, for handler timestamps

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> str | None:
        """A description of the first worker that exited, or None."""
        for p in self.procs:
            code = p.poll()
            if code is not None:
                return f"worker pid {p.pid} exited with code {code}"
        return None

    def stop(self, grace: float = 15.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                p.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            # Also reaps grandchildren a worker forked (multi-process workers).
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class System:
    """Base adapter. Subclasses set the class attributes and worker_commands()."""

    #: display name, e.g. "pgqueuer"
    name: str = ""
    #: the module under systems/ that holds the producer commands
    module: str = ""
    #: distribution whose version the table reports
    distribution: str = ""
    #: SQL returning the number of finished (successful) jobs in the bench queue
    count_done_sql: str = ""
    #: the drain setting, overridable with run.py --set NAME.KEY=VALUE
    settings: dict[str, object] = {}
    #: extra workloads this system supports (django-awa: follow-ups)
    extra_workloads: tuple[str, ...] = ()
    #: the library's own defaults for the keys of ``settings`` (what a user
    #: gets with no flags): the ORM workloads' "default settings" drain
    defaults: dict[str, object] = {}
    #: changes to ``settings`` for the ORM workloads' "best setting" drain
    orm_best: dict[str, object] = {}
    #: handler kinds this system runs for the ORM workloads ("orm", "atomic");
    #: empty when it cannot run them (``orm_unavailable`` says why)
    orm_handlers: tuple[str, ...] = ()
    orm_unavailable: str = ""
    #: Django settings the ORM handler runs under (its app and the run's database)
    orm_settings_module: str = "djbench.settings_orm"

    def __init__(self, overrides: dict[str, str] | None = None) -> None:
        self.settings = dict(type(self).settings)
        self.overrides: dict[str, object] = {}
        for key, value in (overrides or {}).items():
            if key not in self.settings:
                raise SystemExit(
                    f"--set {self.name}.{key}: unknown setting (known: {', '.join(self.settings)})"
                )
            default = self.settings[key]
            self.overrides[key] = (
                type(default)(value)
                if not isinstance(default, bool)
                else value in ("1", "true", "yes")
            )
        self.settings.update(self.overrides)
        self.dbname = "awa_bench_" + self.name.replace("-", "_")
        self.dsn = dsn_for(self.dbname)
        self.log_dir: Path = BENCH_DIR / "results" / "logs"
        self._conn: psycopg.Connection | None = None
        self.workers: WorkerGroup | None = None

    def profile_settings(self, profile: str) -> dict[str, object]:
        """The settings of a named drain: "drain" (``settings``, with --set),
        "defaults" (the library's defaults; --set does not apply) or "best"
        (``settings`` changed by ``orm_best``, then --set)."""
        if profile == "defaults":
            return {**type(self).settings, **self.defaults}
        if profile == "best":
            return {**type(self).settings, **self.orm_best, **self.overrides}
        return dict(self.settings)

    @contextmanager
    def profile(self, profile: str) -> Iterator[None]:
        """Run the body (a worker start) with the settings of ``profile``."""
        saved = self.settings
        self.settings = self.profile_settings(profile)
        try:
            yield
        finally:
            self.settings = saved

    def broker_pids(self) -> list[int]:
        """Processes besides the workers and PostgreSQL whose CPU a job costs."""
        return []

    # ----------------------------------------------------------- description
    def version(self) -> str:
        from importlib import metadata

        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return "?"

    def describe(self) -> str:
        """The drain setting, for the table's footnotes."""
        return ", ".join(f"{k}={v}" for k, v in self.settings.items())

    # ------------------------------------------------------------ environment
    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("DJANGO_SETTINGS_MODULE", None)
        path = [str(BENCH_DIR)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            BENCH_DSN=self.dsn,
            BENCH_DB=self.dbname,
            PYTHONUNBUFFERED="1",
            # libpq variables for tools that read them (pgq, psql).
            PGHOST=PG_HOST,
            PGPORT=str(PG_PORT),
            PGUSER=PG_USER,
            PGDATABASE=self.dbname,
        )
        env.update(extra)
        return env

    # ------------------------------------------------------------- database
    def setup_db(self) -> None:
        """Create a fresh database and install the system's schema."""
        self.close()
        admin_execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        admin_execute(f'CREATE DATABASE "{self.dbname}"')
        self.install_schema()

    def install_schema(self) -> None:
        self.run_client("setup", timeout=300)

    def teardown_db(self) -> None:
        self.stop_worker()
        self.close()
        try:
            admin_execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        except psycopg.Error:
            pass

    def connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def count_done(self) -> int:
        row = self.connection().execute(self.count_done_sql).fetchone()
        return int(row[0] or 0) if row else 0

    def check_succeeded(self) -> None:
        """After a drain: raise SystemUnavailable if a job counted as done failed.

        count_done_sql counts successes only; a system whose count cannot tell
        (Celery's results) checks here, untimed.
        """

    def run_tool(self, argv: list[str], what: str, *, cwd: Path | None = None) -> None:
        """Run one of the system's own commands (a schema install, say); fail naming it."""
        proc = subprocess.run(
            argv, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=120, check=False
        )
        if proc.returncode != 0:
            raise SystemUnavailable(f"{what} failed: " + (proc.stderr or proc.stdout)[-800:])

    # ------------------------------------------------------------- producers
    def client_command(self, *args: object) -> list[str]:
        return [sys.executable, "-m", f"systems.{self.module}", *map(str, args)]

    def client_env(self) -> dict[str, str]:
        return self.env()

    def orm_env(self) -> dict[str, str]:
        """The environment of ORM-handler code: Django set up with orm_settings_module."""
        return self.env(DJANGO_SETTINGS_MODULE=self.orm_settings_module)

    def run_client(self, *args: object, timeout: float, env: dict[str, str] | None = None) -> dict:
        cmd = self.client_command(*args)
        try:
            proc = subprocess.run(
                cmd,
                cwd=BENCH_DIR,
                env=env or self.client_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise SystemUnavailable(
                f"{' '.join(map(str, args))}: timed out after {timeout:.0f}s"
            ) from exc
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("BENCH-RESULT "):
                result = json.loads(line[len("BENCH-RESULT ") :])
        if proc.returncode != 0 or result is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            raise SystemUnavailable(
                f"`{' '.join(map(str, args))}` failed (exit {proc.returncode}):\n    "
                + "\n    ".join(tail)
            )
        return result

    def enqueue_single(self, n: int) -> float:
        """Enqueue n jobs, one transaction each, single client; seconds taken."""
        return float(self.run_client("enqueue-single", n, timeout=max(120, n / 5))["elapsed"])

    def enqueue_bulk(self, n: int, batch: int) -> float:
        """Enqueue n jobs with the system's bulk API in batches; seconds taken."""
        return float(self.run_client("enqueue-bulk", n, batch, timeout=max(120, n / 50))["elapsed"])

    def prepare_orm(self, accounts: int) -> None:
        """Create and fill the ORM handler's table (djbench.handler_app)."""
        self.run_client("orm-setup", accounts, timeout=300, env=self.orm_env())

    def enqueue_orm(self, n: int, batch: int, handler: str, accounts: int) -> float:
        """Enqueue n ORM-handler jobs (handler "orm" or "atomic"), untimed by run.py."""
        result = self.run_client(
            "enqueue-orm", n, batch, handler, accounts, timeout=max(120, n / 20)
        )
        return float(result["elapsed"])

    def pace(self, rate: float, duration: float) -> int:
        """Enqueue rate jobs/s for duration seconds, each carrying its enqueue time."""
        return int(self.run_client("pace", rate, duration, timeout=duration + 120)["count"])

    # --------------------------------------------------------------- workers
    def worker_commands(self, mode: str) -> list[list[str]]:
        """One argv per worker process to start. mode: drain, latency, followups, orm or atomic."""
        raise NotImplementedError

    def worker_env(self, mode: str) -> dict[str, str]:
        return self.env()

    def start_worker(
        self,
        mode: str = "drain",
        latency_dir: Path | None = None,
        finish_dir: Path | None = None,
    ) -> WorkerGroup:
        self.stop_worker()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{self.dbname}-{mode}.log"
        log = open(log_path, "ab")
        log.write(f"\n==== {time.strftime('%H:%M:%S')} start {mode}\n".encode())
        log.flush()
        env = self.worker_env(mode)
        if latency_dir is not None:
            env["BENCH_LATENCY_DIR"] = str(latency_dir)
        if finish_dir is not None:
            env["BENCH_FINISH_DIR"] = str(finish_dir)
        group = WorkerGroup(log_path=log_path)
        # Built before the clock starts: an adapter may probe its command first
        # (django-awa runs `awa_worker --help` once, to see whether it has --processes).
        commands = self.worker_commands(mode)
        group.started_at = time.perf_counter()
        group.started_wall = time.time()
        for argv in commands:
            group.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=BENCH_DIR,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        log.close()
        self.workers = group
        return group

    def stop_worker(self) -> None:
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    def worker_log_tail(self, lines: int = 12) -> str:
        if self.workers is None or self.workers.log_path is None:
            return ""
        try:
            text = self.workers.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n    ".join(text.strip().splitlines()[-lines:])
