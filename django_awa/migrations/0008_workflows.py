"""Results and workflows (SPEC §11): ``result``, ``workflow_id``, ``has_dependents``,
the ``blocked`` state and the dependency edges ``awa_job_dependency``.

Online. The three columns are nullable or carry a constant ``db_default``,
so adding them rewrites nothing and the previous release's inserts fill
them. The state check is replaced by one that admits ``blocked``, added
``NOT VALID`` (a moment's ACCESS EXCLUSIVE lock, waiting at most 5 s) and
validated in its own statement under a lock that lets reads and writes go
on. The previous release never sees a ``blocked`` job it could claim: its
claim reads ``state = 'available'`` only. Indexes on ``awa_job`` and
``awa_job_done`` are built CONCURRENTLY; ``awa_job_dependency`` is new.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

from ._invalid_index import drop_if_invalid

STATES = (
    "'scheduled', 'available', 'running', 'completed', 'retryable', 'failed', "
    "'cancelled', 'waiting_external', 'blocked'"
)
OLD_STATES = (
    "'scheduled', 'available', 'running', 'completed', 'retryable', 'failed', "
    "'cancelled', 'waiting_external'"
)


def _check(states: str) -> list[str]:
    return [
        "SET lock_timeout = '5s'",
        "ALTER TABLE awa_job DROP CONSTRAINT IF EXISTS awa_job_state_valid",
        # The child's own copy (made by LIKE ... INCLUDING CONSTRAINTS) stays
        # when the parent's goes: drop it too, the new one is inherited.
        "ALTER TABLE awa_job_done DROP CONSTRAINT IF EXISTS awa_job_state_valid",
        f"ALTER TABLE awa_job ADD CONSTRAINT awa_job_state_valid CHECK (state IN ({states})) "
        "NOT VALID",
        "RESET lock_timeout",
        "ALTER TABLE awa_job VALIDATE CONSTRAINT awa_job_state_valid",
    ]


STATE_CHOICES = [
    ("scheduled", "Scheduled"),
    ("available", "Available"),
    ("running", "Running"),
    ("completed", "Completed"),
    ("retryable", "Retryable"),
    ("failed", "Failed"),
    ("cancelled", "Cancelled"),
    ("waiting_external", "Waiting External"),
    ("blocked", "Blocked"),
]

DONE_WORKFLOW_INDEX = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS awa_job_done_workflow_idx "
    "ON awa_job_done (workflow_id) WHERE workflow_id IS NOT NULL"
)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("django_awa", "0007_maintenance_lease")]

    operations = [
        migrations.AddField("job", "result", models.JSONField(blank=True, null=True)),
        migrations.AddField("job", "workflow_id", models.UUIDField(blank=True, null=True)),
        migrations.AddField(
            "job", "has_dependents", models.BooleanField(db_default=False, default=False)
        ),
        migrations.AlterField(
            "job",
            "state",
            models.CharField(
                choices=STATE_CHOICES,
                db_default="available",
                default="available",
                max_length=32,
            ),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(_check(STATES), reverse_sql=_check(OLD_STATES))
            ],
            state_operations=[
                migrations.RemoveConstraint("job", "awa_job_state_valid"),
                migrations.AddConstraint(
                    "job",
                    models.CheckConstraint(
                        condition=models.Q(state__in=[value for value, _ in STATE_CHOICES]),
                        name="awa_job_state_valid",
                    ),
                ),
            ],
        ),
        migrations.RunSQL(drop_if_invalid("awa_job_workflow_idx"), migrations.RunSQL.noop),
        AddIndexConcurrently(
            "job",
            models.Index(
                condition=models.Q(workflow_id__isnull=False),
                fields=["workflow_id"],
                name="awa_job_workflow_idx",
            ),
        ),
        migrations.RunSQL(
            [drop_if_invalid("awa_job_done_workflow_idx"), DONE_WORKFLOW_INDEX],
            reverse_sql="DROP INDEX CONCURRENTLY IF EXISTS awa_job_done_workflow_idx",
        ),
        migrations.CreateModel(
            name="Dependency",
            fields=[
                ("pk", models.CompositePrimaryKey("job_id", "depends_on_id", serialize=False)),
                ("job_id", models.BigIntegerField()),
                ("depends_on_id", models.BigIntegerField()),
                ("position", models.IntegerField(db_default=0, default=0)),
                (
                    "requires",
                    models.CharField(
                        choices=[("completed", "Completed"), ("finished", "Finished")],
                        db_default="completed",
                        default="completed",
                        max_length=16,
                    ),
                ),
            ],
            options={
                "db_table": "awa_job_dependency",
                "indexes": [
                    models.Index(
                        fields=["depends_on_id", "job_id"], name="awa_dependency_dependents_idx"
                    )
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(requires__in=["completed", "finished"]),
                        name="awa_dependency_requires_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("job_id", models.F("depends_on_id")), _negated=True),
                        name="awa_dependency_not_self",
                    ),
                ],
            },
        ),
    ]
