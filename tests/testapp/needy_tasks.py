"""A task module of an installed app that needs a package which is not installed.

A worker imports it on demand (tests/test_worker.py): the job must show the
ModuleNotFoundError, not "unknown job kind".
"""

import awa_test_missing_dependency  # noqa: F401
