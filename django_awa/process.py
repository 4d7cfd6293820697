"""The worker process: start the services, act on signals, drain at shutdown.

Services, each in threads of its own with its own database connection, and
sharing only the ``WorkerState``:

* ``producer.Producer``, one per queue, claims jobs while the queue has room;
* ``handlers.HandlerPool``: as many handler threads per queue as its
  concurrency run handlers; the main thread keeps the pool at full strength;
* ``completer.Completer`` writes results in batches (``finalize``);
* ``listener.Listener`` holds a LISTEN connection and wakes producers;
* ``heartbeat.Heartbeat`` heartbeats running attempts and stores progress;
* ``maintenance.MaintenanceService`` competes for leadership and runs maintenance.

SIGTERM/SIGINT stop claiming and give back at once the prefetched jobs no
handler started (no attempt used); running attempts get ``SHUTDOWN_TIMEOUT``
to finish; what is left is given back as an interrupted attempt (``available``
again, or ``failed`` on the last attempt, with its follow-ups) before exit.
A second signal skips the wait.

A service thread that ends on an error it did not expect (a defect, not a
database fault, which each retries) stops the worker as SIGTERM does, or at
once when it was the completer or the heartbeat, which running attempts
need; ``run`` then raises ``WorkerFailed`` (``awa_worker`` exits with status
``FAILED_EXIT``). A worker without one of them would stay up doing less:
claiming nothing from a queue, writing no outcomes, hearing no cancels.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_module
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from django.db import connections

from . import db, fleet, wakeups
from .completer import Completer
from .conf import AwaSettings
from .exceptions import WorkerFailed
from .execute import Attempt, AttemptResult, errored, unstarted
from .finalize import finalize
from .handlers import HandlerPool
from .heartbeat import Heartbeat
from .kinds import registry
from .listener import Listener
from .logs import set_worker
from .maintenance import MaintenanceService
from .models import JobRow, JobState
from .otel import instrumentation
from .producer import Producer, SharedConnection
from .schedules import schedules
from .state import DB_ERRORS, WorkerState

logger = logging.getLogger(__name__)

INTERRUPTED = "interrupted: the worker shut down before the attempt finished"
# awa_worker's exit status after WorkerFailed (sysexits' EX_SOFTWARE): an init system
# or the --processes supervisor starts it again.
FAILED_EXIT = 70
# The services whose loss leaves running attempts without their outcome written or
# their heartbeat kept: the worker gives them back at once, not after their handlers.
_NEEDED_BY_RUNNING = frozenset({"awa-completer", "awa-heartbeat"})
_WAKE = 0  # not a signal: stop() wakes the main thread with it
# The signals that stop a worker: SIGQUIT at once, the others letting running jobs
# finish first. SIGHUP too (a closed terminal, an ssh session dropped): left to its
# default, it killed the process outright, its jobs left for rescue at STALE_AFTER.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Worker:
    """One worker process. ``run()`` blocks until stopped."""

    def __init__(
        self,
        queues: dict[str, int],
        *,
        alias: str | None = None,
        conf: AwaSettings | None = None,
        install_signal_handlers: bool = True,
        repeat_halts: bool = True,
        processes: int = 1,
    ) -> None:
        self.state = state = WorkerState.create(queues, alias=alias, conf=conf)
        self.install_signal_handlers = install_signal_handlers
        # Whether a second SIGTERM/SIGINT means "now". Not for --processes
        # children: they get each signal twice (from the terminal or service
        # manager, and from their supervisor), which sends SIGQUIT for "now".
        self.repeat_halts = repeat_halts
        # How many worker processes like this one run side by side (--processes):
        # together they hold that many times this one's connections.
        self.processes = processes
        # Signals received, for the main thread to act on (see _on_signal).
        self.signals: queue_module.SimpleQueue[int] = queue_module.SimpleQueue()
        shared = SharedConnection(state.alias) if state.need.shared_by_producers else None
        self.producers = [Producer(state, runner, shared) for runner in state.queues.values()]
        self.handlers = HandlerPool(state)
        self.completer = Completer(state)
        self.listener = Listener(state) if state.conf.direct_database is not None else None
        self.heartbeat = Heartbeat(state)
        self.maintenance = MaintenanceService(state)
        # Set when a service thread failed (``_service``): what ``run`` raises at the end.
        self.failure: str | None = None

    @property
    def stopping(self) -> threading.Event:
        """Set once the worker stops claiming."""
        return self.state.stopping

    # -- running and stopping --------------------------------------------------

    def run(self) -> None:
        state = self.state
        set_worker(state.name)
        if self.install_signal_handlers:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_signal)
        connections_told, warnings = self._connections_report()
        logger.info(
            "awa worker %s starting: queues %s; database %r (%s); %s",
            state.name,
            ", ".join(f"{q.name}={q.concurrency}" for q in state.queues.values()),
            state.alias,
            db.database_address(state.alias),
            connections_told,
        )
        for warning in warnings:
            logger.warning("%s", warning)
        self._log_queues_left_out()
        self._warn_of_orphaned_queues()
        if schedules and state.alias != state.conf.database:
            logger.info(
                "awa worker %s fires no periodic jobs: they fire in AWA['DATABASE'] (%r) "
                "only, by a worker there",
                state.name,
                state.conf.database,
            )
        tracing = instrumentation()
        if tracing is not None:
            # The awa.jobs gauge, with the otel extra: observed by the leader only.
            tracing.observe_job_counts(state.alias, lambda: self.maintenance.is_leader)
        try:
            fleet.beat(state)  # registered before it claims; the heartbeat renews it
        except DB_ERRORS as exc:
            logger.warning("could not register worker %s (%s); heartbeats retry", state.name, exc)
        finally:
            connections[state.alias].close()  # the main thread holds none while it runs
        if self.listener is None:
            logger.info(
                "no direct database connection (AWA['DIRECT_DATABASE'] is None): polling "
                "every %.1fs instead of LISTEN",
                state.conf.poll_interval,
            )
        else:
            self._service(self.listener.run, "awa-listener")
        completer = self._service(self.completer.run, "awa-completer")
        self._service(self.heartbeat.run, "awa-heartbeat")
        self._service(self.maintenance.run, "awa-maintenance")
        self._wait_for_engine()
        if not self.completer.connected.is_set():
            # Stopped before the engine reached the database: nothing was claimed
            # or run, so nothing waits to finish or be written. Its threads stop
            # retrying now, rather than the drain waiting SHUTDOWN_TIMEOUT for them.
            state.halt.set()
        self.handlers.start()
        producers = [
            self._service(producer.run, f"awa-producer-{producer.runner.name}")
            for producer in self.producers
        ]
        try:
            while not state.stopping.is_set():
                self._take_signals(0.5)
                self.handlers.tend()
        finally:
            self._drain(producers, completer)
        if self.failure is not None:
            raise WorkerFailed(f"awa worker {state.name} stopped: {self.failure}")

    def _service(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start ``target`` in thread ``name``; should it raise, stop the worker.

        Each service retries database faults itself, and logs and carries on
        past its own duties' errors; what still reaches here is unforeseen, so
        the worker stops rather than run on without the service (see the
        module's docstring).
        """

        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self.failure = self.failure or f"its thread {name} failed: {exc!r}"
                needed = name in _NEEDED_BY_RUNNING
                logger.critical(
                    "awa worker %s: its thread %s failed; stopping, %s",
                    self.state.name,
                    name,
                    "giving running jobs back now"
                    if needed
                    else "running jobs finish first (up to SHUTDOWN_TIMEOUT)",
                    exc_info=exc,
                )
                self.stop(now=needed)

        return self.state.start(run, name)

    def _wait_for_engine(self) -> None:
        """Wait until the heartbeat and the completer hold their connections (or the worker
        stops): no handler runs before, so none takes the server's last connection slot
        from them (``db.hold_connection``). They retry a refusal themselves, logged as an
        outage; meanwhile nothing is claimed."""
        ready = (self.heartbeat.connected, self.completer.connected)
        while not self.state.stopping.is_set() and not all(e.is_set() for e in ready):
            self._take_signals(0.05)

    def _log_queues_left_out(self) -> None:
        """Say which queues kinds are declared on that this worker does not run: their
        jobs wait for a worker that does (``AWA["QUEUES"]``, or ``--queue``)."""
        declared: dict[str, list[str]] = {}
        for kind, spec in sorted(
            registry.workers.items(), key=lambda item: (item[1].queue, item[0])
        ):
            if spec.queue not in self.state.queues:
                declared.setdefault(spec.queue, []).append(kind)
        if declared:
            where = "; ".join(f"{queue} ({', '.join(kinds)})" for queue, kinds in declared.items())
            logger.info(
                "awa worker %s does not run queue(s) %s, where kinds are declared: their jobs "
                "wait for a worker that does (AWA['QUEUES'], or awa_worker --queue NAME)",
                self.state.name,
                where,
            )

    def _warn_of_orphaned_queues(self) -> None:
        """awa.W102, once as the worker starts: queues whose jobs wait to run that
        nothing names any more (not ``AWA["QUEUES"]``, nor a kind's or a periodic
        schedule's queue, nor this worker's) and no live worker runs: a queue left
        behind by a rename. Said nothing of when the database cannot be read: the
        worker's start reports that."""
        state = self.state
        named = {
            *state.conf.queues,
            *state.queues,
            *(spec.queue for spec in registry.workers.values()),
            *(periodic.queue for periodic in schedules.values() if periodic.queue is not None),
        }
        try:
            orphaned = fleet.orphaned_queues(state.alias, named, state.conf.stale_after)
        except DB_ERRORS:
            connections[state.alias].close()
            return
        if orphaned:
            logger.warning(
                "jobs wait in queue(s) %s that no worker runs and neither AWA['QUEUES'] nor "
                "any kind or periodic schedule names: they wait until a worker runs them "
                "(awa_worker --queue NAME), or move them (awa_jobs move --queue NAME "
                "--to QUEUE) (awa.W102)",
                ", ".join(f"{queue} ({count:,} job(s))" for queue, count in orphaned),
            )

    def _connections_report(self) -> tuple[str, list[str]]:
        """The start-up log's words on connections (see ``db.connections_report``), and
        its warnings: the worker would take the server near its limit (awa.W101), or
        its listener would LISTEN through a pooler.

        The connection stays open for the worker's registration that follows
        (``run`` closes it), unless the read failed: then the registration
        connects afresh.
        """
        state = self.state
        need = state.need
        try:
            room = db.server_room(state.alias)
        except DB_ERRORS as exc:
            connections[state.alias].close()
            told = f"up to {need.most} connections ({need.parts()})"
            return f"{told}; the server's limits could not be read ({exc})", []
        told, budget = db.connections_report(need, room, self.processes)
        warnings = [] if budget is None else [f"{budget} (awa.W101)"]
        if state.direct == state.alias and db.behind_pooler(state.alias, room):
            # A transaction-mode pooler hands each statement to any server connection:
            # the LISTEN lands on one, the notifications go nowhere.
            why, fix = (
                ("AWA['DIRECT_DATABASE'] is that alias", "set AWA['DIRECT_DATABASE'] to")
                if state.alias == state.conf.database
                else ("not AWA['DATABASE']: it listens on its own", "start it with --database")
            )
            warnings.append(
                f"the listener LISTENs through the pooler in front of database {state.alias!r} "
                f"({why}): in transaction mode it receives no notifications, and jobs wait "
                f"for the next poll; {fix} an alias that reaches the server itself, or set "
                f"AWA['DIRECT_DATABASE'] to None to poll"
            )
        return told, warnings

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming; in-flight attempts may finish within SHUTDOWN_TIMEOUT.

        A second call, or ``now``, skips that wait: they are given back at once.
        """
        state = self.state
        if now or state.stopping.is_set():
            state.halt.set()
        state.stopping.set()
        state.wake()
        self.signals.put(_WAKE)  # the main thread may be waiting for a signal

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a reentrant put: the handler runs in the main thread between
        # two bytecodes, maybe while it holds an Event's lock, maybe inside
        # this handler for the previous signal. Setting an Event here could
        # wait on a lock this very thread holds, for ever.
        self.signals.put(signum)

    def _take_signals(self, timeout: float) -> None:
        """Act on the signals received, waiting up to ``timeout`` for one (main thread)."""
        with contextlib.suppress(queue_module.Empty):
            signum = self.signals.get(timeout=timeout)
            while True:
                self._act_on(signum)
                signum = self.signals.get_nowait()

    def _act_on(self, signum: int) -> None:
        if signum == _WAKE:
            return
        name = signal.Signals(signum).name
        stopping = self.state.stopping.is_set()
        if signum == signal.SIGQUIT or (stopping and self.repeat_halts):
            logger.warning("%s: giving back in-flight jobs now", name)
            self.stop(now=True)
        elif not stopping:
            logger.info(
                "%s received: finishing in-flight jobs (up to %.0fs), claiming no more",
                name,
                self.state.conf.shutdown_timeout,
            )
            self.stop()

    # -- shutdown ----------------------------------------------------------------

    def _drain(self, producers: list[threading.Thread], completer: threading.Thread) -> None:
        state = self.state
        for thread in producers:
            thread.join()
        self._give_back(self.state.withdraw_waiting(), started=False)
        deadline = time.monotonic() + state.conf.shutdown_timeout
        while state.running and time.monotonic() < deadline and not state.halt.is_set():
            self._take_signals(0.05)
        state.results.put(None)  # the completer writes what it has, then exits
        until = max(deadline, time.monotonic() + 5.0)
        while completer.is_alive() and time.monotonic() < until:
            completer.join(timeout=0.1)
            self._take_signals(0)
        with state.running_lock:
            unfinished = [a for a in state.running.values() if a.job.id not in state.waiting]
        self._give_back(unfinished + self.state.withdraw_waiting(), started=True)
        state.halt.set()
        # Abandoned handlers still running end with the process: their keys go now.
        self.handlers.release_kept_leases()
        self.handlers.stop_loop()
        for runner in state.queues.values():
            for _ in range(runner.concurrency):
                # Each handler thread closes its connections and exits. There are
                # ``concurrency`` of them: abandoned ones take nothing from the inbox.
                runner.inbox.put(None)
        # A thread still stuck in a handler (an abandoned one too) keeps its
        # connection until the process exits; they are daemon threads, and not waited
        # for: waiting, a worker given SHUTDOWN_TIMEOUT 0 exited 3 s after its signal.
        in_handlers = self.handlers.in_handlers()
        until = time.monotonic() + 3.0
        for thread in state.threads:
            if thread not in in_handlers:
                thread.join(timeout=max(0.0, until - time.monotonic()))
        try:
            # The outcomes counted since the last heartbeat, for the dashboard.
            state.tally.flush(state.alias, state.name)
            fleet.deregister(state)
        except DB_ERRORS as exc:
            logger.warning("could not deregister worker %s (%s); it ages out", state.name, exc)
        finally:
            connections.close_all()
        logger.info("awa worker %s stopped after %s jobs", state.name, state.processed)

    def _give_back(self, attempts: list[Attempt], *, started: bool) -> None:
        """Write back attempts this worker will not finish, so others can run them.

        An attempt that never started leaves no trace: the job is available again
        and its next run keeps this attempt's number. One that was interrupted
        counts, as if its handler had raised: available again at once with an
        ``errors`` entry, or failed on its last attempt, with its follow-ups.
        """
        if not attempts:
            return
        for attempt in attempts:
            attempt.cancelled.set()
        # One a handler thread gave back as too late to start (a rate's bound) and the
        # completer did not write before it stopped never started either.
        results = [self._given_back(a.job, started and a.started is not None) for a in attempts]
        for attempt, result in zip(attempts, results, strict=True):
            result.started = attempt.started
        try:
            with wakeups.after_commit(self.state.alias):  # the listener may be gone
                written = finalize(results, self.state.alias)
            self.state.count_outcomes(written)  # flushed at the end of the drain
            logger.warning(
                "gave back %s %s job(s) at shutdown: %s",
                len(written),
                "interrupted" if started else "prefetched",
                ", ".join(str(r.job.id) for r in written),
            )
        except DB_ERRORS:
            logger.exception("could not give back unfinished jobs; maintenance will rescue them")
        finally:
            connections.close_all()

    @staticmethod
    def _given_back(job: JobRow, started: bool) -> AttemptResult:
        if not started:
            return unstarted(job)
        result = errored(job, INTERRUPTED)
        if result.state is JobState.RETRYABLE:
            result.state, result.delay = JobState.AVAILABLE, 0.0
        return result
