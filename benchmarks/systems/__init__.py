"""Adapters, one module per benchmarked system (see base.System).

The first entry is the reference every ratio in the table is taken against;
"ceiling" is not a job system but the limit row (systems/ceiling.py).
"""

from __future__ import annotations

import importlib

# display name -> module under systems/ (":Class" when the module holds more than one)
SYSTEMS: dict[str, str] = {
    "django-awa": "django_awa",
    "ceiling": "ceiling",
    "pgqueuer": "pgqueuer",
    "awa-pg": "awa_pg",
    "procrastinate": "procrastinate",
    "django-tasks-db": "django_tasks_db",
    "celery-prefork": "celery_redis:CeleryPrefork",
    "celery-threads": "celery_redis:CeleryThreads",
}
REFERENCE = "django-awa"


def resolve(name: str) -> str:
    """The display name for a display or module name (``awa_pg`` -> ``awa-pg``)."""
    key = name.strip().lower()
    for display, target in SYSTEMS.items():
        if key in (display, target, display.replace("-", "_")):
            return display
    raise KeyError(name)


def load(display: str, overrides: dict[str, str] | None = None):
    module_name, _, class_name = SYSTEMS[display].partition(":")
    module = importlib.import_module(f"systems.{module_name}")
    return getattr(module, class_name or "ADAPTER")(overrides)
