"""Settings shared by the benchmark's Django projects (django-awa, django-tasks-db).

The database is the run's own (``BENCH_DB``) on 127.0.0.1; the orchestrator
creates it fresh for each system and each repeat and drops it afterwards.
"""

from __future__ import annotations

import os

SECRET_KEY = "benchmarks-only-not-secret"  # noqa: S105 - never served
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_DB", "awa_bench"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        # Another server of this machine's (where_time_goes.py starts its own).
        "PORT": os.environ.get("BENCH_PG_PORT", "5432"),
        # Persistent connections: with Django's default (0) db_worker's
        # close_old_connections() reconnects for every task.
        "CONN_MAX_AGE": None,
        "CONN_HEALTH_CHECKS": True,
    }
}

# Every system's worker runs at WARNING: no per-job log lines.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        name: {"level": "WARNING"}
        for name in ("django", "django.tasks", "django_tasks_db", "django_awa")
    },
}
