"""The moving parts of ``manage.py awa_demo``: worker processes, and threads of its own:

* the workers: ``manage.py awa_worker`` subprocesses (``WorkerProcesses``);
* the producers: create orders at a steady rate and a stream of cheap jobs, each
  tick's ``Order`` rows, their ``ChargeCard`` jobs or workflows and the cheap jobs
  in one transaction of a few statements (``Workflow.enqueue_many``,
  ``enqueue_many``), and with ``--preset burst`` a bulk ``enqueue_many`` now and
  then (``Burst``); threads of a child process of their own (``ProducerProcess``);
* the carrier: answers parked ``ShipOrder`` jobs after a short delay, up to 50
  at a time: by one ``POST`` of their signed callbacks to the batch receiver
  (``http``), or by calling ``complete_external_many`` (``direct``);
* the admin server (``CallbackServer``): the project's admin, with a ``demo``
  superuser (``demo_superuser``), and the callback receiver the carrier posts to;
* the main thread: one line of statistics a second, then a summary.

Each thread uses its own database connections (Django's are per thread) and
closes them when it ends.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import multiprocessing
import os
import queue
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.models.functions import Now
from django.http.request import validate_host
from django.urls import NoReverseMatch, reverse

import django_awa as awa
from django_awa.callbacks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    complete_external_many,
    sign,
)
from django_awa.conf import awa_settings
from django_awa.models import Job, JobState

from .jobs import (
    ChargeCard,
    ResizeImage,
    ShipOrder,
    SyncInventory,
    is_cancelled,
    is_declined,
    order_workflow,
)
from .models import Order
from .producer_process import produce

# Share of produced jobs that are orders (a ChargeCard each) unless the preset says;
# the rest are cheap kinds.
ORDER_SHARE = 0.5
DECLINED_SHARE = 0.03  # amounts ending in 13: charge exhausts, order refunded
CANCELLED_SHARE = 0.05  # amounts ending in 7: customer cancels
TICK = 0.05  # the producer enqueues every TICK seconds
# At most this many seconds' worth of jobs in one batch: a producer stalled
# longer (the database gone a while) drops the rest rather than bursting.
MAX_CATCH_UP = 1.0
WORKFLOW_SHARE = 0.3  # of orders: placed as a workflow (charge, pack + invoice, ship, report)
STATES = (
    JobState.BLOCKED,
    JobState.AVAILABLE,
    JobState.RUNNING,
    JobState.RETRYABLE,
    JobState.SCHEDULED,
    JobState.WAITING_EXTERNAL,
    JobState.COMPLETED,
    JobState.FAILED,
    JobState.CANCELLED,
)
# Loggers quietened while the demo runs: one line per retry or exhausted job
# (django_awa.finalize) or per rescued job (django_awa.maintenance, e.g. parked
# jobs a previous run left behind) is what the statistics line summarises.
QUIET_LOGGERS = {
    "django_awa": logging.WARNING,
    "django_awa.finalize": logging.CRITICAL,
    "django_awa.maintenance": logging.ERROR,
    "django.request": logging.ERROR,
    "django.server": logging.ERROR,
}


@contextmanager
def quiet_logging() -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def pick_amount(rng: random.Random) -> int:
    """An order amount; its last digits decide what the pretend provider does."""
    dollars = rng.randint(5, 400)
    roll = rng.random()
    if roll < DECLINED_SHARE:
        return dollars * 100 + 13
    if roll < DECLINED_SHARE + CANCELLED_SHARE:
        return dollars * 100 + rng.randrange(0, 100, 10) + 7
    while True:
        amount = dollars * 100 + rng.randrange(100)
        if not (is_declined(amount) or is_cancelled(amount)):
            return amount


class Service(threading.Thread):
    """A daemon thread with a stop event that closes its connections on exit."""

    def __init__(self, name: str, err: TextIO) -> None:
        super().__init__(name=name, daemon=True)
        self.stopping = threading.Event()
        self.err = err

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    self.step()
                except DatabaseError as exc:
                    self.err.write(f"{self.name}: database error ({exc}); reconnecting\n")
                    connections.close_all()
                    self.stopping.wait(1.0)
        finally:
            connections.close_all()

    def step(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.stopping.set()


class Producer(Service):
    """Enqueues ``rate`` jobs a second: orders (``order_share`` of them) and cheap kinds.

    The demo runs several, like concurrent web requests. Each tick's jobs are
    placed in one transaction, every ``Order`` row with its ``ChargeCard`` job or
    its workflow (both commit or neither exists): at the default rate that is a
    few jobs a transaction, at thousands a second a batch, as an import would,
    in the same few statements (``Workflow.enqueue_many``, ``enqueue_many``).
    """

    def __init__(
        self,
        rate: float,
        alias: str,
        err: TextIO,
        name: str = "demo-producer",
        order_share: float = ORDER_SHARE,
    ) -> None:
        super().__init__(name, err)
        self.rate = rate
        self.order_share = order_share
        self.alias = alias
        self.rng = random.Random()  # noqa: S311 - a simulation, not crypto
        self.carry = 0.0
        self.last_at = 0.0
        self.orders = 0
        self.others = 0
        self.showcase: list[int] = []  # amounts to place first

    def step(self) -> None:
        # What is due is counted from the clock, not from the ticks done: a
        # tick that waited on the database makes the next batch bigger, so
        # the rate holds while the batches' round trips are what lags.
        now = time.monotonic()
        if not self.last_at:
            self.last_at = now - TICK
        self.carry += self.rate * min(now - self.last_at, MAX_CATCH_UP)
        self.last_at = now
        count = int(self.carry)
        self.carry -= count
        if count:
            self.place(count)
        self.stopping.wait(max(0.0, self.last_at + TICK - time.monotonic()))

    def place(self, count: int) -> None:
        """One tick's jobs in one transaction and a few statements, however many."""
        orders = sum(self.rng.random() < self.order_share for _ in range(count))
        amounts = [
            self.showcase.pop(0) if self.showcase else pick_amount(self.rng) for _ in range(orders)
        ]
        others = [self.cheap_job() for _ in range(count - orders)]
        # The orders and their charges commit together, or none exists.
        with transaction.atomic(using=self.alias):
            placed = Order.objects.using(self.alias).bulk_create(
                Order(reference=f"ORD-{uuid.uuid4().hex[:10].upper()}", amount_cents=amount)
                for amount in amounts
            )
            flows: list[awa.Workflow] = []
            plain: list[awa.JobArgs] = []
            for order in placed:
                if self.rng.random() < WORKFLOW_SHARE:
                    flows.append(order_workflow(order))
                else:
                    plain.append(ChargeCard(order_id=order.id, amount_cents=order.amount_cents))
            if flows:
                awa.Workflow.enqueue_many(flows, using=self.alias)
            if plain or others:
                awa.enqueue_many(plain + others, using=self.alias)
        self.orders += orders
        self.others += len(others)

    def cheap_job(self) -> awa.JobArgs:
        if self.rng.random() < 0.5:
            return ResizeImage(image=f"img/{self.rng.randrange(10_000)}.jpg", width=400)
        return SyncInventory(sku=f"SKU-{self.rng.randrange(1_000):04d}")


