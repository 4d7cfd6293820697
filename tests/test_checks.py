"""Settings validation and system checks."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import CommandError

from django_awa.conf import awa_settings, problems


def awa_errors() -> list[checks.CheckMessage]:
    return [e for e in checks.run_checks() if (e.id or "").startswith("awa.")]


def test_defaults_are_documented_values(settings):
    settings.AWA = {}
    conf = awa_settings()
    assert conf.database == "default"
    assert conf.queues["default"].concurrency == 10
    assert (conf.poll_interval, conf.heartbeat_interval, conf.stale_after) == (1.0, 5.0, 30.0)
    assert conf.shutdown_timeout == 30.0 and conf.callback_secret is None


def test_durations_take_seconds_or_timedeltas(settings):
    settings.AWA = {"STALE_AFTER": dt.timedelta(minutes=2), "POLL_INTERVAL": 0.5}
    conf = awa_settings()
    assert conf.stale_after == 120.0 and conf.poll_interval == 0.5


@pytest.mark.parametrize(
    ("awa", "key"),
    [
        ({"POLL_INTERVAL": "fast"}, "POLL_INTERVAL"),
        ({"POLL_INTERVAL": -1}, "POLL_INTERVAL"),
        ({"HEARTBEAT_INTERVAL": None}, "HEARTBEAT_INTERVAL"),
        ({"STALE_AFTER": 1, "HEARTBEAT_INTERVAL": 5}, "STALE_AFTER"),
        ({"QUEUES": {"default": {"concurrency": 0}}}, "QUEUES"),
        ({"QUEUES": {"bad name": {}}}, "QUEUES"),
        ({"QUEUES": {"q": {"speed": 3}}}, "QUEUES"),
        ({"QUEUES": []}, "QUEUES"),
        ({"DATABASE": "missing"}, "DATABASE"),
        ({"CALLBACK_SECRET": 123}, "CALLBACK_SECRET"),
        ({"COMPLETED_RETENTION": dt.timedelta(seconds=-5)}, "COMPLETED_RETENTION"),
        ({"MAX_ARGS_BYTES": 0}, "MAX_ARGS_BYTES"),
        ({"TYPO_SETTING": 1}, "TYPO_SETTING"),
        (["default"], "AWA"),
    ],
)
def test_a_wrong_setting_is_a_check_error_naming_the_key(settings, awa, key):
    settings.AWA = awa
    assert [k for k, _ in problems()] == [key]
    errors = awa_errors()
    assert len(errors) == 1 and errors[0].id == "awa.E001"
    assert key in errors[0].msg
    with pytest.raises(Exception, match=key):
        awa_settings()


@pytest.mark.parametrize(
    ("awa", "expected"),
    [
        ({"QUEUS": {}}, "unknown AWA setting 'QUEUS' (did you mean 'QUEUES'?)"),
        (
            {"HEARTBEAT_INTERVALL": 5},
            "unknown AWA setting 'HEARTBEAT_INTERVALL' (did you mean 'HEARTBEAT_INTERVAL'?)",
        ),
        (
            {"poll_interval": 1},
            "unknown AWA setting 'poll_interval' (did you mean 'POLL_INTERVAL'?)",
        ),
        (
            {"QUEUES": {"q": {"concurency": 3}}},
            "AWA['QUEUES']['q'] has an unknown option 'concurency' (did you mean 'concurrency'?)",
        ),
    ],
)
def test_a_misspelt_setting_names_the_closest_valid_one(settings, awa, expected):
    settings.AWA = awa
    errors = awa_errors()
    assert [(e.id, e.msg) for e in errors] == [("awa.E001", expected)]
    with pytest.raises(Exception, match=re.escape(expected)):
        awa_settings()


def test_a_setting_like_no_valid_one_gets_no_guess(settings):
    settings.AWA = {"TYPO_SETTING": 1}
    assert [e.msg for e in awa_errors()] == ["unknown AWA setting 'TYPO_SETTING'"]


def test_the_worker_command_refuses_bad_settings(settings):
    settings.AWA = {"POLL_INTERVAL": "fast"}
    with pytest.raises(CommandError, match="POLL_INTERVAL"):
        call_command("awa_worker")


@pytest.mark.parametrize(
    ("awa", "expected"),
    [
        ("{**AWA, 'QUEUE': {}}", "unknown AWA setting 'QUEUE'"),
        # AWA itself not a dict (a list of the queues, say): a ValueError from
        # dict() and its traceback stopped every command instead.
        ("['default']", "AWA must be a dict of django-awa settings, got list"),
    ],
)
def test_a_wrong_setting_is_a_check_error_even_with_periodic_jobs_declared(tmp_path, awa, expected):
    # A jobs.py declaring awa.periodic(...) is imported as the apps load: it must not
    # stop every command with a traceback before the checks can speak.
    app = tmp_path / "nightly_app"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "jobs.py").write_text(
        "from dataclasses import dataclass\n"
        "import django_awa as awa\n"
        "@dataclass\n"
        "class NightlyTypo(awa.JobArgs):\n"
        "    day: str = 'today'\n"
        "awa.periodic('nightly-typo', '0 3 * * *', NightlyTypo())\n"
    )
    (tmp_path / "typo_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "INSTALLED_APPS = [*INSTALLED_APPS, 'nightly_app']\n"
        f"AWA = {awa}\n"
    )
    check = _manage_check(tmp_path, "typo_settings")
    assert check.returncode != 0
    assert "awa.E001" in check.stderr and expected in check.stderr
    assert "Traceback" not in check.stderr


def _manage_check(tmp_path, settings: str) -> subprocess.CompletedProcess[str]:
    """``manage.py check`` as a real process, with settings module ``settings`` in ``tmp_path``."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "check"], env=env, capture_output=True, text=True
    )


