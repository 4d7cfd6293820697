"""Args <-> JSON, and what PostgreSQL can store.

Args travel as the JSON object of their dataclass's fields (SPEC §2):
``encode_checked`` refuses at enqueue what the worker could not decode,
``decode_args`` rebuilds the dataclass and names the kind and field when it
cannot. The ``check_*`` functions refuse user input PostgreSQL cannot store
(NUL bytes, lone surrogates, huge integers, deep nesting); the ``escape_*``
functions keep what a handler raised or returned, escaped, where refusing
would lose the outcome.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import functools
import json
import math
import sys
import types
import typing
import uuid
from collections.abc import Iterator
from typing import Any, cast

from django.conf import settings
from django.utils import timezone

from .exceptions import ValidationError
from .kinds import JobArgs


class ArgsDecodeError(Exception):
    """Stored args do not fit the kind's JobArgs class (a terminal failure)."""


class UnreadableJSON:
    """A stored JSON value that PostgreSQL holds but Python cannot read back: an integer
    of more digits than ``int()`` takes (``sys.get_int_max_str_digits``), or nesting
    deeper than the interpreter's recursion limit. Written by something other than
    django-awa (SQL, a producer in another language), since ``awa.enqueue`` refuses
    both.

    The row keeps its value; what read it holds this marker instead of raising, so
    one such row does not fail the statement that read it with the others (a
    claim's batch, a rescue, an admin list). It is false, as an empty value is; its
    args decode to a terminal failure naming the error (``decode_args``).
    """

    __slots__ = ("error", "size")

    def __init__(self, text: str, error: BaseException) -> None:
        self.size = len(text)
        self.error = f"{type(error).__name__}: {error}"

    # Read as an empty value of any kind, so code that looks into a column
    # (``metadata.get(...)``, ``for tag in tags``) reads nothing rather than raising.
    def __bool__(self) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __contains__(self, item: object) -> bool:
        return False

    def get(self, key: object, default: Any = None) -> Any:
        return default

    def __repr__(self) -> str:
        return f"<stored JSON of {self.size:,} characters that Python cannot read ({self.error})>"

    __str__ = __repr__


class NaiveDatetime(ValueError):
    """A naive datetime in args under ``USE_TZ`` (SPEC §3: refused, as ``run_at`` is)."""


def encode_args(args: object) -> dict[str, Any]:
    """The JSON object of ``args``' fields; :class:`ValidationError` if not encodable."""
    if not isinstance(args, JobArgs) or not dataclasses.is_dataclass(type(args)):
        raise ValidationError(
            f"expected a JobArgs dataclass instance, got {type(args).__name__}: {args!r}"
        )
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, args)):  # a dataclass, checked just above
        try:
            out[f.name] = _encode(getattr(args, f.name))
        except NaiveDatetime as exc:
            raise ValidationError(f"args of kind {args.kind!r}: field {f.name!r}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValidationError(
                f"args of kind {args.kind!r}: field {f.name!r} cannot be stored as JSON: {exc}"
            ) from exc
        except RecursionError:
            raise ValidationError(
                f"args of kind {args.kind!r}: field {f.name!r} is nested deeper than "
                f"{MAX_JSON_DEPTH} levels of lists and objects (or contains itself), the limit"
            ) from None
    return out


# Python refuses to print longer ints (sys.get_int_max_str_digits(), 4300 digits).
MAX_INT_BITS = 14_000


def check_int(value: int) -> int:
    """``value`` if jsonb (and Python's int-to-text) can hold it; else ``ValueError``."""
    if value.bit_length() > MAX_INT_BITS:
        raise ValueError("an integer is too large to be stored as JSON")
    return value


def require_text(value: str, what: str) -> str:
    """``check_text`` for a user-supplied string: :class:`ValidationError` ``"{what}: why"``."""
    try:
        return check_text(value)
    except ValueError as exc:
        raise ValidationError(f"{what}: {exc}") from None


