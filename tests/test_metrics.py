"""``<prefix>/metrics`` and ``<prefix>/health`` (SPEC §15), on the real database and workers."""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

import django_awa as awa
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobCount, Queue, Worker
from tests.conftest import make_job, wait_for, wait_for_state
from tests.testapp.jobs import Act, Echo

pytestmark = pytest.mark.django_db(transaction=True)

METRICS = "/awa/metrics"
HEALTH = "/awa/health"
TOKEN = "scrape-me-0123456789"


def _awa(**extra: Any) -> dict[str, Any]:
    from django.conf import settings

    return {**settings.AWA, **extra}


def samples(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of an exposition, checking every family has HELP and TYPE."""
    found: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            assert key.split("{")[0] in typed, f"{key} has no TYPE line"
            found[key] = float(value)
    return found


def staff_client(*, staff: bool = True) -> Client:
    user = User.objects.create_user(f"u{staff}", is_staff=staff)
    client = Client()
    client.force_login(user)
    return client


def test_metrics_need_a_staff_session_or_the_bearer_token():
    anonymous = Client().get(METRICS)
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"] == 'Bearer realm="awa"'
    assert staff_client(staff=False).get(METRICS).status_code == 403
    staff = staff_client().get(METRICS)
    assert staff.status_code == 200
    assert staff["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    # No token configured: a bearer header opens nothing.
    assert Client().get(METRICS, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 401
    with override_settings(AWA=_awa(METRICS_TOKEN=TOKEN)):
        assert Client().get(METRICS, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
        assert Client().get(METRICS, HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200
        assert Client().get(METRICS, HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
        assert Client().get(METRICS, HTTP_AUTHORIZATION=TOKEN).status_code == 401
    assert Client().post(METRICS, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code in (401, 405)


def test_job_counts_come_from_the_leaders_rollup_and_a_scrape_reads_no_job_row():
    for _ in range(3):
        awa.enqueue(Echo(n=1))
    make_job(queue="echo", kind="echo", args={"n": 2}, state="failed")
    awa.enqueue(Act(), queue="other")
    Maintenance().count_jobs()
    awa.enqueue(Echo(n=9))  # after the count: not in it until the next one

    client = staff_client()
    with CaptureQueriesContext(connection) as queries:
        text = client.get(METRICS).content.decode()
    touched = [q["sql"] for q in queries if re.search(r'\bawa_job\b(?!_)|"awa_job"', q["sql"])]
    assert touched == [], touched
    found = samples(text)
    assert found['awa_jobs{queue="echo",state="available"}'] == 3
    assert found['awa_jobs{queue="echo",state="failed"}'] == 1
    assert found['awa_jobs{queue="other",state="available"}'] == 1
    assert 0 <= found["awa_jobs_counted_age_seconds"] < 60
    assert found['awa_queue_oldest_available_age_seconds{queue="echo"}'] >= 0

    Maintenance().count_jobs()
    assert samples(client.get(METRICS).content.decode())[
        'awa_jobs{queue="echo",state="available"}'
    ] == 4  # fmt: skip


def test_label_values_are_escaped():
    # A row no current name could make (pause_queue refuses it), as an older release wrote.
    Queue.objects.create(name='we"ird\\queue', paused=True)
    text = staff_client().get(METRICS).content.decode()
    assert 'awa_queue_paused{queue="we\\"ird\\\\queue"} 1' in text.splitlines()


def test_workers_sharing_a_name_get_a_series_each():
    # Containers on one host name, each its own pid 1: the same host:pid.
    boxes = {uuid.uuid4(): 3, uuid.uuid4(): 5}
    for worker_id, running in boxes.items():
        Worker.objects.create(
            id=worker_id, name="box:1", host="box", pid=1, running=running, concurrency=10
        )
    Worker.objects.create(id=uuid.uuid4(), name="other:7", host="other", pid=7, running=1)
    lines = staff_client().get(METRICS).content.decode().splitlines()
    running = sorted(line for line in lines if line.startswith("awa_worker_running_jobs{"))
    expected = [
        f'awa_worker_running_jobs{{worker="box:1/{str(i)[:8]}"}} {n}' for i, n in boxes.items()
    ]
    assert running == sorted([*expected, 'awa_worker_running_jobs{worker="other:7"} 1'])


def test_the_maintenance_age_keeps_growing_once_the_leader_is_dead():
    """The dead leader's row is left until a new leader prunes it: its last tick
    ages on in the metrics, as in /health, and an alert on it fires."""
    an_hour_ago = timezone.now() - dt.timedelta(hours=1)
    Worker.objects.create(
        id=uuid.uuid4(), name="gone:1", host="gone", pid=1,
        last_seen_at=an_hour_ago, maintained_at=an_hour_ago,
    )  # fmt: skip
    found = samples(staff_client().get(METRICS).content.decode())
    assert found["awa_workers"] == 0
    assert 3600 <= found["awa_maintenance_age_seconds"] < 3660
    assert 3600 <= Client().get(HEALTH).json()["maintenance_age_seconds"] < 3660


def test_a_count_that_found_no_job_is_as_old_as_the_last_tick_and_none_is_nan():
    client = staff_client()
    Maintenance().count_jobs()  # awa_job is empty: no row
    found = samples(client.get(METRICS).content.decode())
    assert math.isnan(found["awa_jobs_counted_age_seconds"])  # no tick recorded: never counted
    an_hour_ago = timezone.now() - dt.timedelta(hours=1)
    Worker.objects.create(
        id=uuid.uuid4(), name="leader:1", host="leader", pid=1, maintained_at=an_hour_ago
    )
    found = samples(client.get(METRICS).content.decode())
    assert 3600 <= found["awa_jobs_counted_age_seconds"] < 3660
    assert found['awa_jobs{queue="default",state="available"}'] == 0


def test_a_real_worker_fleet_in_the_metrics_and_health(start_worker):
    client = staff_client()
    before = Client().get(HEALTH)
    assert before.status_code == 503
    assert before.json()["status"] == "unavailable" and before.json()["database"] is True
    assert samples(client.get(METRICS).content.decode())["awa_workers"] == 0

    worker = start_worker("--queue", "default=3")
    job = awa.enqueue(Act(action="sleep", seconds=30))
    wait_for_state(job.id, "running")

    def scraped() -> dict[str, float] | None:
        found = samples(client.get(METRICS).content.decode())
        running = f'awa_worker_running_jobs{{worker="{_name(worker.pid)}"}}'
        key = 'awa_jobs{queue="default",state="running"}'
        return found if found.get(running) == 1 and found.get(key) == 1 else None

    found = wait_for(scraped, message=worker.output)
    assert found["awa_workers"] == 1
    assert found[f'awa_worker_concurrency{{worker="{_name(worker.pid)}"}}'] == 3
    assert found["awa_maintenance_age_seconds"] < 10

    healthy = wait_for(lambda: (r := Client().get(HEALTH)).status_code == 200 and r)
    assert healthy.json()["status"] == "ok" and healthy.json()["database"] is True
    assert healthy.json()["maintenance_age_seconds"] <= 1.5  # 3 x MAINTENANCE_INTERVAL

    awa.cancel(job.id)
    # Drained, a queue's series say 0, not nothing (a graph would show no data).
    wait_for(
        lambda: (
            samples(client.get(METRICS).content.decode()).get(
                'awa_jobs{queue="default",state="running"}'
            )
            == 0
        ),
        message=worker.output,
    )
    found = samples(client.get(METRICS).content.decode())
    assert found['awa_jobs{queue="default",state="available"}'] == 0
    # The cancelled job archived (awa_job_done) and its follow-up gone, awa_job is
    # empty: the count has no row to date it by, and its age is the last tick's.
    Job.objects.filter(kind="echo").delete()
    wait_for(lambda: not JobCount.objects.exists(), message=worker.output)
    assert 0 <= samples(client.get(METRICS).content.decode())["awa_jobs_counted_age_seconds"] < 10
    assert worker.stop() == 0
    # No leader any more: unhealthy once three maintenance intervals passed.
    wait_for(lambda: Client().get(HEALTH).status_code == 503, timeout=10)


def _name(pid: int) -> str:
    import socket

    return f"{socket.gethostname()}:{pid}"


def test_health_is_503_when_the_database_does_not_answer():
    settings_dict = connection.settings_dict
    saved = settings_dict["PORT"], settings_dict["HOST"]
    connection.close()
    settings_dict["HOST"], settings_dict["PORT"] = "127.0.0.1", "1"  # nothing listens there
    try:
        response = Client().get(HEALTH)
    finally:
        connection.close()
        settings_dict["PORT"], settings_dict["HOST"] = saved
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "database": False,
        "error": "OperationalError",
    }
    assert Client().get(HEALTH).json()["database"] is True


@pytest.mark.parametrize("token", ["", "   ", 42])
def test_a_bad_metrics_token_is_a_check_error_naming_the_key(token: Any):
    from django_awa.conf import problems

    assert ("METRICS_TOKEN", "AWA['METRICS_TOKEN'] must be a non-empty string") in problems(
        {"METRICS_TOKEN": token}
    )


@pytest.mark.parametrize("token", ["s3cret\n", " s3cret", "s3cret\t", "pässwort", "a\x00b"])
def test_a_metrics_token_no_header_could_carry_is_a_check_error(token: str):
    """A token read from a file with its line end, or with non-ASCII text, never matched
    the stripped, latin-1-decoded header: every scrape got a 401. The check says so."""
    from django_awa.conf import problems

    found = dict(problems({"METRICS_TOKEN": token}))
    fault = "whitespace" if token != token.strip() else "characters other than printable ASCII"
    assert fault in found["METRICS_TOKEN"]
    assert "use printable ASCII without surrounding whitespace" in found["METRICS_TOKEN"]
    # A secret: named by its fault, never shown.
    assert token.strip() not in found["METRICS_TOKEN"]


@pytest.mark.parametrize("token", ["s3cret", "a-Z_0.9~+/=", "two words", "!#$%&'*"])
def test_a_printable_ascii_metrics_token_is_accepted_and_opens_the_metrics(token: str):
    from django_awa.conf import problems

    assert problems({"METRICS_TOKEN": token}) == []
    with override_settings(AWA=_awa(METRICS_TOKEN=token)):
        assert Client().get(METRICS, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
