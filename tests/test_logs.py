"""Structured logs: every record about a job carries its id, kind, queue, attempt and worker."""

from __future__ import annotations

import io
import json
import logging

import django_awa as awa
from django_awa.logs import JobContextFilter, JsonFormatter, job_logging, set_worker
from django_awa.models import Job
from tests.conftest import wait_for, wait_for_state
from tests.testapp.jobs import Act


def _json_logger(name: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(JobContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(name)
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_records_logged_while_a_job_runs_carry_its_fields_as_json():
    logger, stream = _json_logger("tests.logs.inside")
    job = Job(id=41, kind="act", queue="default", attempt=2)
    with job_logging(job, "host:1"):
        logger.info("working on %s", "it", extra={"order": 7})
        logger.info("explicit", extra={"job_id": 99})
    logger.info("outside")
    inside, explicit, outside = _lines(stream)
    assert inside["message"] == "working on it"
    assert {k: inside[k] for k in ("job_id", "kind", "queue", "attempt", "worker")} == {
        "job_id": 41, "kind": "act", "queue": "default", "attempt": 2, "worker": "host:1",
    }  # fmt: skip
    assert inside["order"] == 7 and inside["level"] == "INFO"
    assert explicit["job_id"] == 99 and explicit["kind"] == "act"
    assert outside["job_id"] is None and outside["kind"] is None


def test_the_worker_name_of_a_thread_fills_records_outside_a_job():
    logger, stream = _json_logger("tests.logs.worker")
    set_worker("box:123")
    try:
        logger.info("tick")
    finally:
        set_worker("")
    (line,) = _lines(stream)
    assert line["worker"] == "box:123" and line["job_id"] is None


def test_a_traceback_is_one_json_field():
    logger, stream = _json_logger("tests.logs.exc")
    try:
        raise ValueError("bad")
    except ValueError:
        logger.exception("failed")
    (line,) = _lines(stream)
    assert "ValueError: bad" in line["exc_info"] and line["message"] == "failed"


def test_a_real_worker_with_the_readme_recipe_writes_job_fields_on_handler_and_engine_records(
    start_worker,
):
    job = awa.enqueue(Act(action="log", tag="hello"))
    worker = start_worker(
        "--queue", "default", env={"DJANGO_SETTINGS_MODULE": "tests.json_logging_settings"}
    )
    wait_for_state(job.id, "completed")

    def records() -> list[dict]:
        found = []
        for line in worker.output().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("job_id") == job.id:
                    found.append(entry)
        return found

    wait_for(lambda: len(records()) >= 2, message=lambda: worker.output()[-3000:])
    by_logger = {entry["logger"]: entry for entry in records()}
    handler_record = by_logger["tests.testapp.jobs"]
    assert handler_record["message"] == "handler says hello"
    outcome = by_logger["django_awa.finalize"]
    for entry in (handler_record, outcome):
        assert entry["kind"] == "act" and entry["queue"] == "default"
        assert entry["attempt"] == 1
        assert entry["worker"].endswith(f":{worker.pid}")
