"""On PYTHONPATH first, this makes ``import opentelemetry`` fail as if the otel extra
were not installed (tests/test_otel.py)."""

raise ImportError("opentelemetry is blocked for this test process")
