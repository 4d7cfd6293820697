"""awa_job_done holds finished rows only, and says so: a CHECK on its states.

The planner reads a ``state = 'available'`` (or any live state) filter on
``awa_job`` through both tables; with a CHECK that every row of
``awa_job_done`` is completed, failed or cancelled, it skips the child
(constraint exclusion, on for inheritance children by default) instead of
walking its million rows.

A retry used to UPDATE the finished row inside ``awa_job_done``, and an AFTER
trigger then moved it back into ``awa_job``: the updated row would break the
CHECK before that trigger ran. The engine now moves a finished row back
itself before making it live (``sql.REVIVE_DONE``); the trigger becomes a
BEFORE UPDATE trigger that does the same for any other update (the ORM, raw
SQL) and skips the update in the child (``RETURN NULL``), so no row of
``awa_job_done`` is ever written live. Such an UPDATE counts 0 rows for the
row it moved; ``Job`` sets ``select_on_save``, so ``save()`` of one still
updates it rather than INSERT it twice.

Online, in two transactions: swapping the trigger and adding the check
``NOT VALID`` take an ACCESS EXCLUSIVE lock on ``awa_job_done`` for a moment
(``lock_timeout`` 5 s: the migration fails rather than queue every reader
behind it); ``VALIDATE CONSTRAINT`` then reads the rows under a SHARE UPDATE
EXCLUSIVE lock, which blocks no read or write. Going back drops the check
and restores the AFTER trigger.
"""

from django.db import migrations

FINAL = "('completed', 'failed', 'cancelled')"

SWAP_TRIGGER_AND_CHECK = f"""
BEGIN;
SET LOCAL lock_timeout = '5s';
CREATE OR REPLACE FUNCTION awa_job_done_reopen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A finished job made live again by a statement that did not move it
    -- first (the ORM, raw SQL): moved back where the engine looks for live
    -- jobs, and the update in awa_job_done skipped (its CHECK allows only
    -- finished states).
    DELETE FROM ONLY awa_job_done WHERE id = OLD.id;
    INSERT INTO awa_job SELECT (NEW).*;
    RETURN NULL;
END
$$;
DROP TRIGGER awa_job_done_reopen ON awa_job_done;
CREATE TRIGGER awa_job_done_reopen BEFORE UPDATE ON awa_job_done
    FOR EACH ROW WHEN (NEW.state NOT IN {FINAL})
    EXECUTE FUNCTION awa_job_done_reopen();
ALTER TABLE awa_job_done ADD CONSTRAINT awa_job_done_finished
    CHECK (state IN {FINAL}) NOT VALID;
COMMIT;
"""

VALIDATE = """
BEGIN;
SET LOCAL lock_timeout = '5s';
ALTER TABLE awa_job_done VALIDATE CONSTRAINT awa_job_done_finished;
COMMIT;
"""

RESTORE_AFTER_TRIGGER = f"""
BEGIN;
SET LOCAL lock_timeout = '5s';
ALTER TABLE awa_job_done DROP CONSTRAINT IF EXISTS awa_job_done_finished;
CREATE OR REPLACE FUNCTION awa_job_done_reopen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A finished job made live again (retried, or changed with the ORM)
    -- goes back where the engine looks for live jobs.
    DELETE FROM ONLY awa_job_done WHERE id = NEW.id;
    INSERT INTO awa_job SELECT (NEW).*;
    RETURN NULL;
END
$$;
DROP TRIGGER awa_job_done_reopen ON awa_job_done;
CREATE TRIGGER awa_job_done_reopen AFTER UPDATE ON awa_job_done
    FOR EACH ROW WHEN (NEW.state NOT IN {FINAL})
    EXECUTE FUNCTION awa_job_done_reopen();
COMMIT;
"""


class Migration(migrations.Migration):
    atomic = False  # two transactions: the brief exclusive lock is not held through the scan

    dependencies = [("django_awa", "0010_flow_control")]

    operations = [
        migrations.RunSQL(SWAP_TRIGGER_AND_CHECK, reverse_sql=RESTORE_AFTER_TRIGGER),
        migrations.RunSQL(VALIDATE, reverse_sql=migrations.RunSQL.noop),
        # Job.save() checks that the row exists when its UPDATE counts none
        # (the trigger moved it): no SQL.
        migrations.AlterModelOptions(
            name="job", options={"ordering": ("-id",), "select_on_save": True}
        ),
    ]
