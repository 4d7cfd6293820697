"""awa_job_done_current: completed jobs leave in bulk, a table at a time.

A completed job is written once, into ``awa_job_done`` (``sql.COMPLETE``), and
pruning then deleted it row by row once ``COMPLETED_RETENTION`` had passed: a
DELETE per row, its index entries and dead row versions for VACUUM, about as
much work for the database as the job's claim.

Completions now go into ``awa_job_done_current``, a child of ``awa_job_done``
(and so of ``awa_job``). The maintenance leader renames it, once its oldest
row is a quarter of ``COMPLETED_RETENTION`` old, to
``awa_job_done_<timestamp>`` and makes a new, empty ``awa_job_done_current``
(``awa_job_done_segment()``, below); a renamed table whose newest row is past
retention is dropped whole (``Maintenance.rotate_finished``). Every query on
``awa_job`` or ``awa_job_done`` without ``ONLY`` reads them all: the ``Job``
model, the admin, lineage and raw SQL see every job as before.

Each such table is made ``LIKE awa_job_done`` (its defaults, checks and every
index) with one more partial index, on the rows others depend on (few), and
the ``awa_job_done_reopen`` trigger, now written for whichever table it fires
on: a finished job made live again goes back into ``awa_job``.

Online: a new, empty table; becoming a child takes a SHARE UPDATE EXCLUSIVE
lock on ``awa_job_done`` for a moment, which conflicts with no read or write.
A release that knows nothing of it keeps working beside this one: its
statements on ``awa_job`` and ``awa_job_done`` without ``ONLY`` see these rows,
and its pruning deletes them row by row. Going back moves every row of the
children into ``awa_job_done`` and drops them.
"""

from django.db import migrations

# The finished states, as they appear inside a quoted string of the function.
FINAL_QUOTED = "(''completed'', ''failed'', ''cancelled'')"

CREATE = f"""
SET LOCAL lock_timeout = '5s';
CREATE OR REPLACE FUNCTION awa_job_done_reopen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A finished job made live again by a statement that did not move it
    -- first (the ORM, raw SQL): moved back where the engine looks for live
    -- jobs, and the update in this table of finished rows skipped (its CHECK
    -- allows only finished states).
    EXECUTE format('DELETE FROM ONLY %s WHERE id = $1', TG_RELID::regclass) USING OLD.id;
    INSERT INTO awa_job SELECT (NEW).*;
    RETURN NULL;
END
$$;
CREATE FUNCTION awa_job_done_segment(name text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- awa_job_done's columns, defaults, checks and every index; then its child.
    EXECUTE format('CREATE TABLE %I (LIKE awa_job_done INCLUDING DEFAULTS '
                   'INCLUDING CONSTRAINTS INCLUDING INDEXES)', name);
    -- The rows others depend on stay when the table is dropped (moved into
    -- awa_job_done, where pruning settles their dependents): found by this.
    EXECUTE format('CREATE INDEX ON %I (id) WHERE has_dependents', name);
    EXECUTE format('ALTER TABLE %I INHERIT awa_job_done', name);
    EXECUTE format('ALTER TABLE %I SET (fillfactor = 100, '
                   'autovacuum_vacuum_insert_scale_factor = 0.05, '
                   'autovacuum_analyze_scale_factor = 0.02)', name);
    EXECUTE format('CREATE TRIGGER awa_job_done_reopen BEFORE UPDATE ON %I FOR EACH ROW '
                   'WHEN (NEW.state NOT IN {FINAL_QUOTED}) EXECUTE FUNCTION awa_job_done_reopen()', name);
END
$$;
SELECT awa_job_done_segment('awa_job_done_current');
"""

MOVE_BACK_AND_DROP = """
SET LOCAL lock_timeout = '5s';
DO $$
DECLARE child regclass;
BEGIN
    FOR child IN SELECT inhrelid::regclass FROM pg_inherits
                 WHERE inhparent = 'awa_job_done'::regclass LOOP
        EXECUTE format('INSERT INTO awa_job_done SELECT * FROM ONLY %s', child);
        EXECUTE format('DROP TABLE %s', child);
    END LOOP;
END
$$;
DROP FUNCTION awa_job_done_segment(text);
CREATE OR REPLACE FUNCTION awa_job_done_reopen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM ONLY awa_job_done WHERE id = OLD.id;
    INSERT INTO awa_job SELECT (NEW).*;
    RETURN NULL;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0015_keyed_leases")]

    operations = [migrations.RunSQL(CREATE, reverse_sql=MOVE_BACK_AND_DROP)]
