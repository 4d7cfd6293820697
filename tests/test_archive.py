"""Finished jobs move into awa_job_done, and every query on awa_job still sees them.

Maintenance moves finished rows out of the table new jobs are written to
(migration 0003); these tests check that nothing about a job changes for
whoever reads, retries, prunes or follows it there.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.db.models import QuerySet
from django.forms.models import model_to_dict
from django.urls import reverse
from django.utils import timezone

import django_awa as awa
from django_awa import maintenance as maintenance_module
from django_awa import sql
from django_awa.maintenance import ARCHIVE_BATCH, MIN_SEGMENT_AGE, Maintenance
from django_awa.models import Job, JobState
from django_awa.producer import claim
from tests.conftest import make_job, wait_for
from tests.testapp.jobs import Act, Echo, Noop, SequencedSpan
from tests.testapp.models import FlowRun, Ledger

ago = lambda **kw: timezone.now() - dt.timedelta(**kw)  # noqa: E731


def tables_of(job_id: int) -> list[str]:
    """The tables that physically hold the row: awa_job, awa_job_done or its segments."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM awa_job WHERE id = %s", [job_id])
        return [row[0] for row in cursor.fetchall()]


def table_of(job_id: int) -> str:
    """The one table that holds the row."""
    tables = tables_of(job_id)
    assert len(tables) == 1, f"job {job_id} is in {len(tables)} places"
    return tables[0]


def finished(state: str = JobState.COMPLETED, **fields) -> Job:
    fields.setdefault("finalized_at", timezone.now())
    fields.setdefault("attempt", 1)
    return make_job(state=state, **fields)


@pytest.mark.django_db
def test_finished_rows_move_and_read_back_unchanged():
    done = finished(errors=[{"attempt": 1, "at": "x", "error": "e", "traceback": ""}])
    failed = finished(JobState.FAILED, metadata={"k": [1, 2]}, tags=["t"])
    cancelled = finished(JobState.CANCELLED, progress={"percent": 50})
    live = {
        state: make_job(state=state, heartbeat_at=timezone.now())
        for state in (
            JobState.SCHEDULED,
            JobState.AVAILABLE,
            JobState.RUNNING,
            JobState.RETRYABLE,
            JobState.WAITING_EXTERNAL,
        )
    }
    before = {job.id: model_to_dict(Job.objects.get(id=job.id)) for job in Job.objects.all()}

    assert Maintenance().archive() == 3
    for job in (done, failed, cancelled):
        assert table_of(job.id) == "awa_job_done"
    for job in live.values():
        assert table_of(job.id) == "awa_job"
    after = {job.id: model_to_dict(job) for job in Job.objects.all()}
    assert after == before
    assert Job.objects.filter(state=JobState.FAILED).get().id == failed.id
    assert Maintenance().archive() == 0  # nothing left to move


@pytest.mark.django_db
def test_archive_works_in_batches(monkeypatch):
    monkeypatch.setattr("django_awa.maintenance.ARCHIVE_BATCH", 3)
    jobs = [finished() for _ in range(8)]
    assert ARCHIVE_BATCH > 3  # the real batch is larger; this test makes it small
    assert Maintenance().archive() == 8
    assert {table_of(job.id) for job in jobs} == {"awa_job_done"}


@pytest.mark.django_db
def test_a_column_added_to_awa_job_moves_with_the_row():
    # What a later migration (or a user's own column) adds to awa_job, the
    # child gets too, and a moved row keeps its value.
    job = finished()
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE awa_job ADD COLUMN shard text")
        cursor.execute("UPDATE awa_job SET shard = 'eu' WHERE id = %s", [job.id])
        Maintenance().archive()
        cursor.execute("SELECT shard FROM ONLY awa_job_done WHERE id = %s", [job.id])
        assert cursor.fetchone() == ("eu",)


