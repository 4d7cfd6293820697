#!/usr/bin/env python3
"""Run the example project's demo.

    python3.12 demo.py [awa_demo options]

On a fresh machine this first creates ``.venv`` and installs the project into
it (see _bootstrap.py). The database is ``DATABASE_URL`` if set, else an
embedded PostgreSQL under ``.awa/pgdata-demo``, kept running while the demo
runs and stopped after. Then it runs ``manage.py migrate`` and
``manage.py awa_demo``, passing any arguments on to the latter.
"""

from __future__ import annotations  # lets old Pythons reach the version check

import os
import subprocess
import sys
from pathlib import Path

import _bootstrap

REPO = Path(__file__).resolve().parent
EMBEDDED_DATA_DIR = REPO / ".awa" / "pgdata-demo"


def manage(*args: str) -> int:
    command = [sys.executable, str(REPO / "manage.py"), *args]
    print("demo: " + " ".join(["manage.py", *args]), flush=True)
    process = subprocess.Popen(command, cwd=REPO)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the child too (same process group): let it shut
            # down cleanly, and keep the database up until it has.
            continue


def main(argv: list[str]) -> int:
    os.chdir(REPO)
    os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), path]))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))

    if {"-h", "--help"} & set(argv):
        # The options, without starting a database or migrating one first.
        return manage("awa_demo", *argv)

    if not os.environ.get("DATABASE_URL"):
        from django_awa.contrib.embedded_postgres import ensure_server

        # Held by this process for the whole demo, so the manage.py children
        # (and the workers they start) share one server; stopped at exit.
        os.environ["DATABASE_URL"] = ensure_server(EMBEDDED_DATA_DIR)
        print(f"demo: embedded PostgreSQL in {EMBEDDED_DATA_DIR.relative_to(REPO)}", flush=True)

    code = manage("migrate", "--noinput")
    if code:
        return code
    return manage("awa_demo", *argv)


if __name__ == "__main__":
    _bootstrap.ensure_environment(__file__, sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
