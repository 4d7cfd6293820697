"""The ORM handler alone: for the workers of systems that are not Django projects.

pgqueuer, awa-pg and procrastinate call django.setup() with these settings in
their ORM-handler workers, so their handlers run the same Django ORM code on
the same table as the Django-based systems' (the run's database).
"""

from djbench.settings_common import *  # noqa: F403

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "djbench.handler_app",
]
