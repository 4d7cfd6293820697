"""``<prefix>/metrics`` (Prometheus text format) and ``<prefix>/health`` (SPEC §15).

Cheap on tables of millions of rows: a scrape counts nothing. Jobs per queue
and state come from ``awa_job_count``, which the maintenance leader rewrites
each maintenance interval from ``ONLY awa_job`` (live jobs and the finished
ones not yet archived); finished jobs in ``awa_job_done`` are the catalog's
estimate (``pg_class.reltuples``). The rest reads small tables: the worker
registry, paused queues, pending follow-ups.

``/metrics`` answers staff users (session) and requests carrying
``Authorization: Bearer <AWA["METRICS_TOKEN"]>``; anyone else gets 401 (403
for a signed-in user who is not staff). ``/health`` answers anyone: 200 when
the database answers and a maintenance leader ran a tick within three
``MAINTENANCE_INTERVAL``\\ s, else 503, with a JSON body saying which.
"""

from __future__ import annotations

import hmac
import math
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import sql
from .conf import AwaSettings, awa_settings
from .fleet import live
from .models import JobCount, JobState, PendingFollowup, Queue, Worker
from .state import DB_ERRORS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A leader that ran maintenance within this many intervals is healthy (SPEC §15).
HEALTHY_INTERVALS = 3


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


class _Exposition:
    """Metric families in the Prometheus text format, each with its HELP and TYPE."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
        kind: str = "gauge",
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{key}="{_label(str(v))}"' for key, v in labels.items())
            self.lines.append(
                f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}"
            )

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def exposition(alias: str, conf: AwaSettings) -> str:
    """The metrics text, read on connection ``alias``."""
    out = _Exposition()
    with connections[alias].cursor() as cursor:
        # From every registry row, as /health reads it: the leader that ran the
        # last tick may be dead, and the age must keep growing while nobody runs
        # maintenance (live workers only would leave no value to alert on).
        cursor.execute(sql.LAST_MAINTAINED)
        maintenance_age: float | None
        now: datetime
        maintenance_age, now = cursor.fetchone()
        cursor.execute(sql.DONE_ROWS_ESTIMATE)
        done_estimate = cursor.fetchone()[0]
    counts = list(JobCount.objects.using(alias).order_by("queue", "state"))
    out.family(
        "awa_jobs",
        "Jobs in awa_job per queue and state (live, and finished not yet archived), "
        "as the maintenance leader last counted them.",
        (
            ({"queue": queue, "state": state}, count)
            for queue, state, count in job_counts(
                alias, conf, counts, counted=bool(counts) or maintenance_age is not None
            )
        ),
    )
    counted_at = max((c.counted_at for c in counts), default=None)
    # A count that found no job left no row to date it: it ran in the last
    # maintenance tick that counted, which is at least as old as the last tick.
    counted_age = (now - counted_at).total_seconds() if counted_at else maintenance_age
    out.family(
        "awa_jobs_counted_age_seconds",
        "Seconds since the maintenance leader counted awa_jobs (awa_job empty: since its "
        "last tick; NaN: never).",
        [({}, math.nan if counted_age is None else counted_age)],
    )
    out.family(
        "awa_queue_oldest_available_age_seconds",
        "Age of the oldest available job's run_at per queue, when last counted.",
        (
            ({"queue": c.queue}, max(0.0, (c.counted_at - c.oldest_run_at).total_seconds()))
            for c in counts
            if c.oldest_run_at is not None
        ),
    )
    out.family(
        "awa_finished_jobs_estimate",
        "Finished jobs moved to awa_job_done: the planner's estimate (-1: not analyzed yet).",
        [({}, done_estimate)],
    )
    paused = Queue.objects.using(alias).filter(paused=True).values_list("name", flat=True)
    out.family("awa_queue_paused", "1 for each paused queue.", (({"queue": q}, 1) for q in paused))
    out.family(
        "awa_pending_followups",
        "Committed outcomes whose follow-ups maintenance is still retrying.",
        [({}, PendingFollowup.objects.using(alias).count())],
    )
    workers = list(live(alias, conf.stale_after).order_by("name", "id"))
    labels = _worker_labels(workers)
    out.family("awa_workers", "Live worker processes.", [({}, len(workers))])
    out.family(
        "awa_worker_running_jobs",
        "Jobs whose handlers run in each live worker, as of its last heartbeat.",
        (({"worker": labels[w.id]}, w.running) for w in workers),
    )
    out.family(
        "awa_worker_concurrency",
        "Handler threads of each live worker, over all its queues.",
        (({"worker": labels[w.id]}, w.concurrency) for w in workers),
    )
    out.family(
        "awa_maintenance_age_seconds",
        "Seconds since a maintenance leader last ran a tick, live or not (NaN: none recorded).",
        [({}, math.nan if maintenance_age is None else maintenance_age)],
    )
    return out.text()


def job_counts(
    alias: str, conf: AwaSettings, counts: list[JobCount], *, counted: bool
) -> list[tuple[str, str, int]]:
    """(queue, state, count) of every state of every known queue (configured, with
    a row in ``awa_queue``, or counted), 0 where the count found no job: what
    ``awa_jobs`` and the OpenTelemetry ``awa.jobs`` gauge report.

    The leader's count has rows only for the states it found: without the
    zeros, a queue's series vanished when it drained (``running`` once idle),
    and a graph or ``sum()`` showed no data instead of 0. Before any count
    (``counted`` False) there is nothing to say, and no sample.
    """
    if not counted:
        return []
    found = {(c.queue, c.state): c.count for c in counts}
    queues = {c.queue for c in counts} | set(conf.queues)
    queues.update(Queue.objects.using(alias).values_list("name", flat=True))
    return [
        (queue, state, found.get((queue, state), 0))
        for queue in sorted(queues)
        for state in JobState.values
    ]


def last_job_counts(alias: str, conf: AwaSettings) -> list[tuple[str, str, int]]:
    """``job_counts`` of the leader's last count, read on ``alias``: nothing before a
    leader ran maintenance (an empty count is known only by the tick that made it)."""
    counts = list(JobCount.objects.using(alias))
    if counts:
        return job_counts(alias, conf, counts, counted=True)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.LAST_MAINTAINED)
        maintenance_age = cursor.fetchone()[0]
    return job_counts(alias, conf, counts, counted=maintenance_age is not None)


def _worker_labels(workers: list[Worker]) -> dict[Any, str]:
    """Each worker's ``worker`` label: its name (``host:pid``), or, for workers that
    share one (containers that each run as pid 1 on one host name), the name and
    the start of its id, so that no two series of a family share their labels."""
    counts = Counter(w.name for w in workers)
    return {w.id: w.name if counts[w.name] == 1 else f"{w.name}/{str(w.id)[:8]}" for w in workers}


def _authorized(request: HttpRequest, conf: AwaSettings) -> HttpResponse | None:
    """None if the request may read the metrics, else the response refusing it."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if (
        conf.metrics_token
        and scheme.lower() == "bearer"
        and hmac.compare_digest(token.strip().encode(), conf.metrics_token.encode())
    ):
        return None
    if user is not None and user.is_authenticated:
        return HttpResponse("staff only\n", status=403, content_type="text/plain")
    response = HttpResponse(
        "a staff session or the bearer token AWA['METRICS_TOKEN'] is needed\n",
        status=401,
        content_type="text/plain",
    )
    response["WWW-Authenticate"] = 'Bearer realm="awa"'
    return response


