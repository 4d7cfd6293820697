"""Settings for the example project (``python3.12 demo.py``).

The database is ``DATABASE_URL`` if set, otherwise an embedded PostgreSQL whose
data lives in ``.awa/pgdata-demo`` (started on first use, stopped when the
process that started it exits; see django_awa.contrib.embedded_postgres).
"""

import os
from pathlib import Path

from django_awa.contrib.embedded_postgres import default_database

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-awa-example-insecure-dev-key")
# Off unless DJANGO_DEBUG=1: with DEBUG on, Django keeps every query of every
# connection in memory (connection.queries), which the demo's thousands of
# statements a second would pay for. The demo serves the admin's static files itself.
DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_awa",
    "example_project.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"

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

# Threads keep their connection (the demo's producers, carrier and admin server,
# the worker's services): connecting anew for every request costs more than it.
DATABASES = {
    "default": {
        **default_database(BASE_DIR / ".awa" / "pgdata-demo"),
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
    }
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "/static/"

AWA = {
    "QUEUES": {
        "default": {"concurrency": 10},
        "billing": {"concurrency": 10},
        "email": {"concurrency": 5},
    },
    "CALLBACK_SECRET": os.environ.get("AWA_CALLBACK_SECRET", "example-callback-secret"),
}
