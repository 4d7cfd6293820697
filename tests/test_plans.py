"""Query plans of the admin's heavy pages on a table of many finished rows."""

from __future__ import annotations

import itertools
import re

import pytest
from django.db import connection

from django_awa.models import Job

pytestmark = pytest.mark.django_db

FINISHED = 100_000


@pytest.fixture
def many_finished_followups() -> None:
    """FINISHED follow-ups in awa_job_done, two per trigger id, then ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job_done (id, kind, queue, state, finalized_at, metadata)
            SELECT nextval(pg_get_serial_sequence('awa_job', 'id')), 'act', 'default',
                   'completed', now(), jsonb_build_object('awa_trigger', jsonb_build_object(
                       'job_id', g / 2, 'kind', 'act', 'outcome', 'completed'))
            FROM generate_series(1, %s) g
            """,
            [FINISHED],
        )
        cursor.execute("ANALYZE awa_job; ANALYZE awa_job_done")


def plan(queryset: object) -> str:
    sql, params = queryset.query.sql_with_params()  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_a_jobs_followups_are_found_by_the_trigger_index_not_a_primary_key_walk(
    many_finished_followups: None,
):
    trigger = Job.objects.create(kind="act")
    shown = plan(trigger.followups()[:51])  # the job page's query
    assert "awa_job_done_pkey" not in shown and "awa_job_pkey" not in shown, shown
    assert "(metadata #>> '{awa_trigger,job_id}'::text[])" in shown, shown
    # Still right: the follow-ups of a trigger that has some, oldest first.
    some = Job.objects.filter(metadata__awa_trigger__job_id=500).order_by("id")
    assert list(Job(id=500).followups().values_list("id", flat=True)) == list(
        some.values_list("id", flat=True)
    )
    assert len(some) == 2


@pytest.fixture
def old_failures_under_many_completions() -> None:
    """As in production after a bad week: FINISHED rows in awa_job_done, the failed
    ones (queue 'broken') the oldest ids, the newer half of the completed ones in the
    current segment (where a worker writes them, migration 0016), then ANALYZE (the
    planner's view of them)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job_done (id, kind, queue, state, finalized_at, errors)
            SELECT nextval(pg_get_serial_sequence('awa_job', 'id')),
                   'kind' || (g %% 10), CASE WHEN g <= %(failed)s THEN 'broken' ELSE 'default' END,
                   CASE WHEN g <= %(failed)s THEN 'failed' ELSE 'completed' END, now(),
                   CASE WHEN g <= %(failed)s
                        THEN '[{"attempt": 3, "error": "ValueError: boom\\nmore"}]'::jsonb
                        ELSE '[]'::jsonb END
            FROM generate_series(1, %(total)s) g
            """,
            {"failed": FINISHED // 100, "total": FINISHED},
        )
        cursor.execute(
            """
            WITH moved AS (
                DELETE FROM ONLY awa_job_done WHERE state = 'completed'
                  AND id > (SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY id)
                            FROM awa_job_done)
                RETURNING *
            )
            INSERT INTO awa_job_done_current SELECT * FROM moved
            """
        )
        cursor.execute("VACUUM ANALYZE awa_job_done")
        cursor.execute("VACUUM ANALYZE awa_job_done_current")


# Each (filter, index that should answer it); one table of rows serves them all.
LIST_PAGES = [
    ({"state__exact": "failed"}, "awa_job_done_state_idx"),
    ({"queue": "broken"}, "awa_job_done_queue_idx"),
    # Either partial index of failed rows answers it (PostgreSQL 18's skip scan
    # reads the dead-letter one by kind); a walk of the primary key may not.
    (
        {"kind": "kind3", "state__exact": "failed"},
        "awa_job_done_state_idx|awa_job_done_dead_letter_idx",
    ),
    (
        {
            "state__exact": "failed",
            "queue": "broken",
            "kind": "kind3",
            "error": "ValueError: boom",
        },
        "awa_job_done_dead_letter_idx",
    ),
    ({"o": "2"}, "awa_job_done_kind_idx"),
]


@pytest.mark.django_db(transaction=True)  # VACUUM: index-only scans need the visibility map
def test_a_list_page_reads_its_ids_from_an_index_not_a_primary_key_walk(
    old_failures_under_many_completions: None, admin_client: object
) -> None:
    """The job list's page of ids (admin.EstimatedCountPaginator) comes from the
    filtered column's index in id order; the rows of a page by primary key."""
    from django.test.utils import CaptureQueriesContext

    from django_awa import admin as awa_admin

    for query, index in LIST_PAGES:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(awa_admin, "SMALL_TABLE_BYTES", -1)
            with CaptureQueriesContext(connection) as queries:
                response = admin_client.get("/admin/django_awa/job/", query)  # type: ignore[attr-defined]
        assert response.status_code == 200, query
        assert len(response.context["cl"].result_list) == 50, query
        page_ids = [
            q["sql"]
            for q in queries.captured_queries
            if q["sql"].startswith('SELECT "awa_job"."id" AS "pk"') and "LIMIT 50" in q["sql"]
        ]
        assert len(page_ids) == 1, (query, [q["sql"] for q in queries.captured_queries])
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + page_ids[0])
            shown = "\n".join(row[0] for row in cursor.fetchall())
        assert any(name in shown for name in index.split("|")), (query, shown)
        # Neither table of finished rows is walked: no primary key, no sequential scan.
        assert not re.search(r"awa_job_done\w*_pkey|Seq Scan on awa_job_done", shown), (
            query,
            shown,
        )
        if "error" in query:
            # The error's first line is one of the index's keys, not a filter on its rows.
            conditions = [line for line in shown.splitlines() if "Index Cond" in line]
            assert any("split_part" in line for line in conditions), (query, shown)


