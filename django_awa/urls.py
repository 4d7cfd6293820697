"""``path("awa/", include("django_awa.urls"))``: the signed callback receiver, the
Prometheus metrics and the health check (SPEC §7, §15)."""

from django.urls import path

from . import callbacks, metrics

app_name = "django_awa"

urlpatterns = [
    path("callbacks/complete", callbacks.callback_batch_view, name="callback_batch"),
    path(
        "callbacks/<uuid:callback_id>/<str:action>",
        callbacks.callback_view,
        name="callback",
    ),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("health", metrics.health_view, name="health"),
]
