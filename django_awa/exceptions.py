"""Exceptions raised by django-awa.

Every error derives from :class:`AwaError`; configuration errors also derive
from Django's :class:`~django.core.exceptions.ImproperlyConfigured`.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class AwaError(Exception):
    """A django-awa operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ValidationError(AwaError, ValueError):
    """A job or its options were refused before anything was written."""


class UniqueConflict(AwaError):
    """A job with the same unique key is already held."""

    def __init__(self, message: str | None = None, *, conflicting_id: int | None = None) -> None:
        super().__init__(message)
        self.conflicting_id = conflicting_id


class CallbackNotFound(AwaError, LookupError):
    """No job is waiting on that callback id (unknown, or already resolved)."""


class JobNotFound(AwaError, LookupError):
    """No job has that id."""


class ScheduleNotFound(AwaError, LookupError):
    """No periodic schedule has that name (or it was removed from code, for a trigger)."""


class TerminalError(AwaError):
    """Raised by a handler: fail the job now, without further attempts."""


class ConfigurationError(AwaError, ImproperlyConfigured):
    """django-awa is configured wrongly."""


class WorkerFailed(AwaError):
    """One of the worker's own threads (a producer, the completer, the heartbeat,
    the listener, maintenance) ended on an error it did not expect; the worker
    stopped rather than run on without it."""
