"""A client workload that keeps, outside the cluster, a ledger of what it saw succeed.

Used by ``stress/ha.py`` and ``stress/hosts.py``, in a process where Django is
set up on the job database (``DATABASE_URL``). Three threads:

* the enqueuer enqueues ``Act`` jobs (every tenth a ``Parked`` one, and every
  tenth, offset by five, a workflow of two ``Act`` steps, the second after the
  first), each with a unique tag and ``awa.Unique()``. When an enqueue raises a database
  error it does not know whether the commit landed (an *ambiguous commit*:
  the connection died between the server's commit and its answer), so it
  enqueues the same job again until it succeeds or gets ``UniqueConflict``,
  which says the first try did commit: never a duplicate, never a loss;
* the answerer completes parked jobs' callbacks (``awa.complete_external``),
  retrying the same callback after a database error; ``CallbackNotFound``
  after an error says the first try committed;
* the watcher notes the jobs it sees ``completed``.

Each job carries a unique tag (``Act.tag``; for ``Parked``, its callback
timeout): the ledger and the check name jobs by it.

Each success is a line of the ledger file (JSON), written and flushed
after the client got its answer. ``check(cursor)`` then compares the ledger
with what the (new) primary holds: an enqueue, a callback or a completion
the client saw succeed and the database no longer has is a lost
acknowledged write.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RETRY_FOR = 120.0  # seconds an enqueue or callback is retried before giving up
PARKED_TIMEOUT = 3600  # seconds; plus the job's number, unique

# A job's tag in SQL: Act's ``tag``, or for Parked its unique timeout.
WAITING = """
SELECT id, callback_id, coalesce(args ->> 'tag', 'timeout:' || (args ->> 'timeout'))
FROM awa_job WHERE kind = 'parked' AND state = 'waiting_external' LIMIT 50
"""
COMPLETED = """
SELECT id, coalesce(args ->> 'tag', 'timeout:' || (args ->> 'timeout'))
FROM awa_job WHERE id = ANY(%s) AND state = 'completed'
"""
STATES_BY_TAG = """
SELECT t.tag, j.state FROM awa_job AS j,
     LATERAL (SELECT coalesce(j.args ->> 'tag', 'timeout:' || (j.args ->> 'timeout')) AS tag) t
WHERE j.kind IN ('act', 'parked') AND t.tag = ANY(%s)
"""
DUPLICATED_TAGS = """
SELECT t.tag FROM awa_job AS j,
     LATERAL (SELECT coalesce(j.args ->> 'tag', 'timeout:' || (j.args ->> 'timeout')) AS tag) t
WHERE j.kind IN ('act', 'parked') AND t.tag <> ''
GROUP BY 1 HAVING count(*) > 1
"""


class Ledger:
    """A JSON-lines file of acknowledged writes, outside the database under test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            self._file.flush()
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def close(self) -> None:
        self._file.close()


