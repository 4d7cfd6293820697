"""OpenTelemetry, with the ``otel`` extra (``opentelemetry-api``): traces and metrics.

- Enqueue records the current trace context (W3C ``traceparent``/``tracestate``)
  in ``metadata["awa_trace"]`` when a span is current.
- Each attempt runs in a span ``awa.job <kind>`` (kind CONSUMER, messaging
  attributes): a child of the enqueuing span on attempt 1, a new trace linked
  to it on later attempts. A follow-up's ``awa_trace`` also lists its
  trigger's attempt span under ``"links"``: its span links to it; so does a
  workflow step's, the attempt spans of the dependencies whose outcomes
  released it. Where that attempt did not run in the process writing the
  outcome (a rescue, a callback, a cancel), the link is to the trigger's own
  ``awa_trace``: the span it was enqueued under (``trigger_links``).
- Metrics through the metrics API: ``awa.jobs.finished`` (counter, by kind,
  queue and the outcome the worker wrote: ``count_written``),
  ``awa.job.attempt.duration`` and ``awa.job.wait`` (histograms, seconds:
  handler run, and due to start) and, in the worker leading maintenance,
  ``awa.jobs`` (gauge per queue and state, from that leader's count, 0 where
  it found no job: the samples of ``/metrics``' ``awa_jobs``).

``AWA["OPENTELEMETRY"]``: ``None`` (default) instruments when
``opentelemetry`` can be imported, ``False`` never (nothing is imported),
``True`` requires it (a system check error names the key when it is missing).
Nothing here imports ``opentelemetry`` until ``instrumentation()`` is first asked
and allowed to.

While no tracer provider is set (the API alone, often pulled in by other
libraries, or ``NoOpTracerProvider``) no span is recorded here, so none is
started for an attempt and no workflow step's links are looked up
(``Instrumentation.traces``, asked per call: a project may set its SDK's
provider once its worker runs). A trace context made current all the same (from
an incoming request's headers) is still passed on in ``awa_trace``, with the
links a follow-up takes from its trigger's: no statement of its own.
The metrics are unaffected: they go through the metrics API, whatever the tracer.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils import timezone

from .conf import awa_settings

if TYPE_CHECKING:
    from .execute import AttemptResult
    from .models import Job, JobRow

# How many attempts' span contexts are kept for their follow-ups to link to.
LINKS_KEPT = 10_000
# Histogram values waiting for the completer to hand them to the SDK; past this
# many (no completer running) the attempt's own thread hands them over.
PENDING_KEPT = 100_000
# (kind, queue, worker) combinations whose span names and attributes are kept.
STATIC_KEPT = 10_000

# The keys of the W3C trace context an ``awa_trace`` entry carries.
_W3C_HEADERS = ("traceparent", "tracestate")
_UNRESOLVED = object()
# Attempts finished per (kind, queue, outcome) in this process: awa.jobs.finished.
_FINISHED: dict[tuple[str, str, str], int] = {}
_FINISHED_LOCK = threading.Lock()
_instrumentation: Any = _UNRESOLVED
_lock = threading.Lock()


def importable() -> bool:
    """Whether the OpenTelemetry API can be imported (without importing it if absent)."""
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):
        return False


def instrumentation() -> Instrumentation | None:
    """The instrumentation, or None when disabled or not installed (decided once)."""
    global _instrumentation
    found = _instrumentation
    if found is _UNRESOLVED:
        with _lock:
            if _instrumentation is _UNRESOLVED:
                _instrumentation = _resolve()
            found = _instrumentation
    return found  # type: ignore[no-any-return]


def _resolve() -> Instrumentation | None:
    if awa_settings().opentelemetry is False or not importable():
        return None
    try:
        return Instrumentation()
    except ImportError:
        return None


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    global _instrumentation
    if setting == "AWA":
        _instrumentation = _UNRESOLVED


def with_trace(metadata_json: str | None) -> str | None:
    """Engine metadata text with ``awa_trace`` added from the current span, if any.

    With or without a tracer provider here: a context made current from an
    incoming request's headers is passed on to the job, as the API passes it on
    without an SDK, for a worker that records spans. ``None`` in, ``None`` out
    when there is nothing to add; text that has an ``awa_trace`` already (a
    follow-up's) is left as it is.
    """
    found = instrumentation()
    if found is None or (metadata_json is not None and '"awa_trace"' in metadata_json):
        return metadata_json
    trace = found.current_context()
    if trace is None:
        return metadata_json
    entry = json.dumps({"awa_trace": trace})
    if metadata_json is None or metadata_json == "{}":
        return entry
    return f"{metadata_json[:-1]}, {entry[1:]}"


def count_written(results: Iterable[AttemptResult]) -> None:
    """Count the attempts' outcomes a worker wrote in ``awa.jobs.finished`` (with the
    otel extra; nothing without it)."""
    found = instrumentation()
    if found is not None:
        found.count_written(results)


def followup_trace(trigger: Job) -> dict[str, Any] | None:
    """A follow-up's ``awa_trace``: the current span as parent (if any) and a link
    to the trigger (``Instrumentation.trigger_links``); passed on with or without
    a tracer provider here, as ``with_trace`` passes on a context."""
    found = instrumentation()
    if found is None:
        return None
    trace = found.current_context() or {}
    metadata = trigger.metadata
    stored = metadata.get("awa_trace") if isinstance(metadata, dict) else None
    link = found.trigger_links({trigger.id: stored}).get(trigger.id)
    if link is not None:
        trace["links"] = [link]
    return trace or None


class _Labels:
    """A kind on a queue's metric labels, made once: the wait histogram's and,
    per outcome, the duration histogram's (the SDK copies them as it records)."""

    __slots__ = ("by_outcome", "kind", "queue", "queued")

    def __init__(self, kind: str, queue: str) -> None:
        self.kind, self.queue = kind, queue
        self.queued = {"awa.job.kind": kind, "messaging.destination.name": queue}
        self.by_outcome: dict[str, dict[str, str]] = {}

    def finished(self, outcome: str) -> dict[str, str]:
        labels = self.by_outcome.get(outcome)
        if labels is None:
            labels = self.by_outcome[outcome] = {**self.queued, "awa.job.outcome": outcome}
        return labels


