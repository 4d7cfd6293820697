#!/usr/bin/env python3
"""Install django-awa's wheel as a user would, and run a minimal project on it.

    python .ci/wheel_check.py [--wheel dist/django_awa-X-py3-none-any.whl]

Without ``--wheel`` it builds one (``python -m build --wheel``, so the
interpreter running this needs the ``dev`` extra's ``build``). Then, in a
temporary directory far from this checkout:

1. a fresh virtualenv with the wheel installed (not editable), and
   ``django_awa`` imported from that virtualenv's site-packages, not from here;
2. the wheel holds ``py.typed``, the admin templates and every migration;
3. a project of three files (settings, urls, an app whose ``jobs.py``
   declares one kind) on a database of its own created on ``DATABASE_URL``'s
   server (default ``postgresql://postgres@127.0.0.1:5432/postgres``);
4. ``manage.py migrate``; a job enqueued; ``manage.py awa_worker`` run until
   the job's handler has written its row and the job is ``completed``
   (bounded), then stopped with SIGTERM and expected to exit 0;
5. the admin's job list and the job's page fetched with Django's test client
   as a superuser: 200, naming the kind.

Any failure prints what was run and its output, and exits 1. The database and
the directory are removed afterwards, whatever happened.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import zipfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
WORKER_SECONDS = 60.0  # how long the worker may take to complete the job
STEP_SECONDS = 300.0  # any single command (pip install included)


class CheckFailed(Exception):
    pass


def run(command: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    shown = " ".join(arg if "\n" not in arg else "<script>" for arg in command)
    print(f"wheel check: $ {shown}", flush=True)
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=STEP_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(
            f"{shown} ran over {STEP_SECONDS:g}s:\n{exc.stdout}{exc.stderr}"
        ) from None
    output = done.stdout + done.stderr
    if done.returncode:
        raise CheckFailed(f"{shown} exited {done.returncode}:\n{output}")
    return output


def build_wheel(out: Path) -> Path:
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)], cwd=REPO)
    wheels = sorted(out.glob("django_awa-*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"expected one wheel in {out}, found {wheels}")
    return wheels[0]


def check_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = sorted(REPO.glob("django_awa/migrations/0*.py"))
    wanted = {
        "django_awa/py.typed",
        "django_awa/templates/admin/django_awa/queue/overview.html",
        "django_awa/templates/admin/django_awa/job/change_list.html",
        "django_awa/management/commands/awa_worker.py",
        *(f"django_awa/migrations/{m.name}" for m in migrations),
    }
    missing = sorted(wanted - names)
    if missing:
        raise CheckFailed(f"{wheel.name} lacks {missing}")
    if not migrations:
        raise CheckFailed("no migrations found in the checkout")
    stray = sorted(n for n in names if n.startswith(("tests/", "example_project/")))
    if stray:
        raise CheckFailed(f"{wheel.name} ships files that are not the package: {stray[:5]}")
    print(f"wheel check: {wheel.name} holds py.typed, templates, {len(migrations)} migrations")


SETTINGS = """
import os
from django_awa.contrib.embedded_postgres import database_settings

SECRET_KEY = "wheel-check"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_awa",
    "greeter",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {"default": database_settings(os.environ["DATABASE_URL"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
AWA = {"QUEUES": {"default": {"concurrency": 2}}, "POLL_INTERVAL": 0.2}
"""

URLS = """
from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls), path("awa/", include("django_awa.urls"))]
"""

MODELS = """
from django.db import models


class Greeting(models.Model):
    name = models.CharField(max_length=50)
"""

JOBS = """
from dataclasses import dataclass

import django_awa as awa


@dataclass
class Greet(awa.JobArgs):
    kind = "greet"
    name: str


@awa.worker(Greet)
def greet(job: awa.JobContext) -> None:
    from .models import Greeting

    Greeting.objects.create(name=job.args.name)
"""

MIGRATION = """
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    operations = [
        migrations.CreateModel(
            name="Greeting",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=50)),
            ],
        )
    ]
"""

MANAGE = """
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

WHERE = """
import django_awa, sys
print(django_awa.__file__)
print(django_awa.__version__)
"""

ENQUEUE = """
import django_awa as awa
from greeter.jobs import Greet
print("job", awa.enqueue(Greet(name="wheel")).id)
"""

STATE = """
from django_awa.models import Job
from greeter.models import Greeting
job = Job.objects.get()
print("state", job.state, "greetings", Greeting.objects.filter(name="wheel").count())
"""

