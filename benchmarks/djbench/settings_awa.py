"""django-awa: the bench app declares the no-op kind in its jobs.py."""

import os

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

# sustained.py --completed-retention, run.py --set django-awa.completed_retention=S:
# completed jobs pruned this many seconds on (0: not kept).
if os.environ.get("BENCH_COMPLETED_RETENTION"):
    AWA["COMPLETED_RETENTION"] = float(os.environ["BENCH_COMPLETED_RETENTION"])
