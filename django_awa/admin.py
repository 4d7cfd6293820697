"""The Django admin for jobs: read-only rows with filters by state, queue and kind."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "queue", "state", "priority", "attempt", "run_at", "finalized_at")
    list_filter = ("state", "queue", "kind")
    search_fields = ("=id", "kind", "queue")
    ordering = ("-id",)
    show_full_result_count = False
    list_per_page = 50

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Job._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