ADMIN = """
from django.contrib.auth.models import User
from django.test import Client
from django_awa.models import Job

job = Job.objects.get()
user = User.objects.create_superuser("admin", "admin@example.com", "x")
client = Client()
client.force_login(user)
for url in ("/admin/django_awa/job/", f"/admin/django_awa/job/{job.id}/change/"):
    response = client.get(url)
    body = response.content.decode()
    assert response.status_code == 200, (url, response.status_code, body[:2000])
    assert "greet" in body, (url, body[:2000])
    print("admin", url, response.status_code)
"""


def write_project(root: Path) -> None:
    files = {
        "settings.py": SETTINGS,
        "urls.py": URLS,
        "manage.py": MANAGE,
        "greeter/__init__.py": "",
        "greeter/models.py": MODELS,
        "greeter/jobs.py": JOBS,
        "greeter/migrations/__init__.py": "",
        "greeter/migrations/0001_initial.py": MIGRATION,
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def psql_admin(server: str, statement: str, python: Path, cwd: Path) -> None:
    # Through the virtualenv's psycopg: the check needs nothing of this interpreter's.
    code = (
        "import sys, psycopg\n"
        "with psycopg.connect(sys.argv[1], autocommit=True) as c: c.execute(sys.argv[2])\n"
    )
    run([str(python), "-c", code, server, statement], cwd=cwd)


def shell(python: Path, project: Path, env: dict[str, str], code: str) -> str:
    command = [str(python), "manage.py", "shell", "--no-imports", "-c", code]
    return run(command, cwd=project, env=env)


def run_worker(python: Path, project: Path, env: dict[str, str]) -> None:
    """``awa_worker`` until the job is completed, then SIGTERM; it must exit 0."""
    command = [str(python), "manage.py", "awa_worker"]
    print("wheel check: $ " + " ".join(command), flush=True)
    log = project / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(command, cwd=project, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + WORKER_SECONDS
            state = ""
            while time.monotonic() < deadline and worker.poll() is None:
                state = run(
                    [str(python), "manage.py", "shell", "--no-imports", "-c", STATE],
                    cwd=project,
                    env=env,
                )
                if "state completed greetings 1" in state:
                    break
                time.sleep(0.5)
            else:
                raise CheckFailed(
                    f"the job did not complete within {WORKER_SECONDS:g}s "
                    f"(worker exit code {worker.poll()}; last: {state.strip()}):\n"
                    + log.read_text()
                )
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(timeout=60)
            if code != 0:
                raise CheckFailed(f"awa_worker exited {code} after SIGTERM:\n{log.read_text()}")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    print(f"wheel check: {state.strip()}; awa_worker stopped cleanly")


def check(wheel: Path, server: str, tmp: Path) -> None:
    check_contents(wheel)
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", str(wheel)], cwd=tmp)

    project = tmp / "project"
    write_project(project)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")
    }
    where = run([str(python), "-c", WHERE], cwd=project, env=env).split()
    site = venv.resolve()
    if not Path(where[0]).resolve().is_relative_to(site):
        raise CheckFailed(f"django_awa came from {where[0]}, not from the virtualenv {site}")
    print(f"wheel check: django_awa {where[1]} from {where[0]}")

    name = f"awa_wheel_{uuid.uuid4().hex[:12]}"
    env["DATABASE_URL"] = with_database(server, name)
    psql_admin(server, f'CREATE DATABASE "{name}"', python, tmp)
    try:
        manage = [str(python), "manage.py"]
        run([*manage, "check", "--fail-level", "WARNING"], cwd=project, env=env)
        run([*manage, "migrate", "--noinput"], cwd=project, env=env)
        print("wheel check: " + shell(python, project, env, ENQUEUE).strip())
        run_worker(python, project, env)
        print(shell(python, project, env, ADMIN).strip())
    finally:
        psql_admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', python, tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="the wheel to check (default: build one)")
    options = parser.parse_args()
    server = os.environ.get("DATABASE_URL") or DEFAULT_URL
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="awa-wheel-") as name:
        tmp = Path(name)
        try:
            wheel = options.wheel.resolve() if options.wheel else build_wheel(tmp / "dist")
            check(wheel, server, tmp)
        except CheckFailed as exc:
            print(f"wheel check FAILED: {exc}", file=sys.stderr)
            return 1
    print(f"wheel check passed in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
