"""The ``AWA`` setting, read once into a frozen :class:`AwaSettings`.

Durations accept seconds (``int`` or ``float``) or a :class:`~datetime.timedelta`
and are stored as float seconds. :func:`problems` lists every wrong value by
key; the system check reports them and :func:`awa_settings` refuses them.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .exceptions import ConfigurationError, ValidationError

# A callback's timeout, however it is given (register_callback, heartbeat_callback,
# the HTTP heartbeat): a shorter one lapses before an answer can arrive (1e-300 s
# is no interval at all), a longer one outlives any sender worth waiting for.
MIN_CALLBACK_TIMEOUT = 1.0
MAX_CALLBACK_TIMEOUT = 365 * 86400.0

# \Z, not $: "$" also matches before a final newline, which no queue name holds.
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}\Z")


def invalid_queue_name(name: object) -> str:
    """What every error refusing a queue name says: the name, and what one may hold
    (``QUEUE_NAME_RE``)."""
    return f"invalid queue name {name!r}: 1 to 128 letters, digits and _ . : -"


DEFAULT_CONCURRENCY = 10
# A rate: N attempt starts per second, minute or hour (a sliding window).
RATE_RE = re.compile(r"^\s*([0-9]+)\s*/\s*([smh])\s*$")
RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
QUEUE_OPTIONS = ("concurrency", "rate_limit", "global_concurrency", "min", "weight")

# Key -> default. Durations are seconds; ``None`` disables where documented.
DEFAULTS: dict[str, Any] = {
    "DATABASE": "default",
    "QUEUES": {"default": {"concurrency": DEFAULT_CONCURRENCY}},
    "POLL_INTERVAL": 1.0,
    "HEARTBEAT_INTERVAL": 5.0,
    "STALE_AFTER": 30.0,
    "MAINTENANCE_INTERVAL": 5.0,
    "DEFAULT_DEADLINE": 900.0,
    "SHUTDOWN_TIMEOUT": 30.0,
    "COMPLETED_RETENTION": 86400.0,
    "FAILED_RETENTION": 7 * 86400.0,
    "CALLBACK_SECRET": None,
    # Bearer token that may read <prefix>/metrics besides staff users; None: staff only.
    "METRICS_TOKEN": None,
    # OpenTelemetry (the otel extra): None when installed, False never, True required.
    "OPENTELEMETRY": None,
    "PRIORITY_AGING_INTERVAL": 60.0,
    # The most one claim statement takes. A claim takes no more than the
    # queue's free places plus its prefetch, so only quick handlers reach it;
    # for them each statement's fixed cost is spread over more jobs.
    "CLAIM_BATCH_SIZE": 500,
    # Claim ahead what the queue's handlers will start within this many seconds
    # (by their recent run time); None turns prefetching off.
    "PREFETCH_WINDOW": 0.05,
    "MAX_ARGS_BYTES": 1_000_000,
    # Metadata is for small labels and the engine's lineage; data belongs in args.
    "MAX_METADATA_BYTES": 65_536,
    "PREPARED_STATEMENTS": True,
    # Where autovacuum will not visit awa_job, the maintenance leader vacuums it.
    "VACUUM_WITHOUT_AUTOVACUUM": True,
    # The maintenance leader rebuilds an index of awa_job that outgrew its rows.
    "REINDEX_BLOATED": True,
    # "" (or absent): the DATABASE alias. None: no direct session (poll, per-tick lock).
    "DIRECT_DATABASE": "",
    # A cap on handler threads shared by all of a process's queues (weighted by
    # each queue's "weight", each keeping its "min"); None: each queue its own.
    "WORKER_CONCURRENCY": None,
}

# What each key means: the documentation's settings reference is generated
# from DEFAULTS, DURATIONS and these (docs/_ext/awa_settings.py), and a test
# fails when a key of DEFAULTS has no description here. Markdown.
DESCRIPTIONS: dict[str, str] = {
    "DATABASE": "The database alias holding the job tables.",
    "QUEUES": (
        "The queues a worker runs, and how many jobs at once on each: "
        '`{"name": {"concurrency": N}}`. `awa_worker --queue name=N` overrides it. '
        'Fleet-wide limits per queue: `"rate_limit"` (`"N/s"`, `"N/m"`, `"N/h"`) and '
        '`"global_concurrency"`; with `WORKER_CONCURRENCY`, `"min"` and `"weight"`.'
    ),
    "POLL_INTERVAL": "How often an idle queue polls, as a fallback to LISTEN/NOTIFY.",
    "HEARTBEAT_INTERVAL": "How often a worker heartbeats its running jobs.",
    "STALE_AFTER": (
        "A running job whose heartbeat is older than this is rescued. Longer than "
        "`HEARTBEAT_INTERVAL`."
    ),
    "MAINTENANCE_INTERVAL": (
        "How often the elected worker runs maintenance (rescue, promote, periodic jobs, prune)."
    ),
    "DEFAULT_DEADLINE": (
        "The longest one attempt's handler may run before it is rescued; `None` disables. "
        "`@awa.worker(deadline=...)` overrides it per kind."
    ),
    "SHUTDOWN_TIMEOUT": "On SIGTERM/SIGINT, how long in-flight jobs get to finish.",
    "COMPLETED_RETENTION": (
        "Completed jobs older than this are pruned; `None` keeps them, 0 keeps none."
    ),
    "FAILED_RETENTION": (
        "Failed and cancelled jobs older than this are pruned; `None` keeps them."
    ),
    "CALLBACK_SECRET": (
        "The HMAC key of the external-callback endpoints; while `None` they answer 403."
    ),
    "PRIORITY_AGING_INTERVAL": (
        "An available job moves up one priority level per interval waited, so floods of "
        "high-priority jobs cannot starve it; `None` disables."
    ),
    "CLAIM_BATCH_SIZE": (
        "The most jobs one claim statement takes. A claim never takes more than the queue's "
        "free places plus its prefetch, so only quick handlers reach it."
    ),
    "PREFETCH_WINDOW": (
        "While handlers are quick, claim ahead what they will start within this time (by "
        "their recent run time, and once claimed jobs wait, by the rate the handlers really "
        "start them), so they never wait for a claim; slow handlers get none; `None` turns "
        "it off. A prefetched job is `running` with `attempted_at` empty until a handler "
        "takes it."
    ),
    "MAX_ARGS_BYTES": "The largest encoded args accepted at enqueue, in bytes of JSON (UTF-8).",
    "MAX_METADATA_BYTES": (
        "The largest encoded `metadata` accepted at enqueue, in bytes of JSON (UTF-8); what "
        "django-awa adds itself (`awa_trigger`...) is not counted."
    ),
    "PREPARED_STATEMENTS": (
        "The per-job statements run as prepared statements; turn it off behind a pooler that "
        "cannot keep them (PgBouncer before 1.21 in transaction mode)."
    ),
    "VACUUM_WITHOUT_AUTOVACUUM": (
        "Where autovacuum will not visit `awa_job` (off for the server or the table), the "
        "maintenance leader runs `VACUUM awa_job` itself once its dead row versions pass "
        "autovacuum's threshold for it; `False` leaves them to you."
    ),
    "REINDEX_BLOATED": (
        "Every 10 minutes the maintenance leader rebuilds (`REINDEX INDEX CONCURRENTLY`, "
        "in a thread of its own) an index of `awa_job` larger than 32 MB and than four "
        "times what its live rows need, as a drained backlog of millions of jobs leaves "
        "them; `False` leaves them to you."
    ),
    "DIRECT_DATABASE": (
        "An alias reaching PostgreSQL directly (not through a transaction-mode pooler), for "
        'LISTEN. `""` (the default): the `DATABASE` alias. `None`: workers poll. A worker '
        "started with `--database` naming another alias listens on that alias."
    ),
    "METRICS_TOKEN": (
        "A bearer token (printable ASCII, no surrounding whitespace) that lets a scraper read "
        "`<prefix>/metrics` without a staff login; `None`: staff users only."
    ),
    "WORKER_CONCURRENCY": (
        "One cap on the jobs a worker process runs at once over all its queues, shared by "
        'their `"weight"` while each keeps its `"min"`; `None`: each queue has its own '
        "`concurrency`."
    ),
    "OPENTELEMETRY": (
        "Traces and metrics through the OpenTelemetry API (the `otel` extra): `None` uses "
        "it when installed, `False` never, `True` requires it (a system-check error "
        "without it)."
    ),
}

# The longest value a duration setting takes: past it, timestamps and waits
# computed from it overflow (a claim's deadline_at beyond year 9999 could not
# be read back, and would fail every claim of the queue). Retentions may be
# longer than the rest.
MAX_DURATION = 365 * 86400.0
MAX_RETENTION = 100 * 365 * 86400.0
DURATIONS = {
    "POLL_INTERVAL": False,
    "HEARTBEAT_INTERVAL": False,
    "STALE_AFTER": False,
    "MAINTENANCE_INTERVAL": False,
    "DEFAULT_DEADLINE": True,  # True: None is allowed
    "SHUTDOWN_TIMEOUT": False,
    "COMPLETED_RETENTION": True,
    "FAILED_RETENTION": True,
    "PRIORITY_AGING_INTERVAL": True,
    "PREFETCH_WINDOW": True,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Rate:
    """At most ``count`` attempt starts in any window of ``period`` seconds."""

    count: int
    period: float
    text: str


# The largest limits accepted. A fleet-wide limit is kept in rows (a slot row
# per place of a global_concurrency, a lease row per place of an awa.Limit's,
# a row per start in a rate's window), and a queue's concurrency is that many
# threads in every worker process: past these a value is a mistake, and it
# would stall the queue rather than limit it.
MAX_RATE = 1_000_000
MAX_GLOBAL_CONCURRENCY = 10_000
MAX_CONCURRENCY = 1_000


def parse_rate(value: Any, what: str) -> Rate:
    """A rate from ``"N/s"``, ``"N/m"`` or ``"N/h"`` (N from 1 to ``MAX_RATE``);
    ``ValidationError`` beginning with ``what`` otherwise."""
    match = RATE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValidationError(f'{what} must be a rate "N/s", "N/m" or "N/h", got {value!r}')
    count = int(match.group(1))
    if count < 1:
        raise ValidationError(f"{what} must allow at least one start per period, got {value!r}")
    if count > MAX_RATE:
        raise ValidationError(
            f"{what} allows at most {MAX_RATE:,} starts per period, got {value!r}"
        )
    return Rate(count=count, period=RATE_PERIODS[match.group(2)], text=f"{count}/{match.group(2)}")


def positive_int(value: Any, most: int | None = None) -> bool:
    """Whether ``value`` is an integer from 1 (to ``most``, when given)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 1
        and (most is None or value <= most)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueConfig:
    name: str
    concurrency: int = DEFAULT_CONCURRENCY
    # Fleet-wide limits (SPEC 12); the database's runtime values win (set_queue_limits).
    rate_limit: Rate | None = None
    global_concurrency: int | None = None
    # Weighted sharing of AWA["WORKER_CONCURRENCY"] within one process.
    min: int = 0
    weight: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class AwaSettings:
    database: str
    queues: dict[str, QueueConfig]
    poll_interval: float
    heartbeat_interval: float
    stale_after: float
    maintenance_interval: float
    default_deadline: float | None
    shutdown_timeout: float
    completed_retention: float | None
    failed_retention: float | None
    callback_secret: str | None
    metrics_token: str | None
    opentelemetry: bool | None
    priority_aging_interval: float | None
    claim_batch_size: int
    prefetch_window: float | None
    max_args_bytes: int
    max_metadata_bytes: int
    prepared_statements: bool
    vacuum_without_autovacuum: bool
    reindex_bloated: bool
    direct_database: str | None
    worker_concurrency: int | None = None


