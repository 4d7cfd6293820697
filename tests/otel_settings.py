"""Settings for worker subprocesses that export OpenTelemetry to files (tests/test_otel.py).

``AWA_TEST_OTEL_DIR`` names a directory: each worker process writes its finished
spans to ``spans-<pid>.jsonl`` and its metrics, collected every half second and
at exit, to ``metrics-<pid>.jsonl`` (one JSON document a line).

``AWA_TEST_OTEL_TRACER=late``: no tracer provider is set at start (the API alone,
as a project that configures no SDK has it) until a job runs
``Act(action="tracing")``, which sets it (``install_tracer_provider``); each
statement that reads or writes the trace links (sql.TRIGGER_EDGES,
sql.ADD_TRACE_LINKS) is noted, by name, in ``statements-<pid>.txt``.
"""

import json
import os
from pathlib import Path

from django.db.backends.signals import connection_created
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


def install_tracer_provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_SpanFile()))
    trace.set_tracer_provider(provider)


def _note_link_statements(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
    from django_awa import sql as statements

    for name in ("TRIGGER_EDGES", "ADD_TRACE_LINKS"):
        if sql == getattr(statements, name):
            with (_DIR / f"statements-{os.getpid()}.txt").open("a") as out:
                out.write(name + "\n")
    return execute(sql, params, many, context)


def _on_connection(sender, connection, **kwargs):  # type: ignore[no-untyped-def]
    connection.execute_wrappers.append(_note_link_statements)


if os.environ.get("AWA_TEST_OTEL_TRACER") == "late":
    connection_created.connect(_on_connection)
else:
    install_tracer_provider()
metrics.set_meter_provider(
    MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(_MetricFile(), export_interval_millis=500)]
    )
)
