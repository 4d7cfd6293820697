"""The admin's *Workers* page: the live worker processes (``fleet.py``), and the
link from a running job's page to the worker running it.

Kept apart from ``admin.py``, which registers ``WorkerAdmin`` by importing
this module and shows ``running_worker`` on a job's page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from . import fleet
from .admin_base import ModelAdmin as _ModelAdmin
from .conf import awa_settings
from .models import Job, JobState, Worker

# Running jobs listed on a worker's page.
RUNNING_SHOWN = 100


def _worker_link(worker: Worker) -> SafeString:
    url = reverse("admin:django_awa_worker_change", args=[worker.pk])
    return format_html('<a href="{}">{}</a>', url, worker.name)


@admin.display(description="worker")
def running_worker(model_admin: Any, obj: Job) -> SafeString | str:
    """The live worker whose handler runs this job (as of its last heartbeat).

    A method of ``JobAdmin`` (assigned there).
    """
    if obj.state != JobState.RUNNING:
        return "-"
    conf = awa_settings()
    worker = fleet.running_job(obj._state.db or conf.database, conf.stale_after, obj.id)
    if worker is None:
        return "(no live worker reports running it)"
    return _worker_link(worker)


@admin.register(Worker)
class WorkerAdmin(_ModelAdmin[Worker]):
    """Live workers only: a row unseen for ``STALE_AFTER`` belongs to a dead process."""

    list_display = (
        "name",
        "queue_list",
        "concurrency",
        "running",
        "version",
        "started_at",
        "seen",
        "leader",
    )
    list_display_links = ("name",)
    search_fields = ("name", "host")
    ordering = ("host", "pid")
    show_full_result_count = False
    fields = (
        "name",
        "host",
        "pid",
        "queue_list",
        "concurrency",
        "version",
        "started_at",
        "last_seen_at",
        "maintained_at",
        "running",
        "running_jobs",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Worker]:
        conf = awa_settings()
        return fleet.live(conf.database, conf.stale_after)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Worker | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Worker | None = None) -> bool:
        return False

    @admin.display(description="queues")
    def queue_list(self, obj: Worker) -> str:
        queues = obj.queues if isinstance(obj.queues, dict) else {}
        return ", ".join(f"{name}={n}" for name, n in sorted(queues.items()))

    @admin.display(description="last seen", ordering="last_seen_at")
    def seen(self, obj: Worker) -> str:
        ago = (timezone.now() - obj.last_seen_at).total_seconds()
        return f"{max(ago, 0):.0f}s ago"

    @admin.display(description="maintenance leader", boolean=True)
    def leader(self, obj: Worker) -> bool:
        if obj.maintained_at is None:
            return False
        # The leader stamps its row after every tick, at least once a second.
        window = 3 * max(awa_settings().maintenance_interval, 1.0)
        return (timezone.now() - obj.maintained_at).total_seconds() <= window

    @admin.display(description="running jobs")
    def running_jobs(self, obj: Worker) -> SafeString | str:
        ids = [i for i in (obj.running_ids or []) if isinstance(i, int)][:RUNNING_SHOWN]
        if not ids:
            return "(none)"
        jobs = Job.objects.using(obj._state.db).filter(id__in=ids).values_list("id", "kind")
        items: list[Any] = [
            (reverse("admin:django_awa_job_change", args=[job_id]), f"{kind} #{job_id}")
            for job_id, kind in sorted(jobs)
        ]
        return format_html(
            '<ul class="awa-running">{}</ul>',
            format_html_join("", '<li><a href="{}">{}</a></li>', items),
        )
