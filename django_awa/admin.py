"""The Django admin (SPEC §8): jobs, queues, periodic schedules and dead letters.

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
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Q, QuerySet
from django.http import (
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
from django.utils.text import Truncator
from django.utils.translation import ngettext

from . import control, sql
from .conf import awa_settings
from .kinds import registry
from .models import (
    CANCELLABLE_STATES,
    RETRIABLE_STATES,
    Job,
    JobState,
    PendingFollowup,
    PeriodicSchedule,
    Queue,
)
from .schedules import schedules

logger = logging.getLogger(__name__)

# Follow-ups listed on a job's page; the rest are one click away (?trigger=<id>).
FOLLOWUPS_SHOWN = 50
# Filter choices stop after this many values.
MAX_FILTER_CHOICES = 200
# Above this many rows (pg_class estimate) the unfiltered list shows an estimate.
ESTIMATE_ABOVE = 100_000
# Below this heap size a sequential scan of awa_job is cheap.
SMALL_TABLE_BYTES = 64 * 1024 * 1024


def _alias() -> str:
    """The connection the admin reads and writes jobs on: ``AWA["DATABASE"]``."""
    return awa_settings().database


def _pretty_json(value: Any) -> SafeString:
    if value is None or value == {} or value == []:
        return format_html('<span class="awa-empty">{}</span>', "(none)")
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    return format_html('<pre class="awa-json">{}</pre>', text)


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
    """``2026-01-31 13:05`` in the current time zone, seconds in the tooltip."""
    moment = _to_datetime(value)
    if moment is None:
        return "-"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        moment.isoformat(),
        moment.strftime("%Y-%m-%d %H:%M:%S %Z"),
        moment.strftime("%Y-%m-%d %H:%M"),
    )


def _long_time(value: datetime | str | None) -> str:
    """``2026-01-31 13:05:09 UTC`` in the current time zone."""
    moment = _to_datetime(value)
    if moment is None:
        return str(value or "")
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _job_link(job_id: int, label: str) -> SafeString:
    url = reverse("admin:django_awa_job_change", args=[job_id])
    return format_html('<a href="{}">{}</a>', url, label)


def _state_badge(state: str) -> SafeString:
    try:
        label = JobState(state).label
    except ValueError:
        label = state
    return format_html('<span class="awa-state awa-state-{}">{}</span>', state, label)


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


class EstimatedCountPaginator(Paginator):
    """Counts exactly, except the unfiltered list of a large table: the planner's estimate.

    ``count(*)`` over millions of rows reads them all on every page view.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and not queryset.query.where:
            with connections[queryset.db].cursor() as cursor:
                cursor.execute(sql.ESTIMATED_ROWS)
                row = cursor.fetchone()
            if row is not None and row[0] >= ESTIMATE_ABOVE:
                return int(row[0])
        return super().count


