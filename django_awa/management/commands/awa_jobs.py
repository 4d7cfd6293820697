"""``manage.py awa_jobs list|show|retry|cancel|discard|move|priority|rekind``: jobs
for operators (SPEC §15).

``retry``, ``cancel`` and ``discard`` take job ids, or filters (``--state
--queue --kind``) that select every matching job; ``move`` and ``priority``
take either too. Over a filter the work is done in batches (``django_awa.bulk``)
and ``--dry-run`` only counts. ``rekind OLD_KIND NEW_KIND`` gives the jobs of a
kind that wait to run another kind, and the unique and sequence keys of its
``awa.Unique`` and ``sequence=``, in one transaction (``bulk.rekind``). Exit
codes: see ``django_awa.management.operator`` (0 done, 1 nothing matched or not
found or some refused, 2 usage error).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser
from django.db.models import QuerySet

from django_awa import bulk, control
from django_awa.codec import check_text
from django_awa.conf import QUEUE_NAME_RE, did_you_mean, invalid_queue_name, not_kept_note
from django_awa.exceptions import UniqueConflict, ValidationError
from django_awa.kinds import registry
from django_awa.management.operator import OperatorCommand, nothing, table, usage
from django_awa.models import Job, JobState

LIST_LIMIT = 50

# What each operation may change by id: other states are left as they are.
ALLOWED = {
    "retry": JobState.RETRIABLE,
    "cancel": JobState.LIVE,
    "discard": tuple(JobState),
}
PAST = {"retry": "retried", "cancel": "cancelled", "discard": "discarded"}
# Columns ``show`` prints as JSON.
_JSON_FIELDS = frozenset({"args", "result", "metadata", "tags", "progress"})


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
    help = "List, show, retry, cancel, discard, move, reprioritize or rekind jobs."

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
            ("move", "move jobs waiting to run to another queue"),
            ("priority", "change the priority of jobs waiting to run"),
        ):
            op = sub.add_parser(name, help=f"{text}: the ids given, or every job the filters match")
            if name == "move":
                op.add_argument("--to", required=True, metavar="QUEUE", help="the target queue")
            if name == "priority":
                op.add_argument(
                    "--set", required=True, type=int, metavar="N", help="1 (highest) to 4"
                )
            op.add_argument("job_ids", type=int, nargs="*", metavar="ID")
            filters(op)
            op.add_argument(
                "--dry-run",
                action="store_true",
                help="count the jobs a filter matches; change none",
            )
            op.add_argument(
                "--batch-size",
                type=int,
                default=bulk.BATCH_SIZE,
                help=f"jobs per transaction over a filter (default {bulk.BATCH_SIZE})",
            )
            if name == "cancel":
                op.add_argument("--reason", default="", help="recorded in the job's errors")
            if name == "discard":
                op.add_argument(
                    "--yes", action="store_true", help="needed to discard over a filter"
                )
            self.add_json(op)

        rekind = sub.add_parser(
            "rekind",
            help="give the jobs of a kind that wait to run another kind (its JobArgs "
            "class renamed), in one transaction; running jobs keep theirs",
        )
        rekind.add_argument("old_kind", metavar="OLD_KIND")
        rekind.add_argument("new_kind", metavar="NEW_KIND")
        rekind.add_argument(
            "--queue", action="append", default=[], help="only this queue's jobs (repeatable)"
        )
        rekind.add_argument("--dry-run", action="store_true", help="count the jobs; change none")
        rekind.add_argument(
            "--force",
            action="store_true",
            help="rekind to a kind no @awa.worker of this project declares, or jobs "
            "whose args its JobArgs class cannot decode, that wait on a queue other than "
            "its awa.Limit's, or whose new sequence key would let them start before "
            "jobs of their old or new key finish",
        )
        self.add_json(rekind)

    def handle(self, *args: Any, **options: Any) -> None:
        self.alias = self.database(options)
        action = options["action"]
        if action == "list":
            self.list_jobs(options)
        elif action == "show":
            self.show(options)
        elif action == "rekind":
            self.rekind(options)
        else:
            self.operate(action, options)

    # -- reading ---------------------------------------------------------------

    def filtered(self, options: dict[str, Any]) -> QuerySet[Job]:
        bad = [s for s in options["state"] if s not in JobState.values]
        if bad:
            raise usage(f"unknown state {bad[0]!r}; states: {', '.join(JobState.values)}")
        if options.get("limit", 1) < 1:
            raise usage(f"--limit must be at least 1, got {options['limit']}")
        bad = [q for q in options["queue"] if not QUEUE_NAME_RE.match(q)]
        if bad:
            raise usage(invalid_queue_name(bad[0]))
        for kind in options["kind"]:
            try:
                check_text(kind)
            except ValueError as exc:
                raise usage(f"invalid kind {kind!r}: {exc}") from None
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
            raise nothing(f"no job with id {options['job_id']}{not_kept_note()}")
        document = {
            **_summary(job),
            "created_at": job.created_at,
            "attempted_at": job.attempted_at,
            "heartbeat_at": job.heartbeat_at,
            "deadline_at": job.deadline_at,
            "args": job.args,
            "result": job.result,
            "errors": job.errors,
            "metadata": job.metadata,
            "tags": job.tags,
            "progress": job.progress,
            "callback_id": job.callback_id,
            "workflow_id": job.workflow_id,
        }
        # The JSON columns as JSON (true, null), not as Python would print them.
        lines = [
            f"{key:>13}: {json.dumps(value, ensure_ascii=False) if key in _JSON_FIELDS else value}"
            for key, value in document.items()
            if key != "errors"
        ]
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
        if options["batch_size"] < 1:
            raise usage(f"--batch-size must be at least 1, got {options['batch_size']}")
        operation = bulk.Operation(action)
        try:
            bulk.check_arguments(operation, queue=options.get("to"), priority=options.get("set"))
        except ValidationError as exc:
            raise usage(str(exc)) from exc
        if ids and options["dry_run"]:
            raise usage(f"{action}: --dry-run counts what filters match; give filters, not ids")
        if ids and action in PAST:
            self.operate_on_ids(action, ids, options)
        elif ids:
            self.operate_over(operation, Job.objects.using(self.alias).filter(id__in=ids), options)
        else:
            if action == "discard" and not options["yes"] and not options["dry_run"]:
                raise usage("discard over a filter deletes every job it matches: add --yes")
            self.operate_over(operation, self.filtered(options), options)

    def operate_over(
        self, operation: bulk.Operation, jobs: QuerySet[Job], options: dict[str, Any]
    ) -> None:
        """Every job of ``jobs`` in the states the operation applies to, in batches."""
        past = bulk.PAST[operation]
        verb = "reprioritize" if operation is bulk.Operation.PRIORITY else str(operation)
        found = bulk.preview(jobs, operation)
        states = ", ".join(bulk.ALLOWED[operation])
        if options["dry_run"]:
            document = {"operation": str(operation), "dry_run": True, "matched": found.count}
            self.emit(
                options,
                document,
                f"would {verb} {found.count:,} job(s) (those in states: {states})",
            )
            if not found.count:
                raise nothing(f"nothing to {verb}")
            return
        verbose = options["verbosity"] > 1 and not options["json"]

        def progress(result: bulk.Result) -> None:
            done = result.changed + result.unchanged + len(result.failed)
            self.stderr.write(f"{done:,}/{found.count:,} …")

        result = bulk.run(
            jobs,
            operation,
            up_to=found.up_to,
            queue=options.get("to"),
            priority=options.get("set"),
            reason=options.get("reason") or "cancelled with manage.py awa_jobs",
            batch_size=options["batch_size"],
            on_batch=progress if verbose else None,
        )
        document = {"matched": found.count, **result.as_dict()}
        lines = [f"{past} {result.changed:,} of {found.count:,} matching job(s)"]
        if result.dependents:
            lines.append(_dependents_line(operation, result.dependents))
        if result.unchanged:
            lines.append(
                f"left {result.unchanged:,} job(s) as they were (they had moved on to a state "
                "that does not allow it)"
            )
        lines += [f"could not {verb} job {i}: {e}" for i, e in result.failed[:20]]
        if len(result.failed) > 20:
            lines.append(f"… and {len(result.failed) - 20:,} more refused")
        if result.batch_seconds:
            lines.append(
                f"{len(result.batch_seconds):,} batch(es) of up to {options['batch_size']:,}, "
                f"longest {max(result.batch_seconds):.3f} s"
            )
        self.emit(options, document, "\n".join(lines))
        if not result.changed or result.failed:
            raise nothing(
                f"{operation}: {len(result.failed)} refused"
                if result.failed
                else f"nothing to {verb}"
            )

    def rekind(self, options: dict[str, Any]) -> None:
        old_kind, new_kind = options["old_kind"], options["new_kind"]
        try:
            bulk.check_rekind(old_kind, new_kind, options["queue"])
        except ValidationError as exc:
            raise usage(str(exc)) from exc
        if new_kind not in registry.workers and not options["force"]:
            raise usage(
                f"rekind: no @awa.worker of this project declares kind {new_kind!r}"
                f"{did_you_mean(new_kind, registry.workers)}: its jobs would fail as an "
                "unknown kind; add --force to rekind them all the same"
            )
        try:
            done = bulk.rekind(
                old_kind,
                new_kind,
                queues=options["queue"],
                dry_run=options["dry_run"],
                force=options["force"],
                using=self.alias,
            )
        except (ValidationError, UniqueConflict) as exc:
            raise nothing(str(exc)) from exc
        states = ", ".join(JobState.WAITING)
        dry_run = options["dry_run"]
        lines = [
            f"{'would rekind' if dry_run else 'rekinded'} {done.changed:,} job(s) of kind "
            f"{old_kind!r} to {new_kind!r} (those in states: {states})"
        ]
        if done.in_progress:
            lines.append(_in_progress_line(old_kind, done.in_progress))
        if done.unfit:
            lines.append(
                f"{done.unfit:,} of them have args kind {new_kind!r} cannot decode: a worker "
                "fails them. " + "; ".join(f"job {i}: {reason}" for i, reason in done.unfit_shown)
            )
        if done.keys_remade:
            lines.append(
                f"{done.keys_remade:,} of them {'would get' if dry_run else 'got'} the unique "
                f"key of kind {new_kind!r} (its awa.Unique)"
            )
        if not done.declared and done.changed:
            lines.append(
                f"unique keys {'would be' if dry_run else 'were'} left as they were (made from "
                f"kind {old_kind!r}): kind {new_kind!r} is not declared here, so its "
                "awa.Unique is not known"
            )
        elif done.keys_kept:
            why = (
                f"kind {new_kind!r} declares no awa.Unique"
                if registry.defaults(new_kind).unique is None
                else f"their args do not fit kind {new_kind!r}"
            )
            lines.append(
                f"{done.keys_kept:,} of them {'would keep' if dry_run else 'kept'} the unique "
                f"key made from kind {old_kind!r}: {why}"
            )
        lines.extend(_rekind_sequence_lines(done, old_kind, new_kind, dry_run))
        document = {
            "old_kind": old_kind,
            "new_kind": new_kind,
            "dry_run": dry_run,
            "rekinded": done.changed,
            "in_progress": done.in_progress,
            "new_kind_declared": done.declared,
            "unfit": done.unfit,
            "unfit_jobs": [{"id": i, "error": e} for i, e in done.unfit_shown],
            "unique_keys_remade": done.keys_remade,
            "unique_keys_kept": done.keys_kept,
            "sequence_keys_remade": done.sequence_keys_remade,
            "sequence_keys_kept": done.sequence_keys_kept,
            "off_queue": dict(done.off_queue),
            "sequences_split": done.split,
        }
        self.emit(options, document, "\n".join(lines))
        if not done.changed:
            raise nothing(f"no job of kind {old_kind!r} waits to run")

    def operate_on_ids(self, action: str, ids: list[int], options: dict[str, Any]) -> None:
        allowed = [str(s) for s in ALLOWED[action]]
        states = dict(Job.objects.using(self.alias).filter(id__in=ids).values_list("id", "state"))
        not_found = [i for i in ids if i not in states]
        named = [i for i in dict.fromkeys(ids) if i in states]
        targets = [i for i in named if states[i] in allowed]
        skipped = [i for i in named if states[i] not in allowed]
        changed, unchanged, failed, dependents = self.apply(action, targets, options)
        unchanged = sorted([*skipped, *unchanged])
        document = {
            PAST[action]: changed,
            "dependents": dependents,
            "unchanged": unchanged,
            "not_found": not_found,
            "failed": [{"id": i, "error": e} for i, e in failed],
        }
        lines = [f"{PAST[action]} {len(changed):,} job(s)" + _ids(changed)]
        if dependents:
            lines.append(_dependents_line(bulk.Operation(action), dependents))
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
    ) -> tuple[list[int], list[int], list[tuple[int, str]], int]:
        """(changed, unchanged, refused ids with their error, dependents moved too)."""
        changed: list[int] = []
        unchanged: list[int] = []
        failed: list[tuple[int, str]] = []
        dependents = 0
        if action == "discard":
            # As a discard by filter: batched, its jobs' dependents settled with it.
            jobs = Job.objects.using(self.alias).filter(id__in=ids)
            result = bulk.run(jobs, bulk.Operation.DISCARD, up_to=max(ids, default=None))
            return ids, [], [], result.dependents
        reason = options.get("reason") or "cancelled with manage.py awa_jobs"
        done_state = JobState.AVAILABLE if action == "retry" else JobState.CANCELLED
        for job_id in ids:
            try:
                if action == "retry":
                    job, moved = control.retry_with_dependents(job_id, using=self.alias)
                else:
                    job, moved = control.cancel_with_dependents(job_id, reason, using=self.alias)
            # One job's follow-up function (user code, any exception) or unique
            # key refusing it does not stop the rest; its transaction rolled back.
            except Exception as exc:  # noqa: BLE001
                failed.append((job_id, str(exc) or type(exc).__name__))
                continue
            dependents += len(moved)
            (changed if job.state == done_state else unchanged).append(job_id)
        return changed, unchanged, failed, dependents


def _in_progress_line(old_kind: str, count: int) -> str:
    return (
        f"left {count:,} job(s) of kind {old_kind!r} running or waiting for a callback as "
        "they were: rekind again any that retry once their attempt is over"
    )


def _rekind_sequence_lines(
    done: bulk.Rekinded, old_kind: str, new_kind: str, dry_run: bool
) -> list[str]:
    """What a rekind did to the sequence keys and queues of the jobs it changed."""
    lines = []
    if done.sequence_keys_remade:
        lines.append(
            f"{done.sequence_keys_remade:,} of them {'would get' if dry_run else 'got'} the "
            f"sequence key of kind {new_kind!r} (its sequence=)"
        )
    if done.sequence_keys_kept:
        why = (
            f"kind {new_kind!r} declares no sequence=, so they stay in line behind that key's "
            f"unfinished jobs of kind {old_kind!r}"
            if done.declared and not registry.defaults(new_kind).sequence
            else f"their args do not fit kind {new_kind!r}, or it is not declared here"
        )
        lines.append(
            f"{done.sequence_keys_kept:,} of them {'would keep' if dry_run else 'kept'} the "
            f"sequence key made from kind {old_kind!r}: {why}"
        )
    if done.split:
        shown = ", ".join(f"{i} ({state})" for i, state, _ in done.split_shown)
        lines.append(
            f"{done.split:,} job(s) of their old or new sequence key not rekinded and "
            f"unfinished (job(s) {shown}): the rekinded jobs may start before they finish"
        )
    if done.off_queue:
        queue = registry.defaults(new_kind).queue
        lines.append(
            f"{sum(jobs for _, jobs in done.off_queue):,} of them wait on "
            f"{bulk.off_queue_text(done.off_queue)}, not on {queue!r}, where the awa.Limit "
            f"of kind {new_kind!r} holds: they run there outside the limit"
        )
    return lines


def _dependents_line(operation: bulk.Operation, count: int) -> str:
    """What the operation did to the jobs that depend on those it changed (SPEC §11)."""
    return f"{bulk.DEPENDENTS_PAST[operation]} {count:,} dependent job(s) too"


def _ids(ids: list[int], shown: int = 20) -> str:
    if not ids:
        return ""
    more = f", … ({len(ids) - shown:,} more)" if len(ids) > shown else ""
    return ": " + ", ".join(map(str, ids[:shown])) + more
