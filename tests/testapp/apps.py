from django.apps import AppConfig


class TestAppConfig(AppConfig):
    """Job kinds and follow-ups used by the test suite (jobs.py, followups.py)."""

    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.BigAutoField"
