"""The test settings behind PgBouncer in transaction pooling mode (test_pgbouncer.py).

``default`` goes through the pooler at ``AWA_POOLED_URL``; ``direct`` reaches
PostgreSQL itself and serves LISTEN and the leader lock, unless
``AWA_TEST_DIRECT=none`` leaves the worker with no direct session at all.
"""

import os

from django_awa.contrib.embedded_postgres import database_settings
from tests.settings import *  # noqa: F403
from tests.settings import AWA, DATABASES

DATABASES["direct"] = dict(DATABASES["default"])
DATABASES["default"] = database_settings(os.environ["AWA_POOLED_URL"])
DATABASES["default"]["NAME"] = DATABASES["direct"]["NAME"]
# Server-side cursors do not survive transaction pooling.
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True

AWA = {
    **AWA,
    # PgBouncer before 1.21 cannot keep prepared statements in transaction mode.
    "PREPARED_STATEMENTS": False,
    # AWA_TEST_DIRECT: "none" polls; "pooler" leaves LISTEN on the pooled alias.
    "DIRECT_DATABASE": {"none": None, "pooler": "default"}.get(
        os.environ.get("AWA_TEST_DIRECT", ""), "direct"
    ),
}
