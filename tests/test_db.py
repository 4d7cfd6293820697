"""The database door: every statement is seen by execute_wrapper and the query log.

django-awa's hot path runs its statements on a psycopg cursor of Django's
connection, and an enqueue that is its own transaction straight through
libpq (db.py). Django's own instrumentation points must see them all the
same: ``connection.execute_wrapper`` (APM agents, sqlcommenter, blockers),
``connection.queries`` under DEBUG, ``assertNumQueries`` and
``CaptureQueriesContext``.
"""

from __future__ import annotations

import ast
import datetime as dt
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_awa as awa
from django_awa import db, sql
from django_awa.enqueueing import COPY_THRESHOLD
from django_awa.execute import Attempt, completed, errored, failed_terminally, with_result
from django_awa.finalize import finalize
from django_awa.heartbeat import Heartbeat
from django_awa.models import Job, JobState
from django_awa.producer import claim
from django_awa.state import WorkerState
from tests.conftest import as_prepared, make_job
from tests.testapp.jobs import Echo


class Recorder:
    """An execute_wrapper that passes every statement on and notes what it saw."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, execute: Callable[..., Any], sql_: str, params: Any, many: bool,
                 context: dict[str, Any]) -> Any:  # fmt: skip
        self.calls.append({"sql": sql_, "params": params, "many": many, "context": context})
        return execute(sql_, params, many, context)

    @property
    def statements(self) -> list[str]:
        return [call["sql"] for call in self.calls]


def ours(recorder: Recorder) -> list[str]:
    """The statements seen, less the savepoints of Django's own atomic()."""
    return [s for s in recorder.statements if "SAVEPOINT" not in s]


@contextmanager
def recording() -> Iterator[Recorder]:
    recorder = Recorder()
    with connection.execute_wrapper(recorder):
        yield recorder


def _blocker(*args: Any) -> Any:
    raise RuntimeError("no database access here")


def _heartbeat(attempts: list[Attempt]) -> None:
    """The worker's heartbeat of ``attempts``, as its heartbeat thread sends it."""
    Heartbeat(WorkerState.create({"default": 1})).heartbeat(attempts)


# -- enqueue: the direct path (autocommit) and the cursor path (inside atomic) ------------


@pytest.mark.django_db(transaction=True)
def test_an_execute_wrapper_sees_an_enqueue_that_is_its_own_transaction():
    assert connection.get_autocommit()
    with recording() as seen:
        job = awa.enqueue(Echo(n=1))
    assert seen.statements == [sql.INSERT_ONE]
    call = seen.calls[0]
    assert call["many"] is False
    assert call["params"]["kind"] == "echo"
    assert call["context"]["connection"] is connections["default"]
    assert isinstance(call["context"]["cursor"], db.Cursor)
    # Run once, not once per wrapper layer.
    assert list(Job.objects.values_list("id", flat=True)) == [job.id]


@pytest.mark.django_db
def test_an_execute_wrapper_sees_an_enqueue_inside_atomic():
    with transaction.atomic(), recording() as seen:
        job = awa.enqueue(Echo(n=1))
    assert seen.statements == [sql.INSERT_ONE]
    assert seen.calls[0]["context"]["connection"] is connections["default"]
    assert list(Job.objects.values_list("id", flat=True)) == [job.id]


@pytest.mark.django_db(transaction=True)
def test_an_execute_wrapper_sees_a_unique_conflict_and_its_lookup():
    awa.enqueue(Echo(n=1), unique=awa.Unique())
    with recording() as seen, pytest.raises(awa.UniqueConflict):
        awa.enqueue(Echo(n=1), unique=awa.Unique())
    assert seen.statements == [sql.INSERT_ONE_UNIQUE, sql.FIND_UNIQUE_HOLDER]
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_execute_wrapper_sees_enqueue_many_with_its_copy():
    scheduled = awa.EnqueueRequest(Echo(n=-1), run_at=timezone.now() + dt.timedelta(hours=1))
    items = [Echo(n=i) for i in range(COPY_THRESHOLD)] + [scheduled]
    with recording() as seen:
        ids = awa.enqueue_many(items)
    assert seen.statements == [
        sql.RESERVE_IDS,
        sql.COPY_AVAILABLE,
        sql.INSERT_MANY,
        sql.NOTIFY_QUEUES,
    ]
    assert {call["context"]["connection"] for call in seen.calls} == {connections["default"]}
    assert sorted(Job.objects.values_list("id", flat=True)) == sorted(ids)
    assert len(ids) == len(items)


