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


@dataclass
class TouchAccount(awa.JobArgs):
    """The ORM-handler workload: read one HandlerAccount row and update it."""

    account: int = 1


@dataclass
class TouchAccountAtomic(awa.JobArgs):
    """The same handler run with atomic=True (its update commits with the completion)."""

    account: int = 1


@awa.worker(Noop, queue=common.QUEUE)
def noop(job):
    common.record_latency(job.args.t)


# Follow-ups go to a queue no benchmark worker runs: the follow-up drain
# measures the cost of inserting them with each completion, not of running them.
@awa.worker(NoopFollowUp, queue="bench_followups")
def noop_follow_up(job):
    return None


@awa.worker(TouchAccount, queue=common.QUEUE)
def touch_account(job):
    common.touch_account(job.args.account)


@awa.worker(TouchAccountAtomic, queue=common.QUEUE, atomic=True)
def touch_account_atomic(job):
    common.touch_account(job.args.account)
