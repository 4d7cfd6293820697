"""django-tasks-db on Django 6's built-in django.tasks (no django-tasks backport)."""

from djbench.settings_common import *  # noqa: F403

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django_tasks_db",
    "djbench.tasks_app",
    "djbench.handler_app",
]

TASKS = {
    "default": {
        "BACKEND": "django_tasks_db.DatabaseBackend",
        # bench_single receives enqueue-single's jobs; no worker runs it.
        "QUEUES": ["bench", "bench_single"],
    }
}
