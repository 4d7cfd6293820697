"""Drop ``awa_job_deadline_idx``: a claim writes one index entry fewer.

A claim makes each row it takes ``running``, and every partial index whose
predicate the new row version meets gets an entry: the primary key,
``awa_job_running_idx (heartbeat_at)`` and ``awa_job_deadline_idx
(deadline_at)``, both ``WHERE state = 'running'``. The second served one
reader, the rescue's search for attempts past their deadline, over the same
rows as the first: the running ones, at most the fleet's concurrency. That
search now reads them through ``awa_job_running_idx`` and tests each deadline
(thousands of rows at the most, once a rescue pass), and the claim no longer
writes a WAL record and about 65 bytes a job for it
(``benchmarks/statement_cost.py --without-index awa_job_deadline_idx``).

The copies in ``awa_job_done`` and its segments stay: their rows are finished,
never ``running``, so those indexes get no entries.

Online: ``DROP INDEX CONCURRENTLY`` waits for the transactions using the
index and blocks no read or write. Reversible: built again ``CONCURRENTLY``.
"""

from django.db import migrations, models

from ._invalid_index import drop_if_invalid


class Migration(migrations.Migration):
    atomic = False  # DROP/CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("django_awa", "0016_finished_segments")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex("job", "awa_job_deadline_idx")],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX CONCURRENTLY IF EXISTS awa_job_deadline_idx",
                    reverse_sql=[
                        drop_if_invalid("awa_job_deadline_idx"),
                        "CREATE INDEX CONCURRENTLY IF NOT EXISTS awa_job_deadline_idx "
                        "ON awa_job (deadline_at) WHERE state = 'running'",
                    ],
                )
            ],
        )
    ]
