"""Celery with Redis: the broker and the result backend on the run's redis-server.

systems/celery.py starts redis-server on its own port (BENCH_REDIS_PORT) for
the run. Results go to database 1, so the number of keys there is the number
of finished tasks (what run.py counts); the broker uses database 0.
"""

import os

from djbench.settings_common import *  # noqa: F403

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "djbench.handler_app",
    "djbench.celery_tasks",
]

_redis = f"redis://127.0.0.1:{os.environ.get('BENCH_REDIS_PORT', '16379')}"
CELERY_BROKER_URL = f"{_redis}/0"
CELERY_RESULT_BACKEND = f"{_redis}/1"
CELERY_TASK_DEFAULT_QUEUE = "bench"
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# Celery's Django fixup closes every database connection after each task
# unless CELERY_DB_REUSE_MAX is set (then it closes them every twice that many
# tasks). 0 here: Celery's default. The celery adapters' db_reuse_max setting.
if int(os.environ.get("BENCH_CELERY_DB_REUSE_MAX", "0")):
    CELERY_DB_REUSE_MAX = int(os.environ["BENCH_CELERY_DB_REUSE_MAX"])
