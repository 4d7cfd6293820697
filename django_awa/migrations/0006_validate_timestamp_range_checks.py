"""Validate the checks 0005 added ``NOT VALID``: every existing row is read once.

``VALIDATE CONSTRAINT`` takes a SHARE UPDATE EXCLUSIVE lock on ``awa_job``
and ``awa_job_done`` (it recurses into the child): reads and writes go on
while it scans; only VACUUM and other schema changes wait. In a transaction
of its own (this migration), so 0005's brief exclusive lock is not held
through the scan.

A row stored out of range before 0005 (by 0.1.0, which let ``enqueue`` write
one) makes this migration fail, naming the check; such rows cannot be read
back anyway. Find them with ``SELECT id FROM awa_job WHERE run_at NOT BETWEEN
'0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'`` (likewise
``callback_timeout_at``), delete them, and run ``migrate`` again.
"""

from django.db import migrations

COLUMNS = ("run_at", "callback_timeout_at")

VALIDATE = "SET LOCAL lock_timeout = '5s';\n" + "\n".join(
    f"ALTER TABLE awa_job VALIDATE CONSTRAINT awa_job_{column}_range;" for column in COLUMNS
)


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0005_timestamp_range_checks")]

    # Going back, 0005 drops the checks; a validated check needs no undoing.
    operations = [migrations.RunSQL(VALIDATE, reverse_sql=migrations.RunSQL.noop)]