def _is_small(alias: str) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.TABLE_BYTES)
        return cursor.fetchone()[0] <= SMALL_TABLE_BYTES


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

    def narrow(self, queryset: QuerySet, value: str) -> QuerySet:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = self.known()
        if self.value():
            values.add(self.value())
        return [(value, value) for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        return self.narrow(queryset, value) if value else queryset


class KindFilter(_ColumnFilter):
    title = "kind"
    parameter_name = "kind"

    def known(self) -> set[str]:
        return known_kinds()

    def narrow(self, queryset: QuerySet, value: str) -> QuerySet:
        return queryset.of_kind(value)


class QueueFilter(_ColumnFilter):
    title = "queue"
    parameter_name = "queue"

    def known(self) -> set[str]:
        return known_queues()

    def narrow(self, queryset: QuerySet, value: str) -> QuerySet:
        return queryset.in_queue(value)


class TriggerFilter(admin.SimpleListFilter):
    """``?trigger=<id>``: the follow-ups of one job. Shown only while in use."""

    title = "follow-ups of"
    parameter_name = "trigger"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = request.GET.get(self.parameter_name, "")
        return [(value, f"job #{value}")] if value.isdigit() else []

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if value and value.isdigit():
            return queryset.followups_of(int(value))
        return queryset


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "kind",
        "queue",
        "state_badge",
        "priority",
        "attempts",
        "run_at_short",
        "finalized_at_short",
    )
    list_display_links = ("id", "kind")
    list_filter = ("state", QueueFilter, KindFilter, TriggerFilter)
    search_fields = ("kind", "queue")  # the search itself is get_search_results
    search_help_text = "A job id, or text in the kind or queue, or an exact tag."
    ordering = ("-id",)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatedCountPaginator
    actions = ("retry_jobs", "cancel_jobs", "discard_jobs")
    readonly_fields = (
        "id",
        "kind",
        "queue",
        "state_badge",
        "priority",
        "attempts",
        "tag_list",
        "run_at",
        "created_at",
        "attempted_at",
        "heartbeat_at",
        "deadline_at",
        "finalized_at",
        "args_json",
        "error_list",
        "progress_json",
        "trigger_link",
        "followup_links",
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
                    ("run_at", "created_at", "attempted_at"),
                    ("heartbeat_at", "deadline_at", "finalized_at"),
                )
            },
        ),
        ("Arguments", {"fields": ("args_json",)}),
        ("Errors, oldest first", {"fields": ("error_list",)}),
        ("Progress", {"fields": ("progress_json",)}),
        ("Follow-up chain", {"fields": ("trigger_link", "followup_links")}),
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

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).using(_alias())

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
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        """Each word must match: a number (or ``#number``) is a job id, found by
        primary key; other text is part of the kind, the queue name, or a tag."""
        for word in search_term.split():
            digits = word.removeprefix("#")
            if digits.isdigit():
                queryset = queryset.filter(id=int(digits))
            else:
                queryset = queryset.filter(
                    Q(kind__icontains=word) | Q(queue=word) | Q(tags__contains=[word])
                )
        return queryset, False

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes action_location; 5.2 calls get_actions(request).
        kwargs = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **kwargs)
        # discard_jobs replaces it: one DELETE, no collector walk per object.
        actions.pop("delete_selected", None)
        return actions

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {"title": "Jobs", **self._links(request), **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)

    def _links(self, request: HttpRequest) -> dict[str, str]:
        """Shortcuts to the other awa pages the user may open."""
        links = {
            "awa_failed_url": reverse("admin:django_awa_job_changelist")
            + "?"
            + urlencode({"state__exact": JobState.FAILED}),
        }
        user = request.user
        if user.has_perm("django_awa.view_job") or user.has_perm("django_awa.view_queue"):
            links["awa_queues_url"] = reverse("admin:django_awa_queue_changelist")
        if user.has_perm("django_awa.view_pendingfollowup"):
            links["awa_pending_url"] = reverse("admin:django_awa_pendingfollowup_changelist")
        if user.has_perm("django_awa.view_periodicschedule"):
            links["awa_periodic_url"] = reverse("admin:django_awa_periodicschedule_changelist")
        return links

    # -- detail ------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        # The row is written by workers and the control functions only: its
        # page is always read-only. Without ``obj`` this answers for the
        # retry and cancel actions, which need ``change_job``.
        if obj is not None:
            return False
        return super().has_change_permission(request)

    @admin.display(description="tags")
    def tag_list(self, obj: Job) -> str:
        return ", ".join(str(tag) for tag in obj.tags or []) or "(none)"

    @admin.display(description="args")
    def args_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.args)

    @admin.display(description="progress")
    def progress_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.progress)

    @admin.display(description="metadata")
    def metadata_json(self, obj: Job) -> SafeString:
        return _pretty_json(obj.metadata)

    @admin.display(description="errors")
    def error_list(self, obj: Job) -> SafeString:
        errors = [e for e in obj.errors or [] if isinstance(e, dict)]
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
                        entry.get("attempt", "?"),
                        _long_time(entry.get("at")),
                        entry.get("error", ""),
                        format_html('<pre class="awa-traceback">{}</pre>', entry["traceback"])
                        if entry.get("traceback")
                        else "",
                    )
                    for entry in errors
                ),
            ),
        )

    @admin.display(description="enqueued by")
    def trigger_link(self, obj: Job) -> SafeString | str:
        trigger = (obj.metadata or {}).get("awa_trigger")
        if not isinstance(trigger, dict) or obj.trigger_id is None:
            return "(no trigger: enqueued directly)"
        outcome = trigger.get("outcome", "?")
        parent = obj.trigger()
        if parent is None:
            return format_html(
                '{} #{} (deleted), outcome <span class="awa-outcome">{}</span>',
                trigger.get("kind", "?"),
                obj.trigger_id,
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
            obj.followups().only("id", "kind", "state", "metadata")[: FOLLOWUPS_SHOWN + 1]
        )
        if not children:
            return "(none)"
        items = format_html_join(
            "",
            "<li>{} {}, on {}</li>",
            (
                (
                    _job_link(child.id, f"{child.kind} #{child.id}"),
                    _state_badge(child.state),
                    (child.metadata.get("awa_trigger") or {}).get("outcome", "?"),
                )
                for child in children[:FOLLOWUPS_SHOWN]
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
            "awa_retriable_states": [str(s) for s in RETRIABLE_STATES],
            "awa_cancellable_states": [str(s) for s in CANCELLABLE_STATES],
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra_context=context)

    def get_urls(self) -> list[URLPattern]:
        # Before the defaults: their "<path:object_id>/" catch-all would win.
        return [
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
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet) -> None:
        if not self.has_change_permission(request):
            raise PermissionDenied
        self._operate(request, queryset, "retry")

    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet) -> None:
        if not self.has_change_permission(request):
            raise PermissionDenied
        self._operate(request, queryset, "cancel")

    @admin.action(description="Discard (delete) selected jobs", permissions=["delete"])
    def discard_jobs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        if not self.has_delete_permission(request):
            raise PermissionDenied
        if request.POST.get("confirm") == "yes":
            # Job has no relations: one DELETE. A running job's worker then
            # finds no row for its (id, run_lease) and writes nothing. A
            # finished row that maintenance moved into awa_job_done while the
            # DELETE waited for it is not yet visible to that statement: a
            # second one deletes it.
            deleted, _ = queryset.delete()
            deleted += queryset.delete()[0]
            self.message_user(
                request,
                ngettext("Discarded %d job.", "Discarded %d jobs.", deleted) % deleted,
                messages.SUCCESS,
            )
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
        if not object_id.isdigit():
            return HttpResponseBadRequest("job id must be a number")
        self._operate(request, self.get_queryset(request).filter(id=int(object_id)), operation)
        return HttpResponseRedirect(reverse("admin:django_awa_job_change", args=[object_id]))

    def _operate(self, request: HttpRequest, queryset: QuerySet, operation: str) -> None:
        """Retry or cancel each job of ``queryset``, one transaction each; report counts."""
        alias = _alias()
        if operation == "retry":
            states: Iterable[str] = RETRIABLE_STATES
            done_state = JobState.AVAILABLE
            verb, past = "retry", "Retried"

            def apply(job_id: int) -> Job:
                return control.retry(job_id, using=alias)
        else:
            states = CANCELLABLE_STATES
            done_state = JobState.CANCELLED
            verb, past = "cancel", "Cancelled"
            reason = f"cancelled in admin by {request.user.get_username()}"

            def apply(job_id: int) -> Job:
                return control.cancel(job_id, reason, using=alias)

        skipped = queryset.exclude(state__in=list(states)).count()
        changed, unchanged, failed = self._each(
            queryset.filter(state__in=list(states)), apply, done_state, verb
        )
        # A job may have moved on between the SELECT and its UPDATE: unchanged.
        skipped += unchanged
        if changed or not (skipped or failed):
            self.message_user(
                request,
                ngettext(f"{past} %d job.", f"{past} %d jobs.", changed) % changed,
                messages.SUCCESS,
            )
        if skipped:
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

    def _each(
        self,
        queryset: QuerySet,
        apply: Callable[[int], Job],
        done_state: str,
        verb: str,
    ) -> tuple[int, int, list[tuple[int, str]]]:
        """Apply to each job id in turn: (changed, unchanged, [(id, error), ...])."""
        changed = unchanged = 0
        failed: list[tuple[int, str]] = []
        for job_id in queryset.order_by("id").values_list("id", flat=True).iterator(chunk_size=500):
            try:
                job = apply(job_id)
            # An operator's batch goes on past one job whose follow-up function
            # (user code, any exception) or unique key refused it; that job's
            # own transaction rolled back and the error is shown.
            except Exception as exc:
                logger.warning(
                    "admin %s of job %s failed: %s job_id=%s",
                    verb,
                    job_id,
                    exc,
                    job_id,
                    exc_info=True,
                )
                failed.append((job_id, Truncator(str(exc) or type(exc).__name__).chars(200)))
                continue
            if job.state == done_state:
                changed += 1
            else:
                unchanged += 1
        return changed, unchanged, failed


