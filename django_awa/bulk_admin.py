"""The admin's bulk operations over a filter: every job the changelist's current
filters and search match, not only the selected page (``bulk.py`` does the work).

The job list links each operation the user may run to
``<changelist>/bulk/<operation>/?<the list's filters>``: a page that counts the
jobs it would touch, shows a sample, asks for the queue or priority where one
is needed, and runs it on confirmation (POST), in batches, up to the largest id
it counted. Kept apart from ``admin.py``: ``JobAdmin`` mixes it in.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db import connections, transaction
from django.db.models import QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import ngettext

from . import bulk
from .admin_base import ModelAdmin as _ModelAdmin
from .admin_base import bad_request
from .exceptions import ValidationError
from .kinds import PRIORITY_MAX, PRIORITY_MIN
from .models import Job

# Jobs listed on the confirmation page as a sample of what will be touched.
SAMPLE_SHOWN = 20
# The list's own parameters that are not filters: dropped from the bulk link.
NOT_FILTERS = ("p", "e", "o", "_changelist_filters")

LABELS: dict[bulk.Operation, str] = {
    bulk.Operation.RETRY: "Retry",
    bulk.Operation.CANCEL: "Cancel",
    bulk.Operation.MOVE: "Move to queue",
    bulk.Operation.PRIORITY: "Change priority",
    bulk.Operation.DISCARD: "Discard",
}


def dependents_text(result: bulk.Result, *, exact: bool = True) -> str:
    """`` and 5 dependent jobs`` (`` and reopened 5 …`` for a retry): the jobs the
    operation's cascade moved besides those it was given (SPEC §11), for a
    message that counts those; ``""`` if none. ``exact=False``: "job(s)"."""
    count = result.dependents
    if not count:
        return ""
    verb = bulk.DEPENDENTS_PAST[result.operation]
    verb = "" if verb == bulk.PAST[result.operation] else f"{verb} "
    if not exact:
        return f" and {verb}{count:,} dependent job(s)"
    return ngettext(
        " and %(verb)s%(count)s dependent job", " and %(verb)s%(count)s dependent jobs", count
    ) % {"verb": verb, "count": f"{count:,}"}


class BulkOperationsMixin(_ModelAdmin[Job]):
    """For ``JobAdmin``: the bulk links on the job list and the confirmation page."""

    def bulk_permitted(self, request: HttpRequest, operation: bulk.Operation) -> bool:
        if bulk.PERMISSION[operation] == "delete":
            return self.has_delete_permission(request)
        return self.has_change_permission(request)

    def bulk_links(self, request: HttpRequest) -> list[tuple[str, str]]:
        """(label, url) of each operation this user may run over the list's filter."""
        query = request.GET.copy()
        for name in NOT_FILTERS:
            query.pop(name, None)
        suffix = f"?{query.urlencode()}" if query else ""
        return [
            (LABELS[op], reverse("admin:django_awa_job_bulk", args=[op.value]) + suffix)
            for op in LABELS
            if self.bulk_permitted(request, op)
        ]

    def get_bulk_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.bulk_view)
        # Each batch commits on its own, also under ATOMIC_REQUESTS: of the
        # default alias and of AWA["DATABASE"] (any alias: no request wraps it).
        for alias in connections:
            view = transaction.non_atomic_requests(using=alias)(view)
        return [path("bulk/<str:operation>/", view, name="django_awa_job_bulk")]

    def bulk_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        """The jobs the changelist shows for this request's filters and search (every page)."""
        changelist = self.get_changelist_instance(request)
        return changelist.get_queryset(request)

    def bulk_view(self, request: HttpRequest, operation: str) -> HttpResponse:
        try:
            op = bulk.parse_operation(operation)
        except ValidationError as exc:
            raise Http404(str(exc)) from None
        if not self.has_view_permission(request) or not self.bulk_permitted(request, op):
            raise PermissionDenied
        if request.method not in ("GET", "POST"):
            return bad_request(f"{request.method} is not allowed here")
        try:
            jobs = self.bulk_queryset(request)
        except IncorrectLookupParameters as exc:
            return bad_request(f"the list's filters are not valid: {exc}")
        query = request.GET.urlencode()
        back = reverse("admin:django_awa_job_changelist") + (f"?{query}" if query else "")
        if request.method == "POST":
            return self._run_bulk(request, jobs, op, back)
        found = bulk.preview(jobs, op)
        context = {
            **self.admin_site.each_context(request),
            "title": f"{LABELS[op]}: every job matching the filter",
            "opts": self.opts,
            "operation": op.value,
            "label": LABELS[op],
            "count": found.count,
            "count_text": f"{found.count:,}",
            "up_to": found.up_to or "",
            "states": [str(s) for s in bulk.ALLOWED[op]],
            "sample": list(
                bulk.targets(jobs, op)
                .order_by("id")
                .only("id", "kind", "queue", "state")[:SAMPLE_SHOWN]
            ),
            "filters": [(key, value) for key, values in request.GET.lists() for value in values],
            "search": request.GET.get("q", ""),
            "back": back,
            "priorities": range(PRIORITY_MIN, PRIORITY_MAX + 1),
            "batch_size": bulk.BATCH_SIZE,
        }
        return TemplateResponse(request, "admin/django_awa/job/bulk_confirmation.html", context)

    def _run_bulk(
        self, request: HttpRequest, jobs: QuerySet[Job], op: bulk.Operation, back: str
    ) -> HttpResponse:
        up_to_text = request.POST.get("up_to", "")
        if not up_to_text:
            self.message_user(request, f"No job to {op}: none matched.", messages.WARNING)
            return HttpResponseRedirect(back)
        if not (up_to_text.isascii() and up_to_text.isdigit()):
            return bad_request(f"up_to must be a job id, got {up_to_text!r}")
        queue = request.POST.get("queue") if op == bulk.Operation.MOVE else None
        priority: Any = None
        if op == bulk.Operation.PRIORITY:
            text = request.POST.get("priority", "")
            priority = int(text) if text.isascii() and text.isdigit() else text
        try:
            result = bulk.run(
                jobs,
                op,
                up_to=int(up_to_text),
                queue=queue,
                priority=priority,
                reason=f"cancelled in admin by {request.user.get_username()} (bulk)",
            )
        except ValidationError as exc:
            return bad_request(str(exc))
        past = bulk.PAST[op]
        self.message_user(
            request,
            f"{past.capitalize()} {result.changed:,} job(s){dependents_text(result, exact=False)} "
            f"in {len(result.batch_seconds):,} batch(es).",
            messages.SUCCESS if result.changed else messages.WARNING,
        )
        if result.unchanged:
            self.message_user(
                request,
                f"{result.unchanged:,} job(s) had moved on to a state that does not allow it "
                "and were left as they were.",
                messages.WARNING,
            )
        for job_id, error in result.failed[:10]:
            self.message_user(request, f"Could not {op} job #{job_id}: {error}", messages.ERROR)
        if len(result.failed) > 10:
            self.message_user(
                request, f"… and {len(result.failed) - 10:,} more refused.", messages.ERROR
            )
        return HttpResponseRedirect(back)