@never_cache
@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    conf = awa_settings()
    refused = _authorized(request, conf)
    if refused is not None:
        return refused
    return HttpResponse(exposition(conf.database, conf), content_type=CONTENT_TYPE)


def health(alias: str, conf: AwaSettings) -> tuple[bool, dict[str, object]]:
    """Whether the database answers and a leader ran maintenance lately, and why not."""
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql.HEALTH_TIMEOUT)
            cursor.execute(sql.LAST_MAINTAINED)
            age, now = cursor.fetchone()
    except DB_ERRORS as exc:
        return False, {"database": False, "error": type(exc).__name__}
    limit = HEALTHY_INTERVALS * conf.maintenance_interval
    body: dict[str, object] = {
        "database": True,
        "maintenance_age_seconds": None if age is None else round(age, 3),
        "maintenance_limit_seconds": limit,
        "checked_at": now.isoformat(),
    }
    return age is not None and age <= limit, body


@never_cache
@require_GET
def health_view(request: HttpRequest) -> JsonResponse:
    conf = awa_settings()
    ok, body = health(conf.database, conf)
    if not ok and body.get("database"):
        body["error"] = "no maintenance leader ran within the limit"
    return JsonResponse(
        {"status": "ok" if ok else "unavailable", **body}, status=200 if ok else 503
    )
