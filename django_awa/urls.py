"""``path("awa/", include("django_awa.urls"))``: the signed callback receiver, the
Prometheus metrics and the health check (SPEC §7, §15)."""

import uuid

from django.urls import path, register_converter

from . import callbacks, metrics

app_name = "django_awa"


class _AnyCaseUUID:
    """A UUID in either case: Django's ``uuid`` converter takes lowercase only, and a
    sender that writes the callback id in uppercase (as some platforms print a UUID)
    got a 404. Its URLs are written in lowercase, as ``str(uuid)`` is."""

    regex = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"

    def to_python(self, value: str) -> uuid.UUID:
        return uuid.UUID(value)

    def to_url(self, value: uuid.UUID | str) -> str:
        return str(value).lower()


register_converter(_AnyCaseUUID, "awa_uuid")

urlpatterns = [
    path("callbacks/complete", callbacks.callback_batch_view, name="callback_batch"),
    path(
        "callbacks/<awa_uuid:callback_id>/<str:action>",
        callbacks.callback_view,
        name="callback",
    ),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("health", metrics.health_view, name="health"),
]
