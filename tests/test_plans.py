"""Query plans of the admin's heavy pages on a table of many finished rows."""

from __future__ import annotations

import pytest
from django.db import connection

from django_awa.models import Job

pytestmark = pytest.mark.django_db

FINISHED = 100_000


@pytest.fixture
def many_finished_followups() -> None:
    """FINISHED follow-ups in awa_job_done, two per trigger id, then ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job_done (id, kind, queue, state, finalized_at, metadata)
            SELECT nextval(pg_get_serial_sequence('awa_job', 'id')), 'act', 'default',
                   'completed', now(), jsonb_build_object('awa_trigger', jsonb_build_object(
                       'job_id', g / 2, 'kind', 'act', 'outcome', 'completed'))
            FROM generate_series(1, %s) g
            """,
            [FINISHED],
        )
        cursor.execute("ANALYZE awa_job; ANALYZE awa_job_done")


def plan(queryset: object) -> str:
    sql, params = queryset.query.sql_with_params()  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_a_jobs_followups_are_found_by_the_trigger_index_not_a_primary_key_walk(
    many_finished_followups: None,
):
    trigger = Job.objects.create(kind="act")
    shown = plan(trigger.followups()[:51])  # the job page's query
    assert "awa_job_done_pkey" not in shown and "awa_job_pkey" not in shown, shown
    assert "(metadata #>> '{awa_trigger,job_id}'::text[])" in shown, shown
    # Still right: the follow-ups of a trigger that has some, oldest first.
    some = Job.objects.filter(metadata__awa_trigger__job_id=500).order_by("id")
    assert list(Job(id=500).followups().values_list("id", flat=True)) == list(
        some.values_list("id", flat=True)
    )
    assert len(some) == 2
