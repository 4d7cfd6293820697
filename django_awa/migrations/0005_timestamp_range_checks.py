"""awa_job_run_at_range, awa_job_callback_timeout_at_range: timestamps Python can read.

PostgreSQL's timestamptz holds 4713 BC to 294276 AD; Python's datetime, and so
Django and psycopg, years 1 to 9999. A row holding a ``run_at`` (or a
``callback_timeout_at``) outside years 1 to 9999 in UTC can be written but not
read back: every query returning it fails, among them claims and admin pages
listing other jobs. Enqueue refuses such a ``run_at``; these checks keep any
other path (the ORM, raw SQL, a handler's ``register_callback`` timeout) from
storing one.

Online, in two steps. Here each check is added ``NOT VALID``: new and updated
rows are checked from now on, and no existing row is read, so the ACCESS
EXCLUSIVE lock on ``awa_job`` (and on its child ``awa_job_done``, which
inherits every check of ``awa_job``) is held for a moment; the lock waits at
most 5 s, then ``migrate`` stops with a lock timeout error: run it again.
0006 then validates the existing rows, in its own transaction, under a lock
that lets reads and writes go on. 0.1.0 writes only timestamps within range.
"""

import datetime

from django.db import migrations, models

COLUMNS = ("run_at", "callback_timeout_at")
FIRST = datetime.datetime(1, 1, 1, tzinfo=datetime.UTC)
LAST = datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=datetime.UTC)
BOUNDS = "'0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'"

ADD = "SET LOCAL lock_timeout = '5s';\n" + "\n".join(
    f"ALTER TABLE awa_job ADD CONSTRAINT awa_job_{column}_range "
    f"CHECK ({column} BETWEEN {BOUNDS}) NOT VALID;"
    for column in COLUMNS
)
DROP = "\n".join(
    f"ALTER TABLE awa_job DROP CONSTRAINT IF EXISTS awa_job_{column}_range;"
    for column in COLUMNS
)


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0004_archive_candidates_index")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(ADD, reverse_sql=DROP)],
            state_operations=[
                migrations.AddConstraint(
                    "job",
                    models.CheckConstraint(
                        condition=models.Q(**{f"{column}__gte": FIRST, f"{column}__lte": LAST}),
                        name=f"awa_job_{column}_range",
                    ),
                )
                for column in COLUMNS
            ],
        )
    ]
