"""callback_id: unique where set, by a partial index instead of a full one.

Most jobs never register a callback. The full unique index of 0.1.0 took an
entry for every row on every write that is not a HOT update (the insert,
the claim, the outcome); the partial one only for rows that hold a callback
id. The same values stay unique, so 0.1.0 workers keep working beside this
release, and their lookups by callback id use the new index.

Online: the new index is built CONCURRENTLY before the old constraint goes,
and dropping the constraint waits at most ``lock_timeout`` for its brief
exclusive lock (migrate stops with a lock timeout error instead of stalling
the queue behind a long transaction; run it again).
"""

from django.db import migrations, models
from django.db.models import Q

from ._invalid_index import drop_if_invalid

CREATE = (
    "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS awa_job_callback_id_uniq "
    "ON awa_job (callback_id) WHERE callback_id IS NOT NULL"
)
DROP_OLD = (
    "SET lock_timeout = '5s'; "
    "ALTER TABLE awa_job DROP CONSTRAINT IF EXISTS awa_job_callback_id_key; "
    "RESET lock_timeout"
)
RESTORE_OLD = "ALTER TABLE awa_job ADD CONSTRAINT awa_job_callback_id_key UNIQUE (callback_id)"
DROP_NEW = "DROP INDEX CONCURRENTLY IF EXISTS awa_job_callback_id_uniq"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("django_awa", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    [drop_if_invalid("awa_job_callback_id_uniq"), CREATE], reverse_sql=DROP_NEW
                ),
                migrations.RunSQL(DROP_OLD, reverse_sql=RESTORE_OLD),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="callback_id",
                    field=models.UUIDField(blank=True, null=True),
                ),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=Q(callback_id__isnull=False),
                        fields=("callback_id",),
                        name="awa_job_callback_id_uniq",
                    ),
                ),
            ],
        ),
    ]
