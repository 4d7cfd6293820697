"""django-awa, this repository (SPEC §2, §3, §5, §6).

- schema: ``python -m django migrate`` (settings ``djbench.settings_awa``);
- enqueue: ``awa.enqueue(Noop(n=…), queue=…)``, each its own transaction;
  bulk: ``awa.enqueue_many([...])`` per batch, inside ``transaction.atomic()``;
- worker: ``python -m django awa_worker --queue bench``, the defaults (one
  process, concurrency 10); ``--set django-awa.concurrency=C`` and
  ``--set django-awa.processes=P`` change them (``--processes`` is used only
  when the command offers it; otherwise P separate worker commands run);
- finished jobs: ``awa_job`` rows of the bench queue in state ``completed``;
  with ``--set django-awa.completed_retention=0`` (``COMPLETED_RETENTION = 0``:
  completed jobs are deleted as they complete) the jobs ever enqueued less
  those of the bench queue still to finish;
- ORM workloads: ``TouchAccount`` / ``TouchAccountAtomic`` (``atomic=True``)
  jobs in the bench queue, handlers in ``djbench/awa_app/jobs.py``;
- extra workloads: a drain whose every job has an ``on_completed`` follow-up
  (settings ``djbench.settings_awa_followups``; the follow-ups go to a queue no
  worker runs, and the run checks that there is one per job).

django-awa is imported from the repository root (on PYTHONPATH), whether or
not bootstrap.sh could install it editable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from systems import _common as common
from systems.base import REPO_ROOT, System

SETTINGS = "djbench.settings_awa"
FOLLOWUP_SETTINGS = "djbench.settings_awa_followups"
FOLLOWUP_QUEUE = "bench_followups"


class DjangoAwa(System):
    name = "django-awa"
    module = "django_awa"
    distribution = "django-awa"
    count_done_sql = "SELECT count(*) FROM awa_job WHERE state = 'completed' AND queue = 'bench'"
    # With COMPLETED_RETENTION = 0 a completed job leaves no row: every id the
    # sequence gave (enqueue takes one per job) less the bench jobs not finished.
    count_gone_sql = """
        SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('awa_job', 'id')), 0)
             - (SELECT count(*) FROM awa_job WHERE queue = 'bench' AND state <> 'completed')"""
    count_followups_sql = f"SELECT count(*) FROM awa_job WHERE queue = '{FOLLOWUP_QUEUE}'"  # noqa: S608
    # The defaults a user gets: `awa_worker --queue bench`, one process, the
    # default concurrency (0 here means "not given on the command line").
    # completed_retention: AWA["COMPLETED_RETENTION"] in seconds ("": the default).
    settings = {"processes": 1, "concurrency": 0, "completed_retention": ""}
    defaults = {"processes": 1, "concurrency": 0, "completed_retention": ""}
    # The fastest ORM-handler drain found on 2 cores (see README).
    orm_best = {"processes": 2, "concurrency": 20}
    orm_handlers = ("orm", "atomic")
    orm_settings_module = SETTINGS
    extra_workloads = ("followups",)

    _has_processes_option: bool | None = None

    def version(self) -> str:
        version = super().version()
        if version == "?":
            return "repo"
        return version

    def describe(self) -> str:
        processes = int(self.settings["processes"])
        concurrency = int(self.settings["concurrency"])
        retention = str(self.settings["completed_retention"])
        kept = f", COMPLETED_RETENTION={retention}" if retention else ""
        if processes == 1 and not concurrency:
            return f"awa_worker defaults: 1 process, concurrency 10{kept}"
        return f"processes={processes}, concurrency={concurrency or 10}{kept}"

    def env(self, **extra: str) -> dict[str, str]:
        env = super().env(**{"DJANGO_SETTINGS_MODULE": SETTINGS, **extra})
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO_ROOT)])
        if self.settings["completed_retention"] != "":
            env["BENCH_COMPLETED_RETENTION"] = str(self.settings["completed_retention"])
        return env

    def count_done(self) -> int:
        if not self._keeps_none():
            return super().count_done()
        row = self.connection().execute(self.count_gone_sql).fetchone()
        return int(row[0] or 0) if row else 0

    def _keeps_none(self) -> bool:
        """Whether the worker keeps no completed job (``completed_retention=0``)."""
        retention = str(self.settings["completed_retention"])
        return retention != "" and float(retention) == 0

    def worker_env(self, mode: str) -> dict[str, str]:
        if mode == "followups":
            return self.env(DJANGO_SETTINGS_MODULE=FOLLOWUP_SETTINGS)
        return self.env()

    def count_followups(self) -> int:
        row = self.connection().execute(self.count_followups_sql).fetchone()
        return int(row[0]) if row else 0

    def worker_commands(self, mode: str) -> list[list[str]]:
        processes = int(self.settings["processes"])
        concurrency = int(self.settings["concurrency"])
        queue = f"{common.QUEUE}={concurrency}" if concurrency else common.QUEUE
        argv = [sys.executable, "-m", "django", "awa_worker", "--queue", queue]
        if processes > 1 and self._supports_processes():
            return [[*argv, "--processes", str(processes)]]
        return [argv for _ in range(processes)]

    def _supports_processes(self) -> bool:
        if DjangoAwa._has_processes_option is None:
            proc = subprocess.run(
                [sys.executable, "-m", "django", "awa_worker", "--help"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            DjangoAwa._has_processes_option = "--processes" in proc.stdout
        return DjangoAwa._has_processes_option


ADAPTER = DjangoAwa


# ------------------------------------------------------------- producer side
def cmd_enqueue_single(n: int) -> None:
    common.django_setup()
    from django.db import connection
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    connection.ensure_connection()
    start = time.perf_counter()
    for i in range(n):
        # Outside transaction.atomic() each enqueue is its own transaction (one
        # INSERT, committed at once), as each peer's single enqueue is.
        awa.enqueue(Noop(n=i), queue=common.SINGLE_QUEUE)
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    common.django_setup()
    from django.db import connection, transaction
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    connection.ensure_connection()
    start = time.perf_counter()
    for chunk in common.batches(n, batch):
        with transaction.atomic():
            awa.enqueue_many([Noop(n=i) for i in chunk])
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_orm(n: int, batch: int, handler: str, accounts: int) -> None:
    common.django_setup()
    from django.db import connection, transaction
    from djbench.awa_app.jobs import TouchAccount, TouchAccountAtomic

    import django_awa as awa

    kind = TouchAccountAtomic if handler == "atomic" else TouchAccount
    connection.ensure_connection()
    start = time.perf_counter()
    for chunk in common.batches(n, batch):
        with transaction.atomic():
            awa.enqueue_many([kind(account=common.account_for(i, accounts)) for i in chunk])
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_pace(rate: float, duration: float) -> None:
    common.django_setup()
    from django.db import connection
    from djbench.awa_app.jobs import Noop

    import django_awa as awa

    connection.ensure_connection()
    count = 0
    for i in common.paced(rate, duration):
        # Its own transaction, as each peer's paced enqueue is (see cmd_enqueue_single).
        awa.enqueue(Noop(n=i, t=time.time()))
        count += 1
    common.emit(count=count)


if __name__ == "__main__":
    common.client_main(
        {
            "setup": common.cmd_django_migrate,
            "enqueue-single": cmd_enqueue_single,
            "enqueue-bulk": cmd_enqueue_bulk,
            "pace": cmd_pace,
            "orm-setup": common.cmd_orm_setup,
            "enqueue-orm": cmd_enqueue_orm,
        }
    )