@admin.register(Queue)
class QueueAdmin(admin.ModelAdmin):
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

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        return super().has_view_permission(request, obj) or any(
            user.has_perm(f"django_awa.{p}_job") for p in ("view", "change")
        )

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Pause and resume: ``change_queue`` or ``change_job``."""
        return super().has_change_permission(request, obj) or request.user.has_perm(
            "django_awa.change_job"
        )

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            return self._pause_or_resume(request)
        alias = _alias()
        stats = control.queue_stats(using=alias)
        for name in awa_settings().queues:
            stats.setdefault(name, {state: 0 for state in JobState.values} | {"paused": False})
        jobs_url = reverse("admin:django_awa_job_changelist")
        rows = []
        for name in sorted(stats):
            entry = stats[name]
            rows.append(
                {
                    "name": name,
                    "paused": entry["paused"],
                    "url": f"{jobs_url}?{urlencode({'queue': name})}",
                    "total": sum(entry[state] for state in JobState.values),
                    "counts": [
                        {
                            "state": state,
                            "count": entry[state],
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
        }
        return TemplateResponse(request, "admin/django_awa/queue/overview.html", context)

    def _pause_or_resume(self, request: HttpRequest) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied
        name = request.POST.get("queue", "")
        operation = request.POST.get("operation", "")
        if not name or len(name) > 128 or operation not in ("pause", "resume"):
            return HttpResponseBadRequest("queue and operation (pause or resume) are required")
        if operation == "pause":
            control.pause_queue(name, using=_alias())
            self.message_user(request, f"Paused queue {name}: workers stop claiming from it.")
        else:
            control.resume_queue(name, using=_alias())
            self.message_user(request, f"Resumed queue {name}.")
        logger.info("queue %s %sd in admin by %s", name, operation, request.user.get_username())
        return HttpResponseRedirect(reverse("admin:django_awa_queue_changelist"))


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(PeriodicSchedule)
class PeriodicScheduleAdmin(ReadOnlyAdmin):
    list_display = ("name", "cron", "timezone", "kind", "last_fire_at", "next_fire_at", "paused")
    list_filter = ("paused",)
    search_fields = ("name", "kind")
    readonly_fields = ("jobs_link",)

    @admin.display(description="jobs")
    def jobs_link(self, obj: PeriodicSchedule) -> SafeString:
        url = reverse("admin:django_awa_job_changelist") + "?" + urlencode({"kind": obj.kind})
        return format_html('<a href="{}">{} jobs</a>', url, obj.kind)


@admin.register(PendingFollowup)
class PendingFollowupAdmin(ReadOnlyAdmin):
    """Dead letters: committed outcomes whose follow-ups maintenance keeps retrying."""

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

    def get_queryset(self, request: HttpRequest) -> QuerySet:
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
