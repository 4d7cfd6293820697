from importlib import import_module

from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import autodiscover_modules


class AwaConfig(AppConfig):
    name = "django_awa"
    label = "django_awa"
    verbose_name = "Awa jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the system checks

        # Every installed app's jobs.py, then its followups.py. A missing module
        # is skipped; an error inside one that exists is raised.
        try:
            autodiscover_modules("jobs")
            autodiscover_modules("followups")
        except Exception:
            from . import reloader

            if not reloader.is_watcher():
                raise
            # The `awa_worker --reload` watcher runs no jobs (as runserver's own
            # process serves no requests): the worker it starts meets the error
            # again and prints it, and the watcher waits for the fix.
        # Workers serve Django Tasks only once the backend's resolver is registered.
        backends = getattr(settings, "TASKS", None) or {}
        if any(
            isinstance(conf, dict) and conf.get("BACKEND") == "django_awa.backends.AwaTaskBackend"
            for conf in backends.values()
        ):
            try:
                import_module("django_awa.backends")
            except ImportError as exc:
                raise ImproperlyConfigured(
                    "TASKS uses django_awa.backends.AwaTaskBackend, which needs Django 6 "
                    "(django.tasks) or, on Django 5.2, the django-tasks backport "
                    f"(pip install 'django-awa[tasks]'): {exc}"
                ) from exc
