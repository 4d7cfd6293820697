"""Hostile input (property-based, Hypothesis): every bad value gets a clear error.

For args payloads, enqueue options, ``AWA`` settings, ``awa.periodic`` cron
strings and signed callback requests over HTTP, each generated input either
succeeds or is refused with the documented exception (``awa.ValidationError``,
``awa.UniqueConflict``, ``awa.CallbackNotFound``) or a 4xx answer: never a
500, never another exception type (a ``DataError`` from PostgreSQL, a
``RecursionError``, a ``UnicodeEncodeError``...), and never a half-written
row: rows are counted before and after each example.

Every example runs in the test's transaction (pytest-django's ``db``); an
unexpected error is rolled back to a savepoint first so that Hypothesis can go
on shrinking it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from django.core.checks import Error as CheckError
from django.db import connection, transaction
from django.test import Client, override_settings
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import django_awa as awa
from django_awa import codec, conf
from django_awa.callbacks import sign
from django_awa.checks import check_database, check_settings
from django_awa.codec import decode_args
from django_awa.models import CallbackReceipt, Job, JobState, load_json
from django_awa.schedules import schedules
from tests.conftest import make_job

pytestmark = pytest.mark.django_db

SECRET = "test-secret"
BOUNDED = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,  # no example database between runs: each run explores afresh
)


# -- kinds only this module enqueues (never run by a worker) -----------------------


@dataclasses.dataclass
class HostileNested:
    label: str = ""
    weight: float = 0.0


@dataclasses.dataclass
class HostilePayload(awa.JobArgs):
    kind: ClassVar[str] = "hostile_payload"

    text: str = ""
    number: float = 0.0
    count: int = 0
    flag: bool = False
    items: list[int] = dataclasses.field(default_factory=list)
    blob: dict[str, Any] = dataclasses.field(default_factory=dict)
    when: dt.datetime | None = None
    amount: decimal.Decimal | None = None
    ident: uuid.UUID | None = None
    nested: HostileNested | None = None
    anything: Any = None


# -- helpers ----------------------------------------------------------------------------


def job_count() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM awa_job")
        return cursor.fetchone()[0]


def outcome(fn: Callable[[], Any], expected: tuple[type[BaseException], ...]) -> Any:
    """Run ``fn`` in a savepoint; return its result or the expected exception it raised.

    Anything else propagates (the test fails); the savepoint keeps the test
    transaction usable while Hypothesis shrinks the example.
    """
    try:
        with transaction.atomic():
            return fn()
    except expected as exc:
        return exc


# Text that PostgreSQL cannot store (NUL, lone surrogates) mixed with ordinary text.
any_char = st.characters(codec=None, exclude_categories=())
hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=any_char, max_size=20),
    st.sampled_from(
        ["\x00", "a\x00b", "\ud800", "x\udfffy", "\\u0000", "'; DROP TABLE awa_job;--"]
    ),
)
huge_text = st.integers(min_value=1, max_value=3).map(lambda n: "é" * (n * 600_000))
weird_numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=True, allow_infinity=True),
)
datetimes = st.one_of(
    st.datetimes(),  # naive
    st.datetimes(timezones=st.timezones()),
    st.sampled_from(
        [dt.datetime.min.replace(tzinfo=dt.UTC), dt.datetime.max.replace(tzinfo=dt.UTC)]
    ),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    hostile_text,
    weird_numbers,
    datetimes,
    st.dates(),
    st.uuids(),
    st.binary(max_size=8),
    st.sampled_from([object(), 1j, int, Ellipsis, frozenset({1})]),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(hostile_text, st.integers(), st.none()), inner, max_size=4),
    ),
    max_leaves=12,
)


def self_referencing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


def deeply_nested(depth: int = 5000) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


# -- args payloads ----------------------------------------------------------------------


payloads = st.builds(
    HostilePayload,
    text=st.one_of(hostile_text, junk),
    number=st.one_of(weird_numbers, junk),
    count=st.one_of(weird_numbers, junk),
    flag=st.one_of(st.booleans(), junk),
    items=st.one_of(st.lists(st.integers(), max_size=5), junk),
    blob=st.one_of(st.dictionaries(hostile_text, junk, max_size=4), junk),
    when=st.one_of(st.none(), datetimes, junk),
    amount=st.one_of(st.none(), st.decimals(allow_nan=True, allow_infinity=True), junk),
    ident=st.one_of(st.none(), st.uuids(), junk),
    nested=st.one_of(
        st.none(), st.builds(HostileNested, label=hostile_text, weight=weird_numbers), junk
    ),
    anything=junk,
)


@BOUNDED
@given(args=payloads)
@example(args=HostilePayload(text="a\x00b"))
@example(args=HostilePayload(text="lone \ud800 surrogate"))
@example(args=HostilePayload(blob={"key\x00": 1}))
@example(args=HostilePayload(number=math.nan))
@example(args=HostilePayload(amount=decimal.Decimal("sNaN")))
@example(args=HostilePayload(ident=12345))  # type: ignore[arg-type]
@example(args=HostilePayload(when=[2026]))  # type: ignore[arg-type]
def test_args_payloads_are_stored_faithfully_or_refused(db: Any, args: HostilePayload) -> None:
    before = job_count()
    result = outcome(lambda: awa.enqueue(args), (awa.ValidationError,))
    if isinstance(result, awa.ValidationError):
        assert "hostile_payload" in str(result)
        assert job_count() == before
        return
    assert job_count() == before + 1
    # What was stored decodes as the worker will decode it.
    stored = Job.objects.get(id=result.id)
    assert isinstance(decode_args(HostilePayload, stored.args), HostilePayload)


@dataclasses.dataclass
class PlainPayload(awa.JobArgs):
    """Plain scalar fields only: enqueue checks them on a fast path."""

    kind: ClassVar[str] = "plain_payload"

    n: int = 0
    x: float = 0.0
    s: str = ""
    b: bool = False
    maybe: int | None = None


def _general_path(args: PlainPayload) -> Any:
    """What the general encoder and decoder make of ``args``: the fast path's reference."""
    try:
        encoded = codec.encode_args(args)
        return encoded, codec._decode_dataclass(PlainPayload, encoded, "")
    except (awa.ValidationError, codec.ArgsDecodeError) as exc:
        return type(exc)


