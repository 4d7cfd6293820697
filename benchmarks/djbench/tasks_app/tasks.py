"""The django-tasks-db no-op task."""

from __future__ import annotations

from django.tasks import task
from systems import _common as common


@task(queue_name=common.QUEUE)
def noop(n: int = 0, t: float = 0.0) -> None:
    common.record_latency(t)


@task(queue_name=common.QUEUE)
def touch_account(account: int = 1) -> None:
    common.touch_account(account)