@pytest.mark.django_db
def test_retrying_a_moved_job_brings_it_back_to_be_claimed():
    job = finished(JobState.FAILED, attempt=3, max_attempts=3)
    Maintenance().archive()
    assert table_of(job.id) == "awa_job_done"

    retried = awa.retry(job.id)
    assert retried.state == JobState.AVAILABLE and retried.attempt == 0
    assert table_of(job.id) == "awa_job"
    # The claim reads only awa_job: it finds the job there.
    assert [j.id for j in claim("default", 5, "default")] == [job.id]


@pytest.mark.django_db
def test_any_update_that_makes_a_moved_job_live_moves_it_back():
    by_update = finished(JobState.CANCELLED)
    by_save = finished(JobState.FAILED)
    stays = finished()
    Maintenance().archive()

    # The BEFORE trigger moves the row and skips the update in awa_job_done
    # (whose CHECK holds finished rows only): the UPDATE counts none.
    assert Job.objects.filter(id=by_update.id).update(state=JobState.AVAILABLE) == 0
    assert Job.objects.get(id=by_update.id).state == JobState.AVAILABLE
    row = Job.objects.get(id=by_save.id)
    row.state = JobState.SCHEDULED
    row.run_at = ago(seconds=1)
    row.save()  # an UPDATE that matches the row: no second INSERT
    assert Job.objects.filter(id=stays.id).update(metadata={"note": "seen"}) == 1

    assert table_of(by_update.id) == "awa_job"
    assert table_of(by_save.id) == "awa_job"
    assert table_of(stays.id) == "awa_job_done"  # still finished: stays where it is
    assert Job.objects.get(id=stays.id).metadata == {"note": "seen"}
    assert Maintenance().promote() == {"default"}
    assert {j.id for j in claim("default", 5, "default")} == {by_update.id, by_save.id}


@pytest.mark.django_db
def test_save_with_update_fields_makes_a_moved_job_live():
    """``job.save(update_fields=[...])`` making a finished row in ``awa_job_done`` (or
    a segment) live succeeds: the trigger moved the row and wrote the change, though
    the UPDATE counts none (it raised ``NotUpdated`` with the change made)."""
    moved = finished(JobState.FAILED)
    Maintenance().archive()
    assert table_of(moved.id) == "awa_job_done"
    row = Job.objects.get(id=moved.id)
    row.state = JobState.AVAILABLE
    row.attempt = 0
    row.save(update_fields=["state", "attempt"])
    assert table_of(moved.id) == "awa_job"
    assert Job.objects.values_list("state", "attempt").get(id=moved.id) == (
        JobState.AVAILABLE,
        0,
    )
    # A row that is gone still fails the save, as for any model.
    gone = finished(JobState.FAILED)
    Maintenance().archive()
    stale = Job.objects.get(id=gone.id)
    Job.objects.filter(id=gone.id).delete()
    stale.state = JobState.AVAILABLE
    with pytest.raises(DatabaseError, match="did not affect any rows"), transaction.atomic():
        stale.save(update_fields=["state"])
    assert not Job.objects.filter(id=gone.id).exists()


@pytest.mark.django_db
def test_a_moved_row_that_turns_live_inside_a_rolled_back_transaction_stays_moved():
    job = finished(JobState.FAILED)
    Maintenance().archive()
    with pytest.raises(RuntimeError), transaction.atomic():
        awa.retry(job.id)
        assert table_of(job.id) == "awa_job"
        raise RuntimeError("changed my mind")
    assert table_of(job.id) == "awa_job_done"
    assert Job.objects.get(id=job.id).state == JobState.FAILED


