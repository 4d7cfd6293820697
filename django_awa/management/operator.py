"""What the operator commands (``awa_jobs``, ``awa_queues``, ``awa_schedules``) share.

Exit codes, the same for every command, for scripts:

- ``0``: done; what was asked for exists.
- ``1``: nothing matched, a named job or schedule does not exist, or an
  operation was refused for some of them (the message says which).
- ``2``: usage error: an unknown subcommand or option, a bad value, or a
  command that names nothing to act on.

Output is a table for people, or JSON with ``--json`` (one document on stdout).
The subcommands of ``awa_jobs`` and ``awa_queues`` take ``--database ALIAS`` for
jobs kept in another database than ``AWA["DATABASE"]`` (``using=ALIAS``);
periodic schedules fire in ``AWA["DATABASE"]`` only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_awa import db
from django_awa.db import database_alias
from django_awa.exceptions import ConfigurationError

OK = 0
NOTHING_MATCHED = 1
USAGE = 2

# Django's create_parser adds --skip-checks (when the command runs system checks)
# with parser.add_argument, not add_base_argument, where the others are seen.
_SKIP_CHECKS = (("--skip-checks",), {"action": "store_true", "help": "Skip system checks."})

# The widest a table cell gets before it is cut with an ellipsis.
CELL_WIDTH = 60


class _OperatorParser(CommandParser):
    """A parser whose usage errors exit (or raise) with status 2, also under ``call_command``."""

    def error(self, message: str) -> NoReturn:
        if self.called_from_command_line:
            super().error(message)  # argparse: usage on stderr, exit 2
        raise CommandError(f"Error: {message}", returncode=USAGE)


class _SubcommandParser(_OperatorParser):
    """A subcommand's parser: each takes ``--database``, as ``awa_worker`` does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--database",
            metavar="ALIAS",
            help="the database alias holding the jobs (default AWA['DATABASE'])",
        )


class OperatorCommand(BaseCommand):
    """A command with subcommands, ``--json``, ``--database``, and the exit codes above."""

    # Django's own options as create_parser adds them (add_base_argument's arguments),
    # and what add_subparsers returned in subcommands(), whose ``choices`` are the
    # subcommands' parsers: each subcommand takes those options too.
    _django_options: list[tuple[tuple[str, ...], dict[str, Any]]]
    _subcommands: Any

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        self._django_options = []
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # After add_arguments: the parser's own errors (a missing subcommand) raise too.
        parser.__class__ = _OperatorParser
        self._share_django_options()
        return parser

    def add_base_argument(self, parser: CommandParser, *args: Any, **kwargs: Any) -> None:
        super().add_base_argument(parser, *args, **kwargs)
        if "--version" not in args:  # it exits at once: before the subcommand only
            self._django_options.append((args, kwargs))

    def _share_django_options(self) -> None:
        """Let each subcommand take Django's own options (``-v 2``, ``--traceback``,
        ``--settings``...) after its name too, as ``manage.py awa_jobs retry --state
        failed -v 2``, where argparse hands everything after the name to the subparser.

        Each is added again to every subcommand, as Django added it but defaulting to
        nothing (``SUPPRESS``), so an option given before the subcommand, or its
        default, stands unless the subcommand's copy is given.
        """
        shared = list(self._django_options)
        if self.requires_system_checks and not any("--skip-checks" in a for a, _ in shared):
            shared.append(_SKIP_CHECKS)
        for choice in self._subcommands.choices.values():
            for args, kwargs in shared:
                super().add_base_argument(choice, *args, **{**kwargs, "default": argparse.SUPPRESS})

    def subcommands(self, parser: CommandParser, *, database: bool = True) -> Any:
        """The subcommands' action group: each subparser raises usage errors as ours do,
        takes Django's own options, and ``--database`` unless ``database`` is false."""
        self._subcommands = parser.add_subparsers(
            dest="action",
            required=True,
            metavar="ACTION",
            parser_class=_SubcommandParser if database else _OperatorParser,
        )
        return self._subcommands

    def database(self, options: dict[str, Any]) -> str:
        """The alias ``--database`` names (``AWA["DATABASE"]`` without it); a usage error
        for one that is not a PostgreSQL entry of ``DATABASES``."""
        try:
            alias = database_alias(options.get("database"))
        except ConfigurationError as exc:
            raise usage(str(exc)) from exc
        require_migrations(alias)
        return alias

    def add_json(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def emit(self, options: dict[str, Any], document: Any, text: str) -> None:
        """Write ``document`` as JSON with ``--json``, else ``text``."""
        if options.get("json"):
            self.stdout.write(json.dumps(document, default=_json_default, indent=2))
        elif text:
            self.stdout.write(text)


def require_migrations(alias: str) -> None:
    """Refuse, naming them, to act on a database that lacks django-awa's migrations of
    this code, as a worker refuses to start there: each statement would fail on a
    missing table or column, a traceback that says nothing of why. Migrations applied
    there that this code does not have (a newer release's, during a rollout) are fine."""
    missing, _ = db.migrations_not_in_step(alias)
    if missing:
        raise CommandError(
            f"{db.not_migrated(alias, missing)}; run `manage.py migrate django_awa` first"
        )


def usage(message: str) -> CommandError:
    return CommandError(message, returncode=USAGE)


def nothing(message: str) -> CommandError:
    return CommandError(message, returncode=NOTHING_MATCHED)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def cell(value: Any) -> str:
    """A value as a table cell: times to the second, long text cut, None as '-'."""
    if value is None:
        text = "-"
    elif isinstance(value, datetime):
        text = value.strftime("%Y-%m-%d %H:%M:%S")
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = " ".join(str(value).split())
    return text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as aligned columns under their headers (numbers to the right)."""
    cells = [[cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int) and not isinstance(row[i], bool) for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if numeric[i] else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])
