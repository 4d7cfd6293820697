"""The README's "Testing your jobs" examples: they run here, and the README quotes them.

Each region between ``# README: <name>`` and ``# README: end`` appears verbatim
in README.md as a fenced block; ``test_the_readme_quotes_these_examples`` checks
that, so the README cannot drift from code that runs.
"""

from __future__ import annotations

# README: testing-testcase
from dataclasses import dataclass

from django.test import TestCase

import django_awa as awa
from django_awa.testing import assert_enqueued, perform_job, refute_enqueued, run_jobs


@dataclass
class SendWelcome(awa.JobArgs):
    email: str


SENT: list[str] = []


@awa.worker(SendWelcome, queue="mail")
def send_welcome(job: awa.JobContext) -> None:
    SENT.append(job.args.email)


def sign_up(email: str) -> None:
    # ... create the user, then:
    awa.enqueue(SendWelcome(email=email))


class SignUpTests(TestCase):
    def setUp(self) -> None:
        SENT.clear()

    def test_sign_up_enqueues_the_welcome_mail(self) -> None:
        sign_up("ada@example.com")
        assert_enqueued(SendWelcome, email="ada@example.com", queue="mail")
        refute_enqueued(SendWelcome, email="bob@example.com")

    def test_the_welcome_mail_is_sent(self) -> None:
        sign_up("ada@example.com")
        report = run_jobs()  # in this thread, inside the test's transaction
        assert report.completed == 1
        assert SENT == ["ada@example.com"]
        refute_enqueued(SendWelcome)  # completed jobs are no longer enqueued

    def test_the_handler_alone(self) -> None:
        assert perform_job(SendWelcome(email="x@example.com"), attempt=2) is None
        assert SENT == ["x@example.com"]


# README: end


# README: testing-pytest
# conftest.py: pytest_plugins = ["django_awa.testing.pytest"]


def test_sign_up_with_the_fixture(awa_jobs) -> None:
    sign_up("ada@example.com")
    awa_jobs.assert_enqueued(SendWelcome, email="ada@example.com")
    assert awa_jobs.run_jobs(queue="mail").completed == 1


# README: end


def test_the_readme_quotes_these_examples() -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    region = re.compile(r"^# README: (?P<name>[\w-]+)\n(?P<code>.*?)^# README: end\n", re.M | re.S)
    source = Path(__file__).read_text()
    regions = {m["name"]: m["code"].strip("\n") for m in region.finditer(source)}
    assert set(regions) == {"testing-testcase", "testing-pytest"}
    for name, code in regions.items():
        marker = f"<!-- tests/test_readme_testing.py: {name} -->\n```python\n"
        assert marker in readme, f"README.md lacks the {name} example (marker {marker!r})"
        quoted = readme.split(marker, 1)[1].split("\n```", 1)[0]
        assert quoted == code, f"README.md's {name} example differs from this file's"