@pytest.mark.django_db
def test_a_job_holding_its_unique_key_is_not_moved():
    holder = awa.enqueue(Echo(n=1), unique=awa.Unique())
    free = awa.enqueue(Echo(n=2), unique=awa.Unique(states=("available", "running")))
    Job.objects.filter(id__in=[holder.id, free.id]).update(
        state=JobState.COMPLETED, finalized_at=timezone.now()
    )
    assert Maintenance().archive() == 1
    assert table_of(holder.id) == "awa_job"  # completed still holds its key
    assert table_of(free.id) == "awa_job_done"
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(Echo(n=1), unique=awa.Unique())
    again = awa.enqueue(Echo(n=2), unique=awa.Unique(states=("available", "running")))
    assert again.id != free.id


@pytest.mark.django_db
def test_prune_lineage_and_stats_reach_moved_rows(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60}
    trigger = finished()
    followup = finished(metadata={"awa_trigger": {"job_id": trigger.id, "kind": "act"}})
    old = finished(finalized_at=ago(seconds=120))
    maintenance = Maintenance()
    maintenance.archive()
    assert {table_of(j.id) for j in (trigger, followup, old)} == {"awa_job_done"}

    assert [j.id for j in Job.objects.get(id=trigger.id).followups()] == [followup.id]
    assert Job.objects.get(id=followup.id).trigger().id == trigger.id
    assert awa.queue_stats()["default"]["completed"] == 3
    assert maintenance.prune() == 1
    assert not Job.objects.filter(id=old.id).exists()


@pytest.mark.django_db
def test_statements_about_live_jobs_read_awa_job_alone():
    # The claim and the heartbeat never read the finished rows. (Without ONLY,
    # awa_job_done's CHECK lets the planner skip it only where a statement
    # filters on a live state; an UPDATE joined by id would read it.)
    finished()
    Maintenance().archive()
    awa.enqueue(Act(action="ok"))
    values = {
        "%(queue)s": "'default'",
        "%(limit)s": "10",
        "%(deadlines)s": "'{}'",
        "%(default_deadline)s": "900",
        "%(id)s": "'{1}'",
        "%(run_lease)s": "'{1}'",
        "%(started_ago)s": "'{0.001}'",
        "%(waited)s": "'{0.001}'",
        "%(fresh)s": "5",
    }

    def plan(statement: str) -> str:
        for placeholder, value in values.items():
            statement = statement.replace(placeholder, value)
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + statement)
            return "\n".join(row[0] for row in cursor.fetchall())

    def reads(statement: str) -> str:
        # COMPLETE writes its moved rows into awa_job_done; it reads none there.
        return "\n".join(
            line for line in plan(statement).splitlines() if "Insert on awa_job_done" not in line
        )

    live = (sql.CLAIM, sql.HEARTBEAT, sql.MARK_STARTED, sql.COMPLETE, sql.RESCUE, sql.PROMOTE_DUE)
    for statement in live:
        if "%(stale_after)s" in statement:
            statement = statement.replace("%(stale_after)s", "30")
        assert "awa_job_done" not in reads(statement), statement


@pytest.mark.django_db
def test_a_filter_on_live_states_skips_the_finished_rows_table():
    # The admin's state filters read Job.objects (both tables): the CHECK on
    # awa_job_done's states lets the planner leave it out for a live state.
    finished()
    Maintenance().archive()

    def plan(queryset: QuerySet[Job]) -> str:
        return queryset.explain()

    for state in JobState.LIVE:
        assert "awa_job_done" not in plan(Job.objects.filter(state=state)), state
    assert "awa_job_done" in plan(Job.objects.filter(state=JobState.FAILED))
    with (
        connection.cursor() as cursor,
        pytest.raises(IntegrityError, match="awa_job_done_finished"),
    ):
        cursor.execute(
            "INSERT INTO awa_job_done (id, kind, queue, args, state) "
            "VALUES (-1, 'x', 'default', '{}', 'available')"
        )


