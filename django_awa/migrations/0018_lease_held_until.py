"""``awa_limit_lease.held_until``: a key's place outlives its attempt while its handler runs.

A cancel or a rescue past its deadline takes an attempt out of ``running``
while its sync handler may still run in a live worker (one that ignores
``is_cancelled()``). Its lease is then kept, ``held_until`` set, instead of
deleted, and its worker renews it until the handler returns; a worker that
dies stops renewing it and the place frees once it passes.

Online: a nullable column without a default, added in place (no table
rewrite). A worker of an earlier 0.2 build ignores it: it takes such a lease
over as stale, as before.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0017_drop_deadline_index")]

    operations = [
        migrations.AddField(
            model_name="limitlease",
            name="held_until",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
