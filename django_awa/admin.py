"""The Django admin (SPEC §8): jobs, queues, periodic schedules and pending follow-ups
(the live workers: ``fleet_admin.py``; the dashboard and dead letters, failed jobs
grouped: ``ops_admin.py``).

Job list pages stay cheap on tables of millions of rows: no full count, no
facet counts, an estimated count for the unfiltered list, no per-row queries,
and filter choices read from indexes and settings instead of a
``SELECT DISTINCT`` over the whole job table.

Retry and cancel need ``django_awa.change_job``, discard needs
``django_awa.delete_job``. Without them an action is not offered, and a
forged request is refused: the permission is checked again when it runs.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db import connections
from django.db.models import JSONField, Min, Model, Q, QuerySet, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator, smart_split, unescape_string_literal
from django.utils.translation import gettext, ngettext

from . import bulk, control, sql
from . import schedules as schedule_steering
from .admin_base import ModelAdmin as _ModelAdmin
from .admin_base import bad_request
from .bulk_admin import BulkOperationsMixin, dependents_text
from .codec import UnreadableJSON, check_text
from .conf import awa_settings
from .exceptions import AwaError, ValidationError
from .fleet import live
from .fleet_admin import running_worker
from .kinds import registry
from .models import (
    Dashboard,
    DeadLetter,
    Job,
    JobCount,
    JobQuerySet,
    JobState,
    PendingFollowup,
    PeriodicSchedule,
    Queue,
)
from .ops_admin import ErrorFilter  # registers the Dashboard and Dead letters pages too
from .producer import held_back, queue_limits
from .schedules import schedules
from .workflows import workflow_status

if TYPE_CHECKING:
    _JobPaginator = Paginator[Job]
else:
    # django-stubs makes Paginator generic; Django's own class takes no subscript.
    _JobPaginator = Paginator


logger = logging.getLogger(__name__)

# Follow-ups listed on a job's page; the rest are one click away (?trigger=<id>).
FOLLOWUPS_SHOWN = 50
# Filter choices stop after this many values.
MAX_FILTER_CHOICES = 200
# Above this many rows (pg_class estimate) the unfiltered list shows an estimate.
ESTIMATE_ABOVE = 100_000
# A filtered list counts at most this many matching rows exactly; past it, the
# planner's estimate ("about N").
COUNT_CAP = 10_000
# Past an estimated count, the list offers this many pages (COUNT_CAP rows).
MAX_PAGES = COUNT_CAP // 50
# A tag search (``tag:name``) looks at the newest this many jobs by id: no index
# holds the tags, so a tag matching nothing would read every row.
SEARCH_WINDOW = 100_000
TAG_PREFIX = "tag:"
# Below this heap size a sequential scan of awa_job is cheap.
SMALL_TABLE_BYTES = 64 * 1024 * 1024
# The job list's columns an index orders with the id on awa_job_done (migration
# 0013): the only ones it sorts by on a larger table.
LARGE_TABLE_SORTS = ("id", "kind", "queue")
# JSON nested deeper than this is shown compact, not pretty-printed: indenting
# each level makes a page quadratic in the depth.
PRETTY_DEPTH = 32
# A JSON value's text on a job page stops after this many characters.
JSON_SHOWN_CHARS = 100_000
# The largest id a bigint column holds.
MAX_JOB_ID = 2**63 - 1
# The JSON columns no column of the job list shows: left unread there (each
# admin's ``unlisted_json``), so a value Python cannot decode (nested too
# deep for its parser) spoils no list.
JOB_UNLISTED_JSON = tuple(
    field.name for field in Job._meta.concrete_fields if isinstance(field, JSONField)
)


def _alias() -> str:
    """The connection the admin reads and writes jobs on: ``AWA["DATABASE"]``."""
    return awa_settings().database


def _jobs(queryset: QuerySet[Job]) -> JobQuerySet:
    """``queryset`` as the ``JobQuerySet`` it is.

    Every job queryset the admin is given starts from ``Job.objects`` (a
    ``JobQuerySet`` manager) and keeps its class through each filter; the
    stubs of ModelAdmin, ChangeList and SimpleListFilter only say QuerySet.
    """
    return cast(JobQuerySet, queryset)


# -- user input -----------------------------------------------------------------


def job_id(text: str) -> int | None:
    """The job id ``text`` spells, or None: ASCII digits within bigint.

    Not ``str.isdigit()``: it takes superscripts (``²``), which ``int()``
    refuses, and other scripts' digits, which ``int()`` reads as numbers.
    """
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= MAX_JOB_ID else None


def holdable(text: str) -> bool:
    """Whether PostgreSQL can hold ``text`` (no NUL, valid UTF-8): else comparing a
    column with it raises ``DataError`` instead of matching nothing."""
    try:
        check_text(text)
    except ValueError:
        return False
    return True


def unholdable_parameter(request: HttpRequest) -> HttpResponseBadRequest | None:
    """A 400 naming the first query parameter PostgreSQL cannot hold, if any.

    Every list filter, the search and any lookup Django passes on reach a
    query as text; one check of them all here, before any of them is used.
    """
    for name, values in request.GET.lists():
        if not all(holdable(text) for text in (name, *values)):
            return bad_request(
                f"query parameter {name!r} holds a NUL character or invalid text, "
                f"which PostgreSQL cannot hold: nothing can match it"
            )
    return None


# -- rendering ----------------------------------------------------------------------


class RawJSON(str):
    """The text of a JSON column Python could not decode (nested too deep, or an integer
    of more digits than ``int()`` takes)."""


def _depth_over(value: Any, limit: int) -> bool:
    """Whether lists and objects nest in ``value`` more than ``limit`` deep (no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def json_text(value: Any, *, indent: int | None = None, limit: int = JSON_SHOWN_CHARS) -> str:
    """``value`` as ``json.dumps(value, indent=indent, sort_keys=True,
    ensure_ascii=False, default=str)`` writes it, cut after ``limit`` characters.

    Iterative: ``json.dumps`` recurses once per level (twice with ``indent``),
    and a value nested 950 deep, which jsonb holds, exceeds Python's recursion
    limit. It stops writing at ``limit``, however large the value.
    """
    item_sep, key_sep = ("," if indent is not None else ", "), ": "
    parts: list[str] = []
    size = 0
    # A stack of (value to write, level) and of text, written as it is popped.
    stack: list[tuple[Any, int] | str] = [(value, 0)]
    while stack and size < limit:
        top = stack.pop()
        if isinstance(top, str):
            piece = top
        else:
            item, level = top
            if isinstance(item, RawJSON):
                piece = str(item)
            elif isinstance(item, (dict, list)) and item:
                close = "}" if isinstance(item, dict) else "]"
                inner = "" if indent is None else "\n" + " " * (indent * (level + 1))
                outer = "" if indent is None else "\n" + " " * (indent * level)
                if isinstance(item, dict):
                    entries = sorted(
                        ((k if isinstance(k, str) else str(k)), v) for k, v in item.items()
                    )
                    members = [(json.dumps(k, ensure_ascii=False) + key_sep, v) for k, v in entries]
                else:
                    members = [("", v) for v in item]
                stack.append(outer + close)
                for position in range(len(members) - 1, -1, -1):
                    prefix, child = members[position]
                    stack.append((child, level + 1))
                    stack.append((item_sep if position else "") + inner + prefix)
                piece = "{" if isinstance(item, dict) else "["
            elif isinstance(item, (dict, list)):
                piece = "{}" if isinstance(item, dict) else "[]"
            else:
                piece = json.dumps(item, ensure_ascii=False, default=str)
        parts.append(piece)
        size += len(piece)
    text = "".join(parts)
    return text[:limit] + "…" if stack or len(text) > limit else text


def short_text(value: Any, limit: int = 200) -> str:
    """A JSON value for one line of a page: a string as it is, anything else as JSON."""
    if isinstance(value, str) and not isinstance(value, RawJSON):
        return value
    return json_text(value, limit=limit)


def _pretty_json(value: Any) -> SafeString:
    """A JSON value for a job page: indented, or compact when nested too deep; cut
    after ``JSON_SHOWN_CHARS``, saying so."""
    if value is None or value == {} or value == []:
        return format_html('<span class="awa-empty">{}</span>', "(none)")
    notes = []
    if isinstance(value, RawJSON) or _depth_over(value, PRETTY_DEPTH):
        text = json_text(value)
        notes.append(f"nested too deep to indent (over {PRETTY_DEPTH} levels): shown compact")
    else:
        text = json_text(value, indent=2)
    if len(text) > JSON_SHOWN_CHARS:
        notes.append(f"cut after {JSON_SHOWN_CHARS:,} characters")
    if not notes:
        return format_html('<pre class="awa-json">{}</pre>', text)
    return format_html(
        '<p class="awa-json-note">{}</p><pre class="awa-json">{}</pre>', "; ".join(notes), text
    )


def _to_datetime(value: datetime | str | None) -> datetime | None:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if value is not None and timezone.is_aware(value):
        value = timezone.localtime(value)
    return value


def _short_time(value: datetime | None) -> SafeString | str:
    """``2026-01-31 13:05:09`` in the current time zone, the zone in the tooltip."""
    moment = _to_datetime(value)
    if moment is None:
        return "-"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        moment.isoformat(),
        moment.strftime("%Y-%m-%d %H:%M:%S %Z"),
        moment.strftime("%Y-%m-%d %H:%M:%S"),
    )


