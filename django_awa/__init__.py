"""django-awa: background jobs in your PostgreSQL database, with transactional follow-ups.

The public API. Names load lazily, so ``import django_awa`` is safe before
Django's app registry is ready (``INSTALLED_APPS`` imports this package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0.dev0"

_EXPORTS = {
    # declaring
    "JobArgs": "kinds",
    "worker": "kinds",
    "Unique": "kinds",
    "Limit": "kinds",
    "periodic": "schedules",
    # enqueueing
    "enqueue": "enqueueing",
    "enqueue_many": "enqueueing",
    "aenqueue": "enqueueing",
    "aenqueue_many": "enqueueing",
    "EnqueueRequest": "enqueueing",
    # workflows
    "Workflow": "workflows",
    "WorkflowStatus": "workflows",
    "workflow_status": "workflows",
    # running
    "JobContext": "execute",
    "RetryAfter": "execute",
    "Snooze": "execute",
    "Cancel": "execute",
    "WaitForCallback": "execute",
    "CallbackToken": "execute",
    # rows and outcomes
    "JobState": "models",
    "Outcome": "followups",
    "RescueReason": "followups",
    # callbacks
    "complete_external": "callbacks",
    "fail_external": "callbacks",
    "retry_external": "callbacks",
    "heartbeat_callback": "callbacks",
    # operating
    "cancel": "control",
    "retry": "control",
    "pause_queue": "control",
    "resume_queue": "control",
    "queue_stats": "control",
    "pause_schedule": "schedules",
    "resume_schedule": "schedules",
    "trigger_schedule": "schedules",
    "set_queue_limits": "control",
    # errors
    "AwaError": "exceptions",
    "ValidationError": "exceptions",
    "UniqueConflict": "exceptions",
    "CallbackNotFound": "exceptions",
    "JobNotFound": "exceptions",
    "ScheduleNotFound": "exceptions",
    "TerminalError": "exceptions",
    "ConfigurationError": "exceptions",
}

__all__ = [
    "AwaError",
    "CallbackNotFound",
    "CallbackToken",
    "Cancel",
    "ConfigurationError",
    "EnqueueRequest",
    "JobArgs",
    "JobContext",
    "JobNotFound",
    "JobState",
    "Limit",
    "Outcome",
    "RescueReason",
    "RetryAfter",
    "ScheduleNotFound",
    "Snooze",
    "TerminalError",
    "Unique",
    "UniqueConflict",
    "ValidationError",
    "WaitForCallback",
    "Workflow",
    "WorkflowStatus",
    "aenqueue",
    "aenqueue_many",
    "cancel",
    "complete_external",
    "enqueue",
    "enqueue_many",
    "fail_external",
    "heartbeat_callback",
    "pause_queue",
    "pause_schedule",
    "periodic",
    "queue_stats",
    "resume_queue",
    "resume_schedule",
    "retry",
    "retry_external",
    "set_queue_limits",
    "trigger_schedule",
    "worker",
    "workflow_status",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'django_awa' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"django_awa.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from .callbacks import complete_external, fail_external, heartbeat_callback, retry_external
    from .control import cancel, pause_queue, queue_stats, resume_queue, retry, set_queue_limits
    from .enqueueing import EnqueueRequest, aenqueue, aenqueue_many, enqueue, enqueue_many
    from .exceptions import (
        AwaError,
        CallbackNotFound,
        ConfigurationError,
        JobNotFound,
        ScheduleNotFound,
        TerminalError,
        UniqueConflict,
        ValidationError,
    )
    from .execute import CallbackToken, Cancel, JobContext, RetryAfter, Snooze, WaitForCallback
    from .followups import Outcome, RescueReason
    from .kinds import JobArgs, Limit, Unique, worker
    from .models import JobState
    from .schedules import pause_schedule, periodic, resume_schedule, trigger_schedule
    from .workflows import Workflow, WorkflowStatus, workflow_status
