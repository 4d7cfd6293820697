"""Test settings for tests/test_connections.py: a role with a connection limit, a pool.

``AWA_TEST_DB_USER`` logs the worker's ``default`` alias in as that role;
``AWA_TEST_HANDLER_USER`` adds an alias ``handlers`` (the same database, as
that role) for handlers to use; ``AWA_TEST_POOL`` (``ALIAS:MAX_SIZE``, comma
separated; ``ALIAS:MAX_SIZE:TIMEOUT`` to set its timeout, 5 s by default) gives
an alias Django's pool of that size.
"""

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

if os.environ.get("AWA_TEST_DB_USER"):
    DATABASES["default"]["USER"] = os.environ["AWA_TEST_DB_USER"]
if os.environ.get("AWA_TEST_HANDLER_USER"):
    DATABASES["handlers"] = {
        **DATABASES["default"],
        "OPTIONS": dict(DATABASES["default"].get("OPTIONS", {})),
        "USER": os.environ["AWA_TEST_HANDLER_USER"],
    }
for _entry in filter(None, os.environ.get("AWA_TEST_POOL", "").split(",")):
    _alias, _size, *_timeout = _entry.split(":")
    DATABASES[_alias]["CONN_MAX_AGE"] = 0
    DATABASES[_alias]["OPTIONS"] = {
        **DATABASES[_alias].get("OPTIONS", {}),
        "pool": {"min_size": 1, "max_size": int(_size), "timeout": float(*_timeout or [5])},
    }
if os.environ.get("AWA_TEST_DB_PORT"):  # nothing listens there: an unreachable server
    DATABASES["default"]["HOST"] = "127.0.0.1"
    DATABASES["default"]["PORT"] = os.environ["AWA_TEST_DB_PORT"]
