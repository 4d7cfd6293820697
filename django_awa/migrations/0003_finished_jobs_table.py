"""awa_job_done: finished jobs move out of the table new jobs are written to.

Every job is inserted into ``awa_job``, claimed and finished there. Finished
rows (completed, failed, cancelled) then pile up among the pages new jobs
land in: after VACUUM, a new job goes into whatever room the finished rows'
earlier versions left, scattered over the whole table, and each claim and
outcome reads and dirties more pages than on a table of live jobs only.

``awa_job_done`` is a child of ``awa_job`` by table inheritance. Maintenance
moves finished rows into it in batches (``sql.ARCHIVE_FINISHED``), so
``awa_job`` itself keeps only live jobs and the room they leave, which VACUUM
hands back to the next jobs. Every query on ``awa_job`` that does not say
``ONLY`` reads both tables: the ``Job`` model, the admin, pruning and raw SQL
see every job, as before; updates and deletes reach the finished rows where
they are. Rows in ``awa_job_done`` are always finished: an update that makes
one live again (a retry) moves it back into ``awa_job`` in the same
statement, by the ``awa_job_done_reopen`` trigger, so the engine's statements
on live jobs read ``ONLY awa_job``. A finished row that holds its unique key
(``unique_states`` includes its state) is not moved: the unique index lives on
``awa_job``.

The new table is made ``LIKE awa_job`` with every index ``awa_job`` has
(those over live states stay empty, and cost an insert nothing but their
predicate), so any query on the two reads the child by index. Online: the table, its indexes and trigger are
new and empty; creating a child takes a SHARE UPDATE EXCLUSIVE lock on
``awa_job`` for a moment, which conflicts with no read or write. A release
that knows nothing of the child (0.1.0) keeps working beside this one: its
statements name ``awa_job`` without ``ONLY``, so they see the moved rows too.
Going back (``migrate django_awa 0002``) moves every row back first.
"""

from django.db import migrations

FINAL = "('completed', 'failed', 'cancelled')"

CREATE = f"""
SET LOCAL lock_timeout = '5s';
-- awa_job's columns, defaults, checks and every index (those over live
-- states stay empty); then the child of awa_job, which its columns match.
CREATE TABLE awa_job_done
    (LIKE awa_job INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES);
ALTER TABLE awa_job_done INHERIT awa_job;
-- Rows arrive in batches and are only read, retried or pruned: no room for
-- updates on the page; vacuum after inserts too, so index-only scans hold.
ALTER TABLE awa_job_done SET (fillfactor = 100, autovacuum_vacuum_insert_scale_factor = 0.05,
                              autovacuum_analyze_scale_factor = 0.02);
CREATE FUNCTION awa_job_done_reopen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A finished job made live again (retried, or changed with the ORM)
    -- goes back where the engine looks for live jobs.
    DELETE FROM ONLY awa_job_done WHERE id = NEW.id;
    INSERT INTO awa_job SELECT (NEW).*;
    RETURN NULL;
END
$$;
CREATE TRIGGER awa_job_done_reopen AFTER UPDATE ON awa_job_done
    FOR EACH ROW WHEN (NEW.state NOT IN {FINAL})
    EXECUTE FUNCTION awa_job_done_reopen();
"""

MOVE_BACK_AND_DROP = """
SET LOCAL lock_timeout = '5s';
-- No write into awa_job_done until this commits: a row moved there after the
-- move back would be dropped with it.
LOCK TABLE awa_job_done IN EXCLUSIVE MODE;
WITH moved AS (DELETE FROM ONLY awa_job_done RETURNING *)
INSERT INTO awa_job SELECT * FROM moved;
-- What going back past 0016 left for running workers (a view, its trigger).
DROP VIEW IF EXISTS awa_job_done_current;
DROP FUNCTION IF EXISTS awa_job_done_current_insert();
DROP TABLE awa_job_done;
DROP FUNCTION awa_job_done_reopen();
"""


class Migration(migrations.Migration):
    dependencies = [("django_awa", "0002_callback_id_partial_unique")]

    operations = [migrations.RunSQL(CREATE, reverse_sql=MOVE_BACK_AND_DROP)]