def _long_time(value: Any) -> str:
    """``2026-01-31 13:05:09 UTC`` in the current time zone; other JSON as it is."""
    if not isinstance(value, (datetime, str)) and value is not None:
        return short_text(value)
    moment = _to_datetime(value)
    if moment is None:
        return str(value or "")
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _timestamp(name: str, label: str) -> Callable[[Any, Job], str]:
    """A job page field showing timestamp column ``name`` to the second."""

    @admin.display(description=label)
    def show(model_admin: Any, obj: Job) -> str:
        return _long_time(getattr(obj, name)) or "-"

    return show


def _span(seconds: float) -> str:
    """``0.25s``, ``42s``, ``3m 05s``, ``2h 04m``, ``3d 1h``."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600}h"


def _attempt_ended(job: Job) -> datetime | None:
    """When the job's latest attempt ended: finalized_at, or its errors entry's time."""
    if job.finalized_at is not None:
        return job.finalized_at
    last = job.errors[-1] if job.errors else None
    if isinstance(last, dict) and last.get("attempt") == job.attempt:
        return _to_datetime(last.get("at"))
    return None


def wait_text(job: Job) -> str:
    """How long the latest attempt waited from due (run_at) to its start (attempted_at)."""
    if job.attempted_at is None or job.run_at is None:
        return "-" if job.attempted_at is None else ""
    if job.run_at > job.attempted_at:
        # run_at moved on (a retry's backoff, a snooze): the next run's due time.
        return "- (run at is the next run's due time)"
    return _span((job.attempted_at - job.run_at).total_seconds())


def duration_text(job: Job) -> str:
    """How long the latest attempt ran: to its outcome, or so far while running."""
    if job.attempted_at is None:
        return "-"
    if job.state == JobState.RUNNING:
        # For display only: the attempt's end is not recorded yet.
        return f"{_span(max(0.0, (timezone.now() - job.attempted_at).total_seconds()))} so far"
    ended = _attempt_ended(job)
    if ended is None or ended < job.attempted_at:
        return "-"
    return _span((ended - job.attempted_at).total_seconds())


def _job_link(job_id: int, label: str) -> SafeString:
    url = reverse("admin:django_awa_job_change", args=[job_id])
    return format_html('<a href="{}">{}</a>', url, label)


def _unquoted(word: str) -> str:
    """``word`` without the quotes around it, if it has them (a ``smart_split`` phrase:
    ``"a b"`` or ``'a b'``, backslash escapes undone), as Django's search takes them."""
    if len(word) > 1 and word[0] in "\"'" and word[-1] == word[0]:
        return unescape_string_literal(word)
    return word


def _state_badge(state: str) -> SafeString:
    try:
        label = JobState(state).label
    except ValueError:
        label = state
    return format_html('<span class="awa-state awa-state-{}">{}</span>', state, label)


def _job_list(jobs: Iterable[Job], empty: str) -> SafeString | str:
    items = [(_job_link(job.id, f"{job.kind} #{job.id}"), _state_badge(job.state)) for job in jobs]
    if not items:
        return empty
    return format_html(
        '<ul class="awa-dependencies">{}</ul>', format_html_join("", "<li>{} {}</li>", items)
    )


# The most nodes a workflow's graph draws (the rest are counted, not drawn).
GRAPH_NODES_SHOWN = 300
_NODE_W, _NODE_H, _GAP_X, _GAP_Y = 150, 34, 60, 16


def workflow_svg(jobs: list[Job], alias: str) -> SafeString:
    """The graph of a workflow's jobs as inline SVG: one column per depth (the
    longest chain of dependencies before it), nodes coloured by state and each a
    link to its job; dashed edges are ``requires="finished"``."""
    shown = jobs[:GRAPH_NODES_SHOWN]
    ids = {job.id for job in shown}
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.WORKFLOW_EDGES, {"workflow_id": jobs[0].workflow_id})
        edges = [(a, b, r) for a, b, r, _ in cursor.fetchall() if a in ids and b in ids]
    deps: dict[int, list[int]] = {}
    for job_id, dep, _ in edges:
        deps.setdefault(job_id, []).append(dep)
    depth: dict[int, int] = {}
    for job in sorted(shown, key=lambda j: j.id):  # dependencies have smaller ids
        depth[job.id] = 1 + max((depth.get(d, 0) for d in deps.get(job.id, ())), default=-1)
    columns: dict[int, list[Job]] = {}
    for job in shown:
        columns.setdefault(depth[job.id], []).append(job)
    where: dict[int, tuple[int, int]] = {}
    for column, members in columns.items():
        for row, job in enumerate(members):
            where[job.id] = (
                10 + column * (_NODE_W + _GAP_X),
                10 + row * (_NODE_H + _GAP_Y),
            )
    width = 20 + (max(columns, default=0) + 1) * (_NODE_W + _GAP_X)
    height = 20 + max((len(m) for m in columns.values()), default=1) * (_NODE_H + _GAP_Y)
    lines = format_html_join(
        "",
        '<line x1="{}" y1="{}" x2="{}" y2="{}" class="{}" marker-end="url(#awa-arrow)"/>',
        (
            (
                where[dep][0] + _NODE_W,
                where[dep][1] + _NODE_H // 2,
                where[job_id][0],
                where[job_id][1] + _NODE_H // 2,
                "awa-edge-finished" if requires == "finished" else "awa-edge",
            )
            for job_id, dep, requires in edges
        ),
    )
    nodes = format_html_join(
        "",
        '<a href="{}" class="awa-node" data-job="{}" data-state="{}"><title>{}</title>'
        '<rect x="{}" y="{}" width="{}" height="{}" class="awa-node-{}"/>'
        '<text x="{}" y="{}">{}</text></a>',
        (
            (
                reverse("admin:django_awa_job_change", args=[job.id]),
                job.id,
                job.state,
                f"{job.kind} #{job.id}: {job.state}",
                where[job.id][0],
                where[job.id][1],
                _NODE_W,
                _NODE_H,
                job.state,
                where[job.id][0] + 8,
                where[job.id][1] + 21,
                Truncator(f"#{job.id} {_step_label(job)}").chars(22),
            )
            for job in shown
        ),
    )
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="awa-graph" width="{}" height="{}" '
        'role="img" aria-label="workflow graph"><defs><marker id="awa-arrow" markerWidth="8" '
        'markerHeight="8" refX="8" refY="4" orient="auto"><path d="M0,0 L8,4 L0,8 z" '
        'fill="#6b7280"/></marker></defs>{}{}</svg>',
        width,
        height,
        lines,
        nodes,
    )


