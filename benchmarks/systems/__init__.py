"""Adapters, one module per benchmarked system (see base.System).

The first entry is the reference every ratio in the table is taken against.
"""

from __future__ import annotations

import importlib

# display name -> module under systems/
SYSTEMS: dict[str, str] = {
    "django-awa": "django_awa",
    "pgqueuer": "pgqueuer",
    "awa-pg": "awa_pg",
    "procrastinate": "procrastinate",
    "django-tasks-db": "django_tasks_db",
}
REFERENCE = "django-awa"


def resolve(name: str) -> str:
    """The display name for a display or module name (``awa_pg`` -> ``awa-pg``)."""
    key = name.strip().lower()
    for display, module in SYSTEMS.items():
        if key in (display, module):
            return display
    raise KeyError(name)


def load(display: str, overrides: dict[str, str] | None = None):
    module = importlib.import_module(f"systems.{SYSTEMS[display]}")
    return module.ADAPTER(overrides)