def test_a_periodic_name_declared_in_two_jobs_modules_stops_the_commands(tmp_path):
    for app in ("reports_app", "billing_app"):
        (tmp_path / app).mkdir()
        (tmp_path / app / "__init__.py").write_text("")
        (tmp_path / app / "jobs.py").write_text(
            "from dataclasses import dataclass\n"
            "import django_awa as awa\n"
            "@dataclass\n"
            f"class Nightly{app.title().replace('_', '')}(awa.JobArgs):\n"
            "    day: str = 'today'\n"
            f"awa.periodic('nightly', '0 3 * * *', Nightly{app.title().replace('_', '')}())\n"
        )
    (tmp_path / "twice_settings.py").write_text(
        "from tests.settings import *  # noqa\n"
        "INSTALLED_APPS = [*INSTALLED_APPS, 'reports_app', 'billing_app']\n"
    )
    check = _manage_check(tmp_path, "twice_settings")
    assert check.returncode != 0
    reports, billing = tmp_path / "reports_app" / "jobs.py", tmp_path / "billing_app" / "jobs.py"
    assert (
        f"ImproperlyConfigured: periodic schedule 'nightly' is declared twice: "
        f"at {reports}:6 and at {billing}:6"
    ) in check.stderr


def test_a_database_that_is_not_postgresql_is_refused():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.sqlite_settings"}
    check = subprocess.run(
        [sys.executable, "-m", "django", "check"], env=env, capture_output=True, text=True
    )
    assert check.returncode != 0
    # One check, one message, wherever it is met.
    message = "django-awa needs PostgreSQL, but database 'default' is 'sqlite'"
    assert "awa.E101" in check.stderr and message in check.stderr
    enqueue = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); import django_awa as awa; "
            "from tests.testapp.jobs import Echo; awa.enqueue(Echo(n=1))",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert enqueue.returncode != 0
    assert "ConfigurationError" in enqueue.stderr and message in enqueue.stderr


def test_the_test_project_passes_its_checks():
    assert awa_errors() == []


@pytest.mark.django_db  # makemigrations reads the applied migrations
def test_the_models_need_no_migration_that_is_not_there():
    # A constraint or index declared on a model but missing from the
    # migrations (or the other way round) would show here.
    call_command("makemigrations", "django_awa", "--check", "--dry-run", verbosity=0)


def test_max_metadata_bytes_is_a_positive_integer(settings):
    assert awa_settings().max_metadata_bytes == 65536
    for bad in (0, -1, 1.5, "10", True, None):
        settings.AWA = {"MAX_METADATA_BYTES": bad}
        assert [k for k, _ in problems()] == ["MAX_METADATA_BYTES"], bad
    settings.AWA = {"MAX_METADATA_BYTES": 1_000_000}
    assert awa_settings().max_metadata_bytes == 1_000_000


def test_a_timeout_longer_than_the_default_deadline_is_warned_about(settings):
    from django_awa.checks import check_timeouts

    assert check_timeouts() == []  # the test kinds' 1 s timeouts fit the default deadline
    settings.AWA = {**settings.AWA, "DEFAULT_DEADLINE": 0.5}
    warnings = check_timeouts()
    assert {w.id for w in warnings} == {"awa.W203"}
    assert any("@awa.worker(Timed): timeout (1s) is longer than AWA['DEFAULT_DEADLINE']" in
               w.msg for w in warnings)  # fmt: skip
