#!/usr/bin/env python3
"""Run django-awa's test suite.

    python3.12 runtests.py                 # everything
    python3.12 runtests.py -k enqueue -x   # any pytest arguments pass through

On a fresh machine this first creates ``.venv`` and installs the project with
its dev dependencies into it (see _bootstrap.py; ``AWA_VENV`` picks another
virtualenv). The database is ``DATABASE_URL`` if set, else an embedded
PostgreSQL under ``.awa/pgdata-test``, started for the run and stopped after.
``DATABASE_URL`` is exported either way, so worker subprocesses started by the
tests reach the same server; pytest-django creates and drops the test
database (``test_<NAME>``) on it.
"""

from __future__ import annotations  # lets old Pythons reach the version check

import os
import sys
from pathlib import Path

import _bootstrap

REPO = Path(__file__).resolve().parent
SETTINGS = "tests.settings"
EMBEDDED_DATA_DIR = REPO / ".awa" / "pgdata-test"


def main(argv: list[str]) -> int:
    os.chdir(REPO)
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    # Worker subprocesses (python -m django awa_worker) must import
    # tests.settings whatever their working directory.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), path]))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))

    if os.environ.get("DATABASE_URL"):
        source = "DATABASE_URL"
    else:
        from django_awa.contrib.embedded_postgres import ensure_server

        # The server lives as long as this process: stopped at exit.
        os.environ["DATABASE_URL"] = ensure_server(EMBEDDED_DATA_DIR)
        source = f"embedded server in {EMBEDDED_DATA_DIR.relative_to(REPO)}"

    import django
    import pytest

    print(
        f"runtests: Python {sys.version.split()[0]} ({sys.executable}), "
        f"Django {django.get_version()}, database: {source} "
        f"({_redacted(os.environ['DATABASE_URL'])})",
        flush=True,
    )
    return int(pytest.main(argv))


def _redacted(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


if __name__ == "__main__":
    _bootstrap.ensure_environment(__file__, sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
