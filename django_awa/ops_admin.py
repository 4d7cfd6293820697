"""The admin's *Dashboard* and *Dead letters* pages, and the job list's error filter.

Kept apart from ``admin.py``, which imports this module (registering both
pages) and lists ``ErrorFilter`` among the job list's filters.

- Dashboard (``/admin/django_awa/dashboard/``): charts of outcomes per minute,
  wait before start and the oldest due job's age, per queue and overall,
  redrawn from ``data/`` (JSON) by ``static/django_awa/dashboard.js``. Reads
  the leader's rollup only (``dashboard.py``).
- Dead letters (``/admin/django_awa/deadletter/``): failed jobs grouped by
  queue, kind and the first line of their last error, over the newest
  ``DEAD_LETTER_CAP`` failed jobs, each group linking to the filtered job
  list, with retry (``change_job``) and purge (``delete_job``) per group.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote, unquote, urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from . import bulk, dashboard, sql
from .admin_base import ModelAdmin as _ModelAdmin
from .admin_base import bad_request
from .conf import awa_settings
from .models import (
    ERROR_LINE_CHARS,
    Dashboard,
    DeadLetter,
    Job,
    JobQuerySet,
    JobState,
)

logger = logging.getLogger(__name__)

# The dead-letter view groups the newest this many failed jobs: its cost does
# not grow with the failed rows kept.
DEAD_LETTER_CAP = 10_000
# Seconds between two refreshes of the dashboard page.
REFRESH_SECONDS = 5


def _alias() -> str:
    return awa_settings().database


def _can(request: HttpRequest, *perms: str) -> bool:
    return any(request.user.has_perm(f"django_awa.{p}_job") for p in perms)


class ErrorFilter(admin.SimpleListFilter):
    """``?error=<first line>``: failed jobs of one dead-letter group. Shown only in use."""

    title = "last error"
    parameter_name = "error"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        if self.parameter_name not in request.GET:
            return []
        value = request.GET[self.parameter_name]
        return [(value, value or "(no error text)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        if self.parameter_name not in request.GET:
            return queryset
        jobs = queryset if isinstance(queryset, JobQuerySet) else JobQuerySet(Job, using=_alias())
        return jobs.with_error(request.GET[self.parameter_name][:ERROR_LINE_CHARS])


class _PageAdmin[M: Dashboard | DeadLetter](_ModelAdmin[M]):
    """A page of the admin that shows jobs: readable with ``view_job`` or
    ``change_job``; nothing is added, changed or deleted through it."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _can(request, "view", "change")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Dashboard)
class DashboardAdmin(_PageAdmin[Dashboard]):
    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("", view(self.dashboard_view), name="django_awa_dashboard_changelist"),
            # admin_view: staff only, and never cached.
            path("data/", view(self.data_view), name="django_awa_dashboard_data"),
        ]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        window = request.GET.get("window", "hour")
        if window not in dashboard.WINDOWS:
            return bad_request(
                f"window must be one of {', '.join(sorted(dashboard.WINDOWS))}, not {window!r}"
            )
        try:
            refresh = float(request.GET.get("refresh", REFRESH_SECONDS))
        except ValueError:
            refresh = -1.0
        if not 1 <= refresh <= 300:
            return bad_request("refresh must be a number of seconds from 1 to 300")
        context = {
            **self.admin_site.each_context(request),
            "title": "Dashboard",
            "opts": self.opts,
            "data": dashboard.timed_snapshot(_alias(), window),
            "data_url": reverse("admin:django_awa_dashboard_data"),
            "windows": list(dashboard.WINDOWS),
            "window": window,
            "refresh_ms": int(refresh * 1000),
            "jobs_url": reverse("admin:django_awa_job_changelist"),
            "dead_letters_url": reverse("admin:django_awa_deadletter_changelist"),
        }
        return TemplateResponse(request, "admin/django_awa/dashboard.html", context)

    def data_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        window = request.GET.get("window", "hour")
        if window not in dashboard.WINDOWS:
            return JsonResponse(
                {"error": f"window must be one of {sorted(dashboard.WINDOWS)}, not {window!r}"},
                status=400,
            )
        return JsonResponse(dashboard.timed_snapshot(_alias(), window))


