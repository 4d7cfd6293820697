"""System checks: awa.E0xx settings, awa.E1xx and awa.W1xx database, awa.E2xx declarations."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections

from . import conf, db
from .conf import awa_settings
from .exceptions import ConfigurationError
from .followups import CONTEXT_PARAMETERS, followup_registry, signature_fits
from .kinds import JobArgs, registry


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(
            message,
            hint="Fix AWA in your settings."
            if key == "AWA"
            else f"Fix AWA[{key!r}] in your settings.",
            id="awa.E001",
        )
        for key, message in conf.problems()
    ]


# Untagged on purpose: ``database``-tagged checks only run under ``check --database``.
@checks.register()
def check_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    alias = conf.raw_settings().get("DATABASE", conf.DEFAULTS["DATABASE"])
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        return []  # reported by check_settings
    problem = db.postgresql_problem(alias)
    if problem is not None:
        return [
            checks.Error(
                f"{problem}.",
                hint="Point AWA['DATABASE'] at a PostgreSQL database (django.db.backends."
                "postgresql, psycopg 3).",
                id="awa.E101",
            )
        ]
    return []


@checks.register(checks.Tags.database)
def check_connections(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """awa.W101: a worker running ``AWA["QUEUES"]`` would take the server near its limit.

    Connects, so it is a ``database`` check as Django's own are: it runs under
    ``manage.py check --database ALIAS`` and ``migrate``, for ``AWA["DATABASE"]``
    only, and says nothing when the database cannot be reached (``awa_worker``
    reports the same at start-up, for the queues it runs).
    """
    try:
        conf = awa_settings()
    except ConfigurationError:
        return []  # reported by check_settings
    alias = conf.database
    if not databases or alias not in databases or db.postgresql_problem(alias) is not None:
        return []
    queues = {name: queue.concurrency for name, queue in conf.queues.items()}
    need = db.connection_need(queues, alias, listener=conf.direct_database is not None)
    try:
        room = db.server_room(alias)
    except (DatabaseError, ConfigurationError):
        return []  # unreachable: not this check's to report
    finally:
        connections[alias].close()
    _, warning = db.connections_report(need, room)
    if warning is None:
        return []
    return [
        checks.Warning(
            f"{warning} (queues {', '.join(f'{n}={c}' for n, c in queues.items())}).",
            hint="See the README, 'Connections: Django's pool or PgBouncer'.",
            obj=alias,
            id="awa.W101",
        )
    ]


@checks.register()
def check_followups(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for spec in followup_registry.all:
        where = f"{spec.function.__module__}.{spec.function.__qualname__}"
        decorator = f"@on_{spec.outcome.value}"
        if not (isinstance(spec.trigger, type) and issubclass(spec.trigger, JobArgs)):
            errors.append(
                checks.Error(
                    f"{decorator}({spec.trigger!r}) on {where}: a follow-up must be declared "
                    f"for a JobArgs subclass.",
                    hint="Pass the trigger's JobArgs dataclass, e.g. @on_completed(ChargeCard).",
                    obj=where,
                    id="awa.E201",
                )
            )
        if not signature_fits(spec):
            expected = ", ".join(("args", "job", *CONTEXT_PARAMETERS[spec.outcome]))
            errors.append(
                checks.Error(
                    f"{decorator} function {where} does not accept the outcome's arguments "
                    f"({expected}).",
                    hint=f"Define it as def {spec.function.__name__}({expected}).",
                    obj=where,
                    id="awa.E202",
                )
            )
    return errors


@checks.register()
def check_timeouts(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """A kind's ``timeout`` longer than ``AWA["DEFAULT_DEADLINE"]``, its deadline."""
    if conf.problems():
        return []  # reported by check_settings; the settings cannot be read until fixed
    default = conf.awa_settings().default_deadline
    warnings: list[checks.CheckMessage] = []
    for kind, spec in sorted(registry.workers.items()):
        if spec.timeout is None or spec.deadline is not None or default is None:
            continue
        if spec.timeout > default:
            where = f"@awa.worker({spec.args_cls.__qualname__})"
            warnings.append(
                checks.Warning(
                    f"{where}: timeout ({spec.timeout:g}s) is longer than "
                    f"AWA['DEFAULT_DEADLINE'] ({default:g}s), the deadline of kind {kind!r}: "
                    f"maintenance rescues its attempts before they time out.",
                    hint="Give the kind a deadline= at least its timeout, or raise "
                    "AWA['DEFAULT_DEADLINE'].",
                    obj=where,
                    id="awa.W203",
                )
            )
    return warnings
