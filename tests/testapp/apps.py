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
        # A worker a test starts with AWA_TEST_BREAK_THREAD=completer (or producer,
        # listener) has that service raise an error it does not expect, as a defect
        # in it would: the worker must stop, not run on without it.
        broken = os.environ.get("AWA_TEST_BREAK_THREAD")
        if broken:
            break_service(broken)


def break_service(name: str) -> None:
    from django_awa.completer import Completer
    from django_awa.listener import Listener
    from django_awa.producer import Producer

    owner, method = {
        "producer": (Producer, "run_once"),
        "completer": (Completer, "write"),
        "listener": (Listener, "run_once"),
    }[name]

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"injected fault in the {name}")

    setattr(owner, method, broken)