@pytest.mark.django_db
def test_an_execute_wrapper_sees_claim_finalize_and_heartbeat():
    enqueued = awa.enqueue(Echo(n=1))
    with recording() as seen:
        (job,) = claim("echo", 10, "default")
    assert seen.statements == [sql.CLAIM]
    # Claimed once: the first attempt, the first lease.
    assert (job.id, job.attempt, job.run_lease) == (enqueued.id, 1, 1)

    with recording() as seen:
        _heartbeat([Attempt(job=job, alias="default")])
    assert seen.statements == [sql.HEARTBEAT]

    with recording() as seen:
        assert len(finalize([completed(job)], "default")) == 1
    # One completion: the prepared form for one.
    assert ours(seen) in ([sql.COMPLETE_ONE_STANDALONE], [sql.COMPLETE_ONE_RETURNING_ROWS])
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED

    # A batch: the form with arrays.
    awa.enqueue_many([Echo(n=2), Echo(n=3)])
    pair = claim("echo", 10, "default")
    with recording() as seen:
        assert len(finalize([completed(j) for j in pair], "default")) == 2
    assert ours(seen) in ([sql.COMPLETE_STANDALONE], [sql.COMPLETE_RETURNING_ROWS])


@pytest.mark.django_db
def test_an_execute_wrapper_sees_a_finalize_that_reports_locked_rows():
    running = make_job(state="running", attempt=1, run_lease=1, heartbeat_at=timezone.now())
    stale = Job.objects.get(id=running.id)
    stale.run_lease = 7  # a lost attempt: its write matches nothing
    with recording() as seen:
        assert finalize([completed(stale)], "default") == []
    assert ours(seen)[1:] == [sql.STILL_HELD]
    assert ours(seen)[0] in (sql.COMPLETE_ONE_STANDALONE, sql.COMPLETE_ONE_RETURNING_ROWS)


# -- what counts queries --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_assert_num_queries_counts_an_enqueue_that_is_its_own_transaction(
    django_assert_num_queries: Any,
):
    with django_assert_num_queries(1) as captured:
        awa.enqueue(Echo(n=7, note="counted"))
    (query,) = captured.captured_queries
    assert query["sql"].lstrip().startswith("INSERT INTO awa_job")
    # The statement as it ran, with its values, as Django shows its own.
    assert 'VALUES (\'echo\', \'echo\', \'{"n": 7, "note": "counted"' in query["sql"]
    assert float(query["time"]) >= 0


@pytest.mark.django_db
def test_assert_num_queries_counts_an_enqueue_inside_atomic(django_assert_num_queries: Any):
    with transaction.atomic(), django_assert_num_queries(1):
        awa.enqueue(Echo(n=1))


@pytest.mark.django_db(transaction=True)
def test_debug_query_log_holds_enqueue_many_and_claim(settings: Any):
    settings.DEBUG = True
    connection.queries_log.clear()
    awa.enqueue_many([Echo(n=i) for i in range(COPY_THRESHOLD)])
    claim("echo", 1, "default")
    logged = [query["sql"] for query in connection.queries]
    assert any(text.startswith("COPY awa_job") for text in logged), logged
    assert any("FOR UPDATE SKIP LOCKED" in text and "'echo'" in text for text in logged), logged


@pytest.mark.django_db
def test_the_query_log_is_untouched_when_nobody_asks():
    assert not connection.queries_logged and not connection.execute_wrappers
    with CaptureQueriesContext(connection):
        pass  # leaves force_debug_cursor as it found it
    before = len(connection.queries_log)
    awa.enqueue(Echo(n=1))
    assert len(connection.queries_log) == before


