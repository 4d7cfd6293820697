"""``manage.py awa_worker``: run the queues' jobs until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections

from django_awa import db, reloader
from django_awa.conf import (
    DEFAULT_CONCURRENCY,
    MAX_CONCURRENCY,
    MAX_DURATION,
    QUEUE_NAME_RE,
    AwaSettings,
    awa_settings,
    invalid_queue_name,
)
from django_awa.db import database_alias
from django_awa.exceptions import ConfigurationError, WorkerFailed
from django_awa.logs import JobContextFilter
from django_awa.management.operator import usage
from django_awa.process import FAILED_EXIT, STOP_SIGNALS, Worker
from django_awa.state import DB_ERRORS

logger = logging.getLogger("django_awa.process")


def parse_queue(value: str) -> tuple[str, int | None]:
    name, sep, concurrency = value.partition("=")
    if not QUEUE_NAME_RE.match(name):
        raise usage(f"--queue {value!r}: {invalid_queue_name(name)}")
    if not sep:
        return name, None
    try:
        n = int(concurrency)
    except ValueError:
        raise usage(f"--queue {value!r}: concurrency must be a whole number") from None
    if not 1 <= n <= MAX_CONCURRENCY:
        raise usage(f"--queue {value!r}: concurrency must be 1 to {MAX_CONCURRENCY:,}")
    return name, n


def shutdown_timeout(value: str | float) -> float:
    """``--shutdown-timeout``: seconds, from 0 to ``MAX_DURATION``.

    The parser's ``type``: a bad value is a usage error (exit 2), as an
    unreadable number is. ``float`` alone takes ``nan`` (no wait at all: the
    in-flight jobs given back at once, the completer not waited for), ``inf``
    (a stuck handler holds the shutdown for ever) and negative values.
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 <= seconds <= MAX_DURATION:  # nan is neither
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_DURATION:,.0f} "
            f"({MAX_DURATION / 86400:.0f} days), got {value!r}"
        )
    return seconds


def check_migrations(alias: str) -> None:
    """Refuse to start on a database that lacks migrations of this code, naming them.

    Its statements would fail there on every poll, a table or a column missing,
    and the worker would run on logging them. Once, before ``--processes`` forks
    and before ``--reload`` starts its worker, on the main thread's connection,
    left open for the worker's own first read (``Worker.run``): one round trip
    more at start-up. Migrations applied there that this code does not have (a
    newer release's, while a rollout runs) are said and the worker starts: they
    are written to be applied under the release before's running workers
    (README, *Upgrading*). A database that cannot be read now (down, failing
    over) is not judged: the worker starts and rides the outage, as before.
    """
    try:
        missing, unknown = db.migrations_not_in_step(alias)
    except DB_ERRORS as exc:
        connections[alias].close()
        logger.warning(
            "could not read which django-awa migrations database %r has applied; "
            "starting without checking them: %s",
            alias,
            " ".join(str(exc).split()),
        )
        return
    if missing:
        command = "manage.py migrate django_awa"
        if alias != DEFAULT_DB_ALIAS:
            command += f" --database {alias}"
        raise CommandError(
            f"{db.not_migrated(alias, missing)}; run `{command}` before starting workers"
        )
    if unknown:
        logger.info(
            "database %r (%s) has django-awa migrations this worker does not know, a newer "
            "release's: %s; starting, as a release's migrations leave the one before working",
            alias,
            db.database_address(alias),
            ", ".join(unknown),
        )


