"""One on_completed follow-up per bench job (settings_awa_followups only)."""

from __future__ import annotations

from django_awa.followups import on_completed
from djbench.awa_app.jobs import Noop, NoopFollowUp


@on_completed(Noop)
def follow_up(args, job):
    return NoopFollowUp(n=args.n)
