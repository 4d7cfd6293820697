"""``manage.py awa_queues stats|pause|resume``: queues for operators (SPEC §15).

Exit codes: see ``django_awa.management.operator`` (0 done, 1 no queue known,
2 usage error).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from django_awa import control
from django_awa.conf import QUEUE_NAME_RE, invalid_queue_name
from django_awa.management.operator import OperatorCommand, nothing, table, usage
from django_awa.models import JobState

STATES = [str(s) for s in JobState]


class Command(OperatorCommand):
    help = "Show queue statistics, or pause and resume a queue."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = self.subcommands(parser)
        stats = sub.add_parser("stats", help="jobs per state of every known queue")
        self.add_json(stats)
        for name, text in (
            ("pause", "stop workers claiming from"),
            ("resume", "let workers claim from"),
        ):
            op = sub.add_parser(name, help=f"{text} a queue (running jobs finish)")
            op.add_argument("queue")
            self.add_json(op)

    def handle(self, *args: Any, **options: Any) -> None:
        alias = self.database(options)
        action = options["action"]
        if action == "stats":
            stats = control.queue_stats(using=alias)
            rows = [
                [name, entry["paused"], *(entry[state] for state in STATES)]
                for name, entry in stats.items()
            ]
            self.emit(options, stats, table(["queue", "paused", *STATES], rows) if rows else "")
            if not stats:
                raise nothing("no queue is known yet: no job was enqueued, none paused")
            return
        name = options["queue"]
        if not QUEUE_NAME_RE.match(name):
            raise usage(invalid_queue_name(name))
        if action == "pause":
            control.pause_queue(name, using=alias)
        else:
            control.resume_queue(name, using=alias)
        paused = action == "pause"
        self.emit(
            options,
            {"queue": name, "paused": paused},
            f"queue {name} {'paused' if paused else 'resumed'}",
        )
