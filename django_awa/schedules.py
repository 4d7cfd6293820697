"""Periodic jobs: ``awa.periodic(name, cron, args, ...)`` declared in ``jobs.py``.

The maintenance leader fires them. Each fire is enqueued in the transaction
that advances the schedule's row (locked ``FOR UPDATE``), so it is enqueued
exactly once however many workers run. ``pause_schedule``,
``resume_schedule`` and ``trigger_schedule`` steer one by name (SPEC §8). A
schedule whose row remains after its declaration left the code is *removed*:
it never fires, and is listed as such.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
import sys
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction

from . import sql
from .codec import require_text
from .enqueueing import EnqueueRequest, database_alias, enqueue_prepared, insert, prepare
from .exceptions import ConfigurationError, ScheduleNotFound, ValidationError
from .kinds import JobArgs, check_priority
from .models import Job, PeriodicSchedule

if TYPE_CHECKING:
    from croniter import croniter

logger = logging.getLogger(__name__)

MAX_CATCH_UP = 1000
# The most missed fires coalesce walks through to the latest.
MAX_COALESCED = 10_000_000
# Longer than any repeated hour (clocks go back at most two hours): the latest
# missed fire is found walking from this far before the one croniter counts back to.
_REPEAT_MARGIN = dt.timedelta(hours=3)
MISSED_POLICIES = ("coalesce", "catch_up")


# A cron's fields, seconds first when there are six: name, lowest and highest value.
_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day-of-month", 1, 31),
    ("month", 1, 12),
    ("day-of-week", 0, 6),
)
_SECONDS = ("second", 0, 59)
_MONTHS = "jan feb mar apr may jun jul aug sep oct nov dec".split()
_NAMES = {
    "month": {name: number for number, name in enumerate(_MONTHS, 1)},
    "day-of-week": {name: n for n, name in enumerate("sun mon tue wed thu fri sat".split())},
    "day-of-month": {"l": 31},  # L, the month's last day, ends a range
}
# croniter's hashed (H) and random (R) values: H(0-29), R/15, ...
_HASHED = re.compile(r"([hr])(\(.*\))?(/.*)?")
_RANGE = re.compile(r"([0-9a-z]+)-([0-9a-z]+)(/.*)?")


def _cron_problem(cron: str) -> str | None:
    """What in ``cron`` croniter reads otherwise than cron does; None if nothing.

    croniter takes all of these, so they are refused here, by field: ``H``
    (hashed; croniter wants an id for it), ``R`` (random: another value each
    time the expression is read, so each maintenance pass, and each worker,
    would fire at another time), a range that runs backwards (``22-2``:
    croniter wraps it, but loses values under a step, ``23-1/2`` being 23
    alone) and a range from a value to itself (``3-3``: croniter reads it as
    the whole field, every hour).
    """
    fields = cron.split()
    layout = (_SECONDS, *_FIELDS) if len(fields) == 6 else _FIELDS
    for (field, lowest, highest), text in zip(layout, fields, strict=False):
        names = _NAMES.get(field, {})
        for item in text.split(","):
            hashed = _HASHED.fullmatch(item.lower())
            if hashed:
                what = "H (hashed)" if hashed[1] == "h" else "R (random)"
                return f"{what} in the {field} field {text!r} is not supported: name the values"
            written = _RANGE.fullmatch(item.lower())
            if not written:
                continue
            low, high = (int(v) if v.isdigit() else names.get(v) for v in written.group(1, 2))
            if low is None or high is None or written[1] == "l":
                continue  # not a value (or L first): croniter names it
            if field == "day-of-week" and low == 7 and high < 7:
                low = 0  # 7 is Sunday too: 7-2 runs Sunday to Tuesday
            bounds, step = written[0].partition("/")[::2]
            start, end = item[: len(bounds)].split("-")
            if low > high:
                first = start if low == highest else f"{start}-{highest}"
                second = end if high == lowest else f"{lowest}-{end}"
                how = "list the values it should take" if step else f"write {first},{second}"
                return (
                    f"the range {start}-{end} in the {field} field {text!r} runs backwards: {how}"
                )
            if low == high:
                return (
                    f"the range {start}-{end} in the {field} field {text!r} names one value: "
                    f"write it alone ({start})"
                )
    return None


def _cron(expression: str, start: dt.datetime | None = None) -> croniter:
    """A croniter over ``expression`` from ``start``, seconds first when there are six fields.

    croniter is imported on first use, not with this module: its import runs
    ``file`` on the Python binary (a subprocess, about 15 ms), which every
    worker would pay at start-up whether or not the project declares a
    periodic job.
    """
    from croniter import croniter

    return croniter(expression, start, second_at_beginning=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Periodic:
    name: str
    cron: str
    args: JobArgs
    timezone: str = "UTC"
    queue: str | None = None
    priority: int | None = None
    missed: str = "coalesce"
    # Where the awa.periodic(...) call is (file:line): a second declaration of the
    # name elsewhere is refused, naming both.
    declared_at: str = dataclasses.field(default="", compare=False, repr=False)

    def fires_between(self, after: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
        """Fire times in (after, until], oldest first, at most MAX_CATCH_UP."""
        iterator = self._fires(after)
        fires: list[dt.datetime] = []
        while len(fires) < MAX_CATCH_UP:
            fire = next(iterator)
            if fire > until:
                break
            fires.append(fire)
        return fires

    def last_fire_between(self, after: dt.datetime, until: dt.datetime) -> dt.datetime | None:
        """The latest fire time in (after, until], however many come before it (what
        ``coalesce`` enqueues after a long outage); None if there is none.

        Found backwards from ``until`` (croniter's ``get_prev``), then walked
        forwards over the hours before it, where clocks going back may repeat
        one: a walk from ``after`` took some 40 µs a fire, minutes in the
        maintenance leader's transaction after weeks without an every-second
        schedule's fires, and stopped at the 10,000,000th.
        """
        tz = zoneinfo.ZoneInfo(self.timezone)
        ceiling = until.replace(microsecond=0) + dt.timedelta(seconds=1)  # cron has seconds
        previous: dt.datetime = _cron(self.cron, ceiling.astimezone(tz)).get_prev(dt.datetime)
        start = max(after, min(previous.astimezone(dt.UTC), until) - _REPEAT_MARGIN)
        last = self._last_fire_walking(start, until)
        if last is None and start > after:  # get_prev named no fire: walk it all
            last = self._last_fire_walking(after, until)
        return last

    def _last_fire_walking(self, after: dt.datetime, until: dt.datetime) -> dt.datetime | None:
        last = None
        # Bounded: 10,000,000 fires, months of an every-second schedule.
        for _, fire in zip(range(MAX_COALESCED), self._fires(after), strict=False):
            if fire > until:
                break
            last = fire
        return last

    def next_after(self, moment: dt.datetime) -> dt.datetime:
        return next(self._fires(moment))

    def _fires(self, after: dt.datetime) -> Iterator[dt.datetime]:
        """The fire times after ``after``, in UTC, oldest first.

        When clocks go back an hour, a local time comes twice. As cron does, a
        schedule with a fixed hour (``30 2 * * *``) fires once at it, at its first
        coming; one whose hour is a wildcard (``*/15 * * * *``) fires at each.
        """
        tz = zoneinfo.ZoneInfo(self.timezone)
        local_after = after.astimezone(tz)
        iterator = _cron(self.cron, local_after)
        fields = self.cron.split()
        hour = fields[2] if len(fields) == 6 else fields[1]
        fixed_hour = not hour.startswith("*")
        previous = local_after.replace(tzinfo=None)
        while True:
            fire: dt.datetime = iterator.get_next(dt.datetime)
            wall = fire.replace(tzinfo=None)
            if fixed_hour and wall <= previous:
                continue  # the repeated hour: this wall-clock time came already
            previous = wall
            yield fire.astimezone(dt.UTC)


schedules: dict[str, Periodic] = {}


def _declaration_place() -> str:
    """Where the code that called into django-awa is, as ``file:line``."""
    package = os.path.dirname(__file__) + os.sep
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def periodic(
    name: str,
    cron: str,
    args: JobArgs,
    *,
    timezone: str = "UTC",
    queue: str | None = None,
    priority: int | None = None,
    missed: str = "coalesce",
) -> Periodic:
    """Declare a periodic job. Five-field cron, or six with seconds first.

    Raises ``ValidationError`` naming what is wrong with the declaration, and
    ``ImproperlyConfigured`` for a name declared already elsewhere.
    """
    where = f"periodic {name!r}"
    if not isinstance(name, str) or not name or len(name) > 255:
        raise ValidationError(f"periodic: name must be a non-empty string, got {name!r}")
    require_text(name, f"periodic {name!r}: name")
    if not isinstance(args, JobArgs):
        raise ValidationError(f"{where}: args must be a JobArgs instance, got {args!r}")
    if not isinstance(cron, str) or len(cron.split()) not in (5, 6):
        raise ValidationError(
            f"{where}: cron must have five fields (or six, seconds first), got {cron!r}"
        )
    problem = _cron_problem(cron)
    if problem is not None:
        raise ValidationError(f"{where}: invalid cron expression {cron!r}: {problem}")
    from croniter import CroniterBadCronError, CroniterBadDateError

    try:
        # get_next: a cron naming no real date (February 30th) parses, but never fires.
        _cron(cron).get_next(dt.datetime)
    except (CroniterBadCronError, CroniterBadDateError, ValueError, KeyError) as exc:
        raise ValidationError(f"{where}: invalid cron expression {cron!r}: {exc}") from exc
    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ValidationError(f"{where}: unknown timezone {timezone!r}") from exc
    if missed not in MISSED_POLICIES:
        raise ValidationError(f"{where}: missed must be one of {MISSED_POLICIES}, got {missed!r}")
    if priority is not None:
        check_priority(priority, where)
    try:
        prepare(args, queue=queue, priority=priority)  # validates args and queue now
    except ValidationError as exc:
        # Named: several schedules in one jobs.py may fire the same kind.
        raise ValidationError(f"{where}: {exc}") from exc
    except ConfigurationError:
        # AWA settings that cannot be read: awa.E001 names them (manage.py check, and
        # every command that checks). Raising here, as jobs.py is imported, would
        # stop every command first with a traceback. The fires check the args.
        pass
    declared_at = _declaration_place()
    previous = schedules.get(name)
    # The same place again is its module re-imported (autoreload, tests): replace.
    if previous is not None and previous.declared_at != declared_at:
        raise ImproperlyConfigured(
            f"periodic schedule {name!r} is declared twice: at {previous.declared_at} "
            f"and at {declared_at}"
        )
    schedule = Periodic(
        name=name,
        cron=cron,
        args=args,
        timezone=timezone,
        queue=queue,
        priority=priority,
        missed=missed,
        declared_at=declared_at,
    )
    schedules[name] = schedule
    return schedule


def fire_due(alias: str, now: dt.datetime) -> int:
    """Enqueue every fire of every declared schedule due at ``now``; returns how many
    were enqueued. The caller's clock judges: maintenance passes the database's."""
    fired = 0
    declared = list(schedules.values())
    for schedule in declared:
        try:
            fired += _fire(schedule, alias, now)
        except Exception:
            logger.exception("periodic %r failed to fire", schedule.name)
    # A stored schedule no jobs.py declares is removed: marked so (no next fire, one
    # write), so that declared again it starts from then, not from its last fire.
    try:
        with transaction.atomic(using=alias):
            PeriodicSchedule.objects.using(alias).exclude(
                name__in=[schedule.name for schedule in declared]
            ).exclude(next_fire_at=None).update(next_fire_at=None)
    except Exception:
        logger.exception("periodic: marking removed schedules failed")
    return fired


def _fire(schedule: Periodic, alias: str, now: dt.datetime) -> int:
    with transaction.atomic(using=alias):
        row, created = _get_or_create_locked(schedule, alias, now)
        if created or row.paused:
            return 0
        # No next fire: removed from code (fire_due marked it), and declared again.
        changed = row.next_fire_at is None or (row.cron, row.timezone) != (
            schedule.cron,
            schedule.timezone,
        )
        if changed:
            row.cron, row.timezone, row.kind = schedule.cron, schedule.timezone, schedule.args.kind
            # Edited in code, or back in it: it starts from now, as a new schedule
            # does. The last fire is no mark for what was missed: from it, a cron
            # made every minute would catch up every minute since then, and one
            # back after a month away would catch up the month.
            row.last_fire_at = now
        if schedule.missed == "coalesce":
            last = schedule.last_fire_between(row.last_fire_at or now, now)
            fires = [] if last is None else [last]
        else:
            fires = schedule.fires_between(row.last_fire_at or now, now)
        for fire_at in fires:
            request = EnqueueRequest(
                schedule.args, queue=schedule.queue, priority=schedule.priority, run_at=fire_at
            )
            periodic = {"awa_periodic": {"name": schedule.name, "fire_at": fire_at.isoformat()}}
            prepared = prepare(request, metadata_json=json.dumps(periodic))
            if insert((prepared,), alias).skipped:
                logger.info(
                    "periodic %r fire at %s skipped: unique conflict", schedule.name, fire_at
                )
        if fires:
            row.last_fire_at = fires[-1]
        if fires or changed:
            row.next_fire_at = schedule.next_after(row.last_fire_at or now)
            row.save(using=alias)
        return len(fires)


# -- steering schedules (SPEC §8) ---------------------------------------------


def _database_now(alias: str) -> dt.datetime:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.DATABASE_NOW)
        now: dt.datetime = cursor.fetchone()[0]
    return now


def _row_for_update(name: str, alias: str) -> PeriodicSchedule:
    """The schedule's row, locked; made from its declaration if it has not fired yet.

    Raises ``ScheduleNotFound`` for a name neither declared nor stored.
    """
    row = PeriodicSchedule.objects.using(alias).select_for_update().filter(name=name).first()
    if row is not None:
        return row
    schedule = schedules.get(name)
    if schedule is None:
        raise ScheduleNotFound(f"no periodic schedule named {name!r}")
    row, _ = _get_or_create_locked(schedule, alias, _database_now(alias))
    return row


def _get_or_create_locked(
    schedule: Periodic, alias: str, now: dt.datetime
) -> tuple[PeriodicSchedule, bool]:
    """The schedule's row, locked (FOR UPDATE), created as of ``now`` on its first use;
    and whether it was created."""
    return (
        PeriodicSchedule.objects.using(alias)
        .select_for_update()
        .get_or_create(
            name=schedule.name,
            defaults={
                "cron": schedule.cron,
                "timezone": schedule.timezone,
                "kind": schedule.args.kind,
                "last_fire_at": now,
                "next_fire_at": schedule.next_after(now),
            },
        )
    )


def pause_schedule(name: str, *, using: str | None = None) -> PeriodicSchedule:
    """Stop schedule ``name`` firing until ``resume_schedule``; returns its row.

    Joins the caller's transaction on ``using``. Raises ``ScheduleNotFound``.
    """
    alias = database_alias(using)
    with transaction.atomic(using=alias):
        row = _row_for_update(name, alias)
        if not row.paused:
            row.paused = True
            row.save(using=alias, update_fields=["paused"])
    return row


def resume_schedule(name: str, *, using: str | None = None) -> PeriodicSchedule:
    """Let schedule ``name`` fire again, from now on: fires that fell due while it was
    paused are skipped, not caught up. Returns its row; raises ``ScheduleNotFound``."""
    alias = database_alias(using)
    with transaction.atomic(using=alias):
        row = _row_for_update(name, alias)
        if row.paused:
            now = _database_now(alias)
            row.paused = False
            row.last_fire_at = now
            declared = schedules.get(name)
            row.next_fire_at = declared.next_after(now) if declared else None
            row.save(using=alias, update_fields=["paused", "last_fire_at", "next_fire_at"])
    return row


def trigger_schedule(name: str, *, using: str | None = None) -> Job:
    """Enqueue one fire of schedule ``name`` now (paused or not), beside its regular fires.

    The job is the schedule's args, queue and priority, run now, with
    ``metadata["awa_periodic"] = {"name", "fire_at", "triggered": True}``. Joins
    the caller's transaction. Raises ``ScheduleNotFound`` for a name not
    declared in any ``jobs.py`` (a removed schedule has no args to fire), and
    ``UniqueConflict`` if the args' kind is unique and its key is held.
    """
    alias = database_alias(using)
    schedule = schedules.get(name)
    if schedule is None:
        stored = PeriodicSchedule.objects.using(alias).filter(name=name).exists()
        raise ScheduleNotFound(
            f"periodic schedule {name!r} was removed from code: it has nothing to fire"
            if stored
            else f"no periodic schedule named {name!r}"
        )
    with transaction.atomic(using=alias):
        fire_at = _database_now(alias)
        periodic = {
            "awa_periodic": {"name": name, "fire_at": fire_at.isoformat(), "triggered": True}
        }
        request = EnqueueRequest(schedule.args, queue=schedule.queue, priority=schedule.priority)
        return enqueue_prepared(prepare(request, metadata_json=json.dumps(periodic)), alias)


def is_declared(name: str) -> bool:
    """Whether a ``jobs.py`` declares schedule ``name`` (else its row is a removed one)."""
    return name in schedules
