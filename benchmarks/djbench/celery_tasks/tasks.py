"""The Celery tasks (found by the app's autodiscover_tasks())."""

from __future__ import annotations

from celery import shared_task
from systems import _common as common


@shared_task(name="bench.noop")
def noop(n: int = 0, t: float = 0.0) -> None:
    common.record_latency(t)


@shared_task(name="bench.touch_account")
def touch_account(account: int = 1) -> None:
    common.touch_account(account)
