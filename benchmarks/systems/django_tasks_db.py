"""django-tasks-db 0.13 on Django 6.1 (``django.tasks`` built in).

- schema: ``python -m django migrate`` (settings ``djbench.settings_tasks_db``);
- enqueue: ``noop.enqueue(n=…)``, each its own transaction; bulk: the
  package has no bulk API (``DatabaseBackend.enqueue`` creates one row per
  call), so "bulk" is a batch of ``enqueue()`` calls in one transaction;
- worker: ``python -m django db_worker --queue-name bench``; it runs one task
  at a time, so the drain runs 2 processes (the machine has 2 cores). It
  polls (no LISTEN/NOTIFY): ``--interval 0.1`` instead of the default 1 s
  sleep when the queue is empty, ``--no-startup-delay``;
- finished jobs: ``django_tasks_database_dbtaskresult`` rows (app label
  ``django_tasks_database``) with status SUCCESSFUL.
"""

from __future__ import annotations

import time

from systems import _common as common
from systems.base import System

SETTINGS = "djbench.settings_tasks_db"


class DjangoTasksDb(System):
    name = "django-tasks-db"
    module = "django_tasks_db"
    distribution = "django-tasks-db"
    count_done_sql = (
        "SELECT count(*) FROM django_tasks_database_dbtaskresult"
        " WHERE status = 'SUCCESSFUL' AND queue_name = 'bench'"
    )
    settings = {"processes": 4, "interval": 0.1}
    defaults = {"processes": 1, "interval": 1.0}
    orm_best: dict[str, object] = {}  # the drain setting was the best found for it too
    orm_handlers = ("orm",)
    orm_settings_module = SETTINGS

    def env(self, **extra: str) -> dict[str, str]:
        return super().env(**{"DJANGO_SETTINGS_MODULE": SETTINGS, **extra})

    def install_schema(self) -> None:
        self.run_client("setup", timeout=300)

    def worker_commands(self, mode: str) -> list[list[str]]:
        import sys

        argv = [
            sys.executable,
            "-m",
            "django",
            "db_worker",
            "--queue-name",
            common.QUEUE,
            "--interval",
            str(self.settings["interval"]),
            "--no-startup-delay",
            "--no-reload",
            # 0 = CRITICAL only; the default (1) logs two lines per task.
            "--verbosity",
            "0",
        ]
        return [argv for _ in range(int(self.settings["processes"]))]


ADAPTER = DjangoTasksDb


# ------------------------------------------------------------- producer side
def cmd_enqueue_single(n: int) -> None:
    common.django_setup()
    from django.db import connection
    from djbench.tasks_app.tasks import noop

    single = noop.using(queue_name=common.SINGLE_QUEUE)
    connection.ensure_connection()
    start = time.perf_counter()
    for i in range(n):
        single.enqueue(n=i)
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_bulk(n: int, batch: int) -> None:
    common.django_setup()
    from django.db import connection, transaction
    from djbench.tasks_app.tasks import noop

    connection.ensure_connection()
    start = time.perf_counter()
    for chunk in common.batches(n, batch):
        with transaction.atomic():
            for i in chunk:
                noop.enqueue(n=i)
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_enqueue_orm(n: int, batch: int, handler: str, accounts: int) -> None:
    common.django_setup()
    from django.db import connection, transaction
    from djbench.tasks_app.tasks import touch_account

    connection.ensure_connection()
    start = time.perf_counter()
    for chunk in common.batches(n, batch):
        with transaction.atomic():
            for i in chunk:
                touch_account.enqueue(account=common.account_for(i, accounts))
    common.emit(elapsed=time.perf_counter() - start, count=n)


def cmd_pace(rate: float, duration: float) -> None:
    common.django_setup()
    from django.db import connection
    from djbench.tasks_app.tasks import noop

    connection.ensure_connection()
    count = 0
    for i in common.paced(rate, duration):
        noop.enqueue(n=i, t=time.time())
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