RUNNING = 3_000
BATCH = 100


@pytest.fixture
def running_since_an_idle_analyze() -> list[int]:
    """ANALYZE of awa_job with no job running (as on an idle table, or the demo's
    vacuum at its start), then RUNNING of its rows claimed: the planner believes
    the partial indexes on running rows hold none. Returns a batch of their ids."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job (kind, queue, state, args, metadata, errors, tags, priority,
                                 attempt, max_attempts, run_at, created_at, snoozed,
                                 has_dependents, run_lease)
            SELECT 'act', 'default', 'available', '{}', '{}', '[]', '{}', 2, 0, 25, now(),
                   now(), false, false, 0
            FROM generate_series(1, %s)
            """,
            [4 * RUNNING],
        )
        cursor.execute("ANALYZE awa_job")
        cursor.execute(
            """
            UPDATE ONLY awa_job SET state = 'running', run_lease = 1, attempt = 1,
                heartbeat_at = now(), deadline_at = now() + interval '1 hour'
            WHERE id IN (SELECT id FROM ONLY awa_job ORDER BY id LIMIT %s)
            RETURNING id
            """,
            [RUNNING],
        )
        return sorted(row[0] for row in cursor.fetchall())[:BATCH]


def attempt_params(ids: list[int]) -> dict[str, object]:
    """Parameters for a batch of completed attempts, in the forms finalize.py and
    heartbeat.py send them (COMPLETE's arrays as literals, the others as lists)."""
    count = len(ids)
    return {
        "id": ids,
        "run_lease": [1] * count,
        "state": ["completed"] * count,
        "delay": [None] * count,
        "error": [None] * count,
        "traceback": [None] * count,
        "snoozed": [False] * count,
        "reset_attempts": [False] * count,
        "progress": [None] * count,
        "started_ago": [0.01] * count,
        "waited": [0.0] * count,
        "result": [None] * count,
        "fresh": 5.0,
    }


ATTEMPT_STATEMENTS = [
    "FINALIZE",
    "FINALIZE_STANDALONE",
    "COMPLETE",
    "COMPLETE_STANDALONE",
    "COMPLETE_RETURNING_ROWS",
    "FORGETTING[COMPLETE]",
    "FORGETTING[COMPLETE_STANDALONE]",
    "HEARTBEAT",
    "STILL_HELD",
    "SET_PROGRESS",
    "MARK_STARTED",
]


def statement_named(name: str) -> str:
    """``sql.<name>``; for ``FORGETTING[<X>]``, the form ``sql.FORGETTING`` holds for
    ``sql.<X>`` (COMPLETED_RETENTION = 0)."""
    from django_awa import sql

    if name.startswith("FORGETTING["):
        return sql.FORGETTING[getattr(sql, name.removeprefix("FORGETTING[").removesuffix("]"))]
    return getattr(sql, name)


def explained(name: str, ids: list[int]) -> list[str]:
    """The plan of statement ``sql.<name>`` for a batch of attempts of ``ids``."""
    from django_awa import db

    params = attempt_params(ids)
    if name.startswith(("COMPLETE", "FORGETTING")):
        params.update(
            id=db.int_array(ids),
            run_lease=db.int_array(params["run_lease"]),  # type: ignore[arg-type]
            started_ago=db.float_array(params["started_ago"]),  # type: ignore[arg-type]
        )
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + statement_named(name), params)
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.parametrize("name", ATTEMPT_STATEMENTS)
def test_outcomes_and_heartbeats_find_their_attempts_by_primary_key_whatever_the_statistics(
    running_since_an_idle_analyze: list[int], name: str
) -> None:
    """Statistics taken with nothing running must not lead the statements keyed by
    attempts to read every running row (awa_job_running_idx) for a batch: each
    attempt is one primary key lookup, at any number running."""
    shown = "\n".join(explained(name, running_since_an_idle_analyze))
    assert "awa_job_running_idx" not in shown, shown
    assert re.search(r"Index Scan using awa_job_pkey on awa_job j(_\d+)? ", shown), shown
    assert "Seq Scan on awa_job" not in shown, shown
    # Nor does it compare each row it finds with every attempt of the batch.
    assert "Join Filter: ((j.id = d.id)" not in shown, shown