@pytest.mark.django_db(transaction=True)
def test_a_worker_moves_what_it_finished(start_worker):
    jobs = [awa.enqueue(Act(action="ok")) for _ in range(5)]
    waiting = awa.enqueue(Act(action="ok"), run_at=timezone.now() + dt.timedelta(hours=1))
    start_worker("--queue", "default")
    wait_for(
        lambda: Job.objects.filter(state=JobState.COMPLETED).count() == 5,
        message="five jobs completed",
    )
    wait_for(
        lambda: {table_of(job.id) for job in jobs} == {"awa_job_done_current"},
        message="the completed jobs moved to awa_job_done_current",
    )
    assert table_of(waiting.id) == "awa_job"
    assert all(
        j.state == JobState.COMPLETED for j in Job.objects.filter(id__in=[j.id for j in jobs])
    )


@pytest.mark.django_db
def test_retrying_a_moved_job_whose_key_is_taken_changes_nothing():
    # The key is not held while failed, so the row moved; a new job took the
    # key meanwhile. The retry is refused, and the row stays where it was.
    job = awa.enqueue(Echo(n=7), unique=awa.Unique())
    Job.objects.filter(id=job.id).update(state=JobState.FAILED, finalized_at=timezone.now())
    Maintenance().archive()
    assert table_of(job.id) == "awa_job_done"
    awa.enqueue(Echo(n=7), unique=awa.Unique())
    with pytest.raises(awa.UniqueConflict):
        awa.retry(job.id)
    assert table_of(job.id) == "awa_job_done"
    assert Job.objects.get(id=job.id).state == JobState.FAILED


class MoveInFlight:
    """Maintenance's move of finished rows, begun in a session of its own and held
    uncommitted, so an operator's statement can be made to wait on its row locks."""

    def __init__(self) -> None:
        self.conn = psycopg.connect(**connection.get_connection_params())
        self.conn.execute(sql.ARCHIVE_FINISHED, {"limit": 100})

    def commit_once_waited_on(self) -> None:
        # Asked from outside the move's transaction, which would see one
        # snapshot of pg_stat_activity throughout.
        def waiting() -> int:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
                return cursor.fetchone()[0]

        try:
            wait_for(waiting, message="a statement waiting on the move's row locks")
            self.conn.commit()
        finally:
            self.conn.close()


