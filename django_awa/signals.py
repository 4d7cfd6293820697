"""Signals for observation: metrics, logs, dashboards.

Sent after the outcome commits, best effort (``send_robust``: a failing
receiver is logged, never raised). For a side effect that must happen, declare
a follow-up instead: it commits with the outcome.

Every signal is sent with ``sender=Job`` and ``job`` (the row after the
transition), plus the outcome's context: ``job_retried`` gets ``error``,
``attempt`` and ``next_run_at``; ``job_exhausted`` ``error`` and ``attempt``;
``job_cancelled`` ``reason``; ``job_rescued`` ``reason`` (an ``awa.RescueReason``).
"""

from django.dispatch import Signal

job_completed = Signal()
job_retried = Signal()
job_exhausted = Signal()
job_cancelled = Signal()
job_rescued = Signal()