class Traced:
    """One attempt's span while its handler runs (``Instrumentation.start``/``finish``):
    ``span`` and ``token`` None without a tracer provider, its timing kept for the metrics."""

    __slots__ = ("job_id", "labels", "span", "started", "token", "unended", "waited")

    def __init__(self, job_id: int, span: Any, token: Any, labels: _Labels) -> None:
        self.job_id, self.span, self.token, self.labels = job_id, span, token, labels
        self.waited: float | None = None
        self.started = 0.0
        # Popped by whoever ends the span (Instrumentation._end), once: the
        # handler thread as its handler returns, or, for an attempt past its
        # timeout, the thread that wrote the timed-out outcome, whichever is
        # first. list.pop() is atomic: no lock for the common case.
        self.unended = [True]


class Instrumentation:
    """The tracer, the meter's instruments and the W3C propagator: made once."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from . import __version__

        self.trace = trace
        self._no_provider = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self.propagator = TraceContextTextMapPropagator()
        self.tracer = trace.get_tracer("django_awa", __version__)
        meter = metrics.get_meter("django_awa", __version__)
        # Counted here and reported when the reader collects (an observable
        # counter): a synchronous counter's add() costs the SDK an attribute
        # hashing per attempt, a dict increment costs next to nothing.
        # Module-level, not per instance: the SDK keeps the first observable
        # counter of a name, whose callback must see the counts of a later
        # Instrumentation (made again when AWA settings change).
        self._finished = _FINISHED
        self._finished_lock = _FINISHED_LOCK
        meter.create_observable_counter(
            "awa.jobs.finished",
            callbacks=[self._observe_finished],
            unit="{job}",
            description="Attempts finished, by the outcome the worker wrote",
        )
        self.duration = meter.create_histogram(
            "awa.job.attempt.duration", unit="s", description="How long an attempt's handler ran"
        )
        self.wait = meter.create_histogram(
            "awa.job.wait", unit="s", description="From a job's run_at to its attempt's start"
        )
        self.meter = meter
        from opentelemetry.context import attach, detach
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode

        self._link, self._consumer = Link, SpanKind.CONSUMER
        self._attach, self._detach, self._in_context = attach, detach, trace.set_span_in_context
        # Per (kind, queue, worker): the span's name, fixed attributes and labels.
        self._static: dict[tuple[str, str, str], tuple[str, dict[str, Any], _Labels]] = {}
        self._status, self._error = Status, StatusCode.ERROR
        # The attempt spans' contexts; their W3C headers are made when a
        # follow-up asks (attempt_links), not for every attempt.
        self._links: OrderedDict[int, Any] = OrderedDict()
        self._links_lock = threading.Lock()
        # Contexts of attempts ended since the last fold (_fold_links): the
        # handler threads append without a lock; the threads that build
        # follow-ups (attempt_links) move them into _links under the lock.
        self._new_links: deque[tuple[int, Any]] = deque()
        self._gauges: set[str] = set()
        # The attempts' histogram values and finished counts, recorded by one
        # thread (record_pending, from the completer, or a metric collection):
        # the SDK aggregates a histogram under a lock, and the handler threads
        # recording at once queued on it (and on the finished counts' lock),
        # each waiting while the holder waited for the GIL (a fifth of a
        # drain's samples). deque.append and popleft need no lock of ours.
        self._pending: deque[tuple[_Labels, float | None, float, str]] = deque()

    # -- context -----------------------------------------------------------------

    def traces(self) -> bool:
        """Whether spans can be recorded here: a tracer provider is set (an SDK's).

        Without one (the API's proxy with nothing behind it, or its no-op
        provider) every span is a no-op: its links and the ``awa_trace`` that
        would parent it are not worth a query, a write or the attempt's span.
        Asked per call, not once: the provider may be set after this was made
        (the SDK configured once Django is set up).
        """
        return not isinstance(self.trace.get_tracer_provider(), self._no_provider)

    def current_context(self) -> dict[str, Any] | None:
        """The current span's W3C headers, or None without a valid current span."""
        if not self.trace.get_current_span().get_span_context().is_valid:
            return None
        carrier: dict[str, Any] = {}
        self.propagator.inject(carrier)
        return carrier or None

    def _span_context(self, headers: Any) -> Any:
        """The span context W3C headers name, or None."""
        if not isinstance(headers, dict) or not isinstance(headers.get("traceparent"), str):
            return None
        carrier = {k: v for k, v in headers.items() if k in _W3C_HEADERS}
        context = self.propagator.extract(carrier)
        span_context = self.trace.get_current_span(context).get_span_context()
        return span_context if span_context.is_valid else None

    def attempt_links(self, job_ids: Iterable[int]) -> dict[int, dict[str, str]]:
        """The W3C headers of the latest attempt span in this process of each of
        ``job_ids`` that has one (one lock taken)."""
        with self._links_lock:
            self._fold_links()
            found = [(i, c) for i in job_ids if (c := self._links.get(i)) is not None]
        links: dict[int, dict[str, str]] = {}
        for job_id, span_context in found:
            carrier: dict[str, str] = {}
            span = self.trace.NonRecordingSpan(span_context)
            self.propagator.inject(carrier, context=self.trace.set_span_in_context(span))
            links[job_id] = carrier
        return links

    def trigger_links(self, triggers: dict[int, Any]) -> dict[int, dict[str, str]]:
        """What follow-ups and released workflow steps link to, per trigger job id:
        its latest attempt span in this process (``attempt_links``), else the trace
        it recorded when it was enqueued (``triggers[id]``, its ``awa_trace``): the
        trigger's attempt ran in another process (a rescued job's worker died, a
        callback's answer came to a web process) or never ran (cancelled)."""
        links = self.attempt_links(triggers)
        for job_id, stored in triggers.items():
            if job_id not in links and self._span_context(stored) is not None:
                links[job_id] = {
                    k: v for k, v in stored.items() if k in _W3C_HEADERS and isinstance(v, str)
                }
        return links

    def _observe_finished(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        self.record_pending()  # a collection sees every attempt finished so far
        with self._finished_lock:
            counts = list(self._finished.items())
        return [
            Observation(
                count,
                {
                    "awa.job.kind": kind,
                    "messaging.destination.name": queue,
                    "awa.job.outcome": outcome,
                },
            )
            for (kind, queue, outcome), count in counts
        ]

    def _fold_links(self) -> None:
        """Move the attempts' span contexts queued since into ``_links`` (under
        ``_links_lock``), keeping the newest ``LINKS_KEPT``."""
        links, new = self._links, self._new_links
        while new:
            try:
                job_id, span_context = new.popleft()
            except IndexError:
                break
            links[job_id] = span_context
            links.move_to_end(job_id)
        while len(links) > LINKS_KEPT:
            links.popitem(last=False)

    # -- attempts ----------------------------------------------------------------

    def start(self, job: JobRow, worker: str) -> Traced:
        """Begin the attempt's span and make it current in this thread (until ``finish``).

        Per attempt this costs one ``start_span`` (its attributes passed in the
        call), one context attach and the clock; what depends only on the kind,
        queue and worker (the span's name, most attributes, the metrics'
        labels) is built once and reused. Without a tracer provider (``traces``)
        there is no span: the clock only, for the metrics.
        """
        kind, queue = job.kind, job.queue
        static = self._static.get((kind, queue, worker))
        if static is None:
            static = self._static_for(kind, queue, worker)
        name, fixed, labels = static
        if not self.traces():
            # No tracer provider: the span would be a no-op one (or, under an
            # enqueuing span's context, that context again, linked to for nothing).
            # The metrics' timing only.
            traced = Traced(job.id, None, None, labels)
        else:
            traced = self._begin_span(job, name, fixed, labels)
        if job.run_at is not None:
            # The handler begins now (attempted_at is written later, with the
            # outcome); the worker's clock against the database's run_at.
            # timezone.now() is naive, as run_at is, in a project without USE_TZ.
            traced.waited = max(0.0, (timezone.now() - job.run_at).total_seconds())
        traced.started = time.perf_counter()
        return traced

    def _begin_span(self, job: JobRow, name: str, fixed: dict[str, Any], labels: _Labels) -> Traced:
        """``start``'s span, current from now in this thread."""
        metadata = job.metadata
        trace_entry = metadata.get("awa_trace") if isinstance(metadata, dict) else None
        parent = links = None
        if trace_entry is not None:
            parent, links = self._parent_and_links(trace_entry, job.attempt)
        attributes = {
            **fixed,
            "messaging.message.id": str(job.id),
            "awa.job.attempt": job.attempt,
            "awa.job.max_attempts": job.max_attempts,
            "awa.job.priority": job.priority,
        }
        span = self.tracer.start_span(
            name, context=parent, kind=self._consumer, attributes=attributes, links=links
        )
        traced = Traced(job.id, span, self._attach(self._in_context(span)), labels)
        # For its follow-ups and dependents to link to (attempt_links), from now:
        # its outcome, and what it releases, may be written before the span ends
        # (the completer's batch, an atomic handler's transaction). No lock here.
        span_context = span.get_span_context()
        if span_context.is_valid:
            self._new_links.append((job.id, span_context))
        return traced

    def finish(
        self,
        traced: Traced,
        result: AttemptResult | None,
        error: BaseException | None = None,
        *,
        lost: bool = False,
    ) -> None:
        """End the attempt's span with its outcome; queue its histogram values for the completer
        (unless the write of its timed-out outcome did already: ``count_written``).

        ``result`` None: a stale atomic attempt, or (``error`` given) the
        attempt raised past the worker's handler boundary. ``lost``: the
        attempt was cancelled or rescued, or its lease lost, while its handler
        ran, so what the handler returned is not the job's outcome: the span
        says ``lost``, as it does for a stale atomic attempt. The attempt is
        counted in ``awa.jobs.finished`` once its outcome is written
        (``count_written``), not here: a handler that returns after its
        attempt was cancelled, rescued or timed out had its result ignored.
        """
        try:
            if traced.token is not None:
                self._detach(traced.token)
        finally:
            self._end(traced, result, error, lost=lost)

    def _end(
        self,
        traced: Traced,
        result: AttemptResult | None,
        error: BaseException | None = None,
        *,
        lost: bool = False,
    ) -> None:
        """``finish``'s ending of the span and queueing of its histogram values,
        once: nothing if the span was ended already (``Traced.unended``)."""
        try:
            traced.unended.pop()
        except IndexError:
            return
        elapsed = time.perf_counter() - traced.started
        span = traced.span
        if error is not None:
            outcome = "error"
        elif result is None or lost:
            outcome = "lost"
        else:
            outcome = str(result.state)
        if span is not None:  # None: no tracer provider when the attempt started
            if span.is_recording():  # a span the sampler dropped takes nothing more
                if error is not None:
                    span.record_exception(error)
                    span.set_status(self._status(self._error, f"{type(error).__name__}: {error}"))
                else:
                    span.set_attribute("awa.job.outcome", outcome)
                    if result is not None and not lost and result.error:
                        span.set_status(self._status(self._error, result.error[:1000]))
            span.end()
        pending = self._pending
        pending.append((traced.labels, traced.waited, elapsed, outcome))
        if len(pending) > PENDING_KEPT:
            self.record_pending()

    def _static_for(self, kind: str, queue: str, worker: str) -> tuple[str, dict[str, Any], Any]:
        """The span name, the fixed span attributes and the metrics' labels of a
        kind on a queue in a worker (kept: a worker runs a bounded set of kinds)."""
        fixed = {
            "messaging.system": "awa",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.client.id": worker,
            "awa.job.kind": kind,
        }
        static = (f"awa.job {kind}", fixed, _Labels(kind, queue))
        if len(self._static) >= STATIC_KEPT:
            self._static.clear()
        self._static[(kind, queue, worker)] = static
        return static

    def _parent_and_links(self, trace_entry: Any, attempt: int) -> tuple[Any, list[Any] | None]:
        """From a job's ``awa_trace``: the enqueuing span as parent context
        (attempt 1) or as a link (later attempts), and the trigger's links."""
        Link = self._link
        enqueued = self._span_context(trace_entry)
        parent = None
        links = []
        if enqueued is not None:
            if attempt <= 1:
                parent = self._in_context(self.trace.NonRecordingSpan(enqueued))
            else:
                links.append(Link(enqueued, {"awa.link": "enqueue"}))
        if isinstance(trace_entry, dict):
            for headers in trace_entry.get("links") or ():
                linked = self._span_context(headers)
                if linked is not None:
                    links.append(Link(linked, {"awa.link": "trigger"}))
        return parent, links or None

    def count_written(self, results: Iterable[AttemptResult]) -> None:
        """Count the outcomes finalize wrote (the results it applied) in
        ``awa.jobs.finished``: a job given back (``available`` again: unstarted,
        or interrupted at shutdown) is no outcome. End the spans of those that
        timed out while their handlers still run (``AttemptResult.open_span``)."""
        from .models import JobState

        finished: dict[tuple[str, str, str], int] = {}
        for result in results:
            if result.open_span is not None:
                # Timed out while its handler still runs: the span ends with the
                # outcome written, not whenever (if ever) the handler returns.
                self._end(result.open_span, result)
            if result.state == JobState.AVAILABLE:
                continue
            outcome = str(result.state)
            key = (result.job.kind, result.job.queue, outcome)
            finished[key] = finished.get(key, 0) + 1
        if finished:
            with self._finished_lock:
                for key, count in finished.items():
                    self._finished[key] = self._finished.get(key, 0) + count

    def record_pending(self) -> None:
        """Hand the attempts' histogram values to the SDK (the completer, after each
        batch it writes: one thread, so no two wait on the SDK's lock)."""
        pending = self._pending
        wait, duration = self.wait.record, self.duration.record
        while pending:
            try:
                labels, waited, elapsed, outcome = pending.popleft()
            except IndexError:  # another thread took the last one
                break
            if waited is not None:
                wait(waited, labels.queued)
            duration(elapsed, labels.finished(outcome))
        if len(self._new_links) > LINKS_KEPT:
            with self._links_lock:
                self._fold_links()

    # -- gauges ------------------------------------------------------------------

    def observe_job_counts(self, alias: str, leading: Callable[[], bool] | None = None) -> None:
        """Register the ``awa.jobs`` gauge (once per alias), read from the leader's count.

        ``leading``: whether this process leads maintenance now (a worker's); it
        observes nothing while another does, so a fleet reports each count once,
        not once per worker process, and no collection queries the table twice.
        """
        from opentelemetry.metrics import Observation

        if alias in self._gauges:
            return
        self._gauges.add(alias)

        def observe(options: Any) -> Iterable[Observation]:
            from .metrics import last_job_counts

            if leading is not None and not leading():
                return []
            return [
                Observation(count, {"messaging.destination.name": queue, "awa.job.state": state})
                for queue, state, count in last_job_counts(alias, awa_settings())
            ]

        self.meter.create_observable_gauge(
            "awa.jobs",
            callbacks=[observe],
            unit="{job}",
            description="Jobs per queue and state, as the maintenance leader last counted",
        )
