"""CPU time of a drain: the worker processes, the PostgreSQL backends, a broker.

Orchestrator side. Every figure is user + system time from ``/proc/<pid>/stat``
(clock ticks, ``SC_CLK_TCK``), so it needs Linux and PostgreSQL on this machine
(the benchmark only ever talks to 127.0.0.1).

- **worker**: each worker process and all its descendants (psutil), each
  counted as its own time plus the time of the children it has reaped
  (``cutime + cstime``), so a pool child that exits and is reaped during the
  window is still counted, through its parent.
- **database**: the backends of the run's database, the pids
  ``pg_stat_activity`` lists for its ``datname``, less the orchestrator's own
  (it only counts rows). Each is read at every sample; one first seen after
  the first sample started within the window and counts from zero; one that
  goes away keeps the time of its last sample (a backend exiting in the
  window loses at most one sampling interval, 50 ms). Shared background
  processes (WAL writer, checkpointer, background writer) are not counted:
  they work for every database of the server, and the machine is shared. The
  postmaster's cumulative children time was not used for the same reason: it
  counts every database's exited backends and nothing of the live ones.
- **broker**: any other pids the adapter names (Celery: redis-server).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    return raw[raw.rfind(")") + 2 :].split()


def own_seconds(pid: int) -> float | None:
    """utime + stime of one process, in seconds (None once it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # After ")": state is index 0, so utime (field 14) is 11, stime 12.
    return (int(fields[11]) + int(fields[12])) / TICK


def with_reaped_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime: the process and the children it reaped."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK


def tree_seconds(pids: list[int]) -> float:
    """CPU of the given processes and every live descendant, reaped children included."""
    import psutil

    seen: set[int] = set()
    total = 0.0
    for pid in pids:
        family = [pid]
        with contextlib.suppress(psutil.Error):
            family += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        for member in family:
            if member in seen:
                continue
            seen.add(member)
            value = with_reaped_seconds(member)
            if value is not None:
                total += value
    return total


BACKENDS_SQL = """
SELECT array(
    SELECT pid FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
), (SELECT sessions FROM pg_stat_database WHERE datname = current_database())
"""


@dataclass
class Sample:
    worker: float
    database: float
    broker: float
    done: int
    at: float  # time.perf_counter()
    sessions: int  # connections ever made to the database (pg_stat_database)


class CpuMeter:
    """Cumulative CPU seconds of one system's workers, backends and broker."""

    def __init__(self, system) -> None:
        self.system = system
        self._first = True
        self._base: dict[int, float] = {}
        self._last: dict[int, float] = {}

    def _database(self) -> tuple[float, int]:
        pids, sessions = self.system.connection().execute(BACKENDS_SQL).fetchone()
        for pid in pids:
            value = own_seconds(pid)
            if value is None:
                continue
            if pid not in self._base:
                # Present at the first sample: count from now. Seen later: it
                # connected within the window, so all its time counts.
                self._base[pid] = value if self._first else 0.0
            self._last[pid] = value
        self._first = False
        return sum(self._last[pid] - self._base[pid] for pid in self._last), int(sessions or 0)

    def sample(self, done: int) -> Sample:
        group = self.system.workers
        worker = tree_seconds(group.pids()) if group is not None else 0.0
        broker = sum(own_seconds(pid) or 0.0 for pid in self.system.broker_pids())
        database, sessions = self._database()
        return Sample(worker, database, broker, done, time.perf_counter(), sessions)


def per_job(first: Sample, last: Sample) -> dict[str, float] | None:
    """Between two samples: jobs finished a second, CPU ms per job, and cores kept busy.

    None if no job finished between them.
    """
    jobs = last.done - first.done
    wall = last.at - first.at
    if jobs <= 0 or wall <= 0:
        return None
    # Connections opened in the window: one per job means backends came and
    # went between samples, and their CPU is mostly not counted.
    out: dict[str, float] = {
        "jobs": jobs,
        "seconds": wall,
        "jobs_per_s": jobs / wall,
        "sessions": last.sessions - first.sessions,
    }
    for part in ("worker", "database", "broker"):
        used = getattr(last, part) - getattr(first, part)
        out[f"{part}_ms"] = used * 1000 / jobs
        out[f"{part}_cores"] = used / wall
    return out
