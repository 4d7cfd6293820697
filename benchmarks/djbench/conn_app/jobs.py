"""The ORM handler: read one account through Django's ORM, then update it."""

from __future__ import annotations

from dataclasses import dataclass

import django_awa as awa

from .models import Account

QUEUE = "conn"


@dataclass
class Touch(awa.JobArgs):
    account: int


# Many attempts: without a pool, refused connections are retried, not failed.
@awa.worker(Touch, queue=QUEUE, max_attempts=25)
def touch(job):
    account = Account.objects.get(pk=job.args.account)
    account.balance += 1
    account.touched = job.attempt
    account.save(update_fields=["balance", "touched"])
