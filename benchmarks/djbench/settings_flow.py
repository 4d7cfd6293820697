"""django-awa with the flow-control benchmark's queues (``benchmarks/flow_control.py``)."""

import os

from djbench.settings_common import *  # noqa: F403

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_awa",
    "djbench.flow_app",
]

AWA = {
    "QUEUES": {
        "bench": {},
        "glob": {"global_concurrency": int(os.environ.get("BENCH_GLOBAL", "50"))},
        "rated": {"rate_limit": os.environ.get("BENCH_RATE", "1000/s")},
        "keyed": {},
        "seq": {},
    },
}
