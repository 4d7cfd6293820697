"""django-awa for benchmarks/otel_overhead.py: ``BENCH_OTEL=off`` disables OpenTelemetry
(``AWA["OPENTELEMETRY"] = False``); ``BENCH_OTEL=sdk`` configures the SDK here, spans
and metrics exported to memory, as a process with tracing on would run;
``BENCH_OTEL=sampled`` the same with one trace in ten sampled (``ParentBased(
TraceIdRatioBased(0.1))``), as a busy production process would keep them;
``BENCH_OTEL=absent`` leaves the setting at its default with ``opentelemetry`` not
importable (benchmarks/otel_overhead.py puts tests/blocked first on the path), as
a process without the extra runs."""

import os

from djbench.settings_awa import *  # noqa: F403

_MODE = os.environ.get("BENCH_OTEL")
# absent: the default (None, instrument when importable) with opentelemetry not importable.
AWA = {**AWA, "OPENTELEMETRY": {"off": False, "absent": None}.get(_MODE, True)}  # noqa: F405

if _MODE in ("sdk", "sampled"):
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    _sampled = _MODE == "sampled"
    _provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.1)) if _sampled else None)
    _provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