def _step_label(job: Job) -> str:
    entry = job.metadata.get("awa_workflow") if isinstance(job.metadata, dict) else None
    step = entry.get("step") if isinstance(entry, dict) else None
    return step if isinstance(step, str) else job.kind


def _overdue_note(job: Job) -> SafeString | str:
    """Why a ``running`` job is no longer held, if it is not: until maintenance rescues it.

    Its handler may still run in a worker (one that ignores cancellation): see
    the worker's log for the stuck thread.
    """
    if job.state != JobState.RUNNING:
        return ""
    now = timezone.now()  # for display only: maintenance judges on the database clock
    if job.deadline_at is not None and job.deadline_at < now:
        why = f"deadline passed {(now - job.deadline_at).total_seconds():.0f}s ago"
    elif job.heartbeat_at is not None and (
        (idle := (now - job.heartbeat_at).total_seconds()) > awa_settings().stale_after
    ):
        why = f"no heartbeat for {idle:.0f}s"
    else:
        return ""
    return format_html(
        ' <small class="awa-overdue" style="color: #b91c1c" title="{}">not held: {}</small>',
        "No worker holds this attempt now; maintenance rescues it on its next pass.",
        why,
    )


class _UnlistedJSONChangeList(ChangeList):
    """A change list that does not read the JSON columns its rows do not show."""

    def get_queryset(
        self, request: HttpRequest, exclude_parameters: list[str | None] | None = None
    ) -> QuerySet[Any]:
        queryset = super().get_queryset(request, exclude_parameters)
        # Only AwaModelAdmin.get_changelist makes this change list.
        if isinstance(self.model_admin, AwaModelAdmin):
            queryset = queryset.defer(*self.model_admin.unlisted_json)
        return queryset


