"""``manage.py awa_demo``: a worker, a stream of orders and a carrier, in one process.

Prints one line a second: elapsed time, jobs completed per second, jobs per
state (``awa.queue_stats()`` summed over queues) and how many jobs follow-ups
enqueued. With ``--duration`` (or at the first Ctrl-C) it stops producing,
lets the jobs of the run finish (``--drain``), stops the worker gracefully and
prints a summary with consistency checks computed in SQL; a second Ctrl-C
skips the wait.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from django_awa.conf import DEFAULT_CONCURRENCY, AwaSettings, awa_settings
from django_awa.exceptions import ConfigurationError
from django_awa.process import Worker
from example_project.shop.demo import (
    CallbackServer,
    Carrier,
    HttpCarrier,
    Marks,
    Producers,
    Summary,
    Ticker,
    http_carrier_problem,
    quiet_logging,
    unfinished,
    write_line,
)

# The queues the shop's kinds use; run even if AWA["QUEUES"] leaves one out.
SHOP_QUEUES = ("default", "billing", "email")


def release_worker_connections(timeout: float = 5.0) -> None:
    """Close the database sessions the stopped worker's handler threads opened.

    ``Worker.run()`` returns while its handler pools wind down, and a handler
    thread's connection is not closed when the thread ends: it stays open until
    its ``DatabaseWrapper`` is garbage collected (reference cycles). Whoever
    runs this in-process (a test that then drops its database) needs it gone.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name.startswith("awa-") and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    gc.collect()