# The most lists and objects nested in one another that args, metadata or a
# callback payload may hold, counting the outermost (an args object with a
# list field holding dicts is 3). Deeper JSON is stored by PostgreSQL but
# breaks what reads it back with Python's recursive code (json, the admin).
MAX_JSON_DEPTH = 100


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """``ValueError`` if JSON ``value`` nests lists and objects deeper than ``limit``.

    Iterative: a value nested past Python's recursion limit, or containing
    itself, gets the same answer, naming the top-level key or index it is under.
    """
    if not isinstance(value, (dict, list, tuple)):
        return
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        item, depth, top = stack.pop()
        if depth > limit:
            under = "" if top is None else f" (under {top!r})"
            raise ValueError(
                f"nested deeper than {limit} levels of lists and objects{under}, the limit"
            )
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1, key if top is None else top))


# Non-ASCII text as UTF-8, as args are sent: a byte limit counts the same for both.
_CHECKED_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def check_json(value: Any) -> str:
    """``value`` as JSON text; ``TypeError`` or ``ValueError`` if jsonb cannot store
    it or it is nested deeper than ``MAX_JSON_DEPTH``."""
    check_depth(value)
    text = _CHECKED_ENCODER.encode(value)
    check_storable(value)
    return text


def check_text(value: str) -> str:
    """``value`` if PostgreSQL can store it in text and jsonb; else ``ValueError``."""
    if "\x00" in value:
        raise ValueError("a string holds a NUL character (\\u0000), which PostgreSQL cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"a string holds a lone surrogate, which is not valid UTF-8: {value[:40]!r}"
        ) from None
    return value


# Text from outside that must be kept, not refused (a handler's error and
# traceback, a cancel reason, progress), is cut to these many characters.
MAX_ERROR_CHARS = 10_000
MAX_TRACEBACK_CHARS = 100_000


def escape_text(value: str, limit: int | None = None) -> str:
    """``value`` as text PostgreSQL can store: NUL written as ``\\x00`` and a
    lone surrogate as ``\\udc80``, cut to ``limit`` characters with a note.

    For what a handler raises or returns (SPEC §5: stored escaped), where
    refusing would lose the outcome. User input at enqueue is refused instead
    (``check_text``).
    """
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    if limit is not None and len(value) > limit:
        value = f"{value[:limit]}... ({len(value) - limit} more characters cut)"
    return value


def escape_json(value: Any) -> Any:
    """JSON ``value`` with every string (and key) passed through ``escape_text``."""
    match value:
        case str():
            return escape_text(value)
        case dict():
            return {
                escape_text(k) if isinstance(k, str) else k: escape_json(v)
                for k, v in value.items()
            }
        case list() | tuple():
            return [escape_json(item) for item in value]
        case _:
            return value


def check_storable(value: Any) -> None:
    """``ValueError`` if JSON ``value`` holds text or numbers PostgreSQL's jsonb refuses."""
    match value:
        case str():
            check_text(value)
        case bool() | None:
            pass
        case int():
            check_int(value)
        case dict():
            for key, item in value.items():
                if isinstance(key, str):
                    check_text(key)
                check_storable(item)
        case list() | tuple():
            for item in value:
                check_storable(item)


def _encode(value: Any) -> Any:
    match value:
        case None | bool():
            return value
        case str():
            return check_text(value)
        case int():
            return check_int(value)
        case float():
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{value!r} is not a JSON number")
            return value
        case enum.Enum():
            return _encode(value.value)
        case dt.datetime() if settings.USE_TZ and timezone.is_naive(value):
            # It would come back naive, as stored, to a handler comparing it with
            # aware ones; which time zone it meant is not known here either.
            raise NaiveDatetime(
                f"{value.isoformat()} is a naive datetime while USE_TZ is True; "
                "pass an aware datetime (django.utils.timezone.make_aware)"
            )
        case dt.datetime() | dt.date() | dt.time():
            return value.isoformat()
        case dt.timedelta():
            return value.total_seconds()
        case decimal.Decimal() | uuid.UUID():
            return str(value)
        case list() | tuple() | set() | frozenset():
            return [_encode(item) for item in value]
        case dict():
            for key in value:
                if not isinstance(key, str):
                    raise TypeError(f"dict key {key!r} is not a string")
                check_text(key)
            return {key: _encode(item) for key, item in value.items()}
        case _ if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        case _:
            raise TypeError(f"{type(value).__name__} {value!r} is not JSON")


# --- the fast path for plain args: every field an int, float, str or bool ------

