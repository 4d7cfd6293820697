"""Flow control (SPEC 12): per-key leases of ``awa.Limit(concurrency=...)``.

``awa_limit_lease``: one row per place of a limited kind's key held by a running
attempt, unique per (kind, key, slot), so concurrent claimers never start more
than the limit of one key (``sql.CLAIM_KEYED``). As many rows as such attempts
run; each deleted with its attempt's outcome.

Online: a new, empty table. Earlier releases neither need nor see it.
"""

import django.db.models.functions.datetime
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_awa", "0014_flow_slot_leases"),
    ]

    operations = [
        migrations.CreateModel(
            name="LimitLease",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("kind", models.CharField(max_length=255)),
                ("key", models.TextField()),
                ("slot", models.IntegerField()),
                ("job_id", models.BigIntegerField()),
                ("run_lease", models.BigIntegerField()),
                (
                    "taken_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        default=django.utils.timezone.now,
                    ),
                ),
            ],
            options={
                "db_table": "awa_limit_lease",
                "indexes": [models.Index(fields=["job_id"], name="awa_limit_lease_job_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("kind", "key", "slot"), name="awa_limit_lease_unique"
                    )
                ],
            },
        ),
    ]