# -- wrappers that block or rewrite ---------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_raising_wrapper_blocks_an_enqueue_that_is_its_own_transaction():
    with connection.execute_wrapper(_blocker), pytest.raises(RuntimeError, match="no database"):
        awa.enqueue(Echo(n=1))
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_raising_wrapper_blocks_an_enqueue_inside_atomic():
    with transaction.atomic():
        # Inside: atomic's own SAVEPOINT would be blocked first.
        with connection.execute_wrapper(_blocker), pytest.raises(RuntimeError, match="no data"):
            awa.enqueue(Echo(n=1))
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_wrapper_raising_on_copy_blocks_enqueue_many():
    def block_copy(execute: Callable[..., Any], sql_: str, *args: Any) -> Any:
        if sql_.startswith("COPY"):
            raise RuntimeError("no COPY here")
        return execute(sql_, *args)

    with connection.execute_wrapper(block_copy), pytest.raises(RuntimeError, match="no COPY"):
        awa.enqueue_many([Echo(n=i) for i in range(COPY_THRESHOLD)])
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_wrapper_sees_database_errors_as_django_raises_them():
    from django.db import DataError

    seen: list[BaseException] = []

    def catcher(execute: Callable[..., Any], *args: Any) -> Any:
        try:
            return execute(*args)
        except Exception as exc:
            seen.append(exc)
            raise

    with connection.execute_wrapper(catcher), pytest.raises(DataError):
        db.fetch_one("default", "SELECT %(n)s::int", {"n": "not a number"})
    assert [type(exc) for exc in seen] == [DataError]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("atomic", [False, True], ids=["own-transaction", "in-atomic"])
def test_a_wrapper_may_rewrite_the_statement_and_it_runs_once(atomic: bool):
    # As sqlcommenter does: a comment with the request's trace context.
    def comment(execute: Callable[..., Any], sql_: str, params: Any, many: bool,
                context: dict[str, Any]) -> Any:  # fmt: skip
        return execute(sql_ + " /*traceparent='00-abc'*/", params, many, context)

    with connection.execute_wrapper(comment), transaction.atomic() if atomic else nullcontext():
        job = awa.enqueue(Echo(n=1))
    assert list(Job.objects.values_list("id", "state")) == [(job.id, JobState.AVAILABLE)]


@pytest.mark.django_db(transaction=True)
def test_a_wrapper_that_does_not_return_the_result_still_gives_enqueue_its_row():
    def forgetful(execute: Callable[..., Any], *args: Any) -> None:
        execute(*args)

    with connection.execute_wrapper(forgetful):
        job = awa.enqueue(Echo(n=1))
        job_in_atomic = None
        with transaction.atomic():
            job_in_atomic = awa.enqueue(Echo(n=2))
    assert {job.id, job_in_atomic.id} == set(Job.objects.values_list("id", flat=True))


@pytest.mark.django_db(transaction=True)
def test_a_wrapper_that_skips_the_statement_is_an_error_not_a_missing_row():
    from django.db import ProgrammingError

    def skip(*args: Any) -> None:
        return None

    with connection.execute_wrapper(skip), pytest.raises(ProgrammingError, match="without running"):
        awa.enqueue(Echo(n=1))
    with connection.execute_wrapper(skip), pytest.raises(ProgrammingError, match="without running"):
        with transaction.atomic():
            awa.enqueue(Echo(n=1))
    assert not Job.objects.exists()


# -- every statement lives in sql.py -------------------------------------------------

PACKAGE = Path(awa.__file__).parent
# Not django-awa's statements on the app's database: the schema's history, and
# the development server's setup, which runs before Django is configured.
OUTSIDE = {"migrations", "contrib"}
# Its listener still spells LISTEN and its ping out; sql.LISTEN_JOBS,
# sql.LISTEN_CANCELS and sql.LISTENER_PING are waiting for it.
PENDING: set[str] = set()


def test_every_statement_is_a_named_constant_of_sql_py():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in OUTSIDE or str(relative) in PENDING | {"sql.py"}:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"execute", "executemany", "copy", "copy_rows"}
                and node.args
                and isinstance(node.args[0], ast.Constant | ast.JoinedStr | ast.BinOp)
            ):
                found.append(f"{relative}:{node.lineno}")
    assert not found, f"SQL text outside sql.py: {found}"


# -- one outcome, prepared ---------------------------------------------------------