_PLAIN_TYPES = (int, float, str, bool)
_FLOAT_MAX = sys.float_info.max
_MISSING = object()


@functools.lru_cache(maxsize=1024)
def _plain_fields(cls: type) -> tuple[tuple[str, type, bool], ...] | None:
    """``(name, type, optional)`` of each field when ``cls`` holds plain scalars only.

    ``None`` for any other class (nested types, containers, enums, dates, a
    ``__post_init__``, fields left out of ``__init__``): those take the general
    path. For plain classes, checking each value's type is exactly what
    encoding then decoding would check, at a fraction of the cost.
    """
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
        return None
    try:
        hints, fields = _shape(cls)
    except Exception:  # noqa: BLE001 - unresolvable hints: the general path reports them
        return None
    if len(fields) != len(dataclasses.fields(cls)):
        return None
    plan = []
    for f in fields:
        hint = hints.get(f.name, Any)
        options = typing.get_args(hint)
        optional = False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            if len(options) != 2 or type(None) not in options:
                return None
            hint = options[0] if options[1] is type(None) else options[1]
            optional = True
        if hint not in _PLAIN_TYPES:
            return None
        plan.append((f.name, hint, optional))
    return tuple(plan)


def _plain_ok(hint: type, value: Any, optional: bool) -> bool:
    """Whether ``value`` passes the checks of a plain field of type ``hint``."""
    if value is None:
        return optional
    if hint is str:
        return isinstance(value, str) and _storable_text(value)
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        # An int for a float field must fit a float (the general path names one
        # that does not); the few just past the largest float that would round
        # down to it take the general path too.
        fits = hint is not float or abs(value) <= _FLOAT_MAX
        return fits and value.bit_length() <= MAX_INT_BITS
    return hint is float and math.isfinite(value)


def _storable_text(value: str) -> bool:
    try:
        check_text(value)
    except ValueError:
        return False
    return True


def encode_checked(args: JobArgs) -> dict[str, Any]:
    """The JSON object of ``args``, checked to decode back into its class.

    :class:`ValidationError` (encoding) or :class:`ArgsDecodeError` (a value
    its field's type refuses) name the field.
    """
    # (A class is hashable; typeshed's Hashable refuses a dataclass whose instances are not.)
    plan = _plain_fields(type(args)) if isinstance(args, JobArgs) else None  # type: ignore[arg-type]
    if plan is not None:
        encoded = {}
        for name, hint, optional in plan:
            value = getattr(args, name)
            if not _plain_ok(hint, value, optional):
                break  # the general path names what is wrong
            encoded[name] = value
        else:
            return encoded
    encoded = encode_args(args)
    try:
        check_depth(encoded)
    except ValueError as exc:
        raise ValidationError(f"args of kind {args.kind!r}: {exc}") from None
    # ``encoded`` holds only JSON types, so it stands for the stored args.
    decode_args(type(args), encoded)
    return encoded


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def decode_args(cls: type[JobArgs], data: Any) -> JobArgs:
    """Rebuild ``cls`` from stored JSON; :class:`ArgsDecodeError` names kind and field."""
    if isinstance(data, UnreadableJSON):
        raise ArgsDecodeError(
            f"cannot decode args of kind {cls.kind!r}: the stored args cannot be read: {data.error}"
        )
    plan = _plain_fields(cls)  # type: ignore[arg-type]  # see encode_checked
    if plan is not None and isinstance(data, dict) and len(data) == len(plan):
        values = {}
        for name, hint, optional in plan:
            value = data.get(name, _MISSING)
            kind = type(value)
            # A number or bool of exactly its field's type (as JSON gives it, most
            # often): _plain_ok's check for that type alone, without the call.
            if kind is hint and (
                (kind is int and value.bit_length() <= MAX_INT_BITS)
                or (kind is float and math.isfinite(value))
                or kind is bool
            ):
                values[name] = value
                continue
            if value is _MISSING or not _plain_ok(hint, value, optional):
                break  # the general path names what is wrong
            values[name] = float(value) if hint is float and isinstance(value, int) else value
        else:
            return cls(**values)
    try:
        decoded: JobArgs = _decode_dataclass(cls, data, path="")
        return decoded
    except ArgsDecodeError as exc:
        raise ArgsDecodeError(f"cannot decode args of kind {cls.kind!r}: {exc}") from None


