"""The test settings with the README's JSON-lines ``LOGGING`` recipe (tests/test_logs.py)."""

from tests.settings import *  # noqa: F403

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"awa_job": {"()": "django_awa.logs.JobContextFilter"}},
    "formatters": {"json": {"()": "django_awa.logs.JsonFormatter"}},
    "handlers": {
        "json": {"class": "logging.StreamHandler", "filters": ["awa_job"], "formatter": "json"},
    },
    "root": {"handlers": ["json"], "level": "INFO"},
}