def in_thread(target):
    """Run ``target`` on a thread (its own database connection); returns a join function."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(timeout=30)
        assert not thread.is_alive()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


@pytest.mark.django_db(transaction=True)
def test_a_retry_that_waited_on_the_move_still_retries():
    job = finished(JobState.FAILED)
    move = MoveInFlight()
    retried = in_thread(lambda: awa.retry(job.id))
    move.commit_once_waited_on()
    assert retried().state == JobState.AVAILABLE
    assert table_of(job.id) == "awa_job"
    assert Job.objects.get(id=job.id).state == JobState.AVAILABLE


@pytest.mark.django_db(transaction=True)
def test_a_discard_that_waited_on_the_move_still_deletes(client):
    doomed = finished(JobState.CANCELLED)
    kept = finished(JobState.CANCELLED)
    client.force_login(User.objects.create_superuser("admin", "a@example.com", password=None))
    move = MoveInFlight()
    response = in_thread(
        lambda: client.post(
            reverse("admin:django_awa_job_changelist"),
            {"action": "discard_jobs", "_selected_action": [doomed.id], "confirm": "yes"},
            follow=True,
        )
    )
    move.commit_once_waited_on()
    assert "Discarded 1 job." in response().content.decode()
    assert not Job.objects.filter(id=doomed.id).exists()
    assert table_of(kept.id) == "awa_job_done"


@pytest.mark.django_db
def test_the_move_reads_an_index_of_its_candidates_only():
    # Finished jobs that hold their unique key stay in awa_job for their whole
    # retention; the move finds its rows without walking past them each tick.
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO awa_job (kind, queue, args, state, finalized_at, unique_key,"
            " unique_states) SELECT 'echo', 'default', '{}', 'completed', now(), 'k' || g,"
            " '[\"completed\"]' FROM generate_series(1, 20000) AS g"
        )
        cursor.execute("ANALYZE awa_job")
        cursor.execute("EXPLAIN " + sql.ARCHIVE_FINISHED, {"limit": ARCHIVE_BATCH})
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "awa_job_archive_idx" in plan, plan
    candidate = finished()
    assert Maintenance().archive() == 1
    assert table_of(candidate.id) == "awa_job_done"


@pytest.mark.django_db
def test_between_sweeps_a_tick_reads_only_rows_finished_since_the_last(monkeypatch):
    maintenance = Maintenance()
    assert maintenance.archive() == 0  # the first pass is a sweep; it sets the bound
    recent = finished()
    # Finished (by its transaction's clock) long before the bound, committed only now:
    # an atomic handler's transaction that ran for hours, say.
    straggler = finished(finalized_at=ago(hours=2))
    assert maintenance.archive() == 1
    assert table_of(recent.id) == "awa_job_done"
    assert table_of(straggler.id) == "awa_job"
    monkeypatch.setattr("django_awa.maintenance.ARCHIVE_SWEEP_EVERY", 0.0)
    assert maintenance.archive() == 1  # the sweep finds it
    assert table_of(straggler.id) == "awa_job_done"


def _complete_in_worker(*rows: dict[str, object]) -> list[int]:
    """Claim, run and complete one job per entry of ``rows`` (its fields) as a worker
    does: the producer's CLAIM, the handler pool, the completer's batched COMPLETE."""
    from tests.conftest import due_job

    ids = [due_job(**fields).id for fields in rows]
    _run_as_a_worker("default", len(ids))
    return ids


def _run_as_a_worker(queue: str, concurrency: int) -> None:
    """One claim of up to ``concurrency`` due jobs of ``queue``, run and written as a
    worker does: the producer's CLAIM, the handler pool, one batch of the completer."""
    from django_awa.completer import Completer
    from django_awa.handlers import HandlerPool
    from django_awa.producer import Producer
    from django_awa.state import WorkerState

    state = WorkerState.create({queue: concurrency})
    runner = state.queues[queue]
    Producer(state, runner).run_once()
    pool = HandlerPool(state)
    while pool.run_once(runner, timeout=0):
        pass
    assert Completer(state).run_once() == []
    assert not state.running


@pytest.mark.django_db
def test_a_completed_batch_is_written_once_straight_into_awa_job_done():
    ids = _complete_in_worker({}, {"errors": [{"attempt": 0, "at": "x", "error": "e"}]}, {})

    # No archive pass has run: the completion itself wrote the rows into the
    # current segment of awa_job_done (migration 0016).
    assert {table_of(job_id) for job_id in ids} == {"awa_job_done_current"}
    for job in Job.objects.filter(id__in=ids):
        assert job.state == JobState.COMPLETED
        assert job.attempt == 1 and job.run_lease == 1
        assert job.finalized_at is not None and job.attempted_at is not None
        assert job.attempted_at <= job.finalized_at
        assert job.heartbeat_at is job.deadline_at is job.callback_id is None
    assert Job.objects.get(id=ids[1]).errors == [{"attempt": 0, "at": "x", "error": "e"}]
    # Their follow-ups (act's on_completed) saw the completed rows (COMPLETE_RETURNING_ROWS).
    triggers = Job.objects.filter(kind="echo").values_list(
        "metadata__awa_trigger__job_id", flat=True
    )
    assert set(ids) <= set(triggers)
    assert Maintenance().archive() == 0  # nothing left for maintenance to move


