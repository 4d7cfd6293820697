"""``manage.py awa_jobs list|show|retry|cancel|discard``: jobs for operators (SPEC §15).

Exit codes: see ``django_awa.management.operator`` (0 done, 1 nothing matched
or not found, 2 usage error).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser
from django.db.models import QuerySet

from django_awa import control
from django_awa.conf import awa_settings
from django_awa.management.operator import OperatorCommand, nothing, table, usage
from django_awa.models import Job, JobState

LIST_LIMIT = 50
# The most jobs one retry, cancel or discard over a filter touches; run it again for more.
OPERATION_LIMIT = 1000

# What each operation may change: other states are left as they are.
ALLOWED = {
    "retry": JobState.RETRIABLE,
    "cancel": JobState.LIVE,
    "discard": tuple(JobState),
}
PAST = {"retry": "retried", "cancel": "cancelled", "discard": "discarded"}


def _last_error(job: Job) -> str | None:
    errors = job.errors if isinstance(job.errors, list) else []
    last = errors[-1] if errors else None
    return str(last.get("error", "")) if isinstance(last, dict) else None


def _summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "queue": job.queue,
        "state": job.state,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "priority": job.priority,
        "run_at": job.run_at,
        "finalized_at": job.finalized_at,
        "last_error": _last_error(job),
    }


class Command(OperatorCommand):
    help = "List, show, retry, cancel or discard jobs."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = self.subcommands(parser)

        def filters(p: CommandParser) -> None:
            p.add_argument("--state", action="append", default=[], help="a state (repeatable)")
            p.add_argument("--queue", action="append", default=[], help="a queue (repeatable)")
            p.add_argument("--kind", action="append", default=[], help="a kind (repeatable)")

        listing = sub.add_parser("list", help="jobs matching the filters, newest first")
        filters(listing)
        listing.add_argument("--limit", type=int, default=LIST_LIMIT)
        self.add_json(listing)

        show = sub.add_parser("show", help="one job, in full")
        show.add_argument("job_id", type=int)
        self.add_json(show)

        for name, text in (
            ("retry", "make failed, cancelled or retryable jobs available now"),
            ("cancel", "cancel jobs that have not finished"),
            ("discard", "delete jobs"),
        ):
            op = sub.add_parser(name, help=f"{text}: the ids given, or those the filters match")
            op.add_argument("job_ids", type=int, nargs="*", metavar="ID")
            filters(op)
            op.add_argument("--limit", type=int, default=OPERATION_LIMIT)
            if name == "cancel":
                op.add_argument("--reason", default="", help="recorded in the job's errors")
            if name == "discard":
                op.add_argument(
                    "--yes", action="store_true", help="needed to discard over a filter"
                )
            self.add_json(op)

    def handle(self, *args: Any, **options: Any) -> None:
        self.alias = awa_settings().database
        action = options["action"]
        if action == "list":
            self.list_jobs(options)
        elif action == "show":
            self.show(options)
        else:
            self.operate(action, options)

    # -- reading ---------------------------------------------------------------

    def filtered(self, options: dict[str, Any]) -> QuerySet[Job]:
        bad = [s for s in options["state"] if s not in JobState.values]
        if bad:
            raise usage(f"unknown state {bad[0]!r}; states: {', '.join(JobState.values)}")
        if options["limit"] < 1:
            raise usage(f"--limit must be at least 1, got {options['limit']}")
        jobs = Job.objects.using(self.alias).all()
        if options["state"]:
            jobs = jobs.filter(state__in=options["state"])
        if options["queue"]:
            jobs = jobs.filter(queue__in=options["queue"])
        if options["kind"]:
            jobs = jobs.filter(kind__in=options["kind"])
        return jobs

    def list_jobs(self, options: dict[str, Any]) -> None:
        limit = options["limit"]
        jobs = list(self.filtered(options).order_by("-id")[: limit + 1])
        more = len(jobs) > limit
        rows = [_summary(job) for job in jobs[:limit]]
        headers = [
            "id",
            "kind",
            "queue",
            "state",
            "attempt",
            "run_at",
            "finalized_at",
            "last_error",
        ]
        text = table(
            headers,
            [
                [str(r["id"]), r["kind"], r["queue"], r["state"],
                 f"{r['attempt']}/{r['max_attempts']}", r["run_at"], r["finalized_at"],
                 r["last_error"]]
                for r in rows
            ],
        )  # fmt: skip
        if more:
            text += f"\n(the newest {limit}; --limit for more)"
        self.emit(options, rows, text if rows else "")
        if not rows:
            raise nothing("no job matches")

    def show(self, options: dict[str, Any]) -> None:
        job = Job.objects.using(self.alias).filter(id=options["job_id"]).first()
        if job is None:
            raise nothing(f"no job with id {options['job_id']}")
        document = {
            **_summary(job),
            "created_at": job.created_at,
            "attempted_at": job.attempted_at,
            "heartbeat_at": job.heartbeat_at,
            "deadline_at": job.deadline_at,
            "args": job.args,
            "errors": job.errors,
            "metadata": job.metadata,
            "tags": job.tags,
            "progress": job.progress,
            "callback_id": job.callback_id,
        }
        lines = [f"{key:>13}: {value}" for key, value in document.items() if key != "errors"]
        for entry in job.errors if isinstance(job.errors, list) else []:
            if isinstance(entry, dict):
                lines.append(
                    f"        error: attempt {entry.get('attempt')} at {entry.get('at')}: "
                    f"{entry.get('error')}"
                )
        self.emit(options, document, "\n".join(lines))

    # -- operations --------------------------------------------------------------

    def operate(self, action: str, options: dict[str, Any]) -> None:
        ids: list[int] = options["job_ids"]
        filtering = options["state"] or options["queue"] or options["kind"]
        if ids and filtering:
            raise usage(f"{action}: give job ids or filters (--state/--queue/--kind), not both")
        if not ids and not filtering:
            raise usage(f"{action}: name the jobs: job ids, or filters (--state/--queue/--kind)")
        if action == "discard" and filtering and not options["yes"]:
            raise usage("discard over a filter deletes every job it matches: add --yes")
        allowed = [str(s) for s in ALLOWED[action]]
        not_found: list[int] = []
        skipped: list[int] = []
        if ids:
            states = dict(
                Job.objects.using(self.alias).filter(id__in=ids).values_list("id", "state")
            )
            not_found = [i for i in ids if i not in states]
            named = [i for i in dict.fromkeys(ids) if i in states]
            targets = [i for i in named if states[i] in allowed]
            skipped = [i for i in named if states[i] not in allowed]
        else:
            targets = list(
                self.filtered(options)
                .filter(state__in=allowed)
                .order_by("id")
                .values_list("id", flat=True)[: options["limit"]]
            )
        changed, unchanged, failed = self.apply(action, targets, options)
        unchanged = sorted([*skipped, *unchanged])
        document = {
            PAST[action]: changed,
            "unchanged": unchanged,
            "not_found": not_found,
            "failed": [{"id": i, "error": e} for i, e in failed],
        }
        lines = [f"{PAST[action]} {len(changed):,} job(s)" + _ids(changed)]
        if unchanged:
            lines.append(
                f"left {len(unchanged):,} job(s) as they were (their state does not allow it)"
                + _ids(unchanged)
            )
        lines += [f"no job with id {i}" for i in not_found]
        lines += [f"could not {action} job {i}: {e}" for i, e in failed]
        self.emit(options, document, "\n".join(lines))
        if not changed or not_found or failed:
            raise nothing(
                f"nothing to {action}"
                if not (changed or not_found or failed)
                else f"{action}: {len(not_found)} not found, {len(failed)} refused"
            )

    def apply(
        self, action: str, ids: list[int], options: dict[str, Any]
    ) -> tuple[list[int], list[int], list[tuple[int, str]]]:
        changed: list[int] = []
        unchanged: list[int] = []
        failed: list[tuple[int, str]] = []
        if action == "discard":
            jobs = Job.objects.using(self.alias).filter(id__in=ids)
            # A finished row that maintenance moved into awa_job_done while the
            # DELETE waited is not yet visible to it: a second DELETE takes it.
            jobs.delete()
            jobs.delete()
            return ids, [], []
        reason = options.get("reason") or "cancelled with manage.py awa_jobs"
        done_state = JobState.AVAILABLE if action == "retry" else JobState.CANCELLED
        for job_id in ids:
            try:
                if action == "retry":
                    job = control.retry(job_id, using=self.alias)
                else:
                    job = control.cancel(job_id, reason, using=self.alias)
            # One job's follow-up function (user code, any exception) or unique
            # key refusing it does not stop the rest; its transaction rolled back.
            except Exception as exc:  # noqa: BLE001
                failed.append((job_id, str(exc) or type(exc).__name__))
                continue
            (changed if job.state == done_state else unchanged).append(job_id)
        return changed, unchanged, failed


def _ids(ids: list[int], shown: int = 20) -> str:
    if not ids:
        return ""
    more = f", … ({len(ids) - shown:,} more)" if len(ids) > shown else ""
    return ": " + ", ".join(map(str, ids[:shown])) + more