def dead_letter_groups(alias: str, cap: int = DEAD_LETTER_CAP) -> tuple[list[dict[str, Any]], bool]:
    """The groups of the newest ``cap`` failed jobs, most jobs first; and whether
    the cap was reached (older failed jobs are then not counted)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.DEAD_LETTER_GROUPS, {"cap": cap})
        rows = cursor.fetchall()
    groups = [
        {"queue": q, "kind": k, "error": e, "count": n, "first": first, "last": last}
        for q, k, e, n, first, last in rows
    ]
    return groups, sum(g["count"] for g in groups) >= cap


def group_jobs(alias: str, queue: str, kind: str, error: str) -> JobQuerySet:
    """The failed jobs of one dead-letter group."""
    return (
        Job.objects.using(alias)
        .filter(state=JobState.FAILED)
        .in_queue(queue)
        .of_kind(kind)
        .with_error(error[:ERROR_LINE_CHARS])
    )


def retry_group(alias: str, queue: str, kind: str, error: str) -> tuple[int, list[str]]:
    """Retry every failed job of a group as ``awa.retry`` does, through the bulk
    operations' batches (``bulk.run``); returns how many, and the errors of those
    that could not be (another job holds their unique key)."""
    jobs = group_jobs(alias, queue, kind, error)
    result = bulk.run(
        jobs, bulk.Operation.RETRY, up_to=bulk.preview(jobs, bulk.Operation.RETRY).up_to
    )
    return result.changed, [f"job {job_id}: {problem}" for job_id, problem in result.failed]


def purge_group(alias: str, queue: str, kind: str, error: str) -> int:
    """Delete every failed job of a group through the bulk operations' batches
    (``bulk.run``: a dependent of a purged job is settled as the deletion rule
    says); returns how many."""
    jobs = group_jobs(alias, queue, kind, error)
    discard = bulk.Operation.DISCARD
    return bulk.run(jobs, discard, up_to=bulk.preview(jobs, discard).up_to).changed


def _retention_text(seconds: float | None) -> str:
    if seconds is None:
        return (
            "Failed jobs are kept until they are purged or retried "
            "(AWA['FAILED_RETENTION'] is None)."
        )
    return (
        f"Maintenance deletes failed jobs {_duration(seconds)} after they failed "
        "(AWA['FAILED_RETENTION'])."
    )


def _duration(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} seconds"


@admin.register(DeadLetter)
class DeadLetterAdmin(_PageAdmin[DeadLetter]):
    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "",
                self.admin_site.admin_view(self.dead_letters_view),
                name="django_awa_deadletter_changelist",
            ),
        ]

    def dead_letters_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        alias = _alias()
        if request.method == "POST":
            return self._operate(request, alias)
        groups, capped = dead_letter_groups(alias)
        jobs_url = reverse("admin:django_awa_job_changelist")
        for group in groups:
            query = {"state__exact": JobState.FAILED, "queue": group["queue"]}
            query |= {"kind": group["kind"], "error": group["error"]}
            group["url"] = f"{jobs_url}?{urlencode(query)}"
            # The form carries the error line percent-encoded: a browser reads a
            # "\r" in an attribute as "\n" and posts either as "\r\n", so the
            # line as text (an exception message with CRLF, cut at "\n") would
            # come back as a key no job has.
            group["error_key"] = quote(group["error"], safe="")
            group["count_text"] = f"{group['count']:,}"
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead letters: failed jobs",
            "opts": self.opts,
            "groups": groups,
            "capped": capped,
            "cap_text": f"{DEAD_LETTER_CAP:,}",
            "batch": bulk.BATCH_SIZE,
            "retention": _retention_text(awa_settings().failed_retention),
            "can_retry": _can(request, "change"),
            "can_purge": _can(request, "delete"),
            "pending_url": reverse("admin:django_awa_pendingfollowup_changelist"),
        }
        return TemplateResponse(request, "admin/django_awa/dead_letters.html", context)

    def _operate(self, request: HttpRequest, alias: str) -> HttpResponse:
        operation = request.POST.get("operation")
        needs = {"retry": "change", "purge": "delete"}.get(operation or "")
        if needs is None:
            return bad_request(f"operation must be retry or purge, not {operation!r}")
        if not _can(request, needs):
            raise PermissionDenied
        missing = [f for f in ("queue", "kind", "error") if f not in request.POST]
        if missing:
            return bad_request(f"missing field(s): {', '.join(missing)}")
        if operation == "purge" and request.POST.get("confirm") != "yes":
            return bad_request("purging deletes the jobs: tick 'delete them' (confirm=yes)")
        queue, kind = request.POST["queue"], request.POST["kind"]
        error = unquote(request.POST["error"])  # the page's error_key
        if "\x00" in queue + kind + error:
            # PostgreSQL cannot compare with it (DataError); nothing could match.
            return bad_request("queue, kind and error cannot hold a NUL character")
        label = f"{kind} on {queue} ({error or 'no error text'})"
        if operation == "retry":
            done, problems = retry_group(alias, queue, kind, error)
            self.message_user(request, f"Retried {done:,} failed job(s) of {label}.")
            for problem in problems[:5]:
                self.message_user(request, problem, messages.WARNING)
        else:
            done = purge_group(alias, queue, kind, error)
            self.message_user(request, f"Purged {done:,} failed job(s) of {label}.")
        logger.info("admin %s %s: %s job(s) of %s", request.user, operation, done, label)
        return HttpResponseRedirect(request.path)