class Command(BaseCommand):
    help = "Run the example shop: a worker, an order stream and a carrier, with live statistics."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--duration",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Produce for this long, then drain and print a summary. Default: until Ctrl-C.",
        )
        parser.add_argument(
            "--rate",
            type=float,
            default=200.0,
            metavar="JOBS_PER_SECOND",
            help="Jobs the producer enqueues per second, half of them orders (a ChargeCard "
            "each); follow-ups come on top. Default 200.",
        )
        parser.add_argument(
            "--carrier",
            choices=("auto", "http", "direct"),
            default="auto",
            help="How the carrier answers parked ShipOrder jobs: signed POSTs to the callback "
            "receiver (http), awa.complete_external() (direct), or http when the project "
            "allows it (auto, the default).",
        )
        parser.add_argument(
            "--carrier-delay",
            type=float,
            default=1.0,
            metavar="SECONDS",
            help="How long after a ShipOrder starts the carrier answers. Default 1.",
        )
        parser.add_argument(
            "--drain",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="At the end, wait up to this long for the run's jobs to finish. Default 30.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        duration, rate = options["duration"], options["rate"]
        if duration is not None and duration <= 0:
            raise CommandError("--duration must be positive")
        if rate <= 0:
            raise CommandError("--rate must be positive")
        if options["carrier_delay"] < 0 or options["drain"] < 0:
            raise CommandError("--carrier-delay and --drain cannot be negative")
        try:
            conf = awa_settings()
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from exc
        alias = conf.database
        if connections[alias].vendor != "postgresql":
            raise CommandError(f"django-awa needs PostgreSQL; database {alias!r} is not")
        queues = {name: queue.concurrency for name, queue in conf.queues.items()}
        for name in SHOP_QUEUES:
            queues.setdefault(name, DEFAULT_CONCURRENCY)

        carrier_mode = options["carrier"]
        problem = http_carrier_problem() if carrier_mode != "direct" else None
        if carrier_mode == "http" and problem:
            raise CommandError(f"--carrier http: {problem}")
        use_http = carrier_mode != "direct" and not problem

        with quiet_logging():
            self.run(
                conf=conf,
                alias=alias,
                queues=queues,
                duration=duration,
                rate=rate,
                use_http=use_http,
                http_problem=problem if carrier_mode == "auto" else None,
                carrier_delay=options["carrier_delay"],
                drain=options["drain"],
            )

    def run(
        self,
        *,
        conf: AwaSettings,
        alias: str,
        queues: dict[str, int],
        duration: float | None,
        rate: float,
        use_http: bool,
        http_problem: str | None,
        carrier_delay: float,
        drain: float,
    ) -> None:
        write = write_line(self.stdout)
        marks = Marks.now(alias)
        worker = Worker(queues, alias=alias, conf=conf, install_signal_handlers=False)
        worker_thread = threading.Thread(target=worker.run, name="demo-worker", daemon=True)
        producer = Producers(rate, alias, self.stderr)
        server: CallbackServer | None = None
        carrier: Carrier
        if use_http:
            server = CallbackServer()
            carrier = HttpCarrier(
                carrier_delay, alias, self.stderr, server.url, conf.callback_secret or ""
            )
        else:
            carrier = Carrier(carrier_delay, alias, self.stderr)

        write(
            "awa demo: worker on "
            + ", ".join(f"{name}={n}" for name, n in queues.items())
            + f"; producing {rate:g} jobs/s (half of them orders)"
            + (f" for {duration:g}s" if duration else ", Ctrl-C to stop")
        )
        write(
            f"carrier: {carrier.describe()}"
            + (f" (not over HTTP: {http_problem})" if http_problem else "")
        )

        presses = 0
        wake = threading.Event()

        def on_sigint(signum: int, frame: Any) -> None:
            # First Ctrl-C: stop producing and drain. Second: stop now, also
            # when it comes while the worker is finishing its in-flight jobs.
            nonlocal presses
            presses += 1
            if presses >= 2:
                worker.stop()
            wake.set()

        # Only the main thread may install signal handlers (call_command elsewhere may not).
        handle_sigint = threading.current_thread() is threading.main_thread()
        if handle_sigint:
            previous_handler = signal.signal(signal.SIGINT, on_sigint)

        draining = False
        drain_until = 0.0
        stopped_early = False
        produced_for = 0.0
        ticker = Ticker(alias)
        ticker.prime()
        try:
            worker_thread.start()
            if server is not None:
                server.start()
            carrier.start()
            producer.start()
            next_tick = ticker.started
            while True:
                next_tick += 1.0
                wake.wait(max(0.0, next_tick - time.monotonic()))
                wake.clear()
                if presses >= 2:
                    stopped_early = True
                    produced_for = produced_for or time.monotonic() - ticker.started
                    write("second Ctrl-C: stopping now")
                    break
                if not worker_thread.is_alive():
                    raise CommandError("the worker thread stopped unexpectedly")
                elapsed = time.monotonic() - ticker.started
                if not draining and (presses or (duration and elapsed >= duration)):
                    producer.stop()
                    produced_for = elapsed
                    draining = True
                    drain_until = time.monotonic() + drain
                    write(
                        f"producer stopped after {elapsed:.1f}s; letting this run's jobs finish "
                        f"(up to {drain:g}s{', Ctrl-C again to stop now' if presses else ''})"
                    )
                left = unfinished(alias, marks) if draining else 0
                write(ticker.line(f"[draining: {left} unfinished]" if draining else ""))
                if draining and (left == 0 or time.monotonic() >= drain_until):
                    break
        finally:
            producer.stop()
            carrier.stop()
            worker.stop()
            if stopped_early:
                worker.stop()  # a second stop() skips the in-flight wait
            producer.join(10)
            carrier.join(10)
            worker_thread.join(conf.shutdown_timeout + 10)
            release_worker_connections()
            if server is not None:
                server.stop()
            if handle_sigint:
                signal.signal(signal.SIGINT, previous_handler or signal.default_int_handler)

        summary = Summary.collect(alias, marks)
        write("")
        write(f"summary after {time.monotonic() - ticker.started:.1f}s")
        write(
            f"produced: {producer.orders} orders (one ChargeCard each) and "
            f"{producer.others} other jobs in {produced_for:.1f}s "
            f"({(producer.orders + producer.others) / max(produced_for, 0.001):.0f} jobs/s"
            f" of the {rate:g} asked)"
        )
        write(
            f"carrier: answered {carrier.answered} callbacks ({carrier.mode})"
            + (f", {carrier.errors} errors" if carrier.errors else "")
        )
        summary.render(write)
        if summary.failed_checks:
            raise CommandError("consistency check failed: " + "; ".join(summary.failed_checks))
