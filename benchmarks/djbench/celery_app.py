"""The Celery app of the benchmark's Django project (``celery -A djbench.celery_app``).

Set up as Celery's Django guide does: settings from ``django.conf:settings``
under the ``CELERY_`` namespace, tasks autodiscovered from the installed apps,
so the ORM handler runs the same Django project code as the other systems.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djbench.settings_celery")

app = Celery("djbench")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
