"""The example project's demo, run as users run it: ``manage.py migrate`` then
``manage.py awa_demo`` in subprocesses with ``example_project.settings``.

It gets a throwaway database of its own on the test server (``DATABASE_URL``,
which runtests.py always exports), not pytest-django's: the example app is not
installed in the test settings (its ``charge_card`` kind would clash with
test_enqueue's), and the demo's worker, producers and carrier all commit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@pytest.fixture
def example_database() -> Iterator[str]:
    """A fresh database on the test server; dropped afterwards, whatever happened."""
    server = os.environ.get("DATABASE_URL") or DEFAULT_URL
    name = f"awa_example_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_database(server, name)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def manage(url: str, *args: str, timeout: float) -> str:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "AWA_TEST_DB_NAME")
    }
    env |= {
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "PYTHONPATH": str(ROOT),
    }
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"manage.py {' '.join(args)} ran over {timeout}s:\n{exc.stdout}"
        ) from None
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"manage.py {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


def rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query).fetchall()


def scalar(url: str, query: str) -> Any:
    return rows(url, query)[0][0]


@pytest.mark.slow
def test_demo_runs_orders_through_every_follow_up(example_database: str) -> None:
    url = example_database
    manage(url, "migrate", "--noinput", timeout=120)
    # Exits non-zero if one of its own SQL consistency checks fails.
    output = manage(
        url, "awa_demo", "--duration", "8", "--rate", "100", "--drain", "60", "--port", "0",
        timeout=180,
    )  # fmt: skip
    assert "summary after" in output, output
    assert "FAILED" not in output and "not yet" not in output, output
    # The HTTP carrier posts its answers to the batch receiver, and the summary
    # tells how many jobs waited for one while producing.
    assert "carrier: signed callbacks, up to 50 a POST, to http://127.0.0.1:" in output, output
    parked = re.search(
        r"^waiting for a callback \(parked\) while producing: min (\d+), max (\d+), last (\d+)",
        output,
        re.M,
    )
    assert parked and int(parked.group(1)) <= int(parked.group(3)) <= int(parked.group(2)), output

    # The live line counts this run's jobs from what changed since the line
    # before (no count of every row each second): once all is finished, its
    # counts are the summary's, which counts the run's rows in SQL.
    last = [line for line in output.splitlines() if line.endswith("[draining: 0 unfinished]")]
    assert last, output
    live = dict(re.findall(r"([a-z_-]+)=(\d+)", last[-1]))
    summary = re.search(r"^completed: (\d+) jobs of this run", output, re.M)
    followups = re.search(r"follow-up jobs=(\d+)", output)
    assert summary and followups, output
    assert int(live["completed"]) == int(summary.group(1)), (last[-1], output)
    assert int(live["follow-ups"]) == int(followups.group(1)), (last[-1], output)
    assert live["available"] == live["running"] == "0", last[-1]

    # Everything settled.
    states = dict(rows(url, "SELECT state, count(*) FROM awa_job GROUP BY state"))
    assert set(states) <= {"completed", "failed", "cancelled"}, (states, output)
    assert scalar(url, "SELECT count(*) FROM awa_job WHERE kind = 'charge_card'"
                       " AND state = 'completed'") > 0, output  # fmt: skip

    # Every paid order (shipping, once ShipOrder ran) has exactly one receipt, and
    # no other order has one.
    paid = scalar(url, "SELECT count(*) FROM shop_order WHERE status IN ('paid', 'shipping')")
    assert paid > 0, output
    assert (
        scalar(
            url,
            "SELECT count(*) FROM shop_order o WHERE o.status IN ('paid', 'shipping')"
            " AND (SELECT count(*) FROM shop_receipt r WHERE r.order_id = o.id) <> 1",
        )
        == 0
    )
    assert scalar(url, "SELECT count(*) FROM shop_receipt") == paid

    # Every exhausted charge has one refund, and its order is refunded; the demo
    # always places one declined card.
    exhausted = {
        order_id
        for (order_id,) in rows(
            url,
            "SELECT (args->>'order_id')::bigint FROM awa_job"
            " WHERE kind = 'charge_card' AND state = 'failed'",
        )
    }
    assert exhausted, output
    refunds = rows(url, "SELECT f.order_id, o.status FROM shop_refund f JOIN shop_order o"
                        " ON o.id = f.order_id")  # fmt: skip
    assert sorted(order_id for order_id, _ in refunds) == sorted(exhausted)
    assert {status for _, status in refunds} == {"refunded"}

    # Cancelled charges told their customer; shipped orders got the carrier's tracking.
    cancelled = scalar(url, "SELECT count(*) FROM shop_order WHERE status = 'cancelled'")
    assert cancelled > 0, output
    assert (
        scalar(url, "SELECT count(*) FROM shop_notice WHERE message = 'customer cancelled'")
        == cancelled
    )
    assert scalar(
        url, "SELECT count(*) FROM shop_notice WHERE message LIKE 'shipped, tracking 1Z%'"
    ) == scalar(url, "SELECT count(*) FROM shop_order WHERE status = 'shipping'")

    # Each follow-up row names its trigger and outcome; the refund has its overrides.
    assert (
        scalar(
            url,
            "SELECT count(*) FROM awa_job WHERE kind = 'send_receipt'"
            " AND metadata->'awa_trigger'->>'outcome' = 'completed'",
        )
        == paid
    )
    assert scalar(
        url,
        "SELECT count(*) FROM awa_job WHERE kind = 'refund_order' AND queue = 'billing'"
        " AND priority = 1 AND metadata->'awa_trigger'->>'outcome' = 'exhausted'",
    ) == len(exhausted)

    # Orders placed as workflows: each ended with its report, which ran after
    # shipping finished; a shipped one had its charge, packing and invoice
    # completed first (the demo's own checks say so too).
    workflows = scalar(url, "SELECT count(DISTINCT workflow_id) FROM awa_job")
    assert workflows > 0, output
    reports = "SELECT count(*) FROM awa_job WHERE kind = 'order_report' AND state = 'completed'"
    assert scalar(url, reports) == workflows
    for check in (
        "started after its dependencies completed: ok",
        "no workflow step ran twice: ok",
        "every order workflow ended, its report run once after shipping finished: ok",
    ):
        assert check in output, output


@pytest.mark.slow
def test_demo_at_a_high_rate_settles_with_its_checks_and_prints_a_working_admin_login(
    example_database: str,
) -> None:
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    url = example_database
    manage(url, "migrate", "--noinput", timeout=120)
    # The busy preset: 2,000 jobs/s asked (a shared machine produces what it can),
    # orders placed in batches, two awa_worker processes, the direct carrier.
    output = manage(
        url, "awa_demo", "--preset", "busy", "--duration", "6", "--drain", "120", "--port", "0",
        timeout=300,
    )  # fmt: skip
    assert "2 worker processes (awa_worker)" in output, output
    assert "producer threads in a process of their own" in output, output
    assert "summary after" in output, output
    assert "FAILED" not in output and "not yet" not in output, output
    checks = [line for line in output.splitlines() if line.startswith("check: ")]
    assert len(checks) >= 8 and all(line.endswith(": ok") for line in checks), output
    # The rates it reached, said honestly: asked and achieved side by side. A
    # test is no benchmark (the machine may be shared), so the floor is loose:
    # a producer that placed a handful of orders, or none, fails it.
    produced = re.search(r"^produced: .* \((\d+) jobs/s of the 2000 asked\)$", output, re.M)
    assert produced and int(produced.group(1)) >= 50, output
    backlog = re.search(
        r"^backlog \(available jobs\) while producing: min (\d+), max (\d+)", output, re.M
    )
    assert backlog and int(backlog.group(1)) <= int(backlog.group(2)), output
    completed = re.search(r"^completed: (\d+) jobs of this run .*, (\d+) jobs/s$", output, re.M)
    assert completed and int(completed.group(1)) > 0 and int(completed.group(2)) > 0, output

    # Everything settled: no job left behind by either worker process.
    states = dict(rows(url, "SELECT state, count(*) FROM awa_job GROUP BY state"))
    assert set(states) <= {"completed", "failed", "cancelled"}, (states, output)
    produced = scalar(url, "SELECT count(*) FROM shop_order")
    assert produced > 100, output  # batches of orders, each with its charge
    assert scalar(url, "SELECT count(*) FROM awa_job WHERE kind = 'charge_card'") == produced
    # Every job that ran says when its handler began, after its claim and before its outcome.
    assert (
        scalar(
            url,
            "SELECT count(*) FROM awa_job WHERE state = 'completed'"
            " AND (attempted_at IS NULL OR attempted_at > finalized_at)",
        )
        == 0
    )

    # The printed login works: a superuser whose password is the one printed.
    line = next(line for line in output.splitlines() if line.startswith("admin: "))
    match = re.fullmatch(
        r"admin: http://127\.0\.0\.1:\d+/admin/ \(user '(\w+)', password '([^']+)'\)", line
    )
    assert match, line
    user, password = match.groups()
    with psycopg.connect(url) as conn:
        [(is_superuser, is_staff, encoded)] = conn.execute(
            "SELECT is_superuser, is_staff, password FROM auth_user WHERE username = %s", [user]
        ).fetchall()
    # The example project's hasher (Django's default), whatever the test settings use.
    assert is_superuser and is_staff and PBKDF2PasswordHasher().verify(password, encoded), line


def test_demo_help_prints_the_options_without_starting_or_migrating_a_database() -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "AWA_TEST_DB_NAME")
    }
    done = subprocess.run(
        [sys.executable, "demo.py", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "usage: manage.py awa_demo" in output and "--duration SECONDS" in output
    assert "embedded PostgreSQL" not in output and "migrate" not in output, output
