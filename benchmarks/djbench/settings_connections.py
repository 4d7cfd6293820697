"""django-awa with ORM handlers (benchmarks/connections.py).

``BENCH_POOL`` is the max_size of Django's pool (``OPTIONS["pool"]``); 0 or
unset: no pool, every thread keeps a connection of its own.
"""

import os

from djbench.settings_common import *  # noqa: F403
from djbench.settings_common import DATABASES

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_awa",
    "djbench.conn_app",
]

AWA = {"QUEUES": {"conn": {}}}

_pool = int(os.environ.get("BENCH_POOL") or 0)
if _pool:
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django's pool refuses persistent connections
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": min(4, _pool), "max_size": _pool}}
