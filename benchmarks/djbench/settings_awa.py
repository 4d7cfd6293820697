"""django-awa: the bench app declares the no-op kind in its jobs.py."""

from djbench.settings_common import *  # noqa: F403

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_awa",
    "djbench.awa_app",
    "djbench.handler_app",
]

# Default settings: the worker is started as `awa_worker --queue bench`.
AWA = {
    "QUEUES": {"bench": {}},
}