@pytest.mark.django_db(transaction=True)  # VACUUM: awa_job as a drained queue leaves it
def test_attempt_statements_planned_for_an_empty_table_read_only_their_batch_by_id() -> None:
    """A queue drained, then vacuumed: the planner counts no rows in awa_job's pages
    (and no fewer for a table with inheritance children), whatever lands there next.
    Planned so, each statement keyed by attempts must still name the rows it reads
    by id; a scan that does not (a whole primary key read once per locked row, in a
    nested loop) took minutes once the table had grown under it."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE awa_job CASCADE")
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args) SELECT 'act', 'default', '{}' "
            "FROM generate_series(1, 500)"
        )
        cursor.execute("DELETE FROM ONLY awa_job")
        cursor.execute("VACUUM (TRUNCATE false) awa_job")
        cursor.execute("SELECT reltuples, relpages FROM pg_class WHERE oid = 'awa_job'::regclass")
        assert cursor.fetchone()[0] == 0
        cursor.execute(
            """
            INSERT INTO awa_job (kind, queue, state, args, attempt, run_lease, heartbeat_at,
                                 deadline_at)
            SELECT 'act', 'default', 'running', '{}', 1, 1, now(), now() + interval '1 hour'
            FROM generate_series(1, %s) RETURNING id
            """,
            [BATCH],
        )
        ids = sorted(row[0] for row in cursor.fetchall())
    for name in ATTEMPT_STATEMENTS:
        lines = explained(name, ids)
        for at, line in enumerate(lines):
            if re.search(r"Scan (using \S+ )?on awa_job\b", line):
                conditions = itertools.takewhile(
                    lambda shown: re.match(r"\s*(Index Cond|Recheck Cond|Filter):", shown),
                    lines[at + 1 :],
                )
                assert any(re.search(r"\bid( \+ 0\))? = ", shown) for shown in conditions), (
                    name + "\n" + "\n".join(lines)
                )


def test_the_rescue_finds_passed_deadlines_among_the_running_rows_not_the_whole_table() -> None:
    """awa_job_deadline_idx is gone (migration 0017): the rescue's search for
    attempts past their deadline reads the running rows through
    awa_job_running_idx, however many jobs wait, and still finds them."""
    from django_awa import sql

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO awa_job (kind, queue, state, args, metadata, errors, tags, priority,
                                 attempt, max_attempts, run_at, created_at, snoozed,
                                 has_dependents, run_lease, heartbeat_at, deadline_at)
            SELECT 'act', 'default', CASE WHEN g <= 50 THEN 'running' ELSE 'available' END,
                   '{}', '{}', '[]', '{}', 2, 1, 25, now(), now(), false, false, 1,
                   CASE WHEN g <= 50 THEN now() END,
                   CASE WHEN g <= 5 THEN now() - interval '1 minute'
                        WHEN g <= 50 THEN now() + interval '1 hour' END
            FROM generate_series(1, %s) g
            """,
            [FINISHED],
        )
        cursor.execute("ANALYZE awa_job")
        params = {"stale_after": 3600.0, "limit": 1000}
        cursor.execute("EXPLAIN " + sql.RESCUE, params)
        shown = "\n".join(row[0] for row in cursor.fetchall())
        assert "Seq Scan on awa_job" not in shown, shown
        assert re.search(
            r"Index Scan using awa_job_running_idx on awa_job \w+ .*\n"
            r"\s+Filter: \(deadline_at < now\(\)\)",
            shown,
        ), shown
        cursor.execute(sql.RESCUE, params)
        rescued = cursor.fetchall()
        # A claim writes an entry in the primary key and in one index of running rows.
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'awa_job'"
            " AND indexdef LIKE '%%WHERE ((state)::text = ''running''::text)'"
        )
        assert [row[0] for row in cursor.fetchall()] == ["awa_job_running_idx"]
    assert sorted(row[0] for row in rescued) == ["deadline_exceeded"] * 5


ONE_OUTCOME_STATEMENTS = [
    "COMPLETE_ONE",
    "COMPLETE_ONE_STANDALONE",
    "COMPLETE_ONE_RETURNING_ROWS",
    "FORGETTING[COMPLETE_ONE]",
    "FORGETTING[COMPLETE_ONE_STANDALONE]",
    "FINALIZE_ONE",
    "FINALIZE_ONE_STANDALONE",
    "FINALIZE_ONE_RETURNING_ROWS",
]


@pytest.mark.parametrize("name", ONE_OUTCOME_STATEMENTS)
def test_the_prepared_outcome_of_one_attempt_reads_it_by_primary_key_when_planned_generically(
    running_since_an_idle_analyze: list[int], name: str
) -> None:
    """An atomic handler's outcome and a batch of one are written with a prepared
    statement, which PostgreSQL may plan once for any parameters after its fifth
    run: that plan must still find the one row by primary key, with statistics that
    say nothing is running, never read the running rows or the table."""
    from tests.conftest import generic_plan

    batch = attempt_params(running_since_an_idle_analyze)
    params = {key: value[0] for key, value in batch.items() if isinstance(value, list)}
    shown = generic_plan(statement_named(name), params)
    assert "awa_job_running_idx" not in shown, shown
    assert re.search(r"Index Scan using awa_job_pkey on awa_job j(_\d+)? ", shown), shown
    assert "Seq Scan on awa_job" not in shown, shown
