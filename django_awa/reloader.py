"""``awa_worker --reload``: the worker started again whenever a Python file changes.

For development, as ``runserver`` reloads. The command's process becomes a
watcher that runs no jobs: it starts the worker as a child (the same command
line, in a session of its own, so a Ctrl-C in the terminal reaches only the
watcher, which passes it on) and starts it again when it exits with
``RELOAD``. The child watches the files of every module it imported, with
Django's ``StatReloader``; when one changes, it stops as at SIGTERM (in-flight
jobs finish, up to ``SHUTDOWN_TIMEOUT``; prefetched ones go back, their
attempt unused) and exits with ``RELOAD``. A file saved after the watcher
started it counts as changed, even if saved while it was still importing the
project, before its first look at the files.

A child that exits otherwise (an import error at start-up, say: a file saved
half-written) is started again once a Python file of the project changes or
appears: the developer's fix. The watcher imported the project when it started,
so besides its own modules' files it looks at every ``.py`` file in the
project's directories (the project's roots on ``sys.path`` among them): the
broken module can be one added since, in an app added to ``INSTALLED_APPS``
since, or one not written yet that a module imports. The watcher itself starts
even when an app's ``jobs.py`` or ``followups.py`` raises at import (``AwaConfig``
lets it through, as Django lets ``runserver``'s own process start): the worker
it starts meets the error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.apps import apps
from django.utils import autoreload

from .process import STOP_SIGNALS

logger = logging.getLogger(__name__)

# Set in the child's environment: the worker itself, not the watcher. Its value is
# the time the watcher started it.
CHILD_ENV = "AWA_WORKER_RELOAD_CHILD"
# The child's exit status when a file changed: start it again.
RELOAD = 3


# In the child: when the watcher started it.
_started: float | None = None


def is_child() -> bool:
    """Whether this process is the worker a watcher started (the mark is then taken
    out of the environment: the handlers' own subprocesses do not inherit it)."""
    global _started
    mark = os.environ.pop(CHILD_ENV, None)
    if mark is None:
        return False
    with contextlib.suppress(ValueError):
        _started = float(mark)
    return True


def is_watcher() -> bool:
    """Whether this process is to be an ``awa_worker --reload`` watcher: its command
    line is that command's, and no watcher started it."""
    return (
        CHILD_ENV not in os.environ
        and len(sys.argv) > 2
        and sys.argv[1] == "awa_worker"
        and "--reload" in sys.argv[2:]
    )


def watch(
    on_change: Callable[[Path], None], stopped: Callable[[], bool], since: float | None = None
) -> None:
    """Call ``on_change(path)`` for the first file of a loaded module that changes,
    checking once a second, until ``stopped()``.

    With ``since``, a file saved after that time and before the first check counts
    as changed too: its module may have been imported before the save.
    """
    reloader = autoreload.StatReloader()
    changed: list[Path] = []

    def receiver(sender: Any, file_path: Path, **kwargs: Any) -> bool:
        changed.append(file_path)
        return True  # handled: Django's own reload (sys.exit) is not triggered

    autoreload.file_changed.connect(receiver, sender=reloader, weak=False)
    try:
        ticker = reloader.tick()
        next(ticker)  # its first pass records the files' times
        if since is not None:
            # The first pass takes the times files have now: one saved between
            # its module's import and that pass (a project takes seconds to
            # start) would run on its old code until saved again. A time ahead
            # of this clock (a skewed mount) would restart every worker at once.
            now = time.time()
            changed.extend(p for p, mtime in reloader.snapshot_files() if since < mtime <= now)
        while not changed and not stopped():
            next(ticker)
    finally:
        autoreload.file_changed.disconnect(receiver, sender=reloader)
    if changed and not stopped():
        on_change(Path(changed[0]))


def start_watching(stopping: threading.Event) -> threading.Event:
    """In the child: a thread that stops this process as SIGTERM does once a file
    changes (the worker finishes its in-flight jobs), or once the watcher is gone.

    Returns an event set when it was a file: the child then exits with ``RELOAD``.
    ``stopping`` is set once the process stops for another reason.
    """
    parent = os.getppid()
    reload = threading.Event()

    def changed(path: Path) -> None:
        logger.info("%s changed: finishing in-flight jobs, then starting again", path)
        reload.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def orphaned() -> bool:
        if os.getppid() == parent:
            return False
        logger.warning("the --reload watcher %s is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    threading.Thread(
        target=watch,
        args=(changed, lambda: stopping.is_set() or orphaned(), _started),
        name="awa-reload",
        daemon=True,
    ).start()
    return reload


def run_with_reloader() -> int:
    """In the watcher: run the worker child, start it again after each ``RELOAD``, and
    return its exit status once it stops for a signal this process passed on.

    The first SIGTERM, SIGINT or SIGHUP is passed on as SIGTERM (finish in-flight jobs);
    SIGQUIT, or a second signal, as SIGQUIT (give them back now). A child that
    exits by itself otherwise is started again once a file changes.
    """
    received: queue.SimpleQueue[int] = queue.SimpleQueue()
    for handled in STOP_SIGNALS:
        signal.signal(handled, lambda signum, _frame: received.put(signum))
    arguments = autoreload.get_child_arguments()
    logger.info("awa_worker --reload: the worker starts again when a Python file changes")
    while True:
        environment = {**os.environ, CHILD_ENV: repr(time.time())}
        # The command line this process was started with (Django's, as runserver's).
        child = subprocess.Popen(arguments, env=environment, start_new_session=True)  # noqa: S603
        signals = 0
        while (status := child.poll()) is None:
            with contextlib.suppress(queue.Empty):
                signum = received.get(timeout=0.2)
                signals += 1
                now = signum == signal.SIGQUIT or signals > 1
                child.send_signal(signal.SIGQUIT if now else signal.SIGTERM)
        if signals:
            # Stopping for a changed file when the signal came: it stopped cleanly.
            return 0 if status == RELOAD else status
        if status == RELOAD:
            continue
        logger.error(
            "the worker exited with status %s; it starts again when a Python file changes",
            status,
        )
        changed = _wait_for_change(received)
        if changed is None:
            return status
        logger.info("%s changed: starting the worker again", changed)


def _wait_for_change(received: queue.SimpleQueue[int]) -> Path | None:
    """Wait until a Python file of the project changes or appears (its path) or a
    signal comes (None).

    Besides this process's own modules, every ``.py`` file in the project's
    directories (its apps', its other modules', and the project's roots on
    ``sys.path``, subdirectories included) counts: the child may have imported
    modules the developer added since this process started, an app added to
    ``INSTALLED_APPS`` among them, and its failure can be in one of them, or be
    the import of one not written yet.
    """
    tree = _Tree(_project_directories())
    seen = tree.snapshot()
    while True:
        with contextlib.suppress(queue.Empty):
            received.get(timeout=autoreload.StatReloader.SLEEP_TIME)
            return None
        for path, mtime in tree.snapshot().items():
            if path not in seen or mtime > seen[path]:
                return path


# Directories below a project root that hold no code of the project.
_NOT_PROJECT = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
# Seconds: the coarsest modification times a file system keeps (FAT's are 2 s).
_COARSEST_MTIME = 2.0


def _installed() -> list[Path]:
    """The interpreter's and the installed packages' directories."""
    return [
        Path(p).resolve() for p in {sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()}
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Listing:
    """What one directory held when it was last listed."""

    mtime_ns: int  # the directory's own
    # Listed within a second or two of its last change: a file added in the same
    # tick of a coarse file system clock would leave its time as it was.
    recent: bool
    files: tuple[Path, ...]  # its .py files
    subdirectories: tuple[Path, ...]  # those a walk goes into


class _Tree:
    """The ``.py`` files of ``directories`` (with their subdirectories when marked
    so) and their modification times, looked at again and again.

    A walk leaves out hidden directories, virtualenvs and installed packages: a
    project's ``.venv`` is not its code. A directory's own modification time
    changes when a file or directory is added to it, removed or renamed, and
    only then: each look stats every directory and every ``.py`` file, and lists
    again only the directories whose time changed, so a large tree of data on
    ``sys.path`` costs a stat per directory, not a listing of all its files.
    """

    def __init__(self, directories: set[tuple[Path, bool]]) -> None:
        self.directories = directories
        self.installed = _installed()
        self.listings: dict[Path, _Listing] = {}

    def snapshot(self) -> dict[Path, float]:
        times: dict[Path, float] = {}
        listings: dict[Path, _Listing] = {}
        for top, recursive in self.directories:
            pending = [top]
            while pending:
                directory = pending.pop()
                listing = self._listing(directory, walked=recursive and directory != top)
                if listing is None:
                    continue
                listings[directory] = listing
                for path in listing.files:
                    with contextlib.suppress(OSError):  # removed while looked at
                        times[path] = path.stat().st_mtime
                if recursive:
                    pending.extend(listing.subdirectories)
        self.listings = listings  # a directory removed since is forgotten
        return times

    def _listing(self, directory: Path, *, walked: bool) -> _Listing | None:
        """The directory's listing, from the last look while its time is the same;
        None when it is gone, or is a virtualenv a walk reached."""
        try:
            mtime_ns = directory.stat().st_mtime_ns
        except OSError:
            return None
        known = self.listings.get(directory)
        if known is not None and known.mtime_ns == mtime_ns and not known.recent:
            return known
        files: list[Path] = []
        subdirectories: list[Path] = []
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name == "pyvenv.cfg" and walked:
                        return None
                    if entry.is_dir():
                        # As os.walk: a symbolic link to a directory is not followed.
                        if not entry.is_symlink() and self._walks_into(directory, entry.name):
                            subdirectories.append(Path(entry.path))
                    elif entry.name.endswith(".py"):
                        files.append(Path(entry.path))
        except OSError:
            return None
        return _Listing(
            mtime_ns=mtime_ns,
            recent=time.time() - mtime_ns / 1e9 < _COARSEST_MTIME,
            files=tuple(files),
            subdirectories=tuple(subdirectories),
        )

    def _walks_into(self, directory: Path, name: str) -> bool:
        return (
            not name.startswith(".")
            and name not in _NOT_PROJECT
            and (directory / name).resolve() not in self.installed
        )


def _project_directories() -> set[tuple[Path, bool]]:
    """The directories to look in for the project's Python files, each marked
    whether its subdirectories count too: its apps', the project's roots on
    ``sys.path`` (where ``startapp`` puts a new app) and its other modules',
    outside the interpreter's and the installed packages' directories."""
    installed = _installed()

    def ours(path: Path) -> bool:
        return not any(path.is_relative_to(root) for root in installed)

    directories = {
        (path, True) for app in apps.get_app_configs() if ours(path := Path(app.path).resolve())
    }
    modules = {file.parent for file in autoreload.iter_all_python_module_files() if ours(file)}
    found = {path for path, _ in directories} | modules
    # A root of the project holds one of its apps or modules: not every sys.path
    # entry (a home directory, say) is worth walking.
    directories.update(
        (root, True)
        for entry in sys.path
        if (root := Path(entry or os.curdir).resolve()).is_dir()
        and ours(root)
        and any(path.is_relative_to(root) for path in found)
    )
    walked = [path for path, _ in directories]
    directories.update((directory, False) for directory in modules)
    # Each file looked at once a second, not once per directory that holds it: a
    # directory a walk reaches (an app in the project's root) adds nothing.
    return {
        (path, recursive)
        for path, recursive in directories
        if not any(_reaches(root, path) for root in walked if (root, recursive) != (path, True))
    }


def _reaches(root: Path, path: Path) -> bool:
    """Whether ``_Tree``'s walk of ``root`` goes through ``path``."""
    if not path.is_relative_to(root):
        return False
    return not any(
        part.startswith(".") or part in _NOT_PROJECT for part in path.relative_to(root).parts
    )
