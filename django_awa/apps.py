from django.apps import AppConfig
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
        autodiscover_modules("jobs")
        autodiscover_modules("followups")