def _fast_path(args: PlainPayload) -> Any:
    try:
        encoded = codec.encode_checked(args)
        return encoded, decode_args(PlainPayload, json.loads(json.dumps(encoded)))
    except (awa.ValidationError, codec.ArgsDecodeError) as exc:
        return type(exc)


plain_values = st.one_of(weird_numbers, hostile_text, st.booleans(), st.none(), junk)


@BOUNDED
@given(
    args=st.builds(
        PlainPayload,
        n=plain_values,
        x=plain_values,
        s=plain_values,
        b=plain_values,
        maybe=plain_values,
    )
)
@example(args=PlainPayload(n=True))  # type: ignore[arg-type]
@example(args=PlainPayload(x=3))
@example(args=PlainPayload(x=math.inf))
@example(args=PlainPayload(x=10**400))  # an int no float holds
@example(args=PlainPayload(n=2**20000))
@example(args=PlainPayload(s="a\x00b"))
@example(args=PlainPayload(maybe=None, n=None))  # type: ignore[arg-type]
def test_plain_args_fast_path_agrees_with_the_general_path(args: PlainPayload) -> None:
    fast, general = _fast_path(args), _general_path(args)
    assert fast == general
    if isinstance(general, tuple) and args.x == 3:
        assert type(fast[1].x) is float


def _decoded(decode: Callable[[], Any]) -> Any:
    try:
        decoded = decode()
    except codec.ArgsDecodeError:
        return codec.ArgsDecodeError
    return decoded, [type(getattr(decoded, f.name)) for f in dataclasses.fields(decoded)]


