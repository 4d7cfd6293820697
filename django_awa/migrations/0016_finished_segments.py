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
children into ``awa_job_done`` and drops them, and leaves in
``awa_job_done_current``'s place an empty view whose inserts go into
``awa_job_done``: workers of this release still running (a rollback replaces
them after migrating) keep storing their completions, rather than failing each
one and running the job again. Applying this migration again drops the view;
going back past 0003 drops it too.
"""

from django.db import migrations

# The finished states, as they appear inside a quoted string of the function.
FINAL_QUOTED = "(''completed'', ''failed'', ''cancelled'')"

CREATE = f"""
SET LOCAL lock_timeout = '5s';
-- Applied again after going back: the stand-in left for running workers.
DROP VIEW IF EXISTS awa_job_done_current;
DROP FUNCTION IF EXISTS awa_job_done_current_insert();
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
-- No write into awa_job_done or its children until this commits (reads go
-- on): a completion committed after a child's rows were copied would be
-- dropped with it.
LOCK TABLE awa_job_done IN EXCLUSIVE MODE;
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
-- Workers of this release may still be running (a rollback replaces them
-- after it): their completions name awa_job_done_current. A view of that
-- name, always empty, takes them into awa_job_done, where the earlier
-- release reads finished rows. It refers to no table or column (its columns
-- are typed NULLs, its insert a trigger), so it holds back no later step of
-- going back; applying this migration again drops it.
CREATE FUNCTION awa_job_done_current_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO awa_job_done SELECT (NEW).*;
    RETURN NEW;
END
$$;
DO $$
DECLARE
    columns text;
    defaults record;
BEGIN
    SELECT string_agg(format('NULL::%s AS %I', format_type(atttypid, atttypmod), attname),
                      ', ' ORDER BY attnum)
    INTO columns FROM pg_attribute
    WHERE attrelid = 'awa_job_done'::regclass AND attnum > 0 AND NOT attisdropped;
    EXECUTE format('CREATE VIEW awa_job_done_current AS SELECT %s WHERE false', columns);
    -- A column left out of an insert gets awa_job_done's default, as in the table.
    FOR defaults IN SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) AS expr
                    FROM pg_attribute AS a
                    JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                    WHERE a.attrelid = 'awa_job_done'::regclass AND NOT a.attisdropped LOOP
        EXECUTE format('ALTER VIEW awa_job_done_current ALTER COLUMN %I SET DEFAULT %s',
                       defaults.attname, defaults.expr);
    END LOOP;
END
$$;
CREATE TRIGGER awa_job_done_current_insert INSTEAD OF INSERT ON awa_job_done_current
    FOR EACH ROW EXECUTE FUNCTION awa_job_done_current_insert();
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