class Command(BaseCommand):
    help = "Run django-awa jobs from AWA['QUEUES'] (or the --queue options) until stopped."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            action="append",
            default=[],
            metavar="NAME[=CONCURRENCY]",
            help="A queue to run (repeatable). Without =N: its AWA['QUEUES'] concurrency, or "
            f"{DEFAULT_CONCURRENCY}. Default: every queue in AWA['QUEUES'].",
        )
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            help="Worker processes to run (each runs every queue). Default 1.",
        )
        parser.add_argument(
            "--database", default=None, help="Database alias (default AWA['DATABASE'])."
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=shutdown_timeout,
            default=None,
            help="Seconds in-flight jobs get to finish after SIGTERM (default "
            "AWA['SHUTDOWN_TIMEOUT']).",
        )
        parser.add_argument(
            "--reload",
            action="store_true",
            help="For development: start the worker again when a Python file changes "
            "(in-flight jobs finish first), as runserver reloads.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf = awa_settings()
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        queues: dict[str, int] = {}
        for value in options["queue"]:
            name, n = parse_queue(value)
            configured = conf.queues.get(name)
            queues[name] = n or (configured.concurrency if configured else DEFAULT_CONCURRENCY)
        if not queues:
            queues = {name: q.concurrency for name, q in conf.queues.items()}
        processes = options["processes"]
        if processes < 1:
            raise usage("--processes must be at least 1")
        try:
            alias = database_alias(options["database"])
        except ConfigurationError as exc:
            raise usage(str(exc)) from exc
        if options["shutdown_timeout"] is not None:
            try:  # again: call_command's keyword options skip the parser
                timeout = shutdown_timeout(options["shutdown_timeout"])
            except argparse.ArgumentTypeError as exc:
                raise usage(f"--shutdown-timeout: {exc}") from None
            conf = dataclasses.replace(conf, shutdown_timeout=timeout)
        _configure_logging(options["verbosity"])
        check_migrations(alias)
        if options["reload"]:
            self._reload(processes, queues, alias, conf)
            return
        freeze_startup_objects()
        if processes == 1:
            with _failure_exits():
                Worker(queues, alias=alias, conf=conf).run()
            return
        self._run_processes(processes, queues, alias, conf)

    def _reload(
        self, processes: int, queues: dict[str, int], alias: str, conf: AwaSettings
    ) -> None:
        """``--reload``: this process watches and restarts the worker; or, in the
        process it started, the worker that stops when a file changes."""
        if processes != 1:
            raise usage("--reload runs one worker process: leave out --processes")
        if not reloader.is_child():
            if "awa_worker" not in sys.argv:
                raise CommandError(
                    "--reload starts this command line again: run it as "
                    "`manage.py awa_worker --reload`, not through call_command()"
                )
            connections.close_all()
            sys.exit(reloader.run_with_reloader())
        freeze_startup_objects()
        # Only the watcher signals this process (a session of its own), SIGQUIT for
        # "now": a Ctrl-C while it stops for a changed file is the first signal.
        worker = Worker(queues, alias=alias, conf=conf, repeat_halts=False)
        changed = reloader.start_watching(worker.stopping)
        with _failure_exits():
            worker.run()
        if changed.is_set():
            sys.exit(reloader.RELOAD)

    def _run_processes(
        self, processes: int, queues: dict[str, int], alias: str, conf: AwaSettings
    ) -> None:
        # Fork before any thread or connection exists in this process.
        connections.close_all()
        context = multiprocessing.get_context("fork")
        children: list[multiprocessing.process.BaseProcess] = [
            context.Process(
                target=_child, args=(queues, alias, conf, processes), name=f"awa-worker-{i}"
            )
            for i in range(processes)
        ]
        for child in children:
            child.start()
        logger.info(
            "awa worker supervisor pid=%s started %s processes: %s",
            os.getpid(),
            processes,
            ", ".join(str(c.pid) for c in children),
        )

        # The handlers only queue the signal (a reentrant put); this thread acts.
        received: queue.SimpleQueue[int] = queue.SimpleQueue()
        for handled in STOP_SIGNALS:
            signal.signal(handled, lambda signum, _frame: received.put(signum))
        count = 0
        started = dict.fromkeys(range(processes), time.monotonic())
        while True:
            if not count:
                _replace_dead(children, started, context, (queues, alias, conf, processes))
            if not any(child.is_alive() for child in children):
                break
            try:
                signum = received.get(timeout=0.2)
            except queue.Empty:
                continue
            count += 1
            _forward(signal.Signals(signum), children, now=signum == signal.SIGQUIT or count > 1)
        for child in children:
            child.join()
        failed = [c for c in children if c.exitcode not in (0, None)]
        if failed:
            sys.exit(1)


# A child that died is started again no sooner than this after the one before
# it started: a child that cannot start (its database gone) is not forked in a loop.
RESTART_AFTER = 1.0


def _replace_dead(
    children: list[multiprocessing.process.BaseProcess],
    started: dict[int, float],
    context: Any,
    args: tuple[Any, ...],
) -> None:
    """Start a new child in the place of each killed by a signal no one forwarded, or
    stopped by a failed thread of its own (``FAILED_EXIT``).

    A child killed (SIGKILL, the OOM killer) took its share of the queues'
    capacity with it, unseen: the supervisor ran on with fewer processes. Its
    jobs are rescued at ``STALE_AFTER`` as any dead worker's. A child that
    exited by itself otherwise (an error at start-up) is not started again:
    once none is left the supervisor exits, non-zero, as before.
    """
    for i, child in enumerate(children):
        code = child.exitcode
        if child.is_alive() or code is None or (code >= 0 and code != FAILED_EXIT):
            continue
        if time.monotonic() - started[i] < RESTART_AFTER:
            continue
        child.join()
        replacement = context.Process(target=_child, args=args, name=f"awa-worker-{i}")
        replacement.start()
        children[i] = replacement
        started[i] = time.monotonic()
        logger.error(
            "supervisor: worker process %s exited (code %s) without being asked to stop; "
            "started %s in its place",
            child.pid,
            child.exitcode,
            replacement.pid,
        )


def _forward(
    received: signal.Signals,
    children: Sequence[multiprocessing.process.BaseProcess],
    *,
    now: bool,
) -> None:
    """Pass a signal on to the children: SIGTERM to finish what they run, SIGQUIT for now.

    A child may get the same signal straight from the terminal or the service
    manager too, so it takes only SIGQUIT as "now" (``repeat_halts=False``).
    """
    logger.info(
        "supervisor: %s received; %s",
        received.name,
        "children give back in-flight jobs now" if now else "children finish in-flight jobs",
    )
    for child in children:
        if child.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGQUIT if now else signal.SIGTERM)