class Burst(Service):
    """Every ``every`` seconds, ``size`` cheap jobs in one ``enqueue_many`` (a bulk import)."""

    CHUNK = 5_000

    def __init__(self, size: int, every: float, alias: str, err: TextIO) -> None:
        super().__init__("demo-burst", err)
        self.size = size
        self.every = every
        self.alias = alias
        self.rng = random.Random()  # noqa: S311 - a simulation, not crypto
        self.enqueued = 0
        self.bursts = 0

    def step(self) -> None:
        if self.stopping.wait(self.every if self.bursts else 2.0):
            return
        for start in range(0, self.size, self.CHUNK):
            chunk = [
                SyncInventory(sku=f"SKU-{self.rng.randrange(1_000):04d}")
                if self.rng.random() < 0.5
                else ResizeImage(image=f"img/{self.rng.randrange(10_000)}.jpg", width=400)
                for _ in range(min(self.CHUNK, self.size - start))
            ]
            awa.enqueue_many(chunk, using=self.alias)
            self.enqueued += len(chunk)
        self.bursts += 1


class Carrier(Service):
    """Answers each parked ``ShipOrder`` job ``delay`` seconds after it started.

    This thread finds the parked jobs in the database, as an integration polling
    an outbox would (so it also answers jobs parked by other worker processes),
    and hands their callback ids to ``COURIERS`` threads that deliver the answers,
    up to ``BATCH`` at a time.
    """

    COURIERS = 4
    mode = "direct"

    def __init__(self, delay: float, alias: str, err: TextIO) -> None:
        super().__init__("demo-carrier", err)
        self.delay = delay
        self.alias = alias
        self.answered = 0
        self.gone = 0  # resolved meanwhile (timed out, or answered twice)
        self.errors = 0
        self.lock = threading.Lock()
        self.in_flight: set[uuid.UUID] = set()
        self.outbox: queue.Queue[uuid.UUID] = queue.Queue()
        self.couriers = [
            threading.Thread(target=self.courier, name=f"demo-courier-{i}", daemon=True)
            for i in range(self.COURIERS)
        ]

    def run(self) -> None:
        for courier in self.couriers:
            courier.start()
        try:
            super().run()
        finally:
            for courier in self.couriers:
                courier.join(15)

    def step(self) -> None:
        with self.lock:
            busy = list(self.in_flight)
        # The database clock judges "delay seconds ago", as the worker's does.
        due = list(
            Job.objects.using(self.alias)
            .filter(
                kind=ShipOrder.kind,
                state=JobState.WAITING_EXTERNAL,
                attempted_at__lte=Now() - timedelta(seconds=self.delay),
            )
            .exclude(callback_id__in=busy)
            .order_by("attempted_at")
            .values_list("callback_id", flat=True)[:500]
        )
        with self.lock:
            self.in_flight.update(due)
        for callback_id in due:
            self.outbox.put(callback_id)
        self.stopping.wait(0.2)

    def courier(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    batch = [self.outbox.get(timeout=0.2)]
                except queue.Empty:
                    continue
                while len(batch) < self.BATCH:
                    try:
                        batch.append(self.outbox.get_nowait())
                    except queue.Empty:
                        break
                try:
                    self.deliver_many(batch)
                except DatabaseError as exc:
                    self.errors += 1
                    self.err.write(f"carrier: {exc} for callbacks {batch[0]}...\n")
                    connections.close_all()
                finally:
                    with self.lock:
                        self.in_flight.difference_update(batch)
        finally:
            connections.close_all()

    # Answers one courier delivers at a time, resolved in one transaction and a
    # few statements (complete_external_many). One at a time, each a
    # transaction of its own and several round trips, on two cores busy with
    # the workers, the carrier answered 65 to 75 of the steady preset's 93
    # shipments a second, whether over HTTP (12 couriers, a request each) or
    # in-process (4 couriers, a savepoint and a lock per callback), and the
    # parked shipments grew by about 50 a second.
    BATCH = 50

    def deliver_many(self, callback_ids: list[uuid.UUID]) -> None:
        """Resolve ``callback_ids`` in one transaction and a few statements
        (``complete_external_many``). A callback resolved meanwhile comes back
        ``None``; a database error rolls back the batch, whose jobs still wait:
        a later poll finds them."""
        resolved = complete_external_many(
            ((callback_id, self.payload(callback_id)) for callback_id in callback_ids),
            using=self.alias,
        )
        answered = sum(job is not None for job in resolved.values())
        self.answered += answered
        self.gone += len(resolved) - answered

    @staticmethod
    def payload(callback_id: uuid.UUID) -> dict[str, Any]:
        return {"tracking": f"1Z{callback_id.hex[:12].upper()}", "carrier": "demo-express"}

    def describe(self) -> str:
        return f"calls complete_external_many() in-process, up to {self.BATCH} callbacks a call"


class HttpCarrier(Carrier):
    """Posts signed ``complete`` callbacks to the batch receiver served on ``base_url``."""

    mode = "http"

    def __init__(self, delay: float, alias: str, err: TextIO, base_url: str, secret: str) -> None:
        super().__init__(delay, alias, err)
        self.base_url = base_url
        self.secret = secret

    def deliver_many(self, callback_ids: list[uuid.UUID]) -> None:
        """One POST to the batch receiver (``<prefix>/callbacks/complete``) for
        ``callback_ids``, each entry the body and signature its own ``complete``
        request would carry: the receiver judges each as that request, and
        completes the good ones in one transaction (``complete_external_many``)."""
        entries = []
        for callback_id in callback_ids:
            body = json.dumps({"payload": self.payload(callback_id)})
            headers = sign(body, self.secret, callback_id=callback_id, action="complete")
            entries.append(
                {
                    "id": str(callback_id),
                    "timestamp": headers[TIMESTAMP_HEADER],
                    "signature": headers[SIGNATURE_HEADER],
                    "body": body,
                }
            )
        request = urllib.request.Request(  # noqa: S310 - our own http://127.0.0.1 server
            self.base_url + reverse("django_awa:callback_batch"),
            data=json.dumps({"callbacks": entries}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                results = json.loads(response.read())["results"]
        except urllib.error.HTTPError as exc:
            # 503: a follow-up failed and nothing was written; the jobs still wait,
            # so a later poll sends them again.
            self.errors += 1
            self.err.write(f"carrier: HTTP {exc.code} for {len(entries)} callbacks\n")
            return
        except OSError as exc:
            self.errors += 1
            self.err.write(f"carrier: {exc} for {len(entries)} callbacks\n")
            return
        for result in results:
            if result["status"] == 200:
                self.answered += 1
            elif result["status"] == 404:
                self.gone += 1
            else:
                self.errors += 1
                self.err.write(f"carrier: {result['status']} for callback {result['id']}\n")

    def describe(self) -> str:
        zero = uuid.UUID(int=0)
        path = reverse("django_awa:callback", kwargs={"callback_id": zero, "action": "complete"})
        batch = reverse("django_awa:callback_batch")
        return (
            f"signed callbacks, up to {self.BATCH} a POST, to {self.base_url}{batch}"
            f" (each as its own POST to {path.replace(str(zero), '<id>')} would be)"
        )


class Vacuum(Service):
    """``VACUUM awa_job`` every ``every`` seconds, on a server whose autovacuum is off.

    Every job leaves dead row versions in awa_job (its claim, its outcome, its
    move to awa_job_done), thousands a second here. Its storage settings ask
    autovacuum to clean it after a thousand (migration 0001); on a server
    where autovacuum is off, claims, counts and the move would read a table
    growing by a hundred thousand dead rows a minute, and slow down as it does.
    Does nothing where autovacuum is on.
    """

    def __init__(self, alias: str, err: TextIO, every: float = 10.0, first: float = 1.0) -> None:
        super().__init__("demo-vacuum", err)
        self.alias = alias
        self.every = every
        # The first pass comes sooner: its statistics are the first that see jobs running.
        self.first = first
        self.statement: str | None = None
        self.runs = 0

    def prepare(self) -> None:
        """Before the workers start: whether to vacuum, and a first VACUUM that also
        gives back the empty pages earlier runs left (no claim to stall yet)."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('autovacuum') = 'off',"
                " current_setting('server_version_num')::int"
            )
            off, version = cursor.fetchone()
            if not off:
                return
            # PostgreSQL 18 vacuums a table's inheritance children too, unless
            # ONLY (awa_job_done gets only inserts: nothing to clean).
            table = "ONLY awa_job" if version >= 180000 else "awa_job"
            cursor.execute(f"VACUUM (ANALYZE) {table}")
            # Nor does anything keep the statistics of awa_job_done, which
            # every run adds thousands of rows to, up to date.
            cursor.execute("ANALYZE awa_job_done")
        # While the workers run, TRUNCATE false: no exclusive lock to give
        # empty pages back, which would stall the claims. ANALYZE too, as
        # autovacuum would (migration 0001 asks it at 2% of the rows changed):
        # statistics taken at the start, with no job running, made the planner
        # find the attempts of a batch's outcomes and of a heartbeat through
        # every running row for each of them (awa_job_deadline_idx, a nested
        # loop), which at the busy preset's thousands of running rows took
        # 0.75 s a statement. Every 2 s it kept a backend busy two thirds of
        # the time; every 10 s it costs about 0.4 s.
        self.statement = f"VACUUM (TRUNCATE false, ANALYZE) {table}"

    def step(self) -> None:
        wait = self.every if self.runs else self.first
        if self.statement is None or self.stopping.wait(wait):
            self.stopping.set()
            return
        with connections[self.alias].cursor() as cursor:
            cursor.execute(self.statement)
        self.runs += 1


def http_carrier_problem() -> str | None:
    """Why callbacks cannot go over HTTP in this project, or ``None`` if they can."""
    if not awa_settings().callback_secret:
        return "AWA['CALLBACK_SECRET'] is not set"
    try:
        reverse("django_awa:callback", kwargs={"callback_id": uuid.uuid4(), "action": "complete"})
    except NoReverseMatch:
        return 'the URLconf does not include path("awa/", include("django_awa.urls"))'
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    if not validate_host("127.0.0.1", allowed):
        return "ALLOWED_HOSTS does not allow 127.0.0.1"
    return None


class CallbackServer:
    """This project's WSGI application on 127.0.0.1, in a thread: the admin and the
    callback receiver. On ``port``, or an ephemeral one if that is taken (or 0)."""

    def __init__(self, port: int = 0) -> None:
        from django.contrib.staticfiles.handlers import StaticFilesHandler
        from django.core.handlers.wsgi import WSGIHandler
        from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler

        class QuietHandler(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

        class PooledWSGIServer(ThreadedWSGIServer):
            """Requests served by a pool of threads that keep their database
            connection (CONN_MAX_AGE), not a new thread and connection each:
            at a hundred callbacks a second, connecting cost more than the rest."""

            pool = concurrent.futures.ThreadPoolExecutor(12, thread_name_prefix="demo-http")

            def process_request(self, request: Any, client_address: Any) -> None:
                self.pool.submit(self.process_request_thread, request, client_address)

            def _close_connections(self) -> None:
                pass  # kept for the thread's next request; the process's end closes them

            def server_close(self) -> None:
                super().server_close()
                self.pool.shutdown(wait=False, cancel_futures=True)

        try:
            self.httpd = PooledWSGIServer(("127.0.0.1", port), QuietHandler)
        except OSError:  # taken: any free port will do
            self.httpd = PooledWSGIServer(("127.0.0.1", 0), QuietHandler)
        # Not get_wsgi_application(): it runs django.setup() again, whose logging
        # configuration would undo quiet_logging(). The admin's CSS and scripts
        # are served too, as runserver would, with DEBUG off.
        app = WSGIHandler()
        if apps.is_installed("django.contrib.staticfiles"):
            app = StaticFilesHandler(app)
        self.httpd.set_app(app)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass(slots=True)
class Marks:
    """The highest ids before the run: the summary covers only rows after them."""

    job: int
    order: int
    at: Any = None  # the database's clock then

    @classmethod
    def now(cls, alias: str) -> Marks:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT (SELECT coalesce(max(id), 0) FROM awa_job),"
                " (SELECT coalesce(max(id), 0) FROM shop_order), statement_timestamp()"
            )
            job, order, at = cursor.fetchone()
        return cls(job=job, order=order, at=at)


class Producers:
    """``count`` producers sharing ``rate``, and the burst thread if one is asked for."""

    def __init__(
        self,
        rate: float,
        alias: str,
        err: TextIO,
        count: int = 4,
        burst: tuple[int, float] | None = None,
        order_share: float = ORDER_SHARE,
    ) -> None:
        self.members: list[Service] = []
        self.producers = [
            Producer(rate / count, alias, err, name=f"demo-producer-{i}", order_share=order_share)
            for i in range(count)
        ]
        # Every run shows each path early, however short: a declined card
        # (exhausted, then refunded) and a customer who cancels.
        self.producers[0].showcase = [4213, 2507]
        self.members.extend(self.producers)
        self.burst = Burst(burst[0], burst[1], alias, err) if burst else None
        if self.burst is not None:
            self.members.append(self.burst)

    def start(self) -> None:
        for producer in self.members:
            producer.start()

    def stop(self) -> None:
        for producer in self.members:
            producer.stop()

    def join(self, timeout: float) -> None:
        for producer in self.members:
            producer.join(timeout)

    @property
    def orders(self) -> int:
        return sum(p.orders for p in self.producers)

    @property
    def others(self) -> int:
        return sum(p.others for p in self.producers) + self.bursts

    @property
    def bursts(self) -> int:
        return self.burst.enqueued if self.burst is not None else 0

    @property
    def produced(self) -> int:
        return self.orders + self.others


# Jobs a producer thread places a second, about: a tick's orders, workflows and
# other jobs go in one transaction of a few statements whatever their number
# (``Producer.place``), so a thread waits for a few round trips per tick and
# higher rates make each tick's batch bigger, not the threads more.
JOBS_PER_THREAD = 1000


def producer_threads(rate: float) -> int:
    """How many producer threads share ``rate`` (jobs a second)."""
    return min(8, max(2, math.ceil(rate / JOBS_PER_THREAD)))


class ProducerProcess:
    """``Producers`` run in a child process (``producer_process.produce``), with the
    same interface.

    Placing a thousand orders a second is Python work (model instances, job
    args, encoding): in the demo's process it would share one interpreter lock
    with the carrier, the admin server and the statistics, and the demo would
    produce what that lock left it, not what was asked.
    """

    def __init__(
        self,
        rate: float,
        alias: str,
        count: int | None = None,
        burst: tuple[int, float] | None = None,
        order_share: float = ORDER_SHARE,
    ) -> None:
        if count is None:
            count = producer_threads(rate)
        self.count = count
        context = multiprocessing.get_context("spawn")
        self._counts = context.Array("q", 3)  # orders, other jobs, of them in bursts
        self._ready = context.Event()
        self._go = context.Event()
        self._stop = context.Event()
        self.process = context.Process(
            target=produce,
            args=(
                rate,
                alias,
                count,
                burst,
                order_share,
                self._counts,
                self._ready,
                self._go,
                self._stop,
            ),
            name="demo-producers",
            daemon=True,
        )

    def start(self) -> None:
        """Start the process; it sets Django up, then waits for ``go()``."""
        self.process.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the process is set up and waits for ``go()``."""
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            if self._ready.wait(0.1):
                return True
        return self._ready.is_set()

    def go(self) -> None:
        """Start producing."""
        self._go.set()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self.process.pid is None:
            return  # never started
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def exit_code(self) -> int | None:
        return self.process.exitcode

    @property
    def orders(self) -> int:
        return int(self._counts[0])

    @property
    def others(self) -> int:
        return int(self._counts[1])

    @property
    def bursts(self) -> int:
        return int(self._counts[2])

    @property
    def produced(self) -> int:
        return self.orders + self.others


class WorkerProcesses:
    """``manage.py awa_worker`` in a subprocess, as a deployment runs it.

    Not a thread of the demo's process: the producers, the carrier and the
    admin server would share one interpreter lock with the worker's threads,
    and the worker would keep up with the demo's Python rather than with the
    database. Its own session, so a Ctrl-C in the terminal reaches only the
    demo, which then stops the worker when the run's jobs are done. Its log
    (retries, rescues, shutdown) goes to ``log``.
    """

    def __init__(self, queues: dict[str, int], processes: int, log: Path) -> None:
        self.command = [sys.executable, "-m", "django", "awa_worker", "--processes", str(processes)]
        for name, concurrency in queues.items():
            self.command += ["--queue", f"{name}={concurrency}"]
        self.log = log
        self.processes = processes
        self.process: subprocess.Popen[bytes] | None = None
        self.signals = 0
        self.log_start = 0

    def start(self) -> None:
        base = Path(settings.BASE_DIR) if hasattr(settings, "BASE_DIR") else Path.cwd()
        env = dict(os.environ)
        env["DJANGO_SETTINGS_MODULE"] = settings.SETTINGS_MODULE
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(base), env.get("PYTHONPATH")]))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.log_start = out.tell()
            self.process = subprocess.Popen(
                self.command,
                cwd=base,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    READY = b"listening for new jobs"

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every worker process listens for jobs (its log says so)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.exit_code() is None:
            with self.log.open("rb") as log:
                log.seek(self.log_start)
                if log.read().count(self.READY) >= self.processes:
                    return True
            time.sleep(0.1)
        return False

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        """SIGTERM: stop claiming and drain; a second one gives back what runs, now."""
        if self.process is not None and self.process.poll() is None:
            self.signals += 1
            self.process.send_signal(signal.SIGTERM)

    def join(self, timeout: float) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


DEMO_USER = "demo"


def demo_superuser(alias: str) -> tuple[str, str] | None:
    """A superuser to watch the run in the admin, with a fresh password each run.

    ``None`` when the project has no admin or no auth app.
    """
    if not (apps.is_installed("django.contrib.admin") and apps.is_installed("django.contrib.auth")):
        return None
    from django.contrib.auth import get_user_model

    password = secrets.token_urlsafe(9)
    model = get_user_model()
    user = model._default_manager.db_manager(alias).filter(username=DEMO_USER).first()
    if user is None:
        user = model(username=DEMO_USER)
    user.is_staff = user.is_superuser = user.is_active = True
    user.set_password(password)
    user.save(using=alias)
    return DEMO_USER, password


# The once-a-second line's queries, cheap whatever the table holds: the run's
# jobs already finished sit in awa_job_done (inherited, so plain ``awa_job``
# reads both), where counting them every second would read every row of every
# run (a second of the server's time a line after a few runs). Live jobs are
# counted in the hot table alone (a sequential scan of a few thousand rows);
# finished jobs and follow-ups by what is new since the previous line.
LIVE_COUNTS = "SELECT state, count(*) FROM ONLY awa_job GROUP BY state"
# Jobs finished since ``since`` (awa_job_finalized_idx, and its copy on
# awa_job_done), and of them those before ``cut``, LAG seconds ago: counted
# for good, the next line starts from there. The rest are counted again by the
# next line: an outcome's transaction stamps finalized_at when it begins and
# commits a little later (an atomic handler's transaction, the carrier's batch
# of callbacks: more than a second when the machine is short of CPU), so a row
# may appear after a line counted its time; the last line counts all again.
FINISHED_SINCE = """
SELECT c.cut, f.state, f.before_cut, f.seen
FROM (SELECT statement_timestamp() - make_interval(secs => %(lag)s) AS cut) AS c
LEFT JOIN LATERAL (
    SELECT state, count(*) FILTER (WHERE finalized_at < c.cut) AS before_cut, count(*) AS seen
    FROM awa_job
    WHERE state IN ('completed', 'failed', 'cancelled') AND finalized_at >= %(since)s
    GROUP BY state
) AS f ON true
"""
# Follow-ups among the jobs above id ``since`` (the primary key's range), of
# them those up to ``upto`` (the highest id the previous line saw: counted for
# good, as above), and the highest id now.
# The follow-up test is a FILTER, not in WHERE: there the planner would read
# the follow-ups' index (awa_job_trigger_idx), every follow-up of every run.
FOLLOWUPS_SINCE = """
SELECT count(*) FILTER (WHERE metadata ? 'awa_trigger' AND id <= %(upto)s),
       count(*) FILTER (WHERE metadata ? 'awa_trigger'),
       (SELECT coalesce(max(id), 0) FROM awa_job)
FROM awa_job WHERE id > %(since)s
"""
LAG = 5.0


@dataclass(slots=True)
class Ticker:
    """The once-a-second line: throughput, counts per state, follow-ups.

    Counts this run's jobs: live ones as they are now, finished ones and
    follow-ups by what is new since the line before (``FINISHED_SINCE``).
    """

    alias: str
    marks: Marks
    produced: Callable[[], int] = lambda: 0  # jobs the producers enqueued so far
    started: float = field(default_factory=time.monotonic)
    last_completed: int | None = None
    last_produced: int = 0
    last_at: float = 0.0
    # The backlog (available jobs) seen by the lines while producing, from the
    # second line on (the first follows the workers' start).
    backlog: list[int] = field(default_factory=list)
    parked: list[int] = field(default_factory=list)  # and the jobs waiting for a callback
    lines: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finished before ``cut``
    cut: Any = None  # the database time up to which ``finished`` counts
    followups: int = 0  # follow-ups with ids up to ``upto``
    upto: int = 0
    seen: int = 0  # the highest id the last line saw
    totals_followups: int = 0  # this run's follow-ups, as the last line counted them

    def __post_init__(self) -> None:
        self.upto = self.seen = self.marks.job

    def prime(self) -> None:
        """Take the first sample, so that the first line has a rate."""
        self.last_completed, self.last_at = self.totals()[JobState.COMPLETED], time.monotonic()
        self.last_produced = self.produced()

    def totals(self, *, recount: bool = False) -> dict[str, int]:
        """Jobs per state, the finished ones of this run only; and ``followups``.

        ``recount``: count the run's finished jobs and follow-ups from its start,
        also those whose transaction committed after a line counted their time.
        """
        if recount:
            self.finished, self.cut, self.followups = {}, None, 0
            self.upto = self.seen = self.marks.job
        totals = dict.fromkeys(STATES, 0)
        with connections[self.alias].cursor() as cursor:
            cursor.execute(LIVE_COUNTS)
            for state, count in cursor.fetchall():
                if state not in JobState.FINAL:
                    totals[state] += count
            cursor.execute(FINISHED_SINCE, {"since": self.cut or self.marks.at, "lag": LAG})
            rows = cursor.fetchall()
            cursor.execute(FOLLOWUPS_SINCE, {"since": self.upto, "upto": self.seen})
            before, seen, highest = cursor.fetchone()
        for state, count in self.finished.items():
            totals[state] += count
        for cut, state, before_cut, count in rows:
            self.cut = cut
            if state is not None:
                totals[state] += count
                self.finished[state] = self.finished.get(state, 0) + before_cut
        self.totals_followups = self.followups + seen
        self.followups += before
        self.upto, self.seen = self.seen, max(highest, self.seen)
        return totals

    def line(self, note: str = "", *, producing: bool = True, recount: bool = False) -> str:
        totals = self.totals(recount=recount)
        self.lines += 1
        if producing and self.lines > 1:
            self.backlog.append(totals[JobState.AVAILABLE])
            self.parked.append(totals[JobState.WAITING_EXTERNAL])
        now = time.monotonic()
        completed, produced = totals[JobState.COMPLETED], self.produced()
        rate = enqueued = 0.0
        if self.last_completed is not None and now > self.last_at:
            rate = max(0, completed - self.last_completed) / (now - self.last_at)
            enqueued = max(0, produced - self.last_produced) / (now - self.last_at)
        self.last_completed, self.last_produced, self.last_at = completed, produced, now
        states = " ".join(f"{state}={totals[state]}" for state in STATES)
        text = (
            f"{now - self.started:6.1f}s {enqueued:6.0f} produced/s {rate:6.0f} completed/s"
            f" | {states}"
        )
        text += f" | follow-ups={self.totals_followups}"
        return f"{text}  {note}" if note else text


UNFINISHED = """
SELECT count(*) FROM ONLY awa_job
WHERE id > %(job)s AND state NOT IN ('completed', 'failed', 'cancelled')
"""


def unfinished(alias: str, marks: Marks) -> int:
    """The run's jobs not yet finished: all in awa_job itself, never in awa_job_done."""
    with connections[alias].cursor() as cursor:
        cursor.execute(UNFINISHED, {"job": marks.job})
        (count,) = cursor.fetchone()
    return int(count)


# -- the summary -------------------------------------------------------------------

KIND_STATES = """
SELECT kind, state, count(*) FROM awa_job WHERE id > %(job)s GROUP BY kind, state ORDER BY kind
"""

SHOP_COUNTS = """
SELECT
    (SELECT count(*) FROM shop_receipt r WHERE r.order_id > %(order)s),
    (SELECT count(*) FROM shop_refund f WHERE f.order_id > %(order)s),
    (SELECT count(*) FROM shop_notice n WHERE n.order_id > %(order)s),
    (SELECT count(*) FROM awa_job j WHERE j.id > %(job)s AND j.metadata ? 'awa_trigger')
"""

# From when a handler began to when its outcome was written, per kind: the
# handler's own time plus the completer's batching. ShipOrder waits for its
# callback, so its rows measure the carrier instead.
LATENCY = """
SELECT kind, count(*),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finalized_at - attempted_at)),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finalized_at - attempted_at))
FROM awa_job
WHERE id > %(job)s AND state = 'completed' AND attempted_at IS NOT NULL AND kind <> 'ship_order'
GROUP BY kind ORDER BY kind
"""

ORDER_STATUSES = """
SELECT status, count(*) FROM shop_order WHERE id > %(order)s GROUP BY status ORDER BY status
"""

# Each check counts the rows that break it; 0 is a pass. Follow-ups are found by
# ``metadata #>> '{awa_trigger,job_id}'``, the expression awa_job_trigger_idx covers.
# ``settled``: holds once the follow-up jobs have run; else at every instant.
CHECKS: list[tuple[str, bool, str]] = [
    (
        "every paid order has exactly one receipt",
        True,
        """
        SELECT count(*) FROM shop_order o
        WHERE o.id > %(order)s AND o.status IN ('paid', 'shipping')
          AND (SELECT count(*) FROM shop_receipt r WHERE r.order_id = o.id) <> 1
        """,
    ),
    (
        "every exhausted charge has exactly one refund",
        True,
        """
        SELECT count(*) FROM awa_job j
        WHERE j.id > %(job)s AND j.kind = 'charge_card' AND j.state = 'failed'
          AND (SELECT count(*) FROM shop_refund f
               WHERE f.order_id = (j.args->>'order_id')::bigint) <> 1
        """,
    ),
    (
        "every order is paid if and only if its charge completed",
        False,
        """
        SELECT count(*) FROM shop_order o
        JOIN awa_job j ON j.kind = 'charge_card' AND (j.args->>'order_id')::bigint = o.id
        WHERE o.id > %(order)s AND j.id > %(job)s
          AND (o.status IN ('paid', 'shipping')) <> (j.state = 'completed')
        """,
    ),
    (
        "every completed charge enqueued one SendReceipt and (outside a workflow) one ShipOrder",
        False,
        """
        SELECT count(*) FROM awa_job j
        WHERE j.id > %(job)s AND j.kind = 'charge_card' AND j.state = 'completed'
          AND (SELECT count(*) FILTER (WHERE f.kind = 'send_receipt') <> 1
                   OR count(*) FILTER (WHERE f.kind = 'ship_order')
                      <> CASE WHEN j.workflow_id IS NULL THEN 1 ELSE 0 END
               FROM awa_job f
               WHERE f.metadata ? 'awa_trigger'
                 AND f.metadata #>> '{awa_trigger,job_id}' = j.id::text)
        """,
    ),
    (
        "every exhausted charge enqueued one RefundOrder",
        False,
        """
        SELECT count(*) FROM awa_job j
        WHERE j.id > %(job)s AND j.kind = 'charge_card' AND j.state = 'failed'
          AND (SELECT count(*) FROM awa_job f
               WHERE f.kind = 'refund_order' AND f.metadata ? 'awa_trigger'
                 AND f.metadata #>> '{awa_trigger,job_id}' = j.id::text) <> 1
        """,
    ),
    # Order workflows (shop.jobs.order_workflow). Edges are looked up by
    # awa_dependency_dependents_idx and the primary key (job_id, depends_on_id).
    (
        "every workflow step (a shipped order's too) started after its dependencies completed",
        False,
        """
        SELECT count(*) FROM awa_job s
        JOIN awa_job_dependency e ON e.job_id = s.id
        JOIN awa_job d ON d.id = e.depends_on_id
        WHERE s.id > %(job)s AND s.workflow_id IS NOT NULL AND s.attempted_at IS NOT NULL
          AND e.requires = 'completed'
          AND NOT (d.state = 'completed' AND d.finalized_at <= s.attempted_at)
        """,
    ),
    (
        "no workflow step ran twice",
        False,
        """
        SELECT (SELECT count(*) FROM awa_job
                WHERE id > %(job)s AND workflow_id IS NOT NULL
                  AND kind IN ('pack_order', 'invoice_order', 'order_report') AND attempt > 1)
             + (SELECT count(*) FROM (
                    SELECT 1 FROM awa_job WHERE id > %(job)s AND workflow_id IS NOT NULL
                    GROUP BY workflow_id, kind HAVING count(*) > 1) AS twice)
        """,
    ),
    (
        "every order workflow ended, its report run once after shipping finished",
        True,
        """
        SELECT count(*) FROM (SELECT DISTINCT workflow_id FROM awa_job
                              WHERE id > %(job)s AND workflow_id IS NOT NULL) AS w
        WHERE EXISTS (SELECT 1 FROM awa_job j WHERE j.workflow_id = w.workflow_id
                      AND j.state NOT IN ('completed', 'failed', 'cancelled'))
           OR NOT EXISTS (
                SELECT 1 FROM awa_job r JOIN awa_job s
                  ON s.workflow_id = r.workflow_id AND s.kind = 'ship_order'
                WHERE r.workflow_id = w.workflow_id AND r.kind = 'order_report'
                  AND r.state = 'completed' AND r.attempted_at >= s.finalized_at)
        """,
    ),
]


@dataclass(slots=True)
class Summary:
    kinds: dict[str, dict[str, int]]
    orders: dict[str, int]
    receipts: int
    refunds: int
    notices: int
    followups: int
    unfinished: int
    checks: list[tuple[str, bool, int]]  # (description, settled, violations)
    latency: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # count, p50, p99

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, settled, bad in self.checks if bad and not self.skipped(settled)]

    def skipped(self, settled: bool) -> bool:
        return settled and self.unfinished > 0

    @property
    def totals(self) -> dict[str, int]:
        totals = dict.fromkeys(STATES, 0)
        for states in self.kinds.values():
            for state, count in states.items():
                totals[state] = totals.get(state, 0) + count
        return totals

    @classmethod
    def collect(cls, alias: str, marks: Marks) -> Summary:
        params = {"job": marks.job, "order": marks.order}
        kinds: dict[str, dict[str, int]] = {}
        with connections[alias].cursor() as cursor:
            cursor.execute(KIND_STATES, params)
            for kind, state, count in cursor.fetchall():
                kinds.setdefault(kind, {})[state] = count
            cursor.execute(ORDER_STATUSES, params)
            orders = dict(cursor.fetchall())
            cursor.execute(SHOP_COUNTS, params)
            receipts, refunds, notices, followups = cursor.fetchone()
            checks = []
            for name, settled, query in CHECKS:
                cursor.execute(query, params)
                checks.append((name, settled, cursor.fetchone()[0]))
            cursor.execute(LATENCY, params)
            latency = {kind: (n, p50, p99) for kind, n, p50, p99 in cursor.fetchall()}
        return cls(
            kinds=kinds,
            orders=orders,
            receipts=receipts,
            refunds=refunds,
            notices=notices,
            followups=followups,
            unfinished=unfinished(alias, marks),
            checks=checks,
            latency=latency,
        )

    def render(self, write: Callable[[str], None]) -> None:
        totals = self.totals
        write(f"jobs this run: {sum(totals.values())}")
        write("  " + " ".join(f"{state}={totals[state]}" for state in STATES if totals[state]))
        width = max((len(kind) for kind in self.kinds), default=4)
        for kind, states in sorted(self.kinds.items()):
            parts = " ".join(f"{state}={states[state]}" for state in STATES if state in states)
            write(f"  {kind:<{width}}  {parts}")
        write("orders: " + " ".join(f"{status}={n}" for status, n in self.orders.items()))
        write(
            f"receipts={self.receipts} refunds={self.refunds} notices={self.notices} "
            f"follow-up jobs={self.followups}"
        )
        if self.latency:
            write("handler began -> outcome written (attempted_at to finalized_at), p50 / p99:")
            for kind, (n, p50, p99) in self.latency.items():
                write(f"  {kind:<{width}}  {p50 * 1000:6.1f} / {p99 * 1000:6.1f} ms  ({n} jobs)")
        for name, settled, bad in self.checks:
            if self.skipped(settled) and bad:
                verdict = f"not yet ({bad}; {self.unfinished} jobs unfinished)"
            else:
                verdict = "ok" if not bad else f"FAILED ({bad} rows)"
            write(f"check: {name}: {verdict}")


def write_line(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    return write
