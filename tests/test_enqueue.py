"""Declaring and enqueueing: kinds, args encoding, options, validation, uniqueness."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import ClassVar

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

import django_awa as awa
from django_awa.kinds import registry
from django_awa.listener import listen_params
from django_awa.models import Job, JobState
from django_awa.producer import claim
from tests.testapp.jobs import Echo, SequencedSpan, Unhandled

pytestmark = pytest.mark.django_db


@dataclass
class ChargeCard(awa.JobArgs):
    order_id: int
    amount_cents: int


@dataclass
class Custom(awa.JobArgs):
    kind: ClassVar[str] = "billing.custom"
    x: int = 0


def test_kind_is_snake_case_of_the_class_name_unless_overridden():
    assert ChargeCard.kind == "charge_card"
    assert Custom.kind == "billing.custom"
    assert registry.args_classes["charge_card"] is ChargeCard


def test_a_field_named_kind_is_refused_when_the_class_is_declared():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="a JobArgs field cannot be named 'kind'"):

        @dataclass
        class Notify(awa.JobArgs):
            kind: str
            to: str = ""

    assert "notify" not in registry.args_classes


def test_enqueue_returns_the_available_row_with_the_kinds_defaults():
    job = awa.enqueue(Echo(n=3, note="hi", tags=["a"]))
    assert isinstance(job, Job) and isinstance(job.id, int)
    row = Job.objects.get(id=job.id)
    assert row.kind == "echo"
    assert row.args == {"n": 3, "note": "hi", "tags": ["a"]}
    assert row.state == JobState.AVAILABLE
    assert (row.queue, row.priority, row.max_attempts, row.attempt) == ("echo", 2, 5, 0)
    assert row.errors == [] and row.finalized_at is None


def test_enqueue_options_override_defaults():
    run_at = timezone.now() + dt.timedelta(hours=1)
    job = awa.enqueue(
        Echo(n=1),
        queue="other",
        priority=4,
        max_attempts=9,
        run_at=run_at,
        tags=["x", "y"],
        metadata={"source": "test"},
    )
    row = Job.objects.get(id=job.id)
    assert (row.queue, row.priority, row.max_attempts) == ("other", 4, 9)
    assert row.state == JobState.SCHEDULED
    assert row.run_at == run_at
    assert row.tags == ["x", "y"] and row.metadata == {"source": "test"}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "queue": "other",
            "priority": 1,
            "max_attempts": 3,
            "tags": ["x", "y"],
            "metadata": {"source": "test", "n": [1, 2.5, None]},
        },
        {"run_at": "later"},
        {"unique": awa.Unique(by_period=3600)},
    ],
    ids=["defaults", "options", "scheduled", "unique"],
)
def test_the_job_enqueue_returns_is_the_stored_row_field_by_field(options):
    # enqueue reads back only what the server decides (id, state, run_at,
    # created_at) and fills in the rest from what it sent: all of it must be
    # what a read of the row gives.
    if options.get("run_at") == "later":
        options = {"run_at": timezone.now() + dt.timedelta(hours=1)}
    job = awa.enqueue(Echo(n=3, note="é \u2603", tags=["a"]), **options)
    stored = Job.objects.get(id=job.id)
    for field in Job._meta.concrete_fields:
        mine, orms = getattr(job, field.attname), getattr(stored, field.attname)
        assert mine == orms and type(mine) is type(orms), field.name
    # A saved instance: saving it again updates the row, it does not insert one.
    assert not job._state.adding and job._state.db == "default"
    job.priority = 4
    job.save(update_fields=["priority"])
    assert Job.objects.get(id=job.id).priority == 4 and Job.objects.count() == 1


def test_model_init_signals_still_fire_for_rows_the_engine_reads():
    # Rows become Jobs without Model.__init__ unless someone listens for it.
    from django.db.models.signals import post_init

    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance.id)

    post_init.connect(receiver, sender=Job)
    try:
        job = awa.enqueue(Echo(n=1))
        [claimed] = claim("echo", 10, "default")
        assert seen == [job.id]  # a claimed row is no Job until its handler asks for one
        row = claimed.instance("default")  # what JobContext.row gives the handler
    finally:
        post_init.disconnect(receiver, sender=Job)
    assert seen == [job.id, job.id]
    assert isinstance(row, Job) and (row.id, row.state) == (job.id, JobState.RUNNING)


def test_a_row_made_with_the_orm_alone_is_a_valid_available_job():
    job = Job.objects.create(kind="echo", queue="default", args={"n": 1})
    job.refresh_from_db()
    assert job.state == JobState.AVAILABLE
    assert (job.priority, job.attempt, job.max_attempts, job.run_lease) == (2, 0, 25, 0)
    assert job.errors == [] and job.metadata == {} and job.tags == []


@pytest.mark.django_db(transaction=True)
def test_enqueue_joins_the_callers_transaction_commit_and_rollback():
    with transaction.atomic():
        kept = awa.enqueue(Echo(n=1))
    with pytest.raises(RuntimeError), transaction.atomic():
        lost = awa.enqueue(Echo(n=2))
        assert Job.objects.filter(id=lost.id).exists()  # visible inside
        raise RuntimeError("business write failed")
    assert Job.objects.filter(id=kept.id).exists()
    assert not Job.objects.filter(id=lost.id).exists()


@pytest.mark.django_db(transaction=True)
def test_enqueue_notifies_listeners_at_commit_only():
    import psycopg

    with psycopg.connect(**listen_params("default"), autocommit=True) as listener:
        listener.execute("LISTEN awa_job")
        with transaction.atomic():
            awa.enqueue(Echo(n=1), queue="notify-me")
            assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
        got = list(listener.notifies(timeout=5, stop_after=1))
        assert [(n.channel, n.payload) for n in got] == [("awa_job", "notify-me")]


def _prepared_statements() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_enqueue_runs_as_a_prepared_statement_and_the_orms_queries_do_not():
    # Django opens connections with psycopg's prepare_threshold=None, which
    # would refuse even an explicit prepare: the per-job statements would be
    # planned afresh each time.
    for n in range(3):
        awa.enqueue(Echo(n=n))
        assert Job.objects.filter(kind="echo").count() == n + 1
    statements = _prepared_statements()
    assert [s for s in statements if "INSERT INTO awa_job" in s], statements
    assert not [s for s in statements if "COUNT(*)" in s], statements


def test_rows_read_by_the_engine_carry_the_same_aware_datetimes_as_the_orms():
    job = awa.enqueue(Echo(n=1), run_at=timezone.now() + dt.timedelta(hours=1))
    stored = Job.objects.get(id=job.id)
    for field in ("run_at", "created_at"):
        mine, orms = getattr(job, field), getattr(stored, field)
        assert mine == orms and mine.utcoffset() == dt.timedelta(0), field
        assert mine.tzinfo == orms.tzinfo


def test_no_prepared_statements_when_turned_off(settings):
    before = _prepared_statements()  # what earlier tests on this session prepared
    settings.AWA = {**settings.AWA, "PREPARED_STATEMENTS": False}
    for n in range(3):
        awa.enqueue(Echo(n=n), unique=awa.Unique(by_args=True) if n else None)
    assert _prepared_statements() == before


@pytest.mark.django_db(transaction=True)
def test_enqueue_after_the_connection_was_closed_and_reopened():
    # The engine keeps a cursor per connection: a new connection gets its own.
    # (transaction=True: a connection closed inside the test's atomic block
    # stays closed.)
    from django.db import connection

    first = awa.enqueue(Echo(n=1))
    connection.close()
    second = awa.enqueue(Echo(n=2))
    assert second.id > first.id
    stored = Job.objects.filter(id__in=[first.id, second.id]).order_by("id")
    assert [job.args["n"] for job in stored] == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_enqueue_on_a_lost_connection_raises_operational_error_and_then_reconnects():
    import psycopg
    from django.db import OperationalError, connection

    first = awa.enqueue(Echo(n=1))
    pid = connection.connection.info.backend_pid
    with psycopg.connect(**listen_params("default"), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
        while other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            time.sleep(0.01)
    with pytest.raises(OperationalError, match="server closed the connection"):
        awa.enqueue(Echo(n=2))
    # What Django does at the end of each request: an unusable connection goes.
    connection.close_if_unusable_or_obsolete()
    third = awa.enqueue(Echo(n=3))
    assert list(Job.objects.order_by("id").values_list("id", flat=True)) == [first.id, third.id]


@pytest.mark.django_db(transaction=True)
def test_connections_closed_between_enqueues_are_let_go():
    # What a site with CONN_MAX_AGE = 0 does: a connection per request.
    import gc

    import psycopg
    from django.db import connection

    def closed_connections() -> set[int]:
        gc.collect()
        return {id(c) for c in gc.get_objects() if isinstance(c, psycopg.Connection) and c.closed}

    before = closed_connections()
    for n in range(5):
        awa.enqueue(Echo(n=n))
        connection.close()
    kept = closed_connections() - before
    assert len(kept) <= 1, kept  # the last one, until the connection's next cursor


def _direct_statements() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE '\\_awa\\_%%'")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_on_its_own_is_committed_before_it_returns():
    # Outside atomic() enqueue's INSERT is its own transaction, sent straight
    # through libpq (db.fetch_one) rather than a psycopg cursor.
    import psycopg

    job = awa.enqueue(Echo(n=1))
    unique = awa.enqueue(Echo(n=2), unique=awa.Unique(by_args=True))
    with pytest.raises(awa.UniqueConflict) as conflict:
        awa.enqueue(Echo(n=2), unique=awa.Unique(by_args=True))
    assert conflict.value.conflicting_id == unique.id
    with psycopg.connect(**listen_params("default")) as other:
        seen = other.execute("SELECT id, args->'n' FROM awa_job ORDER BY id").fetchall()
    assert seen == [(job.id, 1), (unique.id, 2)]
    from django_awa import db, sql

    sent = {db._plan(s).name.decode() for s in (sql.INSERT_ONE, sql.INSERT_ONE_UNIQUE)}
    assert sent <= set(_direct_statements()), "not sent directly"


@pytest.mark.django_db(transaction=True)
def test_enqueue_on_its_own_prepares_again_what_was_deallocated():
    from django.db import connection

    first = awa.enqueue(Echo(n=1))
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert _direct_statements() == []
    second = awa.enqueue(Echo(n=2))
    # psycopg deallocates every prepared statement when a transaction in
    # which it had prepared one rolls back.
    with pytest.raises(RuntimeError), transaction.atomic():
        awa.enqueue(Echo(n=3), unique=awa.Unique(by_args=True))
        raise RuntimeError("the transaction rolls back")
    assert _direct_statements() == []
    # Inside a transaction a missing statement would fail it: not sent directly.
    with transaction.atomic():
        Job.objects.exists()
        inside = awa.enqueue(Echo(n=4))
    last = awa.enqueue(Echo(n=5))
    ids = list(Job.objects.order_by("id").values_list("id", flat=True))
    assert ids == [first.id, second.id, inside.id, last.id]


def test_a_statement_run_while_another_is_being_read_leaves_its_rows_alone():
    # A follow-up function may enqueue while the finalize statement's rows are
    # read: the nested statement must not replace the outer one's results.
    from django_awa import db

    with db.cursor("default") as outer:
        outer.execute("SELECT generate_series(1, 3)")
        with db.cursor("default") as inner:
            inner.execute("SELECT 42")
            assert inner.fetchone() == (42,)
        assert outer.fetchall() == [(1,), (2,), (3,)]
    with db.cursor("default") as again:
        again.execute("SELECT 7")
        assert again.fetchone() == (7,)


def test_enqueue_many_inserts_in_bulk_and_returns_ids_in_input_order():
    items = [Echo(n=i) for i in range(50)] + [
        awa.EnqueueRequest(Echo(n=99), queue="other", priority=1)
    ]
    ids = awa.enqueue_many(items)
    assert len(ids) == 51
    rows = {j.id: j for j in Job.objects.filter(id__in=ids)}
    assert [rows[i].args["n"] for i in ids] == [*range(50), 99]
    assert (rows[ids[-1]].queue, rows[ids[-1]].priority) == ("other", 1)


def test_enqueue_many_validates_everything_before_writing():
    before = Job.objects.count()
    with pytest.raises(awa.ValidationError, match="item 2"):
        awa.enqueue_many([Echo(n=1), Echo(n=2), awa.EnqueueRequest(Echo(n=3), priority=0)])
    assert Job.objects.count() == before


def test_enqueue_many_writes_each_plain_job_as_enqueue_would():
    # enqueue_many checks a kind's defaults once for the jobs given as plain args
    # of one class; each row must still be the one enqueue() writes for its item,
    # with its own args, and a sequence key made from each job's own args.
    items: list = [Echo(n=1, note="a"), Unhandled(x=1), Echo(n=2, tags=["t"])]
    items += [awa.EnqueueRequest(Echo(n=3), queue="other", priority=1, metadata={"k": 1})]
    items += [Echo(n=4), Unhandled(x=2)]
    items += [SequencedSpan(key="a", n=1), SequencedSpan(key="b", n=2), SequencedSpan(key="a")]
    columns = ("kind", "queue", "priority", "max_attempts", "args", "metadata", "tags", "state")

    def written(ids: list[int]) -> list[tuple]:
        rows = {job.id: job for job in Job.objects.filter(id__in=ids)}
        return [tuple(getattr(rows[i], c) for c in columns) for i in ids]

    many = written(awa.enqueue_many(items))
    one_by_one = written([awa.enqueue(item).id for item in items])
    assert many == one_by_one
    assert [row[4] for row in many[:3]] == [
        {"n": 1, "note": "a", "tags": []},
        {"x": 1},
        {"n": 2, "note": "", "tags": ["t"]},
    ]
    assert many[0][1:4] == ("echo", 2, 5)  # Echo's worker: queue echo, max_attempts 5
    sequences = [row[5]["awa_sequence"] for row in many[-3:]]
    assert sequences[0] == sequences[2] != sequences[1]


def test_enqueue_many_makes_each_plain_job_its_own_unique_key_from_the_kind(monkeypatch):
    from django_awa.kinds import KindDefaults

    defaults = registry.defaults
    unique = KindDefaults(unique=awa.Unique())
    monkeypatch.setattr(
        registry, "defaults", lambda kind: unique if kind == "unhandled" else defaults(kind)
    )
    ids = awa.enqueue_many([Unhandled(x=1), Unhandled(x=2), Unhandled(x=1)])
    assert len(ids) == 2  # the third holds the first's key
    keys = list(Job.objects.filter(id__in=ids).values_list("unique_key", flat=True))
    assert None not in keys and len(set(keys)) == 2


def test_enqueue_many_names_a_later_plain_job_whose_args_are_refused():
    before = Job.objects.count()
    refused = r"item 3: job of kind 'echo': .*field 'n': expected an integer, got 'three'"
    with pytest.raises(awa.ValidationError, match=refused):
        awa.enqueue_many([Echo(n=1), Unhandled(), Echo(n=2), Echo(n="three")])
    assert Job.objects.count() == before


def test_enqueue_many_skips_unique_duplicates_and_keeps_order():
    unique = awa.Unique()
    first = awa.enqueue(Echo(n=1), unique=unique)
    ids = awa.enqueue_many(
        [
            awa.EnqueueRequest(Echo(n=1), unique=unique),  # held by `first`
            awa.EnqueueRequest(Echo(n=2), unique=unique),
            awa.EnqueueRequest(Echo(n=2), unique=unique),  # duplicate within the batch
            Echo(n=3),
        ]
    )
    assert len(ids) == 2 and first.id not in ids
    assert [Job.objects.get(id=i).args["n"] for i in ids] == [2, 3]


@pytest.mark.parametrize("count", [1, 2, 30])
@pytest.mark.parametrize("ids", [True, False])
def test_insert_reports_skipped_duplicates_by_position_alone_or_in_bulk(count, ids):
    from django_awa.enqueueing import insert, prepare

    unique = awa.Unique()
    held = awa.enqueue(Echo(n=-1), unique=unique)
    plain = [prepare(Echo(n=n)) for n in range(count - 1)]
    duplicate = prepare(awa.EnqueueRequest(Echo(n=-1), unique=unique))
    inserted = insert([*plain, duplicate], "default", ids=ids)
    assert inserted.skipped == [count - 1]
    assert Job.objects.filter(args__n=-1).get().id == held.id
    assert Job.objects.filter(kind="echo").count() == count
    if ids:
        assert [Job.objects.get(id=i).args["n"] for i in inserted.ids] == list(range(count - 1))
    else:
        assert inserted.ids == []


class _NoValidOffset(dt.tzinfo):
    def utcoffset(self, moment):
        return dt.timedelta(hours=30)

    def dst(self, moment):
        return None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority": 0}, "priority must be 1"),
        ({"priority": 5}, "priority must be 1"),
        ({"priority": "high"}, "priority must be an integer"),
        ({"max_attempts": 0}, "max_attempts must be 1 to 1000"),
        ({"max_attempts": 1001}, "max_attempts must be 1 to 1000"),
        ({"queue": "has space"}, "invalid queue name"),
        ({"queue": ""}, "invalid queue name"),
        ({"run_at": dt.datetime(2030, 1, 1)}, "naive datetime"),
        ({"run_at": "tomorrow"}, "run_at must be a datetime"),
        ({"run_at": dt.datetime(2030, 1, 1, tzinfo=_NoValidOffset())}, "offset must be"),
        ({"tags": "one"}, "tags must be a list"),
        ({"metadata": {"x": object()}}, "metadata cannot be stored as JSON"),
        ({"unique": "yes"}, "unique must be an awa.Unique"),
        # Its twin, enqueued while it waited, would break the key in the claim, which
        # fails for every job of the queue: the queue would stop.
        (
            {"unique": awa.Unique(states=("running",))},
            "holds the key while 'running' but not while 'available'.*awa.Limit",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_problem_and_nothing_is_written(kwargs, message):
    before = Job.objects.count()
    with pytest.raises(awa.ValidationError, match=message):
        awa.enqueue(Echo(n=1), **kwargs)
    assert Job.objects.count() == before


def test_a_refused_queue_name_is_told_what_a_queue_name_may_hold():
    """An error refusing a queue name says what a name may hold, not only that it is
    invalid: a user who wrote "emails/eu" learns that "/" is what was wrong."""
    rule = "1 to 128 letters, digits and _ . : -"
    before = Job.objects.count()
    with pytest.raises(awa.ValidationError, match=re.escape(f"'emails/eu': {rule}")):
        awa.enqueue(Echo(n=1), queue="emails/eu")
    with pytest.raises(awa.ValidationError, match=re.escape(f"'emails/eu': {rule}")):
        awa.pause_queue("emails/eu")
    with pytest.raises(awa.ValidationError, match=re.escape(f"'emails/eu': {rule}")):

        @dataclass
        class Routed(awa.JobArgs):
            n: int

        awa.worker(Routed, queue="emails/eu")
    assert Job.objects.count() == before


def test_args_that_are_not_json_are_refused_naming_the_field():
    @dataclass
    class Weird(awa.JobArgs):
        blob: object

    with pytest.raises(awa.ValidationError, match="field 'blob'"):
        awa.enqueue(Weird(blob=object()))
    with pytest.raises(awa.ValidationError, match="field 'blob'"):
        awa.enqueue(Weird(blob=float("nan")))
    assert not Job.objects.filter(kind="weird").exists()


def test_args_that_would_not_decode_are_refused_at_enqueue():
    with pytest.raises(awa.ValidationError, match="field 'n'"):
        awa.enqueue(Echo(n="three"))  # type: ignore[arg-type]


def test_not_a_jobargs_is_refused():
    with pytest.raises(awa.ValidationError, match="expected JobArgs"):
        awa.enqueue({"n": 1})  # type: ignore[arg-type]


def test_a_jobargs_class_given_for_an_instance_is_refused_saying_so():
    words = r"got the class Echo itself, not a job of it: enqueue Echo\(\.\.\.\)"
    with pytest.raises(awa.ValidationError, match=words):
        awa.enqueue(Echo)  # type: ignore[arg-type]
    with pytest.raises(awa.ValidationError, match=r"item 1: .*" + words):
        awa.enqueue_many([Echo(n=1), Echo])  # type: ignore[list-item]
    assert not Job.objects.exists()


def test_oversized_args_are_refused_with_the_limit_named(settings):
    settings.AWA = {**settings.AWA, "MAX_ARGS_BYTES": 1000}
    with pytest.raises(awa.ValidationError, match="over the limit of 1000"):
        awa.enqueue(Echo(n=1, note="x" * 2000))


def test_args_round_trip_rich_types():
    @dataclass
    class Rich(awa.JobArgs):
        when: dt.datetime
        day: dt.date
        items: list[int]
        maybe: int | None = None

    from django_awa.codec import decode_args

    when = timezone.now()
    job = awa.enqueue(Rich(when=when, day=when.date(), items=[1, 2]))
    decoded = decode_args(Rich, Job.objects.get(id=job.id).args)
    assert decoded == Rich(when=when, day=when.date(), items=[1, 2])


@dataclass
class Meeting(awa.JobArgs):
    when: dt.datetime
    reminders: tuple[dt.datetime, ...] = ()


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (Meeting(when=dt.datetime(2030, 1, 2, 3, 4, 5)), "field 'when'"),
        (Meeting(when=timezone.now(), reminders=(dt.datetime(2030, 1, 2),)), "field 'reminders'"),
    ],
)
def test_a_naive_datetime_in_args_is_refused_under_use_tz_naming_the_field(args, where):
    """It was stored as given and handed back naive to the handler, which under
    USE_TZ compares it with aware datetimes (a TypeError then, in the worker)."""
    message = f"args of kind 'meeting': {where}: .* is a naive datetime while USE_TZ is True"
    with pytest.raises(awa.ValidationError, match=message):
        awa.enqueue(args)
    with pytest.raises(awa.ValidationError, match=message):
        awa.enqueue_many([Meeting(when=timezone.now()), args])
    assert not Job.objects.filter(kind="meeting").exists()


def test_a_naive_datetime_in_args_round_trips_without_use_tz(settings):
    from django_awa.codec import decode_args

    settings.USE_TZ = False
    naive = dt.datetime(2030, 1, 2, 3, 4, 5, 6)
    job = awa.enqueue(Meeting(when=naive, reminders=(naive,)))
    assert decode_args(Meeting, Job.objects.get(id=job.id).args) == Meeting(naive, (naive,))


def test_unique_conflict_names_the_holder_and_leaves_the_transaction_usable():
    first = awa.enqueue(Echo(n=7), unique=awa.Unique())
    with transaction.atomic():
        with pytest.raises(awa.UniqueConflict) as info:
            awa.enqueue(Echo(n=7), unique=awa.Unique())
        assert info.value.conflicting_id == first.id
        assert str(first.id) in str(info.value)
        # The transaction is not aborted: more work succeeds in it.
        awa.enqueue(Echo(n=8), unique=awa.Unique())
    assert Job.objects.filter(kind="echo").count() == 2


def test_unique_by_args_queue_and_period():
    awa.enqueue(Echo(n=1), unique=awa.Unique(by_args=False))
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(Echo(n=2), unique=awa.Unique(by_args=False))  # the kind alone is the key
    awa.enqueue(Echo(n=1), queue="a", unique=awa.Unique(by_queue=True))
    awa.enqueue(Echo(n=1), queue="b", unique=awa.Unique(by_queue=True))
    hour = dt.timedelta(hours=1)
    base = timezone.now().replace(minute=0, second=0, microsecond=0) + dt.timedelta(days=1)
    awa.enqueue(Echo(n=5), run_at=base, unique=awa.Unique(by_period=hour))
    with pytest.raises(awa.UniqueConflict):
        awa.enqueue(
            Echo(n=5), run_at=base + dt.timedelta(minutes=5), unique=awa.Unique(by_period=hour)
        )
    awa.enqueue(Echo(n=5), run_at=base + hour, unique=awa.Unique(by_period=hour))


def test_unique_key_is_released_outside_its_states():
    job = awa.enqueue(Echo(n=1), unique=awa.Unique())
    Job.objects.filter(id=job.id).update(state=JobState.FAILED)
    again = awa.enqueue(Echo(n=1), unique=awa.Unique())  # failed does not hold the key
    assert again.id != job.id


@pytest.mark.django_db(transaction=True)
def test_unique_is_enforced_by_the_database_under_concurrency():
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def racer() -> None:
        from django.db import connections

        barrier.wait()
        try:
            awa.enqueue(Echo(n=42), unique=awa.Unique())
            outcomes.append("inserted")
        except awa.UniqueConflict:
            outcomes.append("conflict")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict"] * 7 + ["inserted"]
    assert Job.objects.filter(kind="echo").count() == 1


def test_enqueueing_a_kind_without_a_local_handler_is_allowed():
    job = awa.enqueue(Unhandled(x=1))
    assert job.kind == "unhandled" and job.queue == "default"


def test_worker_decorator_validates_its_options():
    @dataclass
    class Thing(awa.JobArgs):
        pass

    with pytest.raises(awa.ValidationError, match="priority"):
        awa.worker(Thing, priority=7)
    with pytest.raises(awa.ValidationError, match="max_attempts"):
        awa.worker(Thing, max_attempts=0)
    with pytest.raises(awa.ValidationError, match="queue"):
        awa.worker(Thing, queue="no spaces please")
    # A claim would stamp a deadline_at no timestamp holds, and fail for the whole queue.
    for deadline in (1e13, dt.timedelta(days=366), 0):
        with pytest.raises(awa.ValidationError, match="deadline must be positive and at most"):
            awa.worker(Thing, deadline=deadline)
    with pytest.raises(Exception, match="JobArgs"):
        awa.worker(dict)  # type: ignore[arg-type]


def test_enqueue_refuses_a_database_that_is_not_postgresql(settings):
    from django_awa.enqueueing import database_alias

    with pytest.raises(awa.ConfigurationError, match="no database alias 'nope'"):
        database_alias("nope")


# -- inputs that must be refused before anything is written ------------------------------

EAST = dt.timezone(dt.timedelta(hours=14))
WEST = dt.timezone(dt.timedelta(hours=-14))
# Aware datetimes Python holds but PostgreSQL (years 1 to 9999 in UTC) does not.
OUT_OF_RANGE = {
    "year 0 in UTC": dt.datetime(1, 1, 1, tzinfo=EAST),
    "year 10000 in UTC": dt.datetime(9999, 12, 31, 23, tzinfo=WEST),
}


def awa_job_rows() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM awa_job")
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)  # enqueue on its own: autocommit
@pytest.mark.parametrize("run_at", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_a_run_at_postgres_cannot_store_is_refused_and_nothing_is_written(run_at):
    calls = {
        "enqueue": lambda: awa.enqueue(Echo(n=1), run_at=run_at),
        "enqueue_many": lambda: awa.enqueue_many(
            [Echo(n=0), awa.EnqueueRequest(Echo(n=1), run_at=run_at), Echo(n=2)]
        ),
        "atomic enqueue": lambda: _in_atomic(lambda: awa.enqueue(Echo(n=1), run_at=run_at)),
    }
    for name, call in calls.items():
        with pytest.raises(awa.ValidationError, match="run_at") as refused:
            call()
        assert "years 1 to 9999" in str(refused.value), name
        if name == "enqueue_many":
            assert "item 1" in str(refused.value)
        assert awa_job_rows() == 0, name


def _in_atomic(fn):
    with transaction.atomic():
        return fn()


def test_the_first_and_last_instants_postgres_stores_are_accepted():
    first = awa.enqueue(Echo(n=1), run_at=dt.datetime(1, 1, 1, 14, tzinfo=EAST))
    last = awa.enqueue(Echo(n=2), run_at=dt.datetime.max.replace(tzinfo=dt.UTC))
    assert Job.objects.get(id=first.id).run_at == dt.datetime.min.replace(tzinfo=dt.UTC)
    assert Job.objects.get(id=last.id).run_at == dt.datetime.max.replace(tzinfo=dt.UTC)
    assert Job.objects.get(id=last.id).state == JobState.SCHEDULED


@pytest.mark.parametrize("column", ["run_at", "callback_timeout_at"])
@pytest.mark.parametrize("value", OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys())
def test_the_database_refuses_timestamps_it_could_not_give_back_in_either_table(column, value):
    # Past enqueue's checks too: the ORM, raw SQL, and rows already moved to
    # awa_job_done (a child of awa_job: it inherits awa_job's CHECKs) or written
    # to its current segment (a child of awa_job_done, made LIKE it).
    with pytest.raises(IntegrityError, match=f"awa_job_{column}_range"), transaction.atomic():
        Job.objects.create(kind="echo", args={"n": 1}, **{column: value})
    for table in ("awa_job", "awa_job_done", "awa_job_done_current"):
        with (
            pytest.raises(IntegrityError, match=f"awa_job_{column}_range"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(
                f"INSERT INTO {table} (id, kind, queue, args, state, {column}) "  # noqa: S608
                f"VALUES (1, 'echo', 'echo', '{{}}', 'completed', %s)",
                [value],
            )
    assert awa_job_rows() == 0
    # The constraints were validated (ALTER TABLE ... VALIDATE CONSTRAINT), on every table.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conrelid::regclass::text, convalidated FROM pg_constraint "
            "WHERE conname = %s ORDER BY 1",
            [f"awa_job_{column}_range"],
        )
        assert cursor.fetchall() == [
            ("awa_job", True),
            ("awa_job_done", True),
            ("awa_job_done_current", True),
        ]


@pytest.mark.parametrize("key", ["awa_original_priority", "awa_trigger", "awa_periodic", "awa_"])
def test_metadata_keys_of_the_engine_are_refused_naming_the_key(key):
    metadata = {"mine": 1, key: "high"}
    with pytest.raises(awa.ValidationError, match=f"metadata key '{key}'.*awa_"):
        awa.enqueue(Echo(n=1), metadata=metadata)
    with pytest.raises(awa.ValidationError, match=f"item 1: .*metadata key '{key}'"):
        awa.enqueue_many([Echo(n=0), awa.EnqueueRequest(Echo(n=1), metadata=metadata)])
    assert awa_job_rows() == 0
    # Keys merely like the engine's are the user's.
    job = awa.enqueue(Echo(n=1), metadata={"AWA_x": 1, "awa": 2, "x_awa_y": 3})
    assert Job.objects.get(id=job.id).metadata == {"AWA_x": 1, "awa": 2, "x_awa_y": 3}


def test_oversized_metadata_is_refused_with_the_limit_named(settings):
    with pytest.raises(awa.ValidationError, match=r"over the limit of 65536 \(AWA\['MAX_METADATA"):
        awa.enqueue(Echo(n=1), metadata={"blob": "x" * 70_000})
    settings.AWA = {**settings.AWA, "MAX_METADATA_BYTES": 100}
    # Counted in bytes of UTF-8, as sent: {"k": "☃☃..."} with 40 snowmen of 3 bytes each.
    over = "metadata: 129 bytes of JSON, over the limit of 100"
    with pytest.raises(awa.ValidationError, match=over):
        awa.enqueue_many([awa.EnqueueRequest(Echo(n=1), metadata={"k": "\u2603" * 40})])
    assert awa_job_rows() == 0
    awa.enqueue(Echo(n=1), metadata={"k": "x" * 80})


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ({"a": 1}, "tags must be a list or tuple of strings, got dict"),
        ({"a", "b"}, "got set"),
        (frozenset({"a"}), "got frozenset"),
        ((t for t in ["a"]), "got generator"),
        (b"ab", "got bytes"),
        ([f"t{i}" for i in range(101)], "101 tags, over the limit of 100"),
    ],
    ids=["dict", "set", "frozenset", "generator", "bytes", "too many"],
)
def test_tags_must_be_a_list_or_tuple_of_at_most_100(tags, message):
    with pytest.raises(awa.ValidationError, match=message):
        awa.enqueue(Echo(n=1), tags=tags)
    with pytest.raises(awa.ValidationError, match=f"item 0: .*{message}"):
        awa.enqueue_many([awa.EnqueueRequest(Echo(n=1), tags=tags)])
    assert awa_job_rows() == 0


def test_a_tuple_of_100_tags_is_stored_in_order():
    tags = tuple(f"t{i}" for i in range(100))
    job = awa.enqueue(Echo(n=1), tags=tags)
    assert Job.objects.get(id=job.id).tags == list(tags)


_EVERY_USING = {
    "enqueue": lambda using: awa.enqueue(Echo(n=1), using=using),
    "enqueue_many": lambda using: awa.enqueue_many([Echo(n=1)], using=using),
    "cancel": lambda using: awa.cancel(1, using=using),
    "retry": lambda using: awa.retry(1, using=using),
    "pause_queue": lambda using: awa.pause_queue("default", using=using),
    "resume_queue": lambda using: awa.resume_queue("default", using=using),
    "queue_stats": lambda using: awa.queue_stats(using=using),
    "complete_external": lambda using: awa.complete_external(uuid.uuid4(), using=using),
    "fail_external": lambda using: awa.fail_external(uuid.uuid4(), "no", using=using),
    "retry_external": lambda using: awa.retry_external(uuid.uuid4(), using=using),
    "heartbeat_callback": lambda using: awa.heartbeat_callback(uuid.uuid4(), 60, using=using),
}


@pytest.mark.parametrize("call", _EVERY_USING.values(), ids=_EVERY_USING.keys())
@pytest.mark.parametrize("using", ["", "nope", ["default"], 0])
def test_a_using_that_names_no_database_is_refused_naming_it(call, using):
    # Not taken for the default alias: "" (or 0) is a mistake, not a choice.
    with pytest.raises(awa.ConfigurationError, match=re.escape(f"no database alias {using!r}")):
        call(using)
    assert awa_job_rows() == 0


def nested(levels: int) -> list:
    """``levels`` lists, each inside the one before."""
    top: list = []
    for _ in range(levels - 1):
        top = [top]
    return top


@dataclass
class Deep(awa.JobArgs):
    blob: object = None


def test_json_nested_deeper_than_100_levels_is_refused_naming_the_limit():
    # The args object is the first level: a field may hold 99 more.
    job = awa.enqueue(Deep(blob=nested(99)), metadata={"k": nested(99)})
    assert Job.objects.get(id=job.id).args == {"blob": nested(99)}
    limit = r"nested deeper than 100 levels of lists and objects \(under 'blob'\), the limit"
    for levels in (100, 950, 5000):
        with pytest.raises(awa.ValidationError, match=r"kind 'deep': (field 'blob' is )?nested"):
            awa.enqueue(Deep(blob=nested(levels)))
    with pytest.raises(awa.ValidationError, match=limit):
        awa.enqueue(Deep(blob=nested(950)))
    with pytest.raises(awa.ValidationError, match=limit):
        awa.enqueue_many([awa.EnqueueRequest(Deep(blob={"a": [{"b": nested(98)}]}))])
    with pytest.raises(awa.ValidationError, match=limit.replace("blob", "k")):
        awa.enqueue(Echo(n=1), metadata={"k": nested(100)})
    with pytest.raises(awa.ValidationError, match=limit.replace("blob", "k")):
        awa.enqueue(Echo(n=1), metadata={"k": nested(5000)})
    assert Job.objects.count() == 1
