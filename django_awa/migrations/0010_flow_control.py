"""Flow control (SPEC 12): runtime queue limits, the attempt-start log, sequences.

- ``awa_queue.limits``: limits set at runtime (``awa.set_queue_limits``, the
  admin), read by every claim of a limited queue.
- ``awa_attempt_start``: when attempts of limited queues and rate-limited kinds
  started, for the sliding-window rate limits; insert-only, pruned by maintenance.
- ``awa_job_sequence_idx``: the unfinished members of each sequence key
  (``metadata["awa_sequence"]``) in id order, for the claim's "is an earlier
  member unfinished" probe.

Online: a new table; a column with a constant default on the small awa_queue
(no rewrite); the index built CONCURRENTLY, partial on unfinished rows that
carry a sequence key, so other rows add no entries. Earlier releases read none of it
(they ignore the limits and sequences, as they always did).
"""

from django.db import migrations, models

from ._invalid_index import drop_if_invalid

# Partial on the unfinished members, in the words of the claim's probe
# (sql._sequence_free), so the planner matches it: a finished member leaves
# the index, and the probe for an earlier unfinished member reads one entry.
CREATE_SEQUENCE_INDEX = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS awa_job_sequence_idx "
    "ON awa_job ((metadata ->> 'awa_sequence'), id) "
    "WHERE metadata ? 'awa_sequence' AND state NOT IN ('completed', 'failed', 'cancelled')"
)
DROP_SEQUENCE_INDEX = "DROP INDEX CONCURRENTLY IF EXISTS awa_job_sequence_idx"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("django_awa", "0009_operations")]

    operations = [
        migrations.CreateModel(
            name="AttemptStart",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("scope", models.CharField(max_length=300)),
                ("key", models.TextField(blank=True, db_default="", default="")),
                ("started_at", models.DateTimeField()),
            ],
            options={
                "db_table": "awa_attempt_start",
                "indexes": [
                    models.Index(fields=["scope", "started_at"], name="awa_start_window_idx")
                ],
            },
        ),
        migrations.AddField(
            model_name="queue",
            name="limits",
            field=models.JSONField(blank=True, db_default={}, default=dict),
        ),
        migrations.RunSQL(
            [drop_if_invalid("awa_job_sequence_idx"), CREATE_SEQUENCE_INDEX],
            reverse_sql=DROP_SEQUENCE_INDEX,
        ),
    ]
