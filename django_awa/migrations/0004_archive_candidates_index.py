"""awa_job_archive_idx: the finished rows maintenance may move, and only those.

Each maintenance tick looks for finished rows to move into awa_job_done
(``sql.ARCHIVE_FINISHED``). Finished jobs that hold their unique key stay in
awa_job for as long as their retention lasts; through the index of all
finished rows (awa_job_finalized_idx), every tick would walk past each of
them again to find none to move. This partial index holds the rows that may
move: an entry is added when a job finishes and goes when the row moves. It
is ordered by ``finalized_at``, so a tick reads only the rows finished since
the last one: the entries of rows already moved lie before them until VACUUM
removes them.

Online: built CONCURRENTLY; nothing in 0.1.0 reads it.
"""

from django.db import migrations

from ._invalid_index import drop_if_invalid

CREATE = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS awa_job_archive_idx ON awa_job (finalized_at) "
    "WHERE state IN ('completed', 'failed', 'cancelled') "
    "AND (unique_key IS NULL OR NOT coalesce(unique_states ? state, false))"
)
DROP = "DROP INDEX CONCURRENTLY IF EXISTS awa_job_archive_idx"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("django_awa", "0003_finished_jobs_table")]

    operations = [
        migrations.RunSQL([drop_if_invalid("awa_job_archive_idx"), CREATE], reverse_sql=DROP)
    ]
