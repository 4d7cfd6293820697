"""The test settings on SQLite: django-awa must refuse it (test_checks.py)."""

from tests.settings import *  # noqa: F403

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