class _JobChangeList(_UnlistedJSONChangeList):
    """The job list: sorted only by the columns ``get_sortable_by`` offers, ties
    broken by id in the direction of the first sort column, so one index on (that
    column, id) reads a page in order (Django breaks ties by ``-pk`` whatever the
    direction; the job admin's own ordering, ``-id``, comes last too)."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        if self.params.get(ORDER_VAR) and self.sortable_by is not None:
            # A sort by a column the admin does not offer (on a large table, one
            # no index orders: sorting every row for each page) is left out, of
            # the query and of the page's links alike.
            kept = [
                part
                for part in str(self.params[ORDER_VAR]).split(".")
                if (index := part.rpartition("-")[2]).isdigit()
                and int(index) < len(self.list_display)
                and self.list_display[int(index)] in self.sortable_by
            ]
            if kept:
                self.params[ORDER_VAR] = ".".join(kept)
            else:
                del self.params[ORDER_VAR]
        ordering = list(super().get_ordering(request, queryset))
        first = ordering[0] if ordering else None
        if len(ordering) > 1 and ordering[-1] in ("-pk", "-id") and isinstance(first, str):
            if not first.startswith("-") and first not in ("pk", "id"):
                ordering[-1] = "pk"
        return ordering

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        whole = (self.show_all and self.can_show_all) or not self.multi_page
        if whole and isinstance(self.result_list, QuerySet):
            # One page holds every match (at most list_max_show_all): its ids
            # first here too, as EstimatedCountPaginator.page reads them.
            ids = self.result_list.values_list("pk", flat=True)[: self.list_max_show_all]
            self.result_list = self.result_list.filter(pk__in=list(ids))


class AwaModelAdmin[M: Model](_ModelAdmin[M]):
    """What every awa admin page does with input no query can answer.

    A list request with a parameter PostgreSQL cannot hold gets 400 (see
    ``refusal``); an object id it cannot hold names no object (Django's "does
    not exist" redirect). The list leaves ``unlisted_json`` unread.
    """

    # JSON columns the list does not show, so does not read.
    unlisted_json: tuple[str, ...] = ()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _UnlistedJSONChangeList

    def refusal(self, request: HttpRequest) -> HttpResponseBadRequest | None:
        """A 400 for a list request that no query can answer, else None."""
        return unholdable_parameter(request)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return self.refusal(request) or super().changelist_view(request, extra_context)

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> M | None:
        if not holdable(object_id):
            return None
        return super().get_object(request, object_id, from_field)


def _with_raw_json(queryset: QuerySet[Job]) -> Job | None:
    """The one job of ``queryset``, its JSON columns decoded where Python can and
    kept as ``RawJSON`` text where it cannot."""
    texts = {f"{name}_text": Cast(name, TextField()) for name in JOB_UNLISTED_JSON}
    job = queryset.defer(*JOB_UNLISTED_JSON).annotate(**texts).first()
    if job is None:
        return None
    for name in JOB_UNLISTED_JSON:
        text = getattr(job, f"{name}_text")
        try:
            value = None if text is None else json.loads(text)
        except (RecursionError, ValueError):  # too deep, or an integer int() refuses
            value = RawJSON(text)
        setattr(job, name, value)
    return job


class EstimatedCountPaginator(_JobPaginator):
    """Counts exactly up to ``COUNT_CAP`` rows; past it, the planner's estimate.
    Reads a page's ids first, then its rows.

    ``count(*)`` over millions of rows reads them all on every page view. The
    unfiltered list takes the catalog's estimate of the tables' rows; a
    filtered one counts at most ``COUNT_CAP + 1`` matching rows, and past that
    asks the planner (EXPLAIN, no rows read). ``estimated`` says which: the
    page then shows "about N", and offers at most ``MAX_PAGES`` pages (a
    deeper page reads every row before it; sorting the other way shows the
    oldest first).

    A page's ids come from one query that needs no column but the filtered
    and sorted ones, so an index on those and ``id`` (migration 0013) answers
    it without reading a row, in order, however the matching rows lie; the
    rows of those 50 ids are read by primary key. Read in one query, the
    planner walks the primary key past every newer row when the matches are
    all old (a queue whose jobs failed last week).
    """

    estimated = False

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        if not queryset.query.where:
            with connections[queryset.db].cursor() as cursor:
                cursor.execute(sql.ESTIMATED_ROWS)
                row = cursor.fetchone()
            if row is not None and row[0] >= ESTIMATE_ABOVE:
                self.estimated = True
                return int(row[0])
            return super().count
        # Only the ids: an index holding the filtered columns counts them alone.
        counted = queryset.order_by().values("pk")[: COUNT_CAP + 1].count()
        if counted <= COUNT_CAP:
            return counted
        self.estimated = True
        plan = json.loads(queryset.order_by().values("pk").explain(format="json"))
        return max(int(plan[0]["Plan"]["Plan Rows"]), counted)

    @cached_property
    def num_pages(self) -> int:
        pages = super().num_pages
        if self.estimated:
            return min(pages, MAX_PAGES)
        return pages

    @property
    def capped(self) -> bool:
        """Whether pages past ``MAX_PAGES`` are not offered."""
        return self.estimated and self.num_pages == MAX_PAGES

    def page(self, number: int | str) -> Page[Job]:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().page(number)
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = bottom + self.per_page
        ids = list(queryset.values_list("pk", flat=True)[bottom:top])
        return Page(queryset.filter(pk__in=ids), number, self)


def _is_small(alias: str) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.TABLE_BYTES)
        size: int = cursor.fetchone()[0]
    return size <= SMALL_TABLE_BYTES


def _column_values(alias: str, statement: str, params: dict[str, Any]) -> set[str]:
    with connections[alias].cursor() as cursor:
        cursor.execute(statement, params)
        return {row[0] for row in cursor.fetchall()}


def known_kinds() -> set[str]:
    """Kinds for the filter, without reading a large job table.

    A small table is scanned. A large one: the kinds declared in this process
    and those in the planner's statistics; a rare undeclared kind may be
    missed, and ``?kind=<name>`` still filters by it.
    """
    alias = _alias()
    if _is_small(alias):
        return _column_values(alias, sql.DISTINCT_KINDS, {"limit": MAX_FILTER_CHOICES})
    sampled = _column_values(alias, sql.SAMPLED_VALUES, {"column": "kind"})
    return set(registry.workers) | set(registry.args_classes) | sampled


def known_queues() -> set[str]:
    """Queue names for the filter, without reading a large job table.

    A small table is scanned. A large one: the queues of settings,
    declarations and queue rows, those holding available jobs (claim index)
    and those in the planner's statistics; a rare queue holding only finished
    jobs may be missed, and ``?queue=<name>`` still filters by it.
    """
    alias = _alias()
    names = set(awa_settings().queues)
    names.update(spec.queue for spec in registry.workers.values())
    names.update(p.queue for p in schedules.values() if p.queue)
    names.update(Queue.objects.using(alias).values_list("name", flat=True))
    if _is_small(alias):
        names |= _column_values(alias, sql.DISTINCT_QUEUES, {"limit": MAX_FILTER_CHOICES})
    else:
        names |= _column_values(alias, sql.AVAILABLE_QUEUES, {"limit": MAX_FILTER_CHOICES})
        names |= _column_values(alias, sql.SAMPLED_VALUES, {"column": "queue"})
    return names


class _ColumnFilter(admin.SimpleListFilter):
    """A filter whose choices are the known values of one column (plus the one in use)."""

    def known(self) -> set[str]:
        raise NotImplementedError

    def narrow(self, queryset: JobQuerySet, value: str) -> QuerySet[Job]:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = self.known()
        if current := self.value():
            values.add(current)
        return [(value, value) for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        return self.narrow(_jobs(queryset), value) if value else queryset


class KindFilter(_ColumnFilter):
    title = "kind"
    parameter_name = "kind"

    def known(self) -> set[str]:
        return known_kinds()

    def narrow(self, queryset: JobQuerySet, value: str) -> QuerySet[Job]:
        return queryset.of_kind(value)


class QueueFilter(_ColumnFilter):
    title = "queue"
    parameter_name = "queue"

    def known(self) -> set[str]:
        return known_queues()

    def narrow(self, queryset: JobQuerySet, value: str) -> QuerySet[Job]:
        return queryset.in_queue(value)


class TriggerFilter(admin.SimpleListFilter):
    """``?trigger=<id>``: the follow-ups of one job. Shown only while in use."""

    title = "follow-ups of"
    parameter_name = "trigger"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = request.GET.get(self.parameter_name, "")
        return [(value, f"job #{value}")] if job_id(value) is not None else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        # JobAdmin.changelist_view refused a value that is not a job id.
        trigger = job_id(self.value() or "")
        return queryset if trigger is None else _jobs(queryset).followups_of(trigger)


@admin.register(Job)
class JobAdmin(BulkOperationsMixin, AwaModelAdmin[Job]):
    list_display = (
        "id",
        "kind",
        "queue",
        "state_badge",
        "priority",
        "attempts",
        "run_at_short",
        "finalized_at_short",
        "last_error",
    )
    list_display_links = ("id", "kind")
    list_filter = ("state", QueueFilter, KindFilter, TriggerFilter, ErrorFilter)
    search_fields = ("kind", "queue")  # the search itself is get_search_results
    search_help_text = (
        f"A job id; or text in the kind or queue name; or {TAG_PREFIX}name, an exact tag "
        f'among the newest {SEARCH_WINDOW:,} jobs ({TAG_PREFIX}"my tag" for one with spaces).'
    )
    ordering = ("-id",)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    unlisted_json = JOB_UNLISTED_JSON
    actions = ("retry_jobs", "cancel_jobs", "discard_jobs")
    running_worker = running_worker  # the job page's link to its worker (fleet_admin.py)
    # The job page's times, to the second (the admin's default format drops seconds).
    run_at_s = _timestamp("run_at", "run at")
    created_at_s = _timestamp("created_at", "created at")
    attempted_at_s = _timestamp("attempted_at", "attempted at")
    heartbeat_at_s = _timestamp("heartbeat_at", "heartbeat at")
    deadline_at_s = _timestamp("deadline_at", "deadline at")
    finalized_at_s = _timestamp("finalized_at", "finalized at")
    readonly_fields = (
        "id",
        "kind",
        "queue",
        "state_badge",
        "priority",
        "attempts",
        "tag_list",
        "run_at_s",
        "created_at_s",
        "attempted_at_s",
        "heartbeat_at_s",
        "deadline_at_s",
        "finalized_at_s",
        "waited",
        "ran",
        "running_worker",
        "args_json",
        "error_list",
        "progress_json",
        "trigger_link",
        "followup_links",
        "result_json",
        "workflow_link",
        "dependency_links",
        "dependent_links",
        "metadata_json",
        "callback_id",
        "callback_timeout_at",
        "run_lease",
        "unique_key",
    )
    fieldsets = (
        (
            None,
            {"fields": (("kind", "queue", "state_badge"), ("priority", "attempts", "tag_list"))},
        ),
        (
            "Timing",
            {
                "fields": (
                    ("run_at_s", "created_at_s", "attempted_at_s"),
                    ("heartbeat_at_s", "deadline_at_s", "finalized_at_s"),
                    ("waited", "ran"),
                    ("running_worker",),
                )
            },
        ),
        ("Arguments", {"fields": ("args_json",)}),
        ("Errors, oldest first", {"fields": ("error_list",)}),
        ("Progress", {"fields": ("progress_json",)}),
        ("Result", {"fields": ("result_json",)}),
        ("Follow-up chain", {"fields": ("trigger_link", "followup_links")}),
        ("Workflow", {"fields": ("workflow_link", "dependency_links", "dependent_links")}),
        (
            "Metadata",
            {
                "fields": (
                    "metadata_json",
                    ("callback_id", "callback_timeout_at"),
                    ("run_lease", "unique_key"),
                )
            },
        ),
    )

    # -- list --------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> JobQuerySet:
        # The last errors entry's text only, read by the database: the list
        # leaves the errors column (tracebacks and all) unread.
        jobs = super().get_queryset(request).using(_alias())
        return _jobs(jobs.annotate(last_error_text=KT("errors__-1__error")))

    @admin.display(description=getattr(admin.ModelAdmin.action_checkbox, "short_description", ""))
    def action_checkbox(self, obj: Job) -> SafeString:
        """Django's row checkbox, written out: rendering the widget's template for
        each of 50 rows took a sixth of the list's time."""
        return format_html(
            '<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
            helpers.ACTION_CHECKBOX_NAME,
            obj.pk,
            format_html(gettext("Select this object for an action - {}"), str(obj)),
        )

    @admin.display(description="last error")
    def last_error(self, obj: Job) -> str:
        text = getattr(obj, "last_error_text", None)
        if not text:
            return ""
        shown = Truncator(" ".join(str(text).split())).chars(120)
        # Two lines at most (the styles' awa-clamp), the rest in its title: wrapped
        # whole into a column squeezed by the others, it made each row five lines tall.
        return format_html('<span class="awa-clamp" title="{}">{}</span>', shown, shown)

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Job) -> SafeString:
        return format_html("{}{}", _state_badge(obj.state), _overdue_note(obj))

    @admin.display(description="attempt", ordering="attempt")
    def attempts(self, obj: Job) -> str:
        return f"{obj.attempt}/{obj.max_attempts}"

    @admin.display(description="run at", ordering="run_at")
    def run_at_short(self, obj: Job) -> SafeString | str:
        return _short_time(obj.run_at)

    @admin.display(description="finalized at", ordering="finalized_at")
    def finalized_at_short(self, obj: Job) -> SafeString | str:
        return _short_time(obj.finalized_at)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        """Each word must match; quotes make a phrase one word, as in Django's
        own search (``"a b"``, and ``tag:"a b"`` for a tag with spaces). A
        number (or ``#number``) is a job id, found by primary key.
        ``tag:name`` is an exact tag, among the newest ``SEARCH_WINDOW`` jobs
        (a range of the primary key: no index holds the tags). Other text is
        part of a kind or queue name: of the kinds and queues the filters
        offer (``known_kinds``, ``known_queues``) those that hold it, case
        aside, or, if none, the word itself; found among all jobs by the
        indexes on kind and queue (migration 0013)."""
        tags = False
        names: tuple[set[str], set[str]] | None = None
        for word in map(_unquoted, smart_split(search_term)):
            if not word:
                continue
            number = job_id(word.removeprefix("#"))
            if number is not None:
                queryset = queryset.filter(id=number)
            elif word.startswith(TAG_PREFIX) and len(word) > len(TAG_PREFIX):
                tag = _unquoted(word.removeprefix(TAG_PREFIX))
                queryset = queryset.filter(tags__contains=[tag])
                tags = True
            else:
                if names is None:
                    names = known_kinds(), known_queues()
                needle = word.casefold()
                kinds, queues = ({n for n in known if needle in n.casefold()} for known in names)
                if not (kinds or queues):
                    # A name the filters do not know (rare on a large table).
                    kinds = queues = {word}
                # One name is one index range in id order; an OR of several is
                # read by bitmap and sorted.
                match = Q(kind__in=sorted(kinds)) if kinds else Q()
                if queues:
                    match |= Q(queue__in=sorted(queues))
                queryset = queryset.filter(match)
        if tags:
            newest = Job.objects.using(queryset.db).order_by("-id").values_list("id", flat=True)
            last = newest.first()
            if last is not None and last > SEARCH_WINDOW:
                queryset = queryset.filter(id__gt=last - SEARCH_WINDOW)
        return queryset, False

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes action_location; 5.2 calls get_actions(request).
        kwargs = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **kwargs)
        # discard_jobs replaces it: one DELETE, no collector walk per object.
        actions.pop("delete_selected", None)
        return actions

    def refusal(self, request: HttpRequest) -> HttpResponseBadRequest | None:
        refused = super().refusal(request)
        if refused is not None:
            return refused
        trigger = request.GET.get(TriggerFilter.parameter_name)
        if trigger is not None and job_id(trigger) is None:
            return bad_request(f"trigger must be a job id, got {trigger!r}")
        selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        odd = [value for value in selected if job_id(value) is None]
        if odd:
            return bad_request(f"selected jobs must be job ids, got {odd[0]!r}")
        return None

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {
            "title": "Jobs",
            **self._links(request),
            "awa_bulk_links": self.bulk_links(request),  # bulk_admin.py
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    def _sortable(self, request: HttpRequest) -> bool:
        """Whether the list sorts by every column: only on a small table."""
        sortable = getattr(request, "_awa_sortable", None)
        if sortable is None:
            sortable = _is_small(_alias())
            request._awa_sortable = sortable  # type: ignore[attr-defined]
        return sortable

    def get_sortable_by(self, request: HttpRequest) -> Any:
        if self._sortable(request):
            return super().get_sortable_by(request)
        return LARGE_TABLE_SORTS

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _JobChangeList

    def _links(self, request: HttpRequest) -> dict[str, str]:
        """Shortcuts to the other awa pages the user may open."""
        links = {
            "awa_failed_url": reverse("admin:django_awa_job_changelist")
            + "?"
            + urlencode({"state__exact": JobState.FAILED}),
        }
        # Each page's own admin decides, as its changelist does when opened: a
        # user with only change_queue, say, may open the queues.
        for key, model in (
            ("awa_queues_url", Queue),
            ("awa_dead_letters_url", DeadLetter),
            ("awa_dashboard_url", Dashboard),
            ("awa_pending_url", PendingFollowup),
            ("awa_periodic_url", PeriodicSchedule),
        ):
            if not self.admin_site.is_registered(model):
                continue  # a project's own admin site without it
            if self.admin_site.get_model_admin(model).has_view_or_change_permission(request):
                opts = model._meta
                links[key] = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        return links

    # -- detail ------------------------------------------------------------

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Job | None:
        if from_field is not None:
            return super().get_object(request, object_id, from_field)
        number = job_id(object_id)
        if number is None:
            return None
        queryset = self.get_queryset(request).filter(id=number)
        job = queryset.first()
        if job is not None and any(
            isinstance(getattr(job, name), UnreadableJSON) for name in JOB_UNLISTED_JSON
        ):
            # A JSON column Python cannot read (nested deeper than json.loads goes, an
            # integer of more digits than int() takes): its stored text, as it is.
            return _with_raw_json(queryset)
        return job

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        # The row is written by workers and the control functions only: its
        # page is always read-only. Without ``obj`` this answers for the
        # retry and cancel actions, which need ``change_job``.
        if obj is not None:
            return False
        return super().has_change_permission(request)

    @admin.display(description="waited (due to start)")
    def waited(self, obj: Job) -> str:
        return wait_text(obj)

    @admin.display(description="ran (latest attempt)")
    def ran(self, obj: Job) -> str:
        return duration_text(obj)

    @admin.display(description="tags")
    def tag_list(self, obj: Job) -> str:
        tags = obj.tags if isinstance(obj.tags, list) else [obj.tags]
        return ", ".join(short_text(tag) for tag in tags if tag is not None) or "(none)"

    @admin.display(description="args")
    def args_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.args)

    @admin.display(description="progress")
    def progress_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.progress)

    @admin.display(description="metadata")
    def metadata_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.metadata)

    @admin.display(description="result")
    def result_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.result)

    @admin.display(description="workflow")
    def workflow_link(self, obj: Job) -> SafeString | str:
        if obj.workflow_id is None:
            return "(not part of a workflow)"
        entry = (obj.metadata or {}).get("awa_workflow") if isinstance(obj.metadata, dict) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        url = reverse("admin:django_awa_job_workflow", args=[obj.workflow_id])
        return format_html('<a href="{}">{}</a>', url, short_text(name or str(obj.workflow_id)))

    @admin.display(description="waits for")
    def dependency_links(self, obj: Job) -> SafeString | str:
        return _job_list(obj.dependencies(), "(no dependencies)")

    @admin.display(description="needed by")
    def dependent_links(self, obj: Job) -> SafeString | str:
        return _job_list(obj.dependents()[: FOLLOWUPS_SHOWN + 1], "(no dependents)")

    @admin.display(description="errors")
    def error_list(self, obj: Job) -> SafeString:
        if not isinstance(obj.errors, list):
            return _pretty_json(obj.errors)
        errors = [e for e in obj.errors if isinstance(e, dict)]
        if not errors:
            return format_html('<span class="awa-empty">{}</span>', "(none)")
        return format_html(
            '<ol class="awa-errors">{}</ol>',
            format_html_join(
                "",
                '<li class="awa-error"><div class="awa-error-head">Attempt {} · {}</div>'
                '<pre class="awa-error-message">{}</pre>{}</li>',
                (
                    (
                        short_text(entry.get("attempt", "?")),
                        _long_time(entry.get("at")),
                        short_text(entry.get("error", ""), JSON_SHOWN_CHARS),
                        format_html(
                            '<pre class="awa-traceback">{}</pre>',
                            short_text(entry["traceback"], JSON_SHOWN_CHARS),
                        )
                        if entry.get("traceback")
                        else "",
                    )
                    for entry in errors
                ),
            ),
        )

    @admin.display(description="enqueued by")
    def trigger_link(self, obj: Job) -> SafeString | str:
        metadata = obj.metadata if isinstance(obj.metadata, dict) else {}
        trigger = metadata.get("awa_trigger")
        if not isinstance(trigger, dict) or not isinstance(trigger.get("job_id"), int):
            return "(no trigger: enqueued directly)"
        outcome = short_text(trigger.get("outcome", "?"))
        # Only the columns shown: the parent's JSON may be nested too deep to read.
        parent = (
            Job.objects.using(obj._state.db)
            .only("id", "kind", "state")
            .filter(id=trigger["job_id"])
            .first()
        )
        if parent is None:
            return format_html(
                '{} #{} (deleted), outcome <span class="awa-outcome">{}</span>',
                short_text(trigger.get("kind", "?")),
                trigger["job_id"],
                outcome,
            )
        return format_html(
            '{} {}, outcome <span class="awa-outcome">{}</span>',
            _job_link(parent.id, f"{parent.kind} #{parent.id}"),
            _state_badge(parent.state),
            outcome,
        )

    @admin.display(description="its follow-ups")
    def followup_links(self, obj: Job) -> SafeString | str:
        children = list(
            obj.followups()
            .annotate(outcome=KT("metadata__awa_trigger__outcome"))
            .values_list("id", "kind", "state", "outcome")[: FOLLOWUPS_SHOWN + 1]
        )
        if not children:
            return "(none)"
        items = format_html_join(
            "",
            "<li>{} {}, on {}</li>",
            (
                (_job_link(child_id, f"{kind} #{child_id}"), _state_badge(state), outcome or "?")
                for child_id, kind, state, outcome in children[:FOLLOWUPS_SHOWN]
            ),
        )
        more = ""
        if len(children) > FOLLOWUPS_SHOWN:
            url = reverse("admin:django_awa_job_changelist") + f"?trigger={obj.id}"
            more = format_html('<li><a href="{}">{}</a></li>', url, "all follow-ups…")
        return format_html('<ul class="awa-followups">{}{}</ul>', items, more)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        can_change = self.has_change_permission(request)
        context = {
            "awa_can_retry": can_change,
            "awa_can_cancel": can_change,
            "awa_retriable_states": [str(s) for s in JobState.RETRIABLE],
            "awa_cancellable_states": [str(s) for s in JobState.LIVE],
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra_context=context)

    def get_urls(self) -> list[URLPattern]:
        # Before the defaults: their "<path:object_id>/" catch-all would win;
        # the workflow pages before retry/cancel, whose object_id would take them.
        return [
            path(
                "workflow/<uuid:workflow_id>/",
                self.admin_site.admin_view(self.workflow_view),
                name="django_awa_job_workflow",
            ),
            path(
                "workflow/<uuid:workflow_id>/<str:operation>/",
                self.admin_site.admin_view(self.workflow_operation_view),
                name="django_awa_job_workflow_operation",
            ),
            *self.get_bulk_urls(),  # bulk_admin.py
            path(
                "<path:object_id>/retry/",
                self.admin_site.admin_view(self.retry_view),
                name="django_awa_job_retry",
            ),
            path(
                "<path:object_id>/cancel/",
                self.admin_site.admin_view(self.cancel_view),
                name="django_awa_job_cancel",
            ),
            *super().get_urls(),
        ]

    # -- actions -----------------------------------------------------------

    @admin.action(description="Retry selected jobs now (attempts reset)", permissions=["change"])
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        if not self.has_change_permission(request):
            raise PermissionDenied
        self._operate(request, queryset, "retry")

    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        if not self.has_change_permission(request):
            raise PermissionDenied
        self._operate(request, queryset, "cancel")

    @admin.action(description="Discard (delete) selected jobs", permissions=["delete"])
    def discard_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if not self.has_delete_permission(request):
            raise PermissionDenied
        if request.POST.get("confirm") == "yes":
            # In batches, as the bulk page does (bulk.py): a DELETE of the ids,
            # and a second for a finished row that maintenance moved into
            # awa_job_done meanwhile. A running job's worker then finds no row
            # for its (id, run_lease) and writes nothing. The dependents of the
            # discarded jobs are settled (cancelled, if they required them to
            # complete) and counted in the message.
            self._operate(request, queryset, "discard")
            return None
        count = queryset.count()
        context = {
            **self.admin_site.each_context(request),
            "title": "Discard jobs?",
            "opts": self.opts,
            "count": count,
            "sample": list(queryset.only("id", "kind", "queue", "state")[:20]),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_name": "discard_jobs",
        }
        return TemplateResponse(request, "admin/django_awa/job/discard_confirmation.html", context)

    def workflow_view(self, request: HttpRequest, workflow_id: uuid.UUID) -> HttpResponse:
        """A workflow's graph (server-rendered SVG, each node a link to its job) and counts."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        status = workflow_status(workflow_id, using=_alias())
        if not status.jobs:
            raise Http404(f"no workflow {workflow_id}")
        can_change = self.has_change_permission(request)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Workflow {status.name or workflow_id}",
            "opts": self.opts,
            "status": status,
            "counts": [(state, n) for state, n in status.counts.items() if n],
            "graph": workflow_svg(status.jobs, _alias()),
            "shown": min(len(status.jobs), GRAPH_NODES_SHOWN),
            "awa_can_cancel": can_change and any(j.state in JobState.LIVE for j in status.jobs),
            "awa_can_retry": can_change and any(j.state in JobState.RETRIABLE for j in status.jobs),
        }
        return TemplateResponse(request, "admin/django_awa/job/workflow.html", context)

    def workflow_operation_view(
        self, request: HttpRequest, workflow_id: uuid.UUID, operation: str
    ) -> HttpResponse:
        """Cancel every live job of a workflow, or retry every failed or cancelled one
        (those a cascade cancelled are reopened by the retry of their dependency)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if operation not in ("cancel", "retry"):
            raise Http404(f"no workflow operation {operation!r}")
        if not self.has_change_permission(request):
            raise PermissionDenied
        jobs = self.get_queryset(request).filter(workflow_id=workflow_id)
        if operation == "retry":
            # The cascade's victims come back with their dependency's retry.
            jobs = jobs.exclude(metadata__has_key="awa_cancelled_by")
        self._operate(request, jobs, operation)
        return HttpResponseRedirect(reverse("admin:django_awa_job_workflow", args=[workflow_id]))

    def retry_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._object_operation(request, object_id, "retry")

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._object_operation(request, object_id, "cancel")

    def _object_operation(
        self, request: HttpRequest, object_id: str, operation: str
    ) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_change_permission(request):
            raise PermissionDenied
        number = job_id(object_id)
        if number is None:
            return bad_request(f"job id must be a number, got {object_id!r}")
        self._operate(request, self.get_queryset(request).filter(id=number), operation)
        return HttpResponseRedirect(reverse("admin:django_awa_job_change", args=[object_id]))

    def _operate(self, request: HttpRequest, queryset: QuerySet[Job], operation: str) -> None:
        """Retry, cancel or discard the jobs of ``queryset`` in batches (``bulk.run``);
        report counts, the dependents the cascade moved too among them."""
        op = bulk.Operation(operation)
        verb = op.value
        past = bulk.PAST[op].capitalize()
        reason = f"cancelled in admin by {request.user.get_username()}"
        skipped = queryset.exclude(state__in=list(bulk.ALLOWED[op])).count()
        found = bulk.preview(queryset, op)
        result = bulk.run(queryset, op, up_to=found.up_to, reason=reason)
        changed, unchanged, failed = result.changed, result.unchanged, result.failed
        # A job may have moved on between the SELECT and its UPDATE: unchanged.
        skipped += unchanged
        if changed or not (skipped or failed):
            self.message_user(
                request,
                ngettext(f"{past} %d job", f"{past} %d jobs", changed) % changed
                + dependents_text(result)
                + ".",
                messages.SUCCESS,
            )
        if skipped and op is bulk.Operation.DISCARD:
            # Every state allows a discard: these were gone already.
            self.message_user(
                request,
                ngettext("%d job was gone already.", "%d jobs were gone already.", skipped)
                % skipped,
                messages.WARNING,
            )
        elif skipped:
            self.message_user(
                request,
                ngettext(
                    f"%d job was not {past.lower()}: its state does not allow it.",
                    f"%d jobs were not {past.lower()}: their states do not allow it.",
                    skipped,
                )
                % skipped,
                messages.WARNING,
            )
        for job_id, error in failed[:10]:
            self.message_user(request, f"Could not {verb} job #{job_id}: {error}", messages.ERROR)
        if len(failed) > 10:
            self.message_user(
                request,
                f"… and {len(failed) - 10} more jobs could not be {past.lower()}.",
                messages.ERROR,
            )


