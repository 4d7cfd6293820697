"""awa_lease: maintenance leadership as a lease renewed by the leader's writes.

Leadership was a session-level advisory lock, which a frozen leader (SIGSTOP,
a VM paused) kept for as long as its session lived, stopping rescue,
promotion and periodic jobs for the whole fleet. A lease runs out instead.

Online: a new table with its one row; nothing in earlier releases reads it.
Workers of an earlier release still elect their own leader by the advisory
lock while a rolling upgrade runs, and every maintenance statement is safe
to run from two leaders at once (rows are taken with SKIP LOCKED, periodic
fires under the schedule's row lock).
"""

from django.db import migrations, models

SEED = "INSERT INTO awa_lease (name, lease_until) VALUES ('maintenance', '-infinity')"


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0006_validate_timestamp_range_checks")]

    operations = [
        migrations.CreateModel(
            name="MaintenanceLease",
            fields=[
                ("name", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("holder", models.CharField(db_default="", default="", max_length=255)),
                ("term", models.BigIntegerField(db_default=0, default=0)),
                ("lease_until", models.DateTimeField()),
                ("acquired_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={"db_table": "awa_lease"},
        ),
        migrations.RunSQL(SEED, reverse_sql=migrations.RunSQL.noop),
    ]
