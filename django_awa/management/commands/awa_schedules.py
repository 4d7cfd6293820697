"""``manage.py awa_schedules list|pause|resume|trigger``: periodic schedules (SPEC §15).

Exit codes: see ``django_awa.management.operator`` (0 done, 1 no such
schedule, or none, 2 usage error).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from django_awa import schedules as schedule_module
from django_awa.conf import awa_settings
from django_awa.exceptions import ScheduleNotFound, UniqueConflict
from django_awa.management.operator import (
    OperatorCommand,
    nothing,
    require_migrations,
    table,
)
from django_awa.models import PeriodicSchedule


def schedule_status(row: PeriodicSchedule | None, declared: bool) -> str:
    """``active``, ``paused``, ``removed`` (stored, declared in no jobs.py: never fires),
    or ``new`` (declared, not seen by maintenance yet)."""
    if not declared:
        return "removed"
    if row is None:
        return "new"
    return "paused" if row.paused else "active"


class Command(OperatorCommand):
    help = "List periodic schedules, pause or resume one, or trigger one fire now."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = self.subcommands(parser, database=False)  # schedules fire in AWA['DATABASE']
        self.add_json(sub.add_parser("list", help="every schedule declared or stored"))
        for name, text in (
            ("pause", "stop a schedule firing"),
            ("resume", "let a paused schedule fire again, from now on"),
            ("trigger", "enqueue one fire of a schedule now"),
        ):
            op = sub.add_parser(name, help=text)
            op.add_argument("name")
            self.add_json(op)

    def handle(self, *args: Any, **options: Any) -> None:
        self.alias = awa_settings().database
        require_migrations(self.alias)
        action = options["action"]
        if action == "list":
            self.list_schedules(options)
            return
        name = options["name"]
        try:
            if action == "trigger":
                job = schedule_module.trigger_schedule(name, using=self.alias)
                self.emit(
                    options,
                    {"schedule": name, "job_id": job.id, "queue": job.queue, "kind": job.kind},
                    f"schedule {name}: enqueued job {job.id} ({job.kind} on queue {job.queue})",
                )
                return
            if action == "pause":
                row = schedule_module.pause_schedule(name, using=self.alias)
            else:
                row = schedule_module.resume_schedule(name, using=self.alias)
        except (ScheduleNotFound, UniqueConflict) as exc:
            raise nothing(str(exc)) from exc
        status = schedule_status(row, schedule_module.is_declared(name))
        self.emit(options, {"schedule": name, "status": status}, f"schedule {name}: {status}")

    def list_schedules(self, options: dict[str, Any]) -> None:
        rows = {r.name: r for r in PeriodicSchedule.objects.using(self.alias).all()}
        declared = schedule_module.schedules
        entries = []
        for name in sorted({*rows, *declared}):
            row, schedule = rows.get(name), declared.get(name)
            entries.append(
                {
                    "name": name,
                    "status": schedule_status(row, schedule is not None),
                    "cron": schedule.cron if schedule else row.cron if row else None,
                    "timezone": schedule.timezone if schedule else row.timezone if row else None,
                    "kind": schedule.args.kind if schedule else row.kind if row else None,
                    "last_fire_at": row.last_fire_at if row else None,
                    "next_fire_at": row.next_fire_at if row and schedule else None,
                }
            )
        headers = ["name", "status", "cron", "timezone", "kind", "last_fire_at", "next_fire_at"]
        text = table(headers, [[e[h] for h in headers] for e in entries])
        self.emit(options, entries, text if entries else "")
        if not entries:
            raise nothing("no periodic schedule is declared or stored")
