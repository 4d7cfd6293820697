"""``path("awa/", include("django_awa.urls"))``: the signed callback receiver."""

from django.urls import path

from . import callbacks

app_name = "django_awa"

urlpatterns = [
    path(
        "callbacks/<uuid:callback_id>/<str:action>",
        callbacks.callback_view,
        name="callback",
    ),
]
