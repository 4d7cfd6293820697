"""The soak audits' own rule for "a handler ran twice in one attempt" (stress/audit.py).

The fault, HA and crash-soak tests trust this check to fail when an attempt's
handler really runs twice, and not to fail on the one ledger row a run writes
when it sees its attempt cancelled.
"""

from __future__ import annotations

import pytest
from django.db import connection

from stress import audit
from tests.conftest import make_job
from tests.testapp.models import Ledger, Order

pytestmark = pytest.mark.django_db


def _duplicates(job_ids: list[int]) -> list[tuple[object, ...]]:
    with connection.cursor() as cursor:
        return audit.ledger_duplicates(cursor, job_ids)


def test_a_second_run_of_one_attempt_is_reported_with_its_leases() -> None:
    Ledger.objects.create(job_id=1, attempt=1, run_lease=1, note="sleep")
    Ledger.objects.create(job_id=1, attempt=1, run_lease=2, note="sleep")
    Ledger.objects.create(job_id=2, attempt=1, run_lease=1, note="ok")
    Ledger.objects.create(job_id=2, attempt=2, run_lease=2, note="ok")

    assert _duplicates([1, 2]) == [(1, 1, 2, ["sleep@1", "sleep@2"])]


def test_a_run_that_saw_its_attempt_cancelled_is_one_run() -> None:
    # A rescued attempt's handler hears of it from the heartbeat and notes it.
    Ledger.objects.create(job_id=3, attempt=1, run_lease=1, note="sleep")
    Ledger.objects.create(job_id=3, attempt=1, run_lease=1, note="saw-cancel")
    Ledger.objects.create(job_id=3, attempt=2, run_lease=2, note="sleep")

    assert _duplicates([3]) == []


def test_an_atomic_job_whose_writes_committed_other_than_with_its_completion_is_reported():
    # Completed: exactly one Order and one Ledger row. Any other state: none.
    def pay(reference: str, state: str) -> int:
        return make_job(kind="pay", state=state, args={"reference": reference}).id

    good = pay("good", "completed")
    Order.objects.create(reference="good")
    Ledger.objects.create(job_id=good, attempt=1, run_lease=1, note="pay")
    twice = pay("twice", "completed")
    Order.objects.create(reference="twice")
    Order.objects.create(reference="twice")
    Ledger.objects.create(job_id=twice, attempt=1, run_lease=1, note="pay")
    lost = pay("lost", "completed")  # completed, its writes rolled back
    failed = pay("failed", "failed")  # failed, its writes committed anyway
    Order.objects.create(reference="failed")
    Ledger.objects.create(job_id=failed, attempt=1, run_lease=1, note="pay")
    retryable = pay("retryable", "retryable")

    with connection.cursor() as cursor:
        found = audit.atomic_effects(cursor, [good, twice, lost, failed, retryable])

    assert found == [
        (twice, "completed", 2, 1),
        (lost, "completed", 0, 0),
        (failed, "failed", 1, 1),
    ]
