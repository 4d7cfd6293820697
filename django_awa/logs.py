"""Structured logs: the job a record is about, as attributes of the record.

Every record the engine logs about a job carries ``job_id``, ``kind``,
``queue``, ``attempt`` and ``worker`` (``extra=log_context(job)``). Records a
handler logs itself carry them too once :class:`JobContextFilter` is on the
handler that writes them: the worker sets the running job in a context
variable around each attempt (``job_logging``), and the filter copies it onto
records that do not say otherwise. :class:`JsonFormatter` writes a record as
one JSON line, those fields included. The README's *Logging* section has the
``LOGGING`` recipe.

This module imports nothing from the rest of the app: any module may use it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import JobRow

# The fields a job's records carry, in the order JsonFormatter writes them.
JOB_FIELDS = ("job_id", "kind", "queue", "attempt", "worker")

# Per thread (a new thread starts with an empty context): the worker a
# service thread belongs to, and the job whose handler runs in this thread.
_worker: ContextVar[str] = ContextVar("awa_worker", default="")
# The job is kept as it is, and its fields are read only when a record is
# about it: most attempts log nothing, and building them was per-job work.
_job: ContextVar[tuple[JobRow, str | None] | None] = ContextVar("awa_job", default=None)


def set_worker(name: str) -> None:
    """Name the worker this thread works for (``host:pid``), for its records."""
    _worker.set(name)


def log_context(job: JobRow, worker: str | None = None) -> dict[str, Any]:
    """The ``extra`` of a record about ``job``; ``worker`` defaults to this thread's."""
    return {
        "job_id": job.id,
        "kind": job.kind,
        "queue": job.queue,
        "attempt": job.attempt,
        "worker": _worker.get() if worker is None else worker,
    }


class job_logging:  # lower case: used as a function, ``with job_logging(job):``
    """While the block runs, this thread's records are about ``job`` (see the filter).

    A class rather than a ``@contextmanager`` generator: the handler threads
    enter one for every job, and the generator's machinery cost more than the
    rest of it.
    """

    __slots__ = ("_token", "job", "worker")

    def __init__(self, job: JobRow, worker: str | None = None) -> None:
        self.job = job
        self.worker = worker

    def __enter__(self) -> None:
        # Nothing is built here: a record's fields are read only when one is logged.
        self._token = _job.set((self.job, self.worker))

    def __exit__(self, *exc_info: object) -> None:
        _job.reset(self._token)


def current_job() -> dict[str, Any] | None:
    """The log context of the job whose handler runs in this thread, if any."""
    running = _job.get()
    return None if running is None else log_context(*running)


class JobContextFilter(logging.Filter):
    """Adds the running job's fields to every record logged while its handler runs.

    Put it on a handler (``"filters": ["awa_job"]``): a logger's own filters
    do not see the records of its children. Fields a record already has (an
    explicit ``extra``) are kept. Records logged outside a job get the fields
    as ``None`` (``worker`` as this thread's worker, if any), so a format
    string may name them. Never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        context = current_job()
        for name in JOB_FIELDS:
            if not hasattr(record, name):
                if context is not None:
                    value = context[name]
                else:
                    value = (_worker.get() or None) if name == "worker" else None
                setattr(record, name, value)
        return True


# LogRecord's own attributes: what JsonFormatter leaves out of "extra".
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the job's fields,
    any other ``extra``, and the traceback as ``exc_info`` when there is one.

    Values JSON cannot hold are written as their ``str()``.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in JOB_FIELDS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        for name, value in vars(record).items():
            if name not in _RECORD_ATTRS and name not in entry:
                entry[name] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)