def _child(queues: dict[str, int], alias: str, conf: AwaSettings, processes: int) -> None:
    # A child started in a dead one's place was forked after the supervisor's own
    # handlers were set: the worker takes the signals, as in the first children.
    for handled in STOP_SIGNALS:
        signal.signal(handled, signal.SIG_DFL)
    worker = Worker(queues, alias=alias, conf=conf, repeat_halts=False, processes=processes)
    parent = os.getppid()

    def orphan_watch() -> None:
        # The supervisor died without forwarding a signal (SIGKILL, OOM):
        # drain and exit rather than run on unsupervised.
        while not worker.stopping.wait(1.0):
            if os.getppid() != parent:
                logger.warning("supervisor %s is gone; stopping", parent)
                worker.stop()

    threading.Thread(target=orphan_watch, name="awa-orphan-watch", daemon=True).start()
    try:
        worker.run()
    except WorkerFailed:
        sys.exit(FAILED_EXIT)  # the worker logged why; the supervisor starts another


@contextlib.contextmanager
def _failure_exits() -> Iterator[None]:
    """A worker that stopped on a failed thread of its own (``WorkerFailed``, logged
    with its traceback) ends the command with status ``FAILED_EXIT``, so an init
    system restarts it."""
    try:
        yield
    except WorkerFailed as exc:
        raise CommandError(str(exc), returncode=FAILED_EXIT) from exc


def freeze_startup_objects() -> None:
    """Keep what Django's start-up made out of every later garbage collection.

    A worker allocates several objects per job (its row's ``Job``, the
    attempt, the result), and those held across a young collection (the
    prefetched jobs in the inbox, a batch in the completer) age into the
    oldest generation, whose collection then walks every object of the
    process: Django's settings, models, URL patterns and imported modules,
    some seventy thousand objects, each time. In a no-op drain of 60,000 jobs
    those collections took about a tenth of the worker's CPU. ``gc.freeze()``
    moves the objects alive now to a permanent generation that collections
    skip (they are long-lived by nature). The forked ``--processes``
    children inherit them frozen.

    Garbage among the young objects is collected first, not all of it: a
    full collection walks those seventy thousand objects once more, 25 ms of
    every worker's start-up, and finds next to nothing the collections
    during start-up did not (11 objects in the example project, none in the
    benchmark's); what it would have found stays, frozen.
    """
    gc.collect(1)
    gc.freeze()


def _configure_logging(verbosity: int) -> None:
    """Log to stderr unless the project configured django_awa's loggers itself."""
    root = logging.getLogger("django_awa")
    if root.handlers or logging.getLogger().handlers:
        if root.level == logging.NOTSET:
            root.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)
        return
    handler = logging.StreamHandler()
    handler.addFilter(JobContextFilter())
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s [%(processName)s %(name)s] %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)
    if verbosity < 2:
        # One line per job is too much at full speed: outcomes at -v 2.
        logging.getLogger("django_awa.finalize").setLevel(logging.WARNING)
