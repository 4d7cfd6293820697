"""``manage.py awa_demo``: worker processes, a stream of orders, a carrier and the admin.

The workers are ``manage.py awa_worker`` subprocesses and the producers run
in a child process of their own; the carrier and the admin server (with a
``demo`` superuser it prints) are threads of this process. ``--preset`` picks
a rate and a number of workers.

Prints one line a second: elapsed time, jobs produced and completed per second, jobs per
state (``awa.queue_stats()`` summed over queues) and how many jobs follow-ups
enqueued. With ``--duration`` (or at the first Ctrl-C) it stops producing,
lets the jobs of the run finish (``--drain``), stops the worker gracefully and
prints a summary with consistency checks computed in SQL; a second Ctrl-C
skips the wait.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.urls import NoReverseMatch, reverse

from django_awa.conf import DEFAULT_CONCURRENCY, AwaSettings, awa_settings
from django_awa.exceptions import ConfigurationError
from django_awa.models import JobState
from example_project.shop.demo import (
    ORDER_SHARE,
    CallbackServer,
    Carrier,
    HttpCarrier,
    Marks,
    ProducerProcess,
    Summary,
    Ticker,
    Vacuum,
    WorkerProcesses,
    demo_superuser,
    http_carrier_problem,
    quiet_logging,
    unfinished,
    write_line,
)

# The queues the shop's kinds use; run even if AWA["QUEUES"] leaves one out.
SHOP_QUEUES = ("default", "billing", "email")


@dataclass(frozen=True, slots=True)
class Preset:
    rate: float  # jobs a second the producers enqueue
    workers: int  # awa_worker processes
    carrier: str  # auto | http | direct
    burst: tuple[int, float] | None = None  # (jobs, every seconds) enqueued in bulk
    about: str = ""
    orders: float = ORDER_SHARE  # share of the produced jobs that are orders


PRESETS = {
    # Two worker processes: 100 orders a second make about 550 jobs a second that
    # use the database, more than one process ran on a shared two-core machine.
    "steady": Preset(200, 2, "auto", about="200 jobs/s, two worker processes"),
    "busy": Preset(
        2000,
        2,
        "direct",
        orders=0.05,
        about="2,000 jobs/s (100 orders/s, as steady, and 1,900 other jobs/s), "
        "two worker processes",
    ),
    "burst": Preset(
        200,
        2,
        "auto",
        burst=(20_000, 10.0),
        about="200 jobs/s plus 20,000 jobs in one enqueue_many every 10 s, two worker processes",
    ),
}


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
            "--preset",
            choices=sorted(PRESETS),
            default="steady",
            help="What to show: "
            + "; ".join(f"{name}: {preset.about}" for name, preset in PRESETS.items())
            + ". --rate, --workers and --carrier override its values. Default steady.",
        )
        parser.add_argument(
            "--rate",
            type=float,
            default=None,
            metavar="JOBS_PER_SECOND",
            help="Jobs the producer enqueues per second, --orders of them orders (a ChargeCard "
            "each); follow-ups come on top. Default: the preset's (steady: 200).",
        )
        parser.add_argument(
            "--orders",
            type=float,
            default=None,
            metavar="SHARE",
            help="The share (0 to 1) of the produced jobs that are orders; each order brings "
            "3 to 6 more jobs (follow-ups, workflow steps) and a callback. Default: the "
            "preset's (steady: 0.5, busy: 0.05).",
        )
        parser.add_argument(
            "--workers",
            type=int,
            default=None,
            metavar="N",
            help="awa_worker processes to run. Default: the preset's (steady: 2).",
        )
        parser.add_argument(
            "--carrier",
            choices=("auto", "http", "direct"),
            default=None,
            help="How the carrier answers parked ShipOrder jobs: signed POSTs to the batch "
            "callback receiver (http), complete_external_many() (direct), or http when the project "
            "allows it (auto). Default: the preset's (steady: auto).",
        )
        parser.add_argument(
            "--port",
            type=int,
            default=8000,
            help="127.0.0.1 port of the admin (and the callback receiver); 0, or a port "
            "taken, picks a free one. Default 8000.",
        )
        parser.add_argument(
            "--worker-log",
            type=Path,
            default=None,
            metavar="PATH",
            help="Where the worker processes log. Default .awa/demo-worker.log.",
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
        preset = PRESETS[options["preset"]]
        duration = options["duration"]
        rate = options["rate"] if options["rate"] is not None else preset.rate
        workers = options["workers"] if options["workers"] is not None else preset.workers
        orders = options["orders"] if options["orders"] is not None else preset.orders
        if duration is not None and duration <= 0:
            raise CommandError("--duration must be positive")
        if rate <= 0:
            raise CommandError("--rate must be positive")
        if not 0 <= orders <= 1:
            raise CommandError("--orders must be between 0 and 1")
        if workers < 1:
            raise CommandError("--workers must be at least 1")
        if not 0 <= options["port"] <= 65535:
            raise CommandError("--port must be between 0 and 65535")
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

        carrier_mode = options["carrier"] or preset.carrier
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
                orders=orders,
                workers=workers,
                burst=preset.burst,
                port=options["port"],
                worker_log=options["worker_log"]
                or Path(settings.BASE_DIR) / ".awa" / "demo-worker.log",
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
        orders: float,
        workers: int,
        burst: tuple[int, float] | None,
        port: int,
        worker_log: Path,
        use_http: bool,
        http_problem: str | None,
        carrier_delay: float,
        drain: float,
    ) -> None:
        write = write_line(self.stdout)
        vacuum = Vacuum(alias, self.stderr)
        marks = Marks.now(alias)
        worker = WorkerProcesses(queues, workers, worker_log)
        producer = ProducerProcess(rate, alias, burst=burst, order_share=orders)
        server = CallbackServer(port)
        carrier: Carrier
        if use_http:
            carrier = HttpCarrier(
                carrier_delay, alias, self.stderr, server.url, conf.callback_secret or ""
            )
        else:
            carrier = Carrier(carrier_delay, alias, self.stderr)

        write(
            f"awa demo: {workers} worker process{'es' if workers > 1 else ''} (awa_worker) on "
            + ", ".join(f"{name}={n}" for name, n in queues.items())
            + f"; producing {rate:g} jobs/s ({orders:.0%} of them orders; "
            f"{producer.count} producer threads in a process of their own)"
            + (f" and {burst[0]:,} jobs every {burst[1]:g}s" if burst else "")
            + (f" for {duration:g}s" if duration else ", Ctrl-C to stop")
        )
        write(
            f"carrier: {carrier.describe()}"
            + (f" (not over HTTP: {http_problem})" if http_problem else "")
        )
        login = demo_superuser(alias)
        try:
            admin_url = server.url + reverse("admin:index")
        except NoReverseMatch:
            admin_url = None
        if admin_url and login:
            write(f"admin: {admin_url} (user {login[0]!r}, password {login[1]!r})")
        write(f"worker log: {worker_log}")
        presses = 0
        wake = threading.Event()

        def on_sigint(signum: int, frame: Any) -> None:
            # First Ctrl-C: stop producing and drain. Second: stop now, also
            # when it comes while the worker is finishing its in-flight jobs.
            nonlocal presses
            presses += 1
            if presses >= 2:
                worker.stop()
                worker.stop()  # the second SIGTERM: give back what runs, now
            wake.set()

        # Only the main thread may install signal handlers (call_command elsewhere may not).
        handle_sigint = threading.current_thread() is threading.main_thread()
        if handle_sigint:
            previous_handler = signal.signal(signal.SIGINT, on_sigint)

        draining = False
        drain_until = 0.0
        stopped_early = False
        produced_for = 0.0
        ticker = Ticker(alias, marks, produced=lambda: producer.produced)
        ticker.prime()
        try:
            vacuum.prepare()
            worker.start()
            producer.start()
            server.start()
            # Produce once the workers listen and the producers' process is set
            # up: their start (Django, connections) would otherwise show as a
            # backlog, or as a rate short of the one asked, the first seconds.
            if not worker.wait_ready(30.0):
                if (code := worker.exit_code()) is not None:
                    raise CommandError(f"the worker exited at start ({code}); see {worker_log}")
                write("the workers are slow to start; producing anyway")
            if not producer.wait_ready(30.0):
                if (code := producer.exit_code()) is not None:
                    raise CommandError(f"the producer process exited at start ({code})")
                write("the producer process is slow to start; going on")
            ticker.started = time.monotonic()
            ticker.prime()
            carrier.start()
            vacuum.start()
            producer.go()
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
                if (code := worker.exit_code()) is not None:
                    raise CommandError(f"the worker exited unexpectedly ({code}); see {worker_log}")
                if not draining and (code := producer.exit_code()) is not None:
                    raise CommandError(f"the producer process exited unexpectedly ({code})")
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
                write(
                    ticker.line(
                        f"[draining: {left} unfinished]" if draining else "",
                        producing=not draining,
                        # The last line: what the run did, all of it.
                        recount=draining and left == 0,
                    )
                )
                if draining and (left == 0 or time.monotonic() >= drain_until):
                    break
        finally:
            producer.stop()
            carrier.stop()
            vacuum.stop()
            worker.stop()
            if stopped_early:
                worker.stop()  # a second stop() skips the in-flight wait
            producer.join(10)
            carrier.join(10)
            vacuum.join(10)
            code = worker.join(conf.shutdown_timeout + 10)
            server.stop()
            if handle_sigint:
                signal.signal(signal.SIGINT, previous_handler or signal.default_int_handler)

        summary = Summary.collect(alias, marks)
        elapsed = time.monotonic() - ticker.started
        write("")
        write(f"summary after {elapsed:.1f}s")
        steady = producer.orders + producer.others - producer.bursts
        write(
            f"produced: {producer.orders} orders (one ChargeCard each) and "
            f"{producer.others - producer.bursts} other jobs in {produced_for:.1f}s "
            f"({steady / max(produced_for, 0.001):.0f} jobs/s of the {rate:g} asked)"
            + (f", and {producer.bursts} jobs in bursts" if burst else "")
        )
        if ticker.backlog:
            write(
                f"backlog (available jobs) while producing: min {min(ticker.backlog)}, "
                f"max {max(ticker.backlog)}, last {ticker.backlog[-1]}"
            )
            write(
                f"waiting for a callback (parked) while producing: min {min(ticker.parked)}, "
                f"max {max(ticker.parked)}, last {ticker.parked[-1]}"
            )
        completed = summary.totals.get(JobState.COMPLETED, 0)
        write(
            f"completed: {completed} jobs of this run (follow-ups and workflow steps included) "
            f"in {elapsed:.1f}s, {completed / max(elapsed, 0.001):.0f} jobs/s"
        )
        write(
            f"carrier: answered {carrier.answered} callbacks ({carrier.mode})"
            + (f", {carrier.errors} errors" if carrier.errors else "")
        )
        summary.render(write)
        if code:
            write(f"the worker exited {code}; see {worker_log}")
        if summary.failed_checks:
            raise CommandError("consistency check failed: " + "; ".join(summary.failed_checks))
