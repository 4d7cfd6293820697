import os

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    """Job kinds and follow-ups used by the test suite (jobs.py, followups.py)."""

    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A worker a test starts with AWA_TEST_RAISING_RECEIVER=SystemExit (say) has a
        # job_completed receiver that raises it: receivers are the user's code.
        name = os.environ.get("AWA_TEST_RAISING_RECEIVER")
        if name:
            from django_awa.signals import job_completed

            from .jobs import base_exception

            def raising_receiver(sender: object, **kwargs: object) -> None:
                raise base_exception(name)

            job_completed.connect(raising_receiver, weak=False)