@pytest.mark.parametrize(
    "stored",
    [
        {},
        {"x": 3},  # an int for a float field: decoded as a float
        {"x": math.inf},
        {"x": -math.inf},
        {"x": math.nan},
        {"x": 10**400},  # an int no float holds
        {"n": 2**14001},  # past MAX_INT_BITS
        {"n": 1.0},
        {"n": True},
        {"b": 1},
        {"s": 5},
        {"s": "a\x00b"},
        {"maybe": True},
        {"maybe": 7},
    ],
)
def test_stored_plain_args_decode_as_the_general_path_decodes_them(stored: dict[str, Any]) -> None:
    # A row's args need not have come through enqueue (SQL, an old version, Infinity
    # and NaN read from JSON text): whatever they hold, the fast path decodes them
    # as the general path does, or refuses them as it does.
    data = {"n": 0, "x": 0.0, "s": "", "b": False, "maybe": None, **stored}
    data = json.loads(json.dumps(data))
    fast = _decoded(lambda: decode_args(PlainPayload, data))
    general = _decoded(lambda: codec._decode_dataclass(PlainPayload, data, ""))
    assert repr(fast) == repr(general)  # (repr: a NaN, were it decoded, is not == itself)


def _json_outcome(parse: Callable[[str], Any], text: str) -> Any:
    try:
        return ("value", parse(text))
    except json.JSONDecodeError as exc:
        return ("error", exc.msg, exc.pos)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(
    text=st.one_of(
        json_values.map(json.dumps),
        json_values.map(lambda v: " " + json.dumps(v, separators=(",", ":")) + "\n"),
        json_values.map(json.dumps).map(lambda t: t[:-1]),  # cut short
        st.text(max_size=12),
    )
)
@example(text="NaN")
@example(text='{"a": 1} x')
@example(text="")
def test_rows_json_reader_agrees_with_json_loads(text: str) -> None:
    # The engine reads jsonb text with json's scanner directly; whatever the
    # text, it must give what json.loads gives, or raise the same error.
    assert _json_outcome(load_json, text) == _json_outcome(json.loads, text)


# Values whose repr Hypothesis could not print: plain tests, named by id.
UNENCODABLE = {
    "self-referencing list": lambda: HostilePayload(anything=self_referencing()),
    "list nested 5000 deep": lambda: HostilePayload(anything=deeply_nested()),
    "int of 5000 digits": lambda: HostilePayload(count=10**5000),
    "int of 5000 digits, nested": lambda: HostilePayload(blob={"n": [10**5000]}),
}


@pytest.mark.parametrize("make", UNENCODABLE.values(), ids=UNENCODABLE.keys())
def test_unencodable_args_are_refused(db: Any, make: Callable[[], HostilePayload]) -> None:
    before = job_count()
    result = outcome(lambda: awa.enqueue(make()), (awa.ValidationError,))
    assert isinstance(result, awa.ValidationError), result
    assert "hostile_payload" in str(result)
    result = outcome(lambda: awa.enqueue_many([HostilePayload(), make()]), (awa.ValidationError,))
    assert isinstance(result, awa.ValidationError), result
    assert job_count() == before


@BOUNDED
@given(items=st.lists(st.one_of(payloads, st.just(HostilePayload())), min_size=1, max_size=5))
@example(items=[HostilePayload(), HostilePayload(text="\x00")])
def test_enqueue_many_writes_all_or_nothing(db: Any, items: list[HostilePayload]) -> None:
    before = job_count()
    result = outcome(lambda: awa.enqueue_many(items), (awa.ValidationError,))
    if isinstance(result, awa.ValidationError):
        assert "enqueue_many item" in str(result)
        assert job_count() == before
    else:
        assert len(result) == len(items)
        assert job_count() == before + len(items)