@pytest.mark.django_db
def test_a_completed_job_that_holds_its_unique_key_stays_in_awa_job_and_keeps_holding_it():
    holds = {"unique_key": "k-held", "unique_states": ["available", "running", "completed"]}
    frees = {"unique_key": "k-free", "unique_states": ["available", "running"]}
    held, free, plain = _complete_in_worker(holds, frees, {})

    # One COMPLETE wrote all three: the key holder in place, the others moved.
    assert table_of(held) == "awa_job"
    assert table_of(free) == table_of(plain) == "awa_job_done_current"
    assert set(Job.objects.filter(id__in=[held, free, plain]).values_list("state", flat=True)) == {
        JobState.COMPLETED
    }
    assert Job.objects.get(id=held).finalized_at is not None
    # awa_job_unique_idx (on awa_job alone) still refuses a second holder of the key...
    with pytest.raises(IntegrityError), transaction.atomic():
        make_job(**holds)
    # ...and a key the completed job let go of is free again.
    make_job(**frees)


# -- segments: completed jobs leave in bulk (migration 0016) ------------------------


def segments() -> list[str]:
    """The renamed segments of awa_job_done, oldest first (the current one left out)."""
    with connection.cursor() as cursor:
        cursor.execute(sql.FINISHED_SEGMENTS)
        return [row[0] for row in cursor.fetchall()]


