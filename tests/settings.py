"""Settings for django-awa's test suite (run it with ``python runtests.py``).

The database comes from ``DATABASE_URL``, which runtests.py always exports
(the machine's PostgreSQL, or the embedded server it started). Run without
runtests.py and with no ``DATABASE_URL``, the embedded server under
``.awa/pgdata-test`` is started here instead.

Worker subprocesses started by the tests run ``python -m django awa_worker``
with ``DJANGO_SETTINGS_MODULE=tests.settings`` and ``AWA_TEST_DB_NAME`` set to
pytest-django's test database, so they work on the same rows as the test;
``AWA_TEST_<KEY>`` (e.g. ``AWA_TEST_POLL_INTERVAL=30``) overrides one AWA
timing for such a subprocess. Logging is left to ``awa_worker`` itself.
"""

import importlib.util
import os
from pathlib import Path

import django

from django_awa.contrib.embedded_postgres import default_database

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "django-awa-tests-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_awa",
    "tests.testapp",
]
if django.VERSION < (6, 0) and importlib.util.find_spec("django_tasks"):
    # Django 5.2: the django-tasks backport stands in for django.tasks.
    INSTALLED_APPS.append("django_tasks")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "tests.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": default_database(BASE_DIR / ".awa" / "pgdata-test")}
# A second database on the same server, for tests/test_multidb.py: pytest-django
# creates its test database only for the tests that ask for it
# (``databases=["default", "other"]``).
DATABASES["other"] = {
    **DATABASES["default"],
    "OPTIONS": dict(DATABASES["default"].get("OPTIONS", {})),
    "NAME": f"{DATABASES['default']['NAME']}_other",
}
if os.environ.get("AWA_TEST_DB_NAME"):
    # A worker subprocess of a test: use pytest-django's test database.
    DATABASES["default"]["NAME"] = os.environ["AWA_TEST_DB_NAME"]
if os.environ.get("AWA_TEST_OTHER_DB_NAME"):
    DATABASES["other"]["NAME"] = os.environ["AWA_TEST_OTHER_DB_NAME"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "/static/"

# Fast hashing for admin users created by tests.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

AWA = {
    "QUEUES": {"default": {"concurrency": 4}},
    "POLL_INTERVAL": 0.2,
    "HEARTBEAT_INTERVAL": 0.5,
    "STALE_AFTER": 3,
    "MAINTENANCE_INTERVAL": 0.5,
    "SHUTDOWN_TIMEOUT": 5,
    "CALLBACK_SECRET": "test-secret",
}
# Worker subprocesses of the flow-control tests (test_flow_control.py) add
# queues with fleet-wide limits from the settings.
if os.environ.get("AWA_TEST_FLOW_QUEUES"):
    AWA["QUEUES"] = {
        "default": {"concurrency": 4},
        "glob": {"concurrency": 6, "global_concurrency": 4},
        "rated": {"concurrency": 10, "rate_limit": "10/s"},
    }
if os.environ.get("AWA_TEST_FLOW_QUEUES") == "rated_bykey":
    # One worker of a mixed fleet: queue bykey has a rate here (claimed under the
    # queue's lock), none in the others' settings (claimed with key leases alone).
    AWA["QUEUES"] = {
        **AWA["QUEUES"],  # type: ignore[dict-item]
        "bykey": {"concurrency": 4, "rate_limit": "1000/s"},
    }
if os.environ.get("AWA_TEST_FLOW_QUEUES") == "glob_lowered":
    # A worker deployed with a lower global_concurrency for queue glob than the
    # workers still running the settings before it (a rolling deploy).
    AWA["QUEUES"] = {
        **AWA["QUEUES"],  # type: ignore[dict-item]
        "glob": {"concurrency": 6, "global_concurrency": 2},
    }
if os.environ.get("AWA_TEST_FLOW_QUEUES") == "shared":
    # Weighted sharing of one process's places (WORKER_CONCURRENCY).
    AWA["WORKER_CONCURRENCY"] = 4
    AWA["QUEUES"] = {
        "default": {"concurrency": 4},
        "wa": {"concurrency": 4, "min": 1, "weight": 1},
        "wb": {"concurrency": 4, "min": 1, "weight": 1},
    }
# A test may give a worker subprocess other timings: AWA_TEST_POLL_INTERVAL=30.
for _key in (
    "POLL_INTERVAL",
    "HEARTBEAT_INTERVAL",
    "STALE_AFTER",
    "MAINTENANCE_INTERVAL",
    "SHUTDOWN_TIMEOUT",
    "DEFAULT_DEADLINE",
    "COMPLETED_RETENTION",
):
    if os.environ.get(f"AWA_TEST_{_key}"):
        AWA[_key] = float(os.environ[f"AWA_TEST_{_key}"])

if os.environ.get("AWA_TEST_OPENTELEMETRY") == "off":
    AWA["OPENTELEMETRY"] = False

# Django Tasks on awa: django.tasks, or the django-tasks backport on Django 5.2.
TASKS = {"default": {"BACKEND": "django_awa.backends.AwaTaskBackend"}}
