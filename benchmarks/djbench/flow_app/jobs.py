"""Job kinds of the flow-control benchmark (``benchmarks/flow_control.py``): no-ops."""

from __future__ import annotations

from dataclasses import dataclass

import django_awa as awa


@dataclass
class FlowNoop(awa.JobArgs):
    """Enqueued on the queue a workload names: bench (unlimited), glob, rated."""

    n: int = 0


@dataclass
class KeyedNoop(awa.JobArgs):
    key: int = 0
    n: int = 0


@dataclass
class SeqNoop(awa.JobArgs):
    key: int = 0
    n: int = 0


def noop(job: awa.JobContext) -> None:
    return None


awa.worker(FlowNoop, queue="bench")(noop)
awa.worker(KeyedNoop, queue="keyed", limit=awa.Limit(concurrency=1, by="key"))(noop)
awa.worker(SeqNoop, queue="seq", sequence="key")(noop)
