"""Indexes for the admin's job list on millions of finished rows (issue 21).

The list shows 50 jobs newest first. Filtered by a value the finished rows of
``awa_job_done`` hold only among the oldest ids (a queue whose jobs all failed
last week, the failed state), the planner walks the primary key backwards past
every newer row, expecting a match every few rows: 0.4-0.6 s on a million.
The list now reads the ids of its page first (``admin.EstimatedCountPaginator``),
so an index holding the filtered columns and ``id`` answers that read on its
own (an index-only scan), in id order. Each index leads with one filter's
column and ``id`` and carries the other filters' columns (``INCLUDE``), so any
combination of the state, queue and kind filters is read from the index of
the first in id order, the others checked on the index entries:

- ``awa_job_done_queue_idx (queue, id) INCLUDE (kind, state)`` and
  ``awa_job_done_kind_idx (kind, id) INCLUDE (queue, state)``: the queue and
  kind filters, and sorting by queue or kind.
- ``awa_job_done_state_idx (state, id) INCLUDE (queue, kind)`` and
  ``awa_job_state_idx``, partial on ``failed`` and ``cancelled``: the state
  filter for the rare finished states (``completed`` rows are most of the
  table: the primary key finds them).
- ``awa_job_done_dead_letter_idx`` and ``awa_job_dead_letter_idx (queue, kind,
  <first line of the last error>, id)``, partial on ``failed``: a dead-letter
  group's jobs (``Job.objects.with_error``, the same expression,
  ``models.ERROR_LINE_SQL``), read in id order however many failed jobs there are.

``awa_job`` gets only the two partial ones: it holds live jobs, whose claims and
outcomes would pay for an index on every row; failed and cancelled rows are few
there (they move to ``awa_job_done``).

Online: every index is built ``CONCURRENTLY`` (no lock that stops reads or
writes; a million rows take a few seconds each), ``IF NOT EXISTS`` so a build
interrupted and retried goes on, after dropping an index the interrupted build
left invalid (``_invalid_index.drop_if_invalid``). Earlier releases neither need nor see them.
Reversible: dropped ``CONCURRENTLY``.
"""

from django.db import migrations

from ._invalid_index import drop_if_invalid

# models.ERROR_LINE_SQL as of this migration (a migration does not follow later code):
# the expression the dead-letter filter compares, so the planner matches the index.
ERROR_LINE_SQL = "left(split_part(coalesce(errors #>> '{-1,error}', ''), E'\\n', 1), 200)"
_FAILED = "state = 'failed'"
_RARE_FINISHED = "state IN ('failed', 'cancelled')"

INDEXES = {
    "awa_job_done_queue_idx": "awa_job_done (queue, id) INCLUDE (kind, state)",
    "awa_job_done_kind_idx": "awa_job_done (kind, id) INCLUDE (queue, state)",
    "awa_job_done_state_idx": (
        f"awa_job_done (state, id) INCLUDE (queue, kind) WHERE {_RARE_FINISHED}"
    ),
    "awa_job_state_idx": f"awa_job (state, id) INCLUDE (queue, kind) WHERE {_RARE_FINISHED}",
    "awa_job_done_dead_letter_idx": (
        f"awa_job_done (queue, kind, ({ERROR_LINE_SQL}), id) WHERE {_FAILED}"
    ),
    "awa_job_dead_letter_idx": f"awa_job (queue, kind, ({ERROR_LINE_SQL}), id) WHERE {_FAILED}",
}


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("django_awa", "0012_dashboard")]

    operations = [
        migrations.RunSQL(
            [drop_if_invalid(name), f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {target}"],
            reverse_sql=f"DROP INDEX CONCURRENTLY IF EXISTS {name}",
        )
        for name, target in INDEXES.items()
    ]
