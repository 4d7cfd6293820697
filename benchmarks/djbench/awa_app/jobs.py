"""django-awa job kinds for the benchmark (autodiscovered by AwaConfig.ready())."""

from __future__ import annotations

from dataclasses import dataclass

from systems import _common as common

import django_awa as awa


@dataclass
class Noop(awa.JobArgs):
    n: int = 0
    # enqueue time (time.time()) in the pickup-latency workload, else 0
    t: float = 0.0


@dataclass
class NoopFollowUp(awa.JobArgs):
    n: int = 0


@awa.worker(Noop, queue=common.QUEUE)
def noop(job):
    common.record_latency(job.args.t)


# Follow-ups go to a queue no benchmark worker runs: the follow-up drain
# measures the cost of inserting them with each completion, not of running them.
@awa.worker(NoopFollowUp, queue="bench_followups")
def noop_follow_up(job):
    return None