class Workload:
    """The client threads; ``start()``, ``stop()``, then ``check()`` against the primary."""

    def __init__(self, ledger: Ledger, *, rate: float = 50.0, seconds: float = 0.02) -> None:
        self.ledger = ledger
        self.rate = rate  # enqueues per second, at most
        self.seconds = seconds  # each Act job's handler sleeps this long
        self.stop_event = threading.Event()
        self.stop_enqueuing = threading.Event()  # the answerer and watcher go on
        self.threads: list[threading.Thread] = []
        self.counts = {
            "enqueued": 0,
            "enqueue_errors": 0,
            "ambiguous_enqueues": 0,
            "callbacks": 0,
            "callback_errors": 0,
            "ambiguous_callbacks": 0,
            "gave_up": 0,
            "workflows": 0,
        }
        # (first error, first success after it), wall clock, of each enqueue outage.
        self.outages: list[tuple[float, float]] = []
        self._ids: list[int] = []
        self._workflow_ids: list[int] = []  # the workflows' steps, for their audit
        self._completed: set[int] = set()
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    @property
    def ids(self) -> list[int]:
        with self._lock:
            return list(self._ids)

    @property
    def workflow_ids(self) -> list[int]:
        with self._lock:
            return list(self._workflow_ids)

    def start(self) -> None:
        for target in (self._enqueuer, self._answerer, self._watcher):
            thread = threading.Thread(target=self._thread(target), name=target.__name__)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stop_enqueuing.set()
        self.stop_event.set()
        for thread in self.threads:
            thread.join(RETRY_FOR + 30)

    def _thread(self, target: Any) -> Any:
        def run() -> None:
            from django.db import connections

            try:
                target()
            finally:
                connections.close_all()

        return run

    # -- the enqueuer ----------------------------------------------------------------

    def _enqueuer(self) -> None:
        import django_awa as awa
        from tests.testapp.jobs import Act, Parked

        n = 0
        while not (self.stop_event.is_set() or self.stop_enqueuing.is_set()):
            n += 1
            if n % 10 == 0:
                # Parked has no tag field: its callback timeout (never reached) is the key.
                timeout = float(PARKED_TIMEOUT + n)
                args: Any = Parked(timeout=timeout)
                tag = f"timeout:{timeout!r}"
                self._enqueue(awa, args, tag)
            elif n % 10 == 5:
                self._enqueue_workflow(awa, Act, n)
            else:
                tag = f"{time.time_ns()}-{n}"
                self._enqueue(awa, Act("sleep", self.seconds, tag), tag)
            self.stop_event.wait(1.0 / self.rate)

    def _enqueue(self, awa: Any, args: Any, tag: str) -> None:
        def insert() -> list[tuple[int, str]]:
            job = awa.enqueue(args, unique=awa.Unique())
            return [(job.id, job.kind)]

        self._insert(awa, [tag], insert)

    def _enqueue_workflow(self, awa: Any, act: Any, n: int) -> None:
        """Two ``Act`` steps in one workflow, the second after the first, in one transaction."""
        from django.db import transaction

        stamp = time.time_ns()
        tags = [f"{stamp}-{n}-first", f"{stamp}-{n}-then"]

        def insert() -> list[tuple[int, str]]:
            flow = awa.Workflow(f"ha-{n}")
            first = flow.add(
                awa.EnqueueRequest(act("sleep", self.seconds, tags[0]), unique=awa.Unique())
            )
            flow.add(
                awa.EnqueueRequest(act("sleep", self.seconds, tags[1]), unique=awa.Unique()),
                after=[first],
            )
            with transaction.atomic():
                return [(job.id, job.kind) for job in flow.enqueue()]

        if self._insert(awa, tags, insert):
            self.counts["workflows"] += 1

    def _insert(
        self, awa: Any, tags: list[str], insert: Callable[[], list[tuple[int, str]]]
    ) -> bool:
        """Run ``insert`` (the jobs tagged ``tags``, in one transaction) until it is known to
        have committed; ledger what it wrote. False: it gave up."""
        from django_awa import db

        failed_at: float | None = None
        deadline = time.monotonic() + RETRY_FOR
        delay = 0.05
        while time.monotonic() < deadline:
            try:
                written = insert()
                ambiguous = False
            except awa.UniqueConflict as exc:
                if failed_at is None:
                    raise  # a fresh tag conflicts with nothing: a bug
                # The try that raised had committed: the ambiguous commit resolved.
                self.counts["ambiguous_enqueues"] += 1
                ids = [exc.conflicting_id] if len(tags) == 1 else self._ids_of(tags)
                written = [(job_id, "?") for job_id in ids]
                ambiguous = True
            except Exception:  # noqa: BLE001 - a database error: try again, the key dedupes
                self.counts["enqueue_errors"] += 1
                if failed_at is None:
                    failed_at = time.time()
                db.close_thread_connections()
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            for index, ((job_id, kind), tag) in enumerate(zip(written, tags, strict=True)):
                self._enqueued(
                    job_id, tag, kind=kind, ambiguous=ambiguous,
                    failed_at=failed_at if index == 0 else None,
                )  # fmt: skip
            if len(tags) > 1:
                with self._lock:
                    self._workflow_ids.extend(job_id for job_id, _ in written)
            return True
        self.counts["gave_up"] += 1
        return False

    @staticmethod
    def _ids_of(tags: list[str]) -> list[int]:
        """The ids of the ``Act`` jobs tagged ``tags``, in their order."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT args ->> 'tag', id FROM awa_job"
                " WHERE kind = 'act' AND args ->> 'tag' = ANY(%s)",
                [tags],
            )
            found = dict(cursor.fetchall())
        return [found[tag] for tag in tags]

    def _enqueued(
        self, job_id: int, tag: str, *, kind: str, ambiguous: bool, failed_at: float | None
    ) -> None:
        self.ledger.record("enqueued", id=job_id, tag=tag, kind=kind, ambiguous=ambiguous)
        self.counts["enqueued"] += 1
        with self._lock:
            if job_id not in self._seen:  # a lost job's id, handed out again
                self._seen.add(job_id)
                self._ids.append(job_id)
        if failed_at is not None:
            self.outages.append((failed_at, time.time()))

    # -- the answerer ----------------------------------------------------------------

    def _answerer(self) -> None:
        from django.db import connection

        from django_awa import db

        while not self.stop_event.wait(0.2):
            try:
                with connection.cursor() as cursor:
                    cursor.execute(WAITING)
                    waiting = cursor.fetchall()
            except Exception:  # noqa: BLE001 - the database is away: look again later
                db.close_thread_connections()
                continue
            for job_id, callback_id, tag in waiting:
                self._answer(job_id, callback_id, tag or "")

    def _answer(self, job_id: int, callback_id: Any, tag: str) -> None:
        import django_awa as awa
        from django_awa import db

        errored = False
        deadline = time.monotonic() + RETRY_FOR
        while time.monotonic() < deadline:
            try:
                awa.complete_external(callback_id, {"ok": True})
                self.ledger.record("callback", id=job_id, tag=tag, ambiguous=False)
                self.counts["callbacks"] += 1
                return
            except awa.CallbackNotFound:
                if errored:  # the try that raised had committed
                    self.counts["ambiguous_callbacks"] += 1
                    self.ledger.record("callback", id=job_id, tag=tag, ambiguous=True)
                return  # else: rescued or timed out meanwhile; nothing acknowledged
            except Exception:  # noqa: BLE001 - a database error: the same callback again
                errored = True
                self.counts["callback_errors"] += 1
                db.close_thread_connections()
                time.sleep(0.2)

    # -- the watcher -------------------------------------------------------------------

    def _watcher(self) -> None:
        from django.db import connection

        from django_awa import db

        while not self.stop_event.wait(0.5):
            with self._lock:
                pending = [i for i in self._ids if i not in self._completed]
            if not pending:
                continue
            try:
                with connection.cursor() as cursor:
                    cursor.execute(COMPLETED, [pending])
                    done = cursor.fetchall()
            except Exception:  # noqa: BLE001 - the database is away: look again later
                db.close_thread_connections()
                continue
            for job_id, tag in done:
                if tag:  # else the id of a lost job, handed out again to a follow-up
                    self.ledger.record("completed", id=job_id, tag=tag)
            with self._lock:
                self._completed.update(job_id for job_id, _ in done)

    # -- the check -----------------------------------------------------------------------

    def check(self, cursor: Any) -> dict[str, list[Any]]:
        """Acknowledged writes the database does not hold, by kind (empty lists: none lost).

        Jobs are told apart by their unique tag, not their id: a new primary
        that lost writes hands out their ids again (a sequence is logged
        ahead in steps), to other jobs.
        """
        entries = self.ledger.entries()
        enqueued = sorted({e["tag"] for e in entries if e["event"] == "enqueued"})
        completed = sorted({e["tag"] for e in entries if e["event"] == "completed"})
        answered = sorted({e["tag"] for e in entries if e["event"] == "callback"})
        cursor.execute(STATES_BY_TAG, [enqueued])
        states = dict(cursor.fetchall())
        cursor.execute(DUPLICATED_TAGS)
        duplicated = [row[0] for row in cursor.fetchall()]
        return {
            "enqueues_lost": [i for i in enqueued if i not in states],
            "completions_lost": [i for i in completed if states.get(i) != "completed"],
            "callbacks_lost": [i for i in answered if states.get(i) != "completed"],
            "enqueues_duplicated": duplicated,
        }

    def ledger_counts(self) -> dict[str, int]:
        entries = self.ledger.entries()
        return {
            event: len({e["tag"] for e in entries if e["event"] == event})
            for event in ("enqueued", "completed", "callback")
        }


def flow_gap(cursor: Any, since: float, until: float) -> float:
    """The longest pause, in seconds, between two jobs completing in [since, until] (epoch).

    Measured on the database clock (``finalized_at``), from ``since``: how
    long after a fault at ``since`` jobs flowed again.
    """
    cursor.execute(
        "SELECT extract(epoch FROM finalized_at) FROM awa_job WHERE state = 'completed' "
        "AND finalized_at BETWEEN to_timestamp(%s) AND to_timestamp(%s) ORDER BY 1",
        [since, until],
    )
    times = [since] + [float(row[0]) for row in cursor.fetchall()]
    return max((b - a for a, b in itertools.pairwise(times)), default=until - since)


def attempts_lost(cursor: Any, ids: list[int], since: float, until: float) -> int:
    """Attempts that ended in an error (or a rescue) in [since, until]: the workload's jobs
    never fail on their own, so each is an attempt lost to the fault."""
    cursor.execute(
        "SELECT count(*) FROM awa_job, jsonb_array_elements(errors) AS e "
        "WHERE id = ANY(%s) AND (e ->> 'at')::timestamptz "
        "BETWEEN to_timestamp(%s) AND to_timestamp(%s)",
        [ids, since, until],
    )
    return int(cursor.fetchone()[0])