@admin.register(Queue)
class QueueAdmin(AwaModelAdmin[Queue]):
    """The queue overview: every queue with jobs, settings or a row, counts per state.

    A queue exists without a ``Queue`` row (the row only records a pause), so
    this is a custom page at the Queue changelist URL rather than a changelist.
    """

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "",
                self.admin_site.admin_view(self.overview_view),
                name="django_awa_queue_changelist",
            ),
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Queue | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Queue | None = None) -> bool:
        user = request.user
        return super().has_view_permission(request, obj) or any(
            user.has_perm(f"django_awa.{p}_job") for p in ("view", "change")
        )

    def has_change_permission(self, request: HttpRequest, obj: Queue | None = None) -> bool:
        """Pause and resume: ``change_queue`` or ``change_job``."""
        return super().has_change_permission(request, obj) or request.user.has_perm(
            "django_awa.change_job"
        )

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if request.POST.get("operation") == "limits":
                return self._set_limits(request)
            return self._pause_or_resume(request)
        alias = _alias()
        # On a large table, the maintenance leader's count (awa_job_count):
        # live jobs exact as of its last tick; finished ones it does not see
        # once moved to awa_job_done, so those columns are not counted here.
        counted = not _is_small(alias)
        stats = control.queue_stats(using=alias, counted=counted)
        jobs_url = reverse("admin:django_awa_job_changelist")
        flow = _flow_control(sorted(stats), alias)
        triage = queue_triage(alias)
        rows = []
        for name in sorted(stats):
            entry = stats[name]
            total = sum(
                entry[state]
                for state in JobState.values
                if not (counted and state in JobState.FINAL)
            )
            rows.append(
                {
                    "name": name,
                    "paused": entry["paused"],
                    **flow[name],
                    **triage.row(name),
                    "url": f"{jobs_url}?{urlencode({'queue': name})}",
                    "total": f"{total:,}",
                    "counts": [
                        {
                            "state": state,
                            "count": "…"
                            if counted and state in JobState.FINAL
                            else (f"{entry[state]:,}" if entry[state] else 0),
                            "url": jobs_url
                            + "?"
                            + urlencode({"queue": name, "state__exact": state}),
                        }
                        for state in JobState.values
                    ],
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Queues",
            "opts": self.opts,
            "states": JobState.choices,
            "rows": rows,
            "can_change": self.has_change_permission(request),
            "failed_url": f"{jobs_url}?{urlencode({'state__exact': JobState.FAILED})}",
            "counted": counted,
            "counted_at": JobCount.objects.using(alias).aggregate(at=Min("counted_at"))["at"]
            if counted
            else None,
        }
        return TemplateResponse(request, "admin/django_awa/queue/overview.html", context)

    def _pause_or_resume(self, request: HttpRequest) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied
        name = request.POST.get("queue", "")
        operation = request.POST.get("operation", "")
        if not name or len(name) > 128 or operation not in ("pause", "resume"):
            return bad_request("queue and operation (pause or resume) are required")
        if not holdable(name):
            return bad_request("a queue name cannot hold NUL or invalid text")
        changelist = HttpResponseRedirect(reverse("admin:django_awa_queue_changelist"))
        pause = operation == "pause"
        try:
            (control.pause_queue if pause else control.resume_queue)(name, using=_alias())
        except ValidationError as exc:
            self.message_user(request, f"{exc}; nothing changed.", messages.ERROR)
            return changelist
        done = "Paused queue {}: workers stop claiming from it." if pause else "Resumed queue {}."
        self.message_user(request, done.format(name))
        logger.info("queue %s %sd in admin by %s", name, operation, request.user.get_username())
        return changelist

    def _set_limits(self, request: HttpRequest) -> HttpResponse:
        """Change a queue's rate_limit and global_concurrency (blank: none) for every
        worker, or give the settings back with "reset"."""
        if not self.has_change_permission(request):
            raise PermissionDenied
        name = request.POST.get("queue", "")
        if not name or len(name) > 128 or not holdable(name):
            return bad_request("a queue name is required")
        rate = request.POST.get("rate_limit", "").strip() or None
        concurrency_text = request.POST.get("global_concurrency", "").strip()
        changelist = HttpResponseRedirect(reverse("admin:django_awa_queue_changelist"))
        try:
            concurrency = int(concurrency_text) if concurrency_text else None
        except ValueError:
            self.message_user(
                request,
                f"Queue {name}: global concurrency must be a positive integer, "
                f"got {concurrency_text!r}; nothing changed.",
                messages.ERROR,
            )
            return changelist
        try:
            if "reset" in request.POST:
                control.set_queue_limits(name, reset=True, using=_alias())
            else:
                control.set_queue_limits(
                    name, rate_limit=rate, global_concurrency=concurrency, using=_alias()
                )
        except ValidationError as exc:
            self.message_user(request, f"{exc}; nothing changed.", messages.ERROR)
            return changelist
        self.message_user(request, f"Changed the limits of queue {name} for every worker.")
        logger.info("queue %s limits changed in admin by %s", name, request.user.get_username())
        return changelist


class _QueueTriage:
    """What the queue page says of each queue besides its counts: its oldest due job's
    age (from the leader's last count, ``awa_job_count``), since when it is paused,
    and whether a live worker serves it (the worker registry). Small tables only."""

    def __init__(self, alias: str) -> None:
        conf = awa_settings()
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.DATABASE_NOW)
            self.now: datetime = cursor.fetchone()[0]
        self.oldest = dict(
            JobCount.objects.using(alias)
            .filter(state=JobState.AVAILABLE, oldest_run_at__isnull=False)
            .values_list("queue", "oldest_run_at")
        )
        self.paused_at = dict(
            Queue.objects.using(alias).filter(paused=True).values_list("name", "paused_at")
        )
        self.served: set[str] = set()
        for queues in live(alias, conf.stale_after).values_list("queues", flat=True):
            self.served.update(queues or {})

    def row(self, name: str) -> dict[str, Any]:
        oldest = self.oldest.get(name)
        paused_at = self.paused_at.get(name)
        return {
            "oldest_due": "-" if oldest is None else _span((self.now - oldest).total_seconds()),
            "paused_since": _long_time(paused_at) if paused_at else "",
            "served": name in self.served,
        }


