"""pytest fixtures for testing jobs with pytest-django.

Not loaded by itself (no entry point): a project that wants it says so in its
``conftest.py``::

    pytest_plugins = ["django_awa.testing.pytest"]

``awa_jobs`` depends on pytest-django's ``db`` fixture, so the test runs in a
transaction rolled back at its end, as a ``TestCase`` does. Tests that need
commits (a worker process, ``on_commit``) use ``transactional_db`` as usual;
``awa_jobs`` works there too. Importing this module touches no model, so it is
safe before Django is set up.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest


@pytest.fixture
def awa_jobs(db: Any) -> SimpleNamespace:
    """``django_awa.testing``'s helpers as attributes, with database access (``db``).

    ``awa_jobs.assert_enqueued``, ``refute_enqueued``, ``enqueued``,
    ``run_jobs``, ``perform_job``.
    """
    from django_awa import testing

    return SimpleNamespace(
        assert_enqueued=testing.assert_enqueued,
        refute_enqueued=testing.refute_enqueued,
        enqueued=testing.enqueued,
        run_jobs=testing.run_jobs,
        perform_job=testing.perform_job,
    )
