"""Settings for worker subprocesses that export OpenTelemetry to files (tests/test_otel.py).

``AWA_TEST_OTEL_DIR`` names a directory: each worker process writes its finished
spans to ``spans-<pid>.jsonl`` and its metrics, collected every half second and
at exit, to ``metrics-<pid>.jsonl`` (one JSON document a line).
"""

import json
import os
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from tests.settings import *  # noqa: F403

_DIR = Path(os.environ["AWA_TEST_OTEL_DIR"])


class _SpanFile(SpanExporter):
    def export(self, spans):  # type: ignore[no-untyped-def]
        with (_DIR / f"spans-{os.getpid()}.jsonl").open("a") as out:
            for span in spans:
                out.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS


class _MetricFile(MetricExporter):
    def export(self, metrics_data, timeout_millis=10_000, **kwargs):  # type: ignore[no-untyped-def]
        with (_DIR / f"metrics-{os.getpid()}.jsonl").open("a") as out:
            out.write(json.dumps(json.loads(metrics_data.to_json(indent=None))) + "\n")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):  # type: ignore[no-untyped-def]
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):  # type: ignore[no-untyped-def]
        pass


_tracer_provider = TracerProvider()
_tracer_provider.add_span_processor(SimpleSpanProcessor(_SpanFile()))
trace.set_tracer_provider(_tracer_provider)
metrics.set_meter_provider(
    MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(_MetricFile(), export_interval_millis=500)]
    )
)
