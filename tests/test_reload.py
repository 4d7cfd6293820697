"""``awa_worker --reload``: a real worker started again when a project's file changes."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_awa.models import Job, JobState
from tests.conftest import ROOT, WorkerProcess, children_of, make_job, wait_for, wait_for_state

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SETTINGS = """
from tests.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "reloadapp"]  # noqa: F405
AWA = {**AWA, "QUEUES": {"reloadq": {"concurrency": 2}}}  # noqa: F405
"""

JOBS = """
import time
from dataclasses import dataclass

import django_awa as awa


@dataclass
class ReloadProbe(awa.JobArgs):
    seconds: float = 0.0


@awa.worker(ReloadProbe, queue="reloadq")
def probe(job):
    time.sleep(job.args.seconds)
    return "{version}"
"""


def _write_jobs(app: Path, source: str) -> None:
    path = app / "jobs.py"
    before = path.stat().st_mtime if path.exists() else 0.0
    path.write_text(source)
    # A save within the same clock tick as the last still reads as newer; and it is
    # a time of today: a worker that imported the file but has not looked at the
    # files' times yet counts a save after its start as changed, not one of 1970.
    stamp = max(time.time(), before + 0.01)
    os.utime(path, (stamp, stamp))


def _probe(seconds: float = 0.0) -> Job:
    return make_job(kind="reload_probe", queue="reloadq", args={"seconds": seconds})


@pytest.fixture
def project(tmp_path: Path) -> Path:
    app = tmp_path / "reloadapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    _write_jobs(app, JOBS.format(version="v1"))
    (tmp_path / "reload_settings.py").write_text(textwrap.dedent(SETTINGS))
    return tmp_path


def _reloading(start_worker, project: Path) -> WorkerProcess:
    """``awa_worker --reload`` on the scratch project (its queue ``reloadq``)."""
    return start_worker(
        "--reload",
        env={
            "DJANGO_SETTINGS_MODULE": "reload_settings",
            "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]),
        },
    )


def test_a_worker_whose_watcher_was_killed_stops(project, start_worker):
    # kill -9 of the watcher (an IDE's stop button, the OOM killer): the worker, in
    # a session of its own, reached by no signal, stops by itself.
    worker = _reloading(start_worker, project)
    wait_for(lambda: re.search(r"awa worker \S+:(\d+) starting", worker.output()), timeout=30)
    (child,) = children_of(worker.pid)
    os.kill(worker.pid, signal.SIGKILL)
    worker.proc.wait(10)

    def gone() -> bool:
        try:  # "pid (comm) state ...": exited, or a zombie no one reaped yet
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_for(gone, timeout=15, message="the worker outlived its watcher")


def test_a_changed_jobs_module_is_run_after_in_flight_jobs_finish(project, start_worker):
    worker = _reloading(start_worker, project)
    first = _probe()
    assert wait_for_state(first.id, "completed", timeout=30).result == "v1"

    # A job running when the file changes finishes on the code it started with,
    # once: the worker stops as at SIGTERM, then starts again.
    slow = _probe(seconds=2)
    wait_for_state(slow.id, "running")
    time.sleep(0.3)  # its handler has begun
    _write_jobs(project / "reloadapp", JOBS.format(version="v2"))
    wait_for(lambda: "changed: finishing in-flight jobs" in worker.output(), timeout=10)
    done = wait_for_state(slow.id, "completed", timeout=30)
    assert (done.result, done.attempt, done.errors) == ("v1", 1, [])
    assert wait_for_state(_probe().id, "completed", timeout=30).result == "v2"
    assert worker.output().count("awa worker") >= 2  # two workers' start-up lines

    # A file saved broken: the worker cannot start, the watcher waits for the fix.
    _write_jobs(project / "reloadapp", "def broken(:\n")
    wait_for(lambda: "it starts again when a Python file changes" in worker.output(), timeout=20)
    stalled = _probe()
    time.sleep(1.5)
    assert worker.proc.poll() is None
    assert Job.objects.get(id=stalled.id).state == JobState.AVAILABLE
    _write_jobs(project / "reloadapp", JOBS.format(version="v3"))
    assert wait_for_state(stalled.id, "completed", timeout=30).result == "v3"

    # Ctrl-C reaches the watcher only (the worker has a session of its own); the
    # worker it passes it to finishes its job and both exit.
    last = _probe(seconds=1.5)
    wait_for_state(last.id, "running")
    time.sleep(0.3)
    child = int(re.findall(r"awa worker \S+:(\d+) starting", worker.output())[-1])
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0, worker.output()
    finished = Job.objects.get(id=last.id)
    assert (finished.state, finished.errors) == (JobState.COMPLETED, [])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_reload_refuses_what_it_cannot_do():
    with pytest.raises(CommandError, match="leave out --processes"):
        call_command("awa_worker", "--reload", "--processes", "2")
    with pytest.raises(CommandError, match="not through call_command"):
        call_command("awa_worker", "--reload")


def test_a_broken_worker_starts_again_when_a_module_it_imported_later_is_fixed(
    project, start_worker
):
    # The watcher imported the project when it started: a module the developer adds
    # afterwards is not one of its modules, yet fixing (or creating) it is the fix.
    worker = _reloading(start_worker, project)
    assert wait_for_state(_probe().id, "completed", timeout=30).result == "v1"
    app = project / "reloadapp"

    # A new module, saved broken, that jobs.py now imports.
    (app / "helpers.py").write_text("def version(:\n")
    (app / "jobs.py").write_text(
        f"from reloadapp.helpers import version\n{JOBS}".format(version="v2")
    )
    wait_for(lambda: "it starts again when a Python file changes" in worker.output(), timeout=20)
    time.sleep(1.5)  # the watcher has taken its first look at the files
    fixed = _probe()
    (app / "helpers.py").write_text("def version():\n    return 'v2'\n")
    assert wait_for_state(fixed.id, "completed", timeout=20).result == "v2"

    # An import of a module not written yet: writing it is the fix.
    (app / "jobs.py").write_text(
        f"from reloadapp.later import version\n{JOBS}".format(version="v3")
    )
    wait_for(
        lambda: worker.output().count("it starts again when a Python file changes") == 2,
        timeout=20,
    )
    time.sleep(1.5)
    created = _probe()
    (app / "later.py").write_text("def version():\n    return 'v3'\n")
    assert wait_for_state(created.id, "completed", timeout=20).result == "v3"
    os.killpg(worker.pid, signal.SIGINT)  # the worker has a session of its own: stop it
    assert worker.wait(20) == 0, worker.output()


def test_a_file_changed_while_the_worker_was_starting_is_not_missed(project, start_worker):
    # A project whose start-up takes a while: jobs.py is imported, then the other
    # modules; a file saved in between ran on its old code until the next save.
    app = project / "reloadapp"
    (app / "followups.py").write_text(
        textwrap.dedent(
            """
            import os
            import time
            from pathlib import Path

            MARK = Path(__file__).with_name("importing")
            if os.environ.get("AWA_WORKER_RELOAD_CHILD") and not MARK.exists():
                MARK.write_text("")  # the first worker only
                time.sleep(2)
            """
        )
    )
    worker = _reloading(start_worker, project)
    wait_for(lambda: (app / "importing").exists(), timeout=20)
    (app / "jobs.py").write_text(JOBS.format(version="v2"))  # saved now, after its import
    wait_for(lambda: "jobs.py changed: finishing in-flight jobs" in worker.output(), timeout=20)
    assert wait_for_state(_probe().id, "completed", timeout=30).result == "v2"
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0, worker.output()


def test_ctrl_c_during_a_reload_still_lets_the_running_job_finish(project, start_worker):
    worker = _reloading(start_worker, project)
    slow = _probe(seconds=3)
    wait_for_state(slow.id, "running", timeout=30)
    # Saved now: newer than the worker's start, whether or not it has looked yet.
    (project / "reloadapp" / "jobs.py").write_text(JOBS.format(version="v2"))
    wait_for(lambda: "changed: finishing in-flight jobs" in worker.output(), timeout=10)
    # The worker already stops for the file: the developer's one Ctrl-C is a first
    # signal, not a second one that would give the running job back.
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0, worker.output()
    done = Job.objects.get(id=slow.id)
    assert (done.state, done.attempt, done.errors) == (JobState.COMPLETED, 1, [])


def test_a_broken_app_added_to_the_settings_starts_once_fixed(project, start_worker):
    # The developer runs startapp and adds the app to INSTALLED_APPS while the worker
    # runs; its jobs.py raises at import. The watcher started before the app existed:
    # fixing the app's file is the fix all the same.
    worker = _reloading(start_worker, project)
    assert wait_for_state(_probe().id, "completed", timeout=30).result == "v1"
    app = project / "laterapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    later_jobs = JOBS.replace("ReloadProbe", "LaterProbe").replace("reloadq", "laterq")
    (app / "jobs.py").write_text(f"RATE = undefined_rate\n{later_jobs}".format(version="v1"))
    settings = project / "reload_settings.py"
    settings.write_text(
        textwrap.dedent(SETTINGS).replace('"reloadapp"]', '"reloadapp", "laterapp"]')
        + 'AWA["QUEUES"]["laterq"] = {"concurrency": 1}\n'
    )
    wait_for(lambda: "it starts again when a Python file changes" in worker.output(), timeout=20)
    assert "NameError: name 'undefined_rate' is not defined" in worker.output()
    time.sleep(1.5)  # the watcher has taken its first look at the files
    fixed = make_job(kind="later_probe", queue="laterq", args={})
    (app / "jobs.py").write_text(later_jobs.format(version="fixed"))
    assert wait_for_state(fixed.id, "completed", timeout=20).result == "fixed"
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0, worker.output()


def test_a_project_broken_when_the_command_starts_is_waited_for(project, start_worker):
    # As runserver: `awa_worker --reload` started while a jobs.py raises at import
    # (a NameError, not a syntax error) watches for the fix instead of exiting.
    app = project / "reloadapp"
    _write_jobs(app, f"RATE = undefined_rate\n{JOBS}".format(version="v1"))
    worker = _reloading(start_worker, project)
    wait_for(lambda: "it starts again when a Python file changes" in worker.output(), timeout=30)
    assert "NameError: name 'undefined_rate' is not defined" in worker.output()
    assert worker.output().count("Traceback") == 1  # the worker's; the watcher's own start went on
    time.sleep(1.5)  # the watcher has taken its first look at the files
    assert worker.proc.poll() is None
    job = _probe()
    _write_jobs(app, JOBS.format(version="fixed"))
    assert wait_for_state(job.id, "completed", timeout=30).result == "fixed"
    os.killpg(worker.pid, signal.SIGINT)
    assert worker.wait(20) == 0, worker.output()