@pytest.mark.parametrize("blowup", [1, 0])
def test_oversized_args_are_refused_naming_the_limit(db: Any, blowup: int) -> None:
    limit = conf.awa_settings().max_args_bytes
    text = "x" * (limit + blowup * 10)
    before = job_count()
    if blowup:
        with pytest.raises(awa.ValidationError, match=r"MAX_ARGS_BYTES") as info:
            awa.enqueue(HostilePayload(text=text))
        assert str(limit) in str(info.value)
        with pytest.raises(awa.ValidationError, match=r"MAX_ARGS_BYTES"):
            awa.enqueue_many([HostilePayload(), HostilePayload(text=text)])
        assert job_count() == before
    else:
        # At the limit in characters but over it in bytes: the limit counts UTF-8 bytes.
        with pytest.raises(awa.ValidationError, match=r"MAX_ARGS_BYTES"):
            awa.enqueue(HostilePayload(text="é" * (limit // 2 + 1)))
        assert job_count() == before


@override_settings(AWA={**conf.DEFAULTS, "CALLBACK_SECRET": SECRET, "MAX_ARGS_BYTES": 1000})
def test_a_lowered_max_args_bytes_is_honoured(db: Any) -> None:
    with pytest.raises(awa.ValidationError, match=r"limit of 1000 \(AWA\['MAX_ARGS_BYTES'\]\)"):
        awa.enqueue(HostilePayload(text="y" * 2000))
    assert awa.enqueue(HostilePayload(text="y" * 100)).id


@BOUNDED
@given(args=huge_text.map(lambda t: HostilePayload(text=t)))
def test_huge_strings_are_refused_not_truncated(db: Any, args: HostilePayload) -> None:
    before = job_count()
    with pytest.raises(awa.ValidationError, match="MAX_ARGS_BYTES"):
        awa.enqueue(args)
    assert job_count() == before


# -- enqueue options ----------------------------------------------------------------------


def option_values(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), good, junk)


units = st.one_of(
    st.builds(
        awa.Unique,
        by_args=st.one_of(st.booleans(), junk),
        by_queue=st.one_of(st.booleans(), junk),
        by_period=st.one_of(
            st.none(),
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(min_value=-10, max_value=10**12),
            st.timedeltas(),
            st.sampled_from([1e-300, 5e-324, -0.0]),
            junk,
        ),
        states=st.one_of(
            st.lists(st.sampled_from([*JobState.values, "nope", ""]), max_size=4).map(tuple),
            junk,
        ),
    ),
    junk,
)


@BOUNDED
@given(
    priority=option_values(st.integers(min_value=-5, max_value=10)),
    max_attempts=option_values(st.integers(min_value=-5, max_value=2000)),
    queue=option_values(hostile_text),
    run_at=option_values(datetimes),
    tags=option_values(st.lists(hostile_text, max_size=4)),
    metadata=option_values(st.dictionaries(hostile_text, junk, max_size=4)),
    unique=st.one_of(st.none(), units),
    as_request=st.booleans(),
)
@example(None, None, None, None, ["a\x00"], None, None, False)
@example(None, None, None, None, ["\udfff"], None, None, False)
@example(None, None, None, None, None, {"k": "\x00"}, None, False)
@example(None, None, None, None, None, {"k": "\ud800"}, None, True)
@example(None, None, None, None, None, None, awa.Unique(by_period=1e-300), False)
@example(None, None, None, None, None, None, awa.Unique(states=5), False)
@example(None, None, "default\x00", None, None, None, None, False)
def test_enqueue_options_are_applied_or_refused(
    db: Any,
    priority: Any,
    max_attempts: Any,
    queue: Any,
    run_at: Any,
    tags: Any,
    metadata: Any,
    unique: Any,
    as_request: bool,
) -> None:
    options = {
        "priority": priority,
        "max_attempts": max_attempts,
        "queue": queue,
        "run_at": run_at,
        "tags": tags,
        "metadata": metadata,
        "unique": unique,
    }
    args = HostilePayload(text=str(uuid.uuid4()))
    if as_request:
        call = lambda: awa.enqueue_many([awa.EnqueueRequest(args, **options)])  # noqa: E731
    else:
        call = lambda: awa.enqueue(args, **options)  # noqa: E731
    before = job_count()
    result = outcome(call, (awa.ValidationError, awa.UniqueConflict))
    if isinstance(result, Exception):
        assert str(result)
        assert job_count() == before
        return
    assert job_count() == before + 1
    job_id = result[0] if as_request else result.id
    row = Job.objects.get(id=job_id)
    if priority is not None:
        assert row.priority == priority
    if max_attempts is not None:
        assert row.max_attempts == max_attempts
    if queue is not None:
        assert row.queue == queue
    if tags is not None:
        assert row.tags == list(tags)


# -- AWA settings ---------------------------------------------------------------------------

# Per key: values that must be accepted, and values that must be reported.
GOOD: dict[str, list[Any]] = {
    "DATABASE": ["default"],
    "QUEUES": [{"default": {"concurrency": 3}}, {"a.b:c-d": {}}],
    "POLL_INTERVAL": [0.1, 2, dt.timedelta(seconds=1)],
    "HEARTBEAT_INTERVAL": [0.5, 1],
    "STALE_AFTER": [3600, dt.timedelta(hours=1)],
    "MAINTENANCE_INTERVAL": [1, 0.25],
    "DEFAULT_DEADLINE": [None, 60, dt.timedelta(minutes=5)],
    "SHUTDOWN_TIMEOUT": [1, 30.0],
    "COMPLETED_RETENTION": [None, 86400, 0, dt.timedelta(0)],  # 0: none kept
    "FAILED_RETENTION": [None, dt.timedelta(days=7)],
    "CALLBACK_SECRET": [None, "s3cret"],
    "PRIORITY_AGING_INTERVAL": [None, 60],
    "CLAIM_BATCH_SIZE": [1, 100],
    "MAX_ARGS_BYTES": [1, 10**6],
    "MAX_METADATA_BYTES": [1, 65536],
    "PREPARED_STATEMENTS": [True, False],
    "REINDEX_BLOATED": [True, False],
}
BAD_DURATION = [
    0,
    -1,
    -0.5,
    math.nan,
    math.inf,
    10**400,
    "5",
    [5],
    {},
    True,
    dt.timedelta(0),
    b"1",
    1j,
    10**200,  # a float, but no timestamp lies that far away
    dt.timedelta.max,
]
# What COMPLETED_RETENTION takes beyond the other durations: zero (keep no completed job).
BAD_RETENTION = [
    value
    for value in BAD_DURATION
    if not any(type(value) is type(zero) and value == zero for zero in (0, dt.timedelta(0)))
]
BAD: dict[str, list[Any]] = {
    "DATABASE": ["nope", 3, None, ["default"], {"default": 1}, ""],
    "QUEUES": [
        {},
        [],
        "default",
        None,
        {"bad name!": {}},
        {"q": {"concurrency": 0}},
        {"q": {"concurrency": "4"}},
        {"q": {"concurrency": True}},
        {"q": {"speed": 1}},
        {"q": 4},
        {3: {}},
        {"\x00": {}},
    ],
    "POLL_INTERVAL": [*BAD_DURATION, None],
    "HEARTBEAT_INTERVAL": [*BAD_DURATION, None],
    "STALE_AFTER": [*BAD_DURATION, None],
    "MAINTENANCE_INTERVAL": [*BAD_DURATION, None],
    "DEFAULT_DEADLINE": BAD_DURATION,
    "SHUTDOWN_TIMEOUT": [*BAD_DURATION, None],
    "COMPLETED_RETENTION": BAD_RETENTION,
    "FAILED_RETENTION": BAD_DURATION,
    "CALLBACK_SECRET": ["", 5, b"bytes", ["x"]],
    "PRIORITY_AGING_INTERVAL": BAD_DURATION,
    "CLAIM_BATCH_SIZE": [0, -1, 1.5, "10", True, None, math.nan],
    "MAX_ARGS_BYTES": [0, -1, 1.5, "10", False, None],
    "MAX_METADATA_BYTES": [0, -1, 1.5, "10", False, None],
    "PREPARED_STATEMENTS": [1, 0, "yes", None],
    "REINDEX_BLOATED": [1, "no", None],
}


@st.composite
def awa_settings_dicts(draw: st.DrawFn) -> tuple[dict[Any, Any], set[str]]:
    raw: dict[Any, Any] = {}
    expected_bad: set[str] = set()
    for key in draw(st.lists(st.sampled_from(sorted(GOOD)), unique=True, max_size=6)):
        if draw(st.booleans()):
            raw[key] = draw(st.sampled_from(BAD[key]))
            expected_bad.add(key)
        else:
            raw[key] = draw(st.sampled_from(GOOD[key]))
    for key in draw(st.lists(st.text(min_size=1, max_size=12), max_size=2)):
        if key not in GOOD:
            raw[key] = draw(junk)
            expected_bad.add(key)
    return raw, expected_bad


@BOUNDED
@given(case=awa_settings_dicts())
@example(case=({"DATABASE": ["default"]}, {"DATABASE"}))
@example(case=({"STALE_AFTER": 1, "HEARTBEAT_INTERVAL": 5}, set()))
def test_settings_problems_name_every_bad_key_and_never_raise(
    db: Any, case: tuple[dict[Any, Any], set[str]]
) -> None:
    raw, expected_bad = case
    found = conf.problems(raw)
    assert isinstance(found, list)
    for key, message in found:
        assert isinstance(key, str) and isinstance(message, str)
        assert key in message or repr(key) in message
    keys = {key for key, _ in found}
    # A cross-key rule may add STALE_AFTER (it must exceed HEARTBEAT_INTERVAL).
    assert expected_bad <= keys <= expected_bad | {"STALE_AFTER"}
    with override_settings(AWA=raw):
        # The system checks report the same problems, and never crash either.
        errors = check_settings() + check_database()
        assert all(isinstance(e, CheckError) for e in errors)
        assert {e.msg for e in check_settings()} == {m for _, m in found}
        if found:
            with pytest.raises(awa.ConfigurationError) as info:
                conf.awa_settings()
            assert any(key in str(info.value) or repr(key) in str(info.value) for key in keys)
        else:
            conf.awa_settings()  # builds


@BOUNDED
@given(raw=junk)
def test_settings_problems_of_a_non_dict_awa(db: Any, raw: Any) -> None:
    if isinstance(raw, dict) or raw is None:  # None: read settings.AWA
        return
    assert conf.problems(raw)[0][0] == "AWA"


# -- cron strings -----------------------------------------------------------------------------

CRON_TOKENS = [
    "*", "0", "5", "59", "60", "61", "23", "24", "31", "32", "2", "12", "13", "7", "8",
    "*/15", "*/0", "*/-1", "1-5", "5-1", "1,2,3", ",", "-", "L", "W", "#", "?", "MON", "FRI#2",
    "JAN", "FOO", "1/2/3", "", "\x00", "\ud800", "é", "9" * 30, "@daily", "0x10",
]  # fmt: skip


@st.composite
def cron_strings(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(st.text(alphabet=any_char, max_size=30))
    fields = draw(st.lists(st.sampled_from(CRON_TOKENS), min_size=4, max_size=7))
    return draw(st.sampled_from([" ", "  ", "\t"])).join(fields)


@BOUNDED
@given(cron=cron_strings(), timezone=st.one_of(st.just("UTC"), hostile_text))
@example(cron="0 0 30 2 *", timezone="UTC")  # February 30th: parses, never fires
@example(cron="0 0 31 4 *", timezone="UTC")
@example(cron="* * * * *", timezone="Europe/Paris")
def test_periodic_takes_a_good_cron_and_names_a_bad_one(db: Any, cron: str, timezone: str) -> None:
    name = f"hostile-{uuid.uuid4()}"
    try:
        result = outcome(
            lambda: awa.periodic(name, cron, HostilePayload(), timezone=timezone),
            (awa.ValidationError,),
        )
        if isinstance(result, awa.ValidationError):
            assert repr(cron) in str(result) or repr(timezone) in str(result)
            assert name not in schedules
            return
        # Accepted: the maintenance leader must be able to compute its fires.
        now = dt.datetime.now(dt.UTC)
        assert result.next_after(now) > now
        result.fires_between(now, now + dt.timedelta(days=400))
    finally:
        schedules.pop(name, None)


@pytest.mark.parametrize("name", ["", "x" * 256, "nul\x00name", 5, None])
def test_periodic_refuses_bad_names(db: Any, name: Any) -> None:
    try:
        with pytest.raises(awa.ValidationError):
            awa.periodic(name, "* * * * *", HostilePayload())
    finally:
        schedules.pop(name, None) if isinstance(name, str) else None


# -- callback request bodies over HTTP ------------------------------------------------------

ACTIONS = ["complete", "fail", "retry", "heartbeat", "explode"]
SIGNED = ACTIONS[:4]
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**40), max_value=10**40),
        st.floats(allow_nan=True, allow_infinity=True),
        hostile_text,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)
    ),
    max_leaves=10,
)
KEYS = ["payload", "error", "timeout", "state", "id", "\x00"]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["object", "raw", "scalar", "literal"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "scalar":
        return json.dumps(draw(json_values)).encode()
    if kind == "literal":
        return draw(
            st.sampled_from(
                [
                    b"",
                    b"{}",
                    b"[" * 100_000,
                    b'{"payload": ' + b"9" * 5000 + b"}",
                    b'{"payload": NaN}',
                    b'{"payload": Infinity}',
                    b'{"timeout": 1e999}',
                    b'{"timeout": -0.0}',
                    b'{"timeout": 1e-300}',
                    b'{"timeout": true}',
                    b'{"error": "\\u0000"}',
                    b'{"error": "\\ud800"}',
                    b'{"payload": {"\\u0000": 1}}',
                    b'{"payload": "\\udfff"}',
                    b'{"payload": 1, "payload": 2}',
                    b"\xff\xfe{}",
                ]
            )
        )
    keys = draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
    return json.dumps({key: draw(json_values) for key in keys}).encode()


@st.composite
def headers_for(
    draw: st.DrawFn, body: bytes, callback_id: uuid.UUID, action: str
) -> dict[str, str]:
    modes = ["good", "good", "good", "none", "stale", "future", "junk", "bad", "elsewhere"]
    mode = draw(st.sampled_from(modes))
    now = int(time.time())
    # An unknown action is 404 before any signature is read; sign it as another.
    target = {"callback_id": callback_id, "action": action if action in SIGNED else "complete"}
    if mode == "good":
        return sign(body, SECRET, **target)
    if mode == "none":
        return {}
    if mode == "stale":
        return sign(body, SECRET, **target, timestamp=now - 301)
    if mode == "future":
        return sign(body, SECRET, **target, timestamp=now + 10**6)
    if mode == "bad":
        headers = sign(body, SECRET, **target)
        headers["X-Awa-Signature"] = sign(body + b" ", SECRET, **target)["X-Awa-Signature"]
        return headers
    if mode == "elsewhere":  # signed for another callback or action
        other = draw(st.sampled_from([a for a in SIGNED if a != target["action"]]))
        elsewhere = draw(
            st.sampled_from([{**target, "callback_id": uuid.uuid4()}, {**target, "action": other}])
        )
        return sign(body, SECRET, **elsewhere)
    return {
        "X-Awa-Timestamp": draw(st.text(alphabet=st.characters(codec="latin-1"), max_size=12)),
        "X-Awa-Signature": draw(st.text(alphabet=st.characters(codec="latin-1"), max_size=70)),
    }


def parked() -> Job:
    return make_job(
        kind="parked",
        args={"timeout": 60.0, "hold": 0.0},
        state=JobState.WAITING_EXTERNAL,
        attempt=1,
        max_attempts=2,
        callback_id=uuid.uuid4(),
        callback_timeout_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
    )


def row_state(job_id: int) -> tuple[Any, ...]:
    return tuple(
        Job.objects.filter(id=job_id).values_list(
            "state", "attempt", "metadata", "errors", "callback_id", "callback_timeout_at"
        )[0]
    )


EXPECTED_STATE = {
    "complete": JobState.COMPLETED,
    "fail": JobState.FAILED,
    "retry": JobState.AVAILABLE,
    "heartbeat": JobState.WAITING_EXTERNAL,
}


@settings(BOUNDED, max_examples=100)
@given(data=st.data(), action=st.sampled_from(ACTIONS), known=st.booleans())
def test_callback_requests_get_a_clear_answer_and_change_nothing_unless_accepted(
    db: Any, data: st.DataObject, action: str, known: bool
) -> None:
    body = data.draw(bodies(), label="body")
    job = parked()
    callback_id = job.callback_id if known else uuid.uuid4()
    headers = data.draw(headers_for(body, callback_id, action), label="headers")
    before = (job_count(), CallbackReceipt.objects.count(), row_state(job.id))
    with transaction.atomic():  # a savepoint: an unexpected error leaves the test usable
        response = Client(raise_request_exception=True).post(
            f"/awa/callbacks/{callback_id}/{action}",
            data=body,
            content_type="application/json",
            headers=headers,
        )
    assert response.status_code in (200, 400, 403, 404, 413), response.content
    assert response["Content-Type"] == "application/json"
    answer = json.loads(response.content)
    if response.status_code != 200:
        assert answer.get("error")
        assert (job_count(), CallbackReceipt.objects.count(), row_state(job.id)) == before
        return
    assert known and action in EXPECTED_STATE
    assert answer == {"id": job.id, "state": EXPECTED_STATE[action]}
    assert Job.objects.get(id=job.id).state == EXPECTED_STATE[action]
    assert CallbackReceipt.objects.count() == before[1] + 1


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("complete", b'{"payload": "\\u0000"}'),
        ("complete", b'{"payload": {"k": "\\ud800"}}'),
        ("complete", b'{"payload": {"\\udfff": 1}}'),
        ("fail", b'{"error": "bad \\u0000 error"}'),
        ("fail", b'{"error": "lone \\ud800"}'),
        ("complete", b'{"payload": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("complete", b'{"payload": ' + b"[" * 101 + b"]" * 101 + b"}"),
    ],
)
def test_callback_bodies_postgres_cannot_store_are_400(db: Any, action: str, body: bytes) -> None:
    job = parked()
    before = (job_count(), CallbackReceipt.objects.count(), row_state(job.id))
    response = Client(raise_request_exception=True).post(
        f"/awa/callbacks/{job.callback_id}/{action}",
        data=body,
        content_type="application/json",
        headers=sign(body, SECRET, callback_id=job.callback_id, action=action),
    )
    assert response.status_code == 400, response.content
    assert (job_count(), CallbackReceipt.objects.count(), row_state(job.id)) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda cid: awa.complete_external(cid, {"k": "\ud800"}),
        lambda cid: awa.complete_external(cid, self_referencing()),
        lambda cid: awa.complete_external(cid, deeply_nested()),
        lambda cid: awa.fail_external(cid, "lone \udfff"),
        lambda cid: awa.fail_external(cid, b"bytes"),
        lambda cid: awa.heartbeat_callback(cid, math.nan),
        lambda cid: awa.heartbeat_callback(cid, -1),
        lambda cid: awa.heartbeat_callback(cid, 10**400),
        lambda cid: awa.heartbeat_callback(cid, dt.timedelta.max),
    ],
)
def test_external_functions_refuse_unstorable_values(db: Any, call: Callable[[Any], Any]) -> None:
    job = parked()
    before = (job_count(), row_state(job.id))
    result = outcome(lambda: call(job.callback_id), (awa.ValidationError,))
    assert isinstance(result, awa.ValidationError), result
    assert (job_count(), row_state(job.id)) == before


def test_callback_payloads_nested_deeper_than_100_levels_are_refused(db: Any) -> None:
    # The limit args and metadata have (codec.MAX_JSON_DEPTH), by the same check.
    job = parked()
    before = (job_count(), row_state(job.id))
    too_deep = {"k": deeply_nested(99)}  # 101 levels: the dict, then 100 lists
    with pytest.raises(awa.ValidationError, match=r"nested deeper than 100 levels.*the limit"):
        awa.complete_external(job.callback_id, too_deep)
    assert (job_count(), row_state(job.id)) == before
    awa.complete_external(job.callback_id, {"k": deeply_nested(98)})
    assert Job.objects.get(id=job.id).state == JobState.COMPLETED


@pytest.mark.parametrize("callback_id", ["", "not-a-uuid", "\x00", 5, None, "0" * 10_000])
def test_external_functions_with_junk_ids_raise_callback_not_found(
    db: Any, callback_id: Any
) -> None:
    with pytest.raises(awa.CallbackNotFound):
        awa.complete_external(callback_id)
    with pytest.raises(awa.CallbackNotFound):
        awa.retry_external(callback_id)