def queue_triage(alias: str) -> _QueueTriage:
    return _QueueTriage(alias)


def _flow_control(names: list[str], alias: str) -> dict[str, dict[str, Any]]:
    """Per queue: its limits (and whether set at runtime), the jobs a limit or a
    sequence holds back now, and the attempts started per second over the last minute."""
    limits = {name: queue_limits(name, alias) for name in names}
    runtime = {
        q.name: q.limits for q in Queue.objects.using(alias).filter(name__in=names) if q.limits
    }
    limited = [name for name, lim in limits.items() if lim.locked]  # starts logged
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.ACHIEVED_RATE, {"limited": limited})
        started = dict(cursor.fetchall())
    flow = {}
    for name, lim in limits.items():
        kinds = json.loads(lim.kinds)
        flow[name] = {
            "global_concurrency": lim.global_concurrency,
            "rate_limit": lim.rate_limit.text if lim.rate_limit else None,
            "runtime_limits": name in runtime,
            "kind_limits": [
                f"{kind}: "
                + ", ".join(
                    part
                    for part in (
                        f"{entry['c']} at once" if "c" in entry else "",
                        f"{entry['rn']} per {entry['rs']:g}s" if "rn" in entry else "",
                        f"per {', '.join(entry['by'])}" if entry["by"] else "",
                    )
                    if part
                )
                for kind, entry in sorted(kinds.items())
            ],
            "held_back": held_back(lim, alias),
            "rate": round(started.get(name, 0) / 60, 2),
        }
    return flow