def to_seconds(value: Any) -> float:
    """Seconds from an int, float or timedelta; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError(
                f"expected a finite duration, got an integer of {value.bit_length()} bits"
            ) from None
    elif isinstance(value, float):
        seconds = value
    else:
        raise TypeError(f"expected seconds (int or float) or a timedelta, got {value!r}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return seconds


def callback_timeout(value: Any, what: str) -> float:
    """Seconds of a callback timeout (seconds or a timedelta), from one second to
    365 days; else ``ValidationError`` beginning with ``what``."""
    try:
        seconds = to_seconds(value)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{what}: {exc}") from None
    if not MIN_CALLBACK_TIMEOUT <= seconds <= MAX_CALLBACK_TIMEOUT:
        raise ValidationError(
            f"{what} must be from {MIN_CALLBACK_TIMEOUT:.0f} second to "
            f"{MAX_CALLBACK_TIMEOUT / 86400:.0f} days, got {value!r}"
        )
    return seconds


def _importable(name: str) -> bool:
    """Whether module ``name`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _header_text(text: str) -> bool:
    """Whether ``text`` is printable ASCII, which an HTTP header carries as it is."""
    return all(" " <= char <= "~" for char in text)


def did_you_mean(name: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` naming the one of ``choices`` closest to ``name``
    (letter case aside), or ``""`` when none is close."""
    if not isinstance(name, str):
        return ""
    folded = {choice.casefold(): choice for choice in choices}
    close = difflib.get_close_matches(name.casefold(), folded, n=1)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""


def _given() -> Any:
    """``settings.AWA`` as the user wrote it: any value at all."""
    return getattr(settings, "AWA", None) or {}


def raw_settings() -> dict[str, Any]:
    """A copy of ``settings.AWA``; ``{}`` when it is not a dict (``problems()``
    reports that, and ``awa_settings()`` refuses it)."""
    raw = _given()
    return dict(raw) if isinstance(raw, dict) else {}


def problems(raw: Any = None) -> list[tuple[str, str]]:
    """Every wrong value in ``settings.AWA`` (or in ``raw``, which may be any
    value a user put there) as ``(key, message)`` pairs."""
    raw = _given() if raw is None else raw
    found: list[tuple[str, str]] = []
    if not isinstance(raw, dict):
        return [("AWA", f"AWA must be a dict of django-awa settings, got {type(raw).__name__}")]
    for key in raw:
        if key not in DEFAULTS:
            found.append((key, f"unknown AWA setting {key!r}{did_you_mean(key, DEFAULTS)}"))
    for key, allow_none in DURATIONS.items():
        if key not in raw:
            continue
        value = raw[key]
        if value is None:
            if not allow_none:
                found.append((key, f"AWA[{key!r}] cannot be None"))
            continue
        try:
            seconds = to_seconds(value)
        except (TypeError, ValueError) as exc:
            found.append((key, f"AWA[{key!r}]: {exc}"))
            continue
        longest = MAX_RETENTION if key.endswith("_RETENTION") else MAX_DURATION
        # COMPLETED_RETENTION = 0: completed jobs are not kept (sql.FORGETTING).
        zero = key == "COMPLETED_RETENTION"
        if not (0 <= seconds if zero else 0 < seconds) or seconds > longest:
            found.append(
                (
                    key,
                    f"AWA[{key!r}] must be {'0 or ' if zero else ''}a positive duration of "
                    f"at most {longest / 86400:.0f} days, got {value!r}",
                )
            )
    if "DATABASE" in raw:
        alias = raw["DATABASE"]
        if not isinstance(alias, str) or alias not in settings.DATABASES:
            found.append(("DATABASE", f"AWA['DATABASE'] names no entry of DATABASES: {alias!r}"))
    if "DIRECT_DATABASE" in raw:
        direct = raw["DIRECT_DATABASE"]
        if direct not in (None, "") and (
            not isinstance(direct, str) or direct not in settings.DATABASES
        ):
            found.append(
                (
                    "DIRECT_DATABASE",
                    f"AWA['DIRECT_DATABASE'] names no entry of DATABASES: {direct!r} "
                    f"(None: no direct connection)",
                )
            )
    if "CALLBACK_SECRET" in raw:
        secret = raw["CALLBACK_SECRET"]
        if secret is not None and (not isinstance(secret, str) or not secret):
            found.append(("CALLBACK_SECRET", "AWA['CALLBACK_SECRET'] must be a non-empty string"))
    if "METRICS_TOKEN" in raw:
        token = raw["METRICS_TOKEN"]
        if token is not None and (not isinstance(token, str) or not token.strip()):
            found.append(("METRICS_TOKEN", "AWA['METRICS_TOKEN'] must be a non-empty string"))
        elif token is not None and (token != token.strip() or not _header_text(token)):
            # The receiver strips the header's token and compares its text as
            # the server decoded it (latin-1): such a token could never match,
            # and every scrape would get a 401 saying only that a token is needed.
            # Named by its fault, never shown: it is a secret, and checks are logged.
            fault = (
                "has leading or trailing whitespace (a line end read from a file?)"
                if token != token.strip()
                else "holds characters other than printable ASCII"
            )
            found.append(
                (
                    "METRICS_TOKEN",
                    f"AWA['METRICS_TOKEN'] {fault}: no Authorization header could carry it, "
                    "so every scrape would get a 401; use printable ASCII without surrounding "
                    "whitespace",
                )
            )
    if "OPENTELEMETRY" in raw:
        otel = raw["OPENTELEMETRY"]
        if otel not in (None, True, False):
            found.append(("OPENTELEMETRY", "AWA['OPENTELEMETRY'] must be None, True or False"))
        elif otel is True and not _importable("opentelemetry.trace"):
            found.append(
                (
                    "OPENTELEMETRY",
                    "AWA['OPENTELEMETRY'] is True but opentelemetry-api is not installed "
                    "(pip install 'django-awa[otel]')",
                )
            )
    for key in ("CLAIM_BATCH_SIZE", "MAX_ARGS_BYTES", "MAX_METADATA_BYTES"):
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                found.append((key, f"AWA[{key!r}] must be a positive integer, got {value!r}"))
    for key in ("PREPARED_STATEMENTS", "VACUUM_WITHOUT_AUTOVACUUM", "REINDEX_BLOATED"):
        if key in raw and not isinstance(raw[key], bool):
            found.append((key, f"AWA[{key!r}] must be True or False"))
    if "QUEUES" in raw:
        found.extend(_queue_problems(raw["QUEUES"]))
    if raw.get("WORKER_CONCURRENCY") is not None:
        found.extend(_worker_concurrency_problems(raw["WORKER_CONCURRENCY"], raw.get("QUEUES")))
    stale = raw.get("STALE_AFTER", DEFAULTS["STALE_AFTER"])
    beat = raw.get("HEARTBEAT_INTERVAL", DEFAULTS["HEARTBEAT_INTERVAL"])
    try:
        if to_seconds(stale) <= to_seconds(beat):
            found.append(
                ("STALE_AFTER", "AWA['STALE_AFTER'] must be longer than AWA['HEARTBEAT_INTERVAL']")
            )
    except (TypeError, ValueError):
        pass  # already reported above
    return found


def _queue_problems(queues: Any) -> list[tuple[str, str]]:
    if not isinstance(queues, dict) or not queues:
        return [("QUEUES", "AWA['QUEUES'] must be a non-empty dict of {name: {'concurrency': N}}")]
    found = []
    for name, options in queues.items():
        if not isinstance(name, str) or not QUEUE_NAME_RE.match(name):
            found.append(("QUEUES", f"AWA['QUEUES'] has an {invalid_queue_name(name)}"))
            continue
        if not isinstance(options, dict):
            found.append(("QUEUES", f"AWA['QUEUES'][{name!r}] must be a dict, got {options!r}"))
            continue
        for opt in options:
            if opt not in QUEUE_OPTIONS:
                found.append(
                    (
                        "QUEUES",
                        f"AWA['QUEUES'][{name!r}] has an unknown option {opt!r}"
                        f"{did_you_mean(opt, QUEUE_OPTIONS)}",
                    )
                )
        if options.get("rate_limit") is not None:
            try:
                parse_rate(options["rate_limit"], f"AWA['QUEUES'][{name!r}]['rate_limit']")
            except ValidationError as exc:
                found.append(("QUEUES", str(exc)))
        for opt, most in (("global_concurrency", MAX_GLOBAL_CONCURRENCY), ("weight", None)):
            if options.get(opt) is not None and not positive_int(options[opt], most):
                upto = "a positive integer" if most is None else f"an integer from 1 to {most:,}"
                found.append(
                    (
                        "QUEUES",
                        f"AWA['QUEUES'][{name!r}][{opt!r}] must be {upto}, got {options[opt]!r}",
                    )
                )
        low = options.get("min")
        if low is not None and (not isinstance(low, int) or isinstance(low, bool) or low < 0):
            found.append(
                (
                    "QUEUES",
                    f"AWA['QUEUES'][{name!r}]['min'] must be an integer of at least 0, got {low!r}",
                )
            )
        concurrency = options.get("concurrency", DEFAULT_CONCURRENCY)
        if not positive_int(concurrency, MAX_CONCURRENCY):
            found.append(
                (
                    "QUEUES",
                    f"AWA['QUEUES'][{name!r}]['concurrency'] must be an integer from 1 to "
                    f"{MAX_CONCURRENCY:,}, got {concurrency!r}",
                )
            )
    return found


def _worker_concurrency_problems(cap: Any, queues: Any) -> list[tuple[str, str]]:
    if not positive_int(cap):
        return [
            (
                "WORKER_CONCURRENCY",
                f"AWA['WORKER_CONCURRENCY'] must be a positive integer or None, got {cap!r}",
            )
        ]
    if not isinstance(queues, dict):
        return []  # the default queue, or reported under QUEUES
    mins = {
        name: opts["min"]
        for name, opts in queues.items()
        if isinstance(opts, dict) and isinstance(opts.get("min"), int)
    }
    found = [
        (
            "WORKER_CONCURRENCY",
            f"AWA['QUEUES'][{name!r}]['min'] ({low}) is more than "
            f"AWA['WORKER_CONCURRENCY'] ({cap})",
        )
        for name, low in mins.items()
        if low > cap
    ]
    if not found and sum(mins.values()) > cap:
        found.append(
            (
                "WORKER_CONCURRENCY",
                f"the queues' 'min' values add up to {sum(mins.values())}, more than "
                f"AWA['WORKER_CONCURRENCY'] ({cap})",
            )
        )
    return found


def _queue_config(name: str, opts: dict[str, Any]) -> QueueConfig:
    rate = opts.get("rate_limit")
    return QueueConfig(
        name=name,
        concurrency=opts.get("concurrency", DEFAULT_CONCURRENCY),
        rate_limit=None if rate is None else parse_rate(rate, name),
        global_concurrency=opts.get("global_concurrency"),
        min=opts.get("min") or 0,
        weight=opts.get("weight") or 1,
    )


@functools.cache
def awa_settings() -> AwaSettings:
    """The validated settings; raises :class:`ConfigurationError` naming the first bad key."""
    bad = problems()
    if bad:
        raise ConfigurationError("; ".join(message for _, message in bad))
    raw = raw_settings()
    merged = {**DEFAULTS, **raw}

    def duration(key: str) -> float | None:
        value = merged[key]
        return None if value is None else to_seconds(value)

    def required(key: str) -> float:
        # problems() refused None for these keys before we got here.
        return to_seconds(merged[key])

    return AwaSettings(
        database=merged["DATABASE"],
        queues={name: _queue_config(name, opts) for name, opts in merged["QUEUES"].items()},
        poll_interval=required("POLL_INTERVAL"),
        heartbeat_interval=required("HEARTBEAT_INTERVAL"),
        stale_after=required("STALE_AFTER"),
        maintenance_interval=required("MAINTENANCE_INTERVAL"),
        default_deadline=duration("DEFAULT_DEADLINE"),
        shutdown_timeout=required("SHUTDOWN_TIMEOUT"),
        completed_retention=duration("COMPLETED_RETENTION"),
        failed_retention=duration("FAILED_RETENTION"),
        callback_secret=merged["CALLBACK_SECRET"],
        metrics_token=merged["METRICS_TOKEN"],
        opentelemetry=merged["OPENTELEMETRY"],
        priority_aging_interval=duration("PRIORITY_AGING_INTERVAL"),
        claim_batch_size=merged["CLAIM_BATCH_SIZE"],
        prefetch_window=duration("PREFETCH_WINDOW"),
        max_args_bytes=merged["MAX_ARGS_BYTES"],
        max_metadata_bytes=merged["MAX_METADATA_BYTES"],
        prepared_statements=merged["PREPARED_STATEMENTS"],
        vacuum_without_autovacuum=merged["VACUUM_WITHOUT_AUTOVACUUM"],
        reindex_bloated=merged["REINDEX_BLOATED"],
        direct_database=(
            merged["DATABASE"] if merged["DIRECT_DATABASE"] == "" else merged["DIRECT_DATABASE"]
        ),
        worker_concurrency=merged["WORKER_CONCURRENCY"],
    )


def not_kept_note() -> str:
    """What a "no job with id N" message adds when completed jobs are not kept
    (``COMPLETED_RETENTION = 0``): the job may have completed."""
    if awa_settings().completed_retention == 0:
        return " (or it completed: AWA['COMPLETED_RETENTION'] is 0, completed jobs are not kept)"
    return ""


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("AWA", "DATABASES"):
        awa_settings.cache_clear()
