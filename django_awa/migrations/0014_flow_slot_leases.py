"""Flow control (SPEC 12): slot leases of ``global_concurrency`` queues.

``awa_queue_slot``: one row per place of a ``global_concurrency`` queue that a
worker process holds (``slots.py``), unique per (queue, slot), so the fleet
holds at most N. A handful of rows per limited queue, taken and given back a
few times a poll interval, never by a claim or a finalize.

Online: a new, empty table. Earlier releases neither need nor see it.
"""

import django.db.models.functions.datetime
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_awa", "0013_admin_list_indexes"),
    ]

    operations = [
        migrations.CreateModel(
            name="QueueSlot",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue", models.CharField(max_length=255)),
                ("slot", models.IntegerField()),
                ("worker_id", models.UUIDField()),
                (
                    "taken_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        default=django.utils.timezone.now,
                    ),
                ),
            ],
            options={
                "db_table": "awa_queue_slot",
                "indexes": [models.Index(fields=["worker_id"], name="awa_queue_slot_worker_idx")],
                "constraints": [
                    models.UniqueConstraint(fields=("queue", "slot"), name="awa_queue_slot_unique")
                ],
            },
        ),
    ]
