"""``awa_limit_lease.held_until``: a key's place outlives its attempt while its handler runs.

A cancel or a rescue past its deadline takes an attempt out of ``running``
while its sync handler may still run in a live worker (one that ignores
``is_cancelled()``). Its lease is then kept, ``held_until`` set, instead of
deleted, and its worker renews it until the handler returns; a worker that
dies stops renewing it and the place frees once it passes.

Online: a nullable column without a default, added in place (no table
rewrite). A worker of an earlier 0.2 build ignores it: it takes such a lease
over as stale, as before.

Going back leaves the column in the table, only Django's model state loses it:
a rollback migrates back with this release while its workers still run, and
their rescues and cancels name the column (without it every maintenance tick
failed). The earlier builds name their columns, so they never see it; applied
again, it is added only if missing. Going back past 0015 drops the table.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0017_drop_deadline_index")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    "ALTER TABLE awa_limit_lease ADD COLUMN IF NOT EXISTS held_until timestamptz",
                    reverse_sql=migrations.RunSQL.noop,
                )
            ],
            state_operations=[
                migrations.AddField(
                    model_name="limitlease",
                    name="held_until",
                    field=models.DateTimeField(blank=True, null=True),
                )
            ],
        ),
    ]