class ReadOnlyAdmin[M: Model](AwaModelAdmin[M]):
    def has_add_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: M | None = None) -> bool:
        return False


@admin.register(PeriodicSchedule)
class PeriodicScheduleAdmin(ReadOnlyAdmin[PeriodicSchedule]):
    list_display = (
        "name", "cron", "timezone", "kind", "last_fire_at", "next_fire_at", "paused", "status",
    )  # fmt: skip
    list_filter = ("paused",)
    search_fields = ("name", "kind")
    readonly_fields = ("jobs_link", "status")
    actions = ("pause_schedules", "resume_schedules", "trigger_schedules")

    def get_queryset(self, request: HttpRequest) -> QuerySet[PeriodicSchedule]:
        return super().get_queryset(request).using(_alias())

    @admin.display(description="status")
    def status(self, obj: PeriodicSchedule) -> SafeString | str:
        """A schedule no jobs.py declares any more never fires: said so, in red."""
        if obj.name not in schedules:
            return format_html('<span class="awa-removed" style="color: #b91c1c">{}</span>',
                               "removed from code: not firing")  # fmt: skip
        return "paused" if obj.paused else "active"

    def has_steer_permission(self, request: HttpRequest) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def _steer(self, request: HttpRequest, queryset: QuerySet[PeriodicSchedule], verb: str) -> None:
        if not self.has_steer_permission(request):
            raise PermissionDenied
        steer = {
            "paused": schedule_steering.pause_schedule,
            "resumed": schedule_steering.resume_schedule,
            "triggered": schedule_steering.trigger_schedule,
        }[verb]
        done = []
        for name in queryset.order_by("name").values_list("name", flat=True):
            try:
                steer(name, using=_alias())
            except AwaError as exc:  # removed from code (trigger), a unique key held
                self.message_user(request, f"{name}: {exc}", messages.ERROR)
                continue
            done.append(name)
        if done:
            self.message_user(request, f"{verb.capitalize()}: {', '.join(done)}.", messages.SUCCESS)

    @admin.action(description="Pause selected schedules", permissions=["steer"])
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet[PeriodicSchedule]) -> None:
        self._steer(request, queryset, "paused")

    @admin.action(description="Resume selected schedules", permissions=["steer"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[PeriodicSchedule]) -> None:
        self._steer(request, queryset, "resumed")

    @admin.action(description="Trigger selected schedules now (one fire)", permissions=["steer"])
    def trigger_schedules(self, request: HttpRequest, queryset: QuerySet[PeriodicSchedule]) -> None:
        self._steer(request, queryset, "triggered")

    @admin.display(description="jobs")
    def jobs_link(self, obj: PeriodicSchedule) -> SafeString:
        url = reverse("admin:django_awa_job_changelist") + "?" + urlencode({"kind": obj.kind})
        return format_html('<a href="{}">{} jobs</a>', url, obj.kind)


@admin.register(PendingFollowup)
class PendingFollowupAdmin(ReadOnlyAdmin[PendingFollowup]):
    """Pending follow-ups: committed outcomes whose follow-ups maintenance keeps retrying.

    (Failed jobs, what users call dead letters, have their own page: ``ops_admin.py``.)
    """

    list_display = (
        "id",
        "trigger_job",
        "kind",
        "outcome",
        "attempts",
        "next_attempt_at",
        "short_error",
        "created_at",
    )
    list_filter = ("outcome", "kind")
    search_fields = ("=job_id", "kind")
    ordering = ("next_attempt_at", "id")
    unlisted_json = ("context", "snapshot")
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = (
        "id",
        "trigger_job",
        "kind",
        "outcome",
        "attempts",
        "next_attempt_at",
        "created_at",
        "last_error_text",
        "context_json",
        "snapshot_json",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[PendingFollowup]:
        return super().get_queryset(request).using(_alias())

    @admin.display(description="job", ordering="job_id")
    def trigger_job(self, obj: PendingFollowup) -> SafeString:
        # A link even if the row was pruned since: the page then says so.
        return _job_link(obj.job_id, f"#{obj.job_id}")

    @admin.display(description="last error")
    def short_error(self, obj: PendingFollowup) -> str:
        return Truncator(obj.last_error).chars(120)

    @admin.display(description="last error")
    def last_error_text(self, obj: PendingFollowup) -> SafeString:
        return format_html('<pre class="awa-traceback">{}</pre>', obj.last_error or "(none)")

    @admin.display(description="context")
    def context_json(self, obj: PendingFollowup) -> SafeString:
        return _pretty_json(obj.context)

    @admin.display(description="trigger row after the transition")
    def snapshot_json(self, obj: PendingFollowup) -> SafeString:
        return _pretty_json(obj.snapshot)