def _decode_dataclass(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ArgsDecodeError(f"{path or 'args'}: expected a JSON object, got {data!r}")
    try:
        hints, fields = _shape(cls)
    except Exception as exc:
        raise ArgsDecodeError(f"{path or 'args'}: cannot resolve type hints: {exc}") from exc
    kwargs: dict[str, Any] = {}
    names = set()
    for f in fields:
        names.add(f.name)
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ArgsDecodeError(f"field {where!r} is missing")
            continue
        kwargs[f.name] = _decode_value(hints.get(f.name, Any), data[f.name], where)
    extra = sorted(set(data) - names)
    if extra:
        raise ArgsDecodeError(f"unexpected field {(path + '.' if path else '') + extra[0]!r}")
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise ArgsDecodeError(f"{path or 'args'}: {exc}") from exc


@functools.lru_cache(maxsize=1024)
def _shape(cls: type) -> tuple[dict[str, Any], tuple[dataclasses.Field[Any], ...]]:
    """A dataclass's resolved type hints and init fields (resolved once per class)."""
    fields = tuple(f for f in dataclasses.fields(cls) if f.init)
    return typing.get_type_hints(cls), fields


def _decode_value(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _decode_value(option, value, where)
            except ArgsDecodeError as exc:
                errors.append(str(exc))
        raise ArgsDecodeError(errors[0] if errors else f"field {where!r}: no type fits {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ArgsDecodeError(
                f"field {where!r}: {value!r} is not one of {typing.get_args(hint)}"
            )
        return value
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple, set, frozenset):
        if not isinstance(value, list):
            raise ArgsDecodeError(f"field {where!r}: expected a list, got {value!r}")
        params = typing.get_args(hint)
        container = origin or hint
        if container is tuple and params and params[-1] is not Ellipsis:
            if len(params) != len(value):
                raise ArgsDecodeError(f"field {where!r}: expected {len(params)} items")
            return tuple(
                _decode_value(p, v, f"{where}[{i}]")
                for i, (p, v) in enumerate(zip(params, value, strict=True))
            )
        item_hint = params[0] if params else Any
        return container(_decode_value(item_hint, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ArgsDecodeError(f"field {where!r}: expected an object, got {value!r}")
        params = typing.get_args(hint)
        value_hint = params[1] if len(params) == 2 else Any
        return {k: _decode_value(value_hint, v, f"{where}.{k}") for k, v in value.items()}
    if origin is not None:
        return value  # other generics: passed through as stored
    if isinstance(hint, type):
        return _decode_scalar(hint, value, where)
    return value


def _decode_scalar(hint: type, value: Any, where: str) -> Any:
    def wrong(expected: str) -> ArgsDecodeError:
        return ArgsDecodeError(f"field {where!r}: expected {expected}, got {value!r}")

    try:
        if dataclasses.is_dataclass(hint):
            return _decode_dataclass(hint, value, where)
        if issubclass(hint, enum.Enum):
            return hint(value)
        if hint is bool:
            if not isinstance(value, bool):
                raise wrong("a boolean")
            return value
        if hint is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise wrong("an integer")
            return value
        if hint is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise wrong("a number")
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise wrong("a string")
            return value
        if hint is dt.datetime:
            if not isinstance(value, str):
                raise wrong("an ISO datetime string")
            return dt.datetime.fromisoformat(value)
        if hint is dt.date:
            if not isinstance(value, str):
                raise wrong("an ISO date string")
            return dt.date.fromisoformat(value)
        if hint is dt.time:
            if not isinstance(value, str):
                raise wrong("an ISO time string")
            return dt.time.fromisoformat(value)
        if hint is dt.timedelta:
            return dt.timedelta(seconds=value)
        if hint is decimal.Decimal:
            return decimal.Decimal(value)
        if hint is uuid.UUID:
            if not isinstance(value, str):
                raise wrong("a UUID string")
            return uuid.UUID(value)
    except ArgsDecodeError:
        raise
    except (
        TypeError,
        ValueError,
        AttributeError,
        OverflowError,
        decimal.InvalidOperation,
    ) as exc:
        raise ArgsDecodeError(f"field {where!r}: {exc}") from exc
    return value
