"""The flush that ends each transactional test (``conftest._flush_written_tables_only``)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection

from django_awa.models import Job


@pytest.mark.django_db(transaction=True)
def test_the_flush_empties_the_finished_jobs_table_when_awa_job_itself_was_never_written():
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE awa_job")  # as a flush leaves it: no page on disk
        cursor.execute(
            "INSERT INTO awa_job_done (id, kind, queue, state, finalized_at) "
            "VALUES (nextval(pg_get_serial_sequence('awa_job', 'id')), 'act', 'default', "
            "'completed', now())"
        )
        cursor.execute("SELECT pg_relation_size('awa_job')")
        assert cursor.fetchone() == (0,)  # awa_job's own heap untouched, its child's not
    assert Job.objects.count() == 1

    # As a transactional test's teardown calls it (TransactionTestCase._fixture_teardown).
    call_command("flush", interactive=False, verbosity=0, reset_sequences=False)

    assert Job.objects.count() == 0