def rows_in(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT count(*) FROM ONLY "{table}"')  # noqa: S608 (a table we name)
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_completed_jobs_leave_with_their_segment_once_all_of_it_is_past_retention(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 3600}
    ids = _complete_in_worker({}, {}, {})
    maintenance = Maintenance()

    # Not yet a quarter of the retention old: left as it is.
    Job.objects.filter(id__in=ids).update(finalized_at=ago(seconds=880))
    assert maintenance.prune() == 0
    assert segments() == []
    # A quarter of it: renamed, a new current one started, nothing dropped.
    Job.objects.filter(id__in=ids).update(finalized_at=ago(seconds=920))
    assert maintenance.prune() == 0
    [segment] = segments()
    assert segment.startswith("awa_job_done_20")
    assert {table_of(job_id) for job_id in ids} == {segment}
    assert rows_in("awa_job_done_current") == 0
    # The renamed segment is still a part of every query on awa_job.
    assert Job.objects.filter(id__in=ids, state=JobState.COMPLETED).count() == 3
    assert awa.queue_stats()["default"]["completed"] == 3

    # New completions go into the new current one.
    later = _complete_in_worker({})
    assert table_of(later[0]) == "awa_job_done_current"

    # One row still within retention keeps the whole segment.
    Job.objects.filter(id__in=ids[:2]).update(finalized_at=ago(seconds=7200))
    assert maintenance.prune() == 0
    assert segments() == [segment]

    # All past it: dropped whole, every row with it, and nothing else.
    Job.objects.filter(id=ids[2]).update(finalized_at=ago(seconds=3610))
    assert maintenance.prune() == 3
    assert segments() == []
    assert not Job.objects.filter(id__in=ids).exists()
    assert Job.objects.get(id=later[0]).state == JobState.COMPLETED


@pytest.mark.django_db
def test_a_job_made_live_again_in_a_segment_moves_back_into_awa_job(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 3600}
    current, renamed = _complete_in_worker({}, {})
    Job.objects.filter(id=renamed).update(finalized_at=ago(seconds=920))
    Maintenance().prune()
    assert table_of(renamed) == segments()[0]
    # The ORM (or raw SQL) makes each live: the segment's trigger moves it.
    for job_id in (current, renamed):
        assert Job.objects.filter(id=job_id).update(state=JobState.AVAILABLE) == 0
        assert table_of(job_id) == "awa_job"
        assert Job.objects.get(id=job_id).state == JobState.AVAILABLE


@pytest.mark.django_db(transaction=True)
def test_a_segment_in_use_is_left_for_the_next_pass(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60}
    ids = _complete_in_worker({}, {})
    Job.objects.filter(id__in=ids).update(finalized_at=ago(seconds=MIN_SEGMENT_AGE + 10))
    reader = psycopg.connect(**connection.get_connection_params() | {"autocommit": False})
    try:
        # A long read of awa_job holds a lock on every child until it ends:
        # the rename waits a second for it, then gives up until the next pass.
        reader.execute("SELECT count(*) FROM awa_job")
        assert Maintenance().prune() == 0
        assert segments() == []
        assert {table_of(job_id) for job_id in ids} == {"awa_job_done_current"}
    finally:
        reader.close()
    assert Maintenance().prune() == 2
    assert segments() == []
    assert not Job.objects.filter(id__in=ids).exists()


@pytest.mark.django_db
def test_a_short_retention_renames_its_segment_once_ten_minutes_at_most(settings):
    # Each rename makes a table and each drop removes one (catalog rows for
    # VACUUM): with a retention of a minute, not one every pass.
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60}
    ids = _complete_in_worker({}, {})
    maintenance = Maintenance()
    Job.objects.filter(id__in=ids).update(finalized_at=ago(seconds=MIN_SEGMENT_AGE - 10))
    assert maintenance.prune() == 0
    assert segments() == []
    assert {table_of(job_id) for job_id in ids} == {"awa_job_done_current"}
    # Ten minutes old: renamed, and dropped in the same pass, all of it past retention.
    Job.objects.filter(id__in=ids).update(finalized_at=ago(seconds=MIN_SEGMENT_AGE + 10))
    assert maintenance.prune() == 2
    assert segments() == []
    assert not Job.objects.filter(id__in=ids).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_segments_renamed_and_dropped_under_a_running_worker_lose_no_job(
    start_worker, settings, monkeypatch
):
    # The worker's prepared COMPLETE names awa_job_done_current: each rename
    # makes it write into the new table, and a drop never takes a job not yet
    # past retention. Every job is either still there, completed, or was
    # counted by the prune that dropped its segment. (Renamed as often as the
    # passes come, here: the pruning runs in this process.)
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 1}
    monkeypatch.setattr(maintenance_module, "MIN_SEGMENT_AGE", 0.0)
    worker = start_worker("--queue", "echo")
    maintenance = Maintenance()
    awa.enqueue(Echo(n=-1))  # the worker is up and completing before the clock starts
    wait_for(lambda: Job.objects.filter(state=JobState.COMPLETED).exists(), message="first job")
    enqueued, pruned = 1, 0
    # 50 jobs a pass for at least 3 s (three retentions), so segments of jobs
    # finished early are past retention while the worker completes later ones.
    for _ in range(1000):  # bounded: at least 0.05 s a pass, 60 of them enqueueing
        if enqueued < 3001:
            with transaction.atomic():
                awa.enqueue_many([Echo(n=n) for n in range(enqueued, enqueued + 50)])
            enqueued += 50
        pruned += maintenance.prune()
        time.sleep(0.05)
        if enqueued == 3001 and not Job.objects.exclude(state=JobState.COMPLETED).exists():
            break
    assert not Job.objects.exclude(state=JobState.COMPLETED).exists()
    assert pruned > 0  # segments went while the worker was completing others
    time.sleep(1.1)  # every job past retention now
    pruned += maintenance.prune()
    assert pruned == 3001
    assert not Job.objects.exists()
    assert segments() == []
    assert "could not be stored" not in worker.output()


# -- COMPLETED_RETENTION = 0: completed jobs are not kept (sql.FORGETTING) --------------


def _where(job_id: int) -> str | None:
    """The table holding job ``job_id``'s row, None once it is gone."""
    return table_of(job_id) if tables_of(job_id) else None


