"""The admin dashboard's history: per-worker outcome counts and the per-minute rollup.

- ``awa_stat_delta``: insert-only rows each worker's heartbeat adds with the
  outcomes it counted since the last one; the maintenance leader takes them.
- Proxy models of ``Job`` for the admin's *Dashboard* and *Dead letters*
  entries (no table); pending follow-ups lose the "dead letters" name.
- ``awa_stat_minute``: one row per queue and minute, written by the leader
  only, kept for a day (pruned by maintenance).

Online: two new, empty tables; nothing else is touched or locked. Earlier
releases neither write nor read them. Reversible (the tables are dropped).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0011_bulk_done_states")]

    operations = [
        migrations.AlterModelOptions(
            name="pendingfollowup",
            options={
                "ordering": ("next_attempt_at", "id"),
                "verbose_name": "pending follow-up",
                "verbose_name_plural": "pending follow-ups",
            },
        ),
        migrations.CreateModel(
            name="Dashboard",
            fields=[],
            options={
                "verbose_name": "dashboard",
                "verbose_name_plural": "dashboard",
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("django_awa.job",),
        ),
        migrations.CreateModel(
            name="DeadLetter",
            fields=[],
            options={
                "verbose_name": "dead letter (failed job)",
                "verbose_name_plural": "dead letters (failed jobs)",
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("django_awa.job",),
        ),
        migrations.CreateModel(
            name="StatDelta",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("worker", models.CharField(max_length=300)),
                ("queue", models.CharField(max_length=128)),
                ("minute", models.DateTimeField()),
                ("completed", models.BigIntegerField(default=0)),
                ("failed", models.BigIntegerField(default=0)),
                ("retried", models.BigIntegerField(default=0)),
                ("wait", models.JSONField(default=list)),
            ],
            options={"db_table": "awa_stat_delta"},
        ),
        migrations.CreateModel(
            name="StatMinute",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("queue", models.CharField(max_length=128)),
                ("minute", models.DateTimeField()),
                ("completed", models.BigIntegerField(default=0)),
                ("failed", models.BigIntegerField(default=0)),
                ("retried", models.BigIntegerField(default=0)),
                ("wait", models.JSONField(default=list)),
                ("oldest_due", models.FloatField(blank=True, null=True)),
            ],
            options={
                "db_table": "awa_stat_minute",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("minute", "queue"), name="awa_stat_minute_uniq"
                    )
                ],
            },
        ),
    ]