_COMPLETE_ONE_FORMS = (
    sql.COMPLETE_ONE,
    sql.COMPLETE_ONE_STANDALONE,
    sql.COMPLETE_ONE_RETURNING_ROWS,
)
_FINALIZE_ONE_FORMS = (
    sql.FINALIZE_ONE,
    sql.FINALIZE_ONE_STANDALONE,
    sql.FINALIZE_ONE_RETURNING_ROWS,
)


def _runs_prepared(forms: tuple[str, ...]) -> int:
    """How many times this session ran its prepared statements among ``forms``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(generic_plans + custom_plans), 0) "
            "FROM pg_prepared_statements WHERE statement = ANY(%s)",
            [[as_prepared(form)[0] for form in forms]],
        )
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_completions_written_one_at_a_time_reuse_one_prepared_statement():
    # A worker whose jobs finish one at a time writes each outcome alone (a
    # completer's batch of one, an atomic handler's own transaction): parsed and
    # planned once, not for every job, and each job ends as a batch would leave it.
    ids = awa.enqueue_many([Echo(n=i) for i in range(7)])
    for job in claim("echo", 10, "default"):
        assert [r.job.id for r in finalize([completed(job)], "default")] == [job.id]
    assert _runs_prepared(_COMPLETE_ONE_FORMS) == 7
    done = Job.objects.filter(id__in=ids)
    assert sorted(done.values_list("id", flat=True)) == sorted(ids)
    assert set(done.values_list("state", flat=True)) == {JobState.COMPLETED}
    assert not done.filter(finalized_at=None).exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM ONLY awa_job_done_current WHERE id = ANY(%s)", [ids])
        assert cursor.fetchone()[0] == 7  # moved, as COMPLETE moves them


@pytest.mark.django_db(transaction=True)
def test_one_completion_is_not_prepared_where_prepared_statements_are_off(settings: Any):
    # Behind a pooler that cannot keep prepared statements: written all the same.
    settings.AWA = {**settings.AWA, "PREPARED_STATEMENTS": False}
    awa.enqueue(Echo(n=1))
    (job,) = claim("echo", 10, "default")
    assert len(finalize([completed(job)], "default")) == 1
    assert _runs_prepared(_COMPLETE_ONE_FORMS) == 0
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED


_WRITTEN = ("state", "attempt", "snoozed", "result", "progress", "callback_id", "deadline_at")


@pytest.mark.django_db(transaction=True)
def test_an_outcome_written_alone_leaves_its_row_as_a_batch_leaves_its_twin():
    # Retried, exhausted, completed with a result: each written alone (the prepared
    # FINALIZE_ONE) and, for a twin job, in a batch of two (FINALIZE's arrays).
    outcomes = [
        lambda job: errored(job, "boom", "Traceback: boom"),
        lambda job: failed_terminally(job, "gone", "Traceback: gone"),
        lambda job: with_result(job, {"total": 3}),
    ]
    awa.enqueue_many([Echo(n=i) for i in range(3 * len(outcomes))])
    jobs = claim("echo", 100, "default")
    for make, (alone, twin, other) in zip(outcomes, itertools.batched(jobs, 3), strict=True):
        assert [r.job.id for r in finalize([make(alone)], "default")] == [alone.id]
        batch = [make(twin), completed(other)]
        assert {r.job.id for r in finalize(batch, "default")} == {twin.id, other.id}
        rows = Job.objects.in_bulk([alone.id, twin.id])
        written, expected = rows[alone.id], rows[twin.id]
        assert [getattr(written, f) for f in _WRITTEN] == [getattr(expected, f) for f in _WRITTEN]
        assert [e["error"] for e in written.errors] == [e["error"] for e in expected.errors]
        assert (written.finalized_at is None) == (expected.finalized_at is None)
        assert (written.run_at > timezone.now()) == (expected.run_at > timezone.now())
    states = sorted(Job.objects.filter(id__in=[j.id for j in jobs]).values_list("state", flat=True))
    assert states.count(JobState.RETRYABLE) == 2 and states.count(JobState.FAILED) == 2
    assert _runs_prepared(_FINALIZE_ONE_FORMS) == 3