@pytest.mark.django_db
def test_with_no_retention_a_completion_keeps_only_the_rows_something_still_reads(settings):
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 0}
    plain = awa.enqueue(Noop(n=1))
    unique = awa.Unique(by_args=True, states=("available", "running", "completed"))
    held = awa.enqueue(Noop(n=2), unique=unique)
    depended_on = awa.enqueue(Noop(n=3))
    dependent = awa.enqueue(Echo(n=3), after=[depended_on])
    flow = awa.Workflow("kept")
    member = flow.add(Noop(n=4))
    (member,) = flow.enqueue()

    _run_as_a_worker("bulk", 10)

    # One batch wrote all four: the plain job is gone, nowhere in any table (and
    # asking for it says why it may be)...
    assert _where(plain.id) is None
    with pytest.raises(awa.JobNotFound, match=r"or it completed: .*'COMPLETED_RETENTION'.* 0"):
        awa.cancel(plain.id)
    # A job that waits for it can no longer be enqueued, as once it is pruned.
    with pytest.raises(awa.ValidationError, match=f"job id {plain.id}, .*or it completed"):
        awa.enqueue(Echo(n=1), after=[plain.id])
    # ...the key holder completed in place, still holding its key...
    assert _where(held.id) == "awa_job"
    assert Job.objects.get(id=held.id).state == JobState.COMPLETED
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(Noop(n=2), unique=unique)
    # ...the job another depends on kept, and its dependent released by it...
    assert _where(depended_on.id) == "awa_job_done_current"
    assert Job.objects.get(id=dependent.id).state == JobState.AVAILABLE
    # ...and the workflow's member kept: the workflow is complete, not empty.
    assert _where(member.id) == "awa_job_done_current"
    assert awa.workflow_status(member.workflow_id).counts[JobState.COMPLETED] == 1
    # The kept rows leave with their segment, once it is MIN_SEGMENT_AGE old.
    kept = [held.id, depended_on.id, member.id]
    Job.objects.filter(id__in=kept).update(finalized_at=ago(seconds=MIN_SEGMENT_AGE - 10))
    assert Maintenance().prune() == 1  # the key holder, from awa_job
    assert segments() == []
    Job.objects.filter(id__in=kept).update(finalized_at=ago(seconds=MIN_SEGMENT_AGE + 10))
    assert Maintenance().prune() == 2
    assert not Job.objects.filter(id__in=kept).exists()


@pytest.mark.django_db
def test_with_no_retention_a_completion_alone_is_not_kept_either(settings):
    # A batch of one: the prepared COMPLETE_ONE form, not the arrays.
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 0}
    alone = awa.enqueue(Noop(n=1))
    _run_as_a_worker("bulk", 1)
    assert _where(alone.id) is None
    # With a retention, the same completion keeps the job.
    settings.AWA = {**settings.AWA, "COMPLETED_RETENTION": 60}
    kept = awa.enqueue(Noop(n=2))
    _run_as_a_worker("bulk", 1)
    assert _where(kept.id) == "awa_job_done_current"


@pytest.mark.django_db(transaction=True)
def test_a_worker_keeping_no_completed_jobs_runs_follow_ups_and_sequences(start_worker):
    # A job with follow-ups is kept until the next pruning pass, so they may name
    # it (lineage, after=); a sequence's members hand on (COMPLETE_HAND_ON's form).
    worker = start_worker(
        "--queue", "default", "--queue", "echo", "--queue", "bulk", "--queue", "seq",
        env={"AWA_TEST_COMPLETED_RETENTION": "0"},
    )  # fmt: skip
    with transaction.atomic():
        plain = awa.enqueue_many([Noop(n=n) for n in range(50)])
        act = awa.enqueue(Act(action="ok"))
        members = [awa.enqueue(SequencedSpan(key="s", n=n, seconds=0)) for n in range(5)]
    wait_for(
        lambda: not Job.objects.exclude(state=JobState.COMPLETED).exists(),
        timeout=20,
        message=lambda: str(list(Job.objects.values_list("id", "kind", "state"))),
    )
    assert not Job.objects.filter(id__in=[*plain, *(j.id for j in members)]).exists()
    # Act's two on_completed follow-ups ran (and, plain completions, are gone too).
    assert Ledger.objects.filter(note=f"echo:{act.id}").count() == 2
    assert FlowRun.objects.filter(key="s").count() == 5
    assert "Traceback" not in worker.output()
