"""Short versions of stress/ha.py and stress/crash_soak.py --hosts: real clusters, real faults.

They need root and Debian's ``patroni``, ``etcd-server``, ``haproxy``,
``python3-etcd`` and ``iproute2`` (``.ci/run`` installs them),
and take a few minutes, so they run only when ``AWA_HA_TESTS=1`` (the first of
``.ci/run``'s three test runs sets it). Selected, a missing package or
privilege fails them: it never skips them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stress.cluster import missing_packages
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    os.environ.get("AWA_HA_TESTS") != "1",
    reason="the HA and network-namespace tests run with AWA_HA_TESTS=1 (.ci/run's first run)",
)


def _require_setup() -> None:
    assert os.geteuid() == 0, "the HA tests need root (namespaces; Patroni runs as postgres)"
    missing = missing_packages()
    if not Path("/usr/sbin/ip").exists():
        missing.append("iproute2")
    assert not missing, f"missing Debian packages: {' '.join(missing)}"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AWA_TEST_DB_NAME"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def _ha(tmp_path: Path, sync: str) -> dict:
    _require_setup()
    out = tmp_path / "ha.json"
    proc = _run(["stress/ha.py", "--sync", sync, "--short", "--json", str(out)], timeout=600)
    shown = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, shown
    (results,) = json.loads(out.read_text())
    print(proc.stdout)  # noqa: T201 - the measured figures, shown with -s or on failure
    return results


def test_switchover_and_failover_with_synchronous_replication_lose_nothing(tmp_path):
    results = _ha(tmp_path, "on")
    faults = {fault["fault"]: fault for fault in results["faults"]}
    assert set(faults) == {"switchover", "kill primary"}
    for fault in faults.values():
        assert fault["flow_gap"] < 60, fault  # jobs flowed again
    # Every write the client saw acknowledged is on the new primary, once.
    assert results["lost"] == {
        "enqueues_lost": [],
        "completions_lost": [],
        "callbacks_lost": [],
        "enqueues_duplicated": [],
    }
    assert results["counts"]["enqueued"] > 100
    # Its workflows' steps, through both faults: none ran before its dependency
    # completed, none ran twice, every one finished.
    assert results["counts"]["workflows"] > 5
    assert results["workflow_rules_broken"] == {}
    assert results["counts"]["enqueue_errors"] > 0  # the faults were felt
    assert results["handler_runs_duplicated"] == []
    assert results["outcome_mismatches"] == []
    assert results["not_final"] == []
    # Each worker says so once per outage and once per recovery.
    outages = [line for line in results["logs"] if "unavailable (" in line]
    recoveries = [line for line in results["logs"] if "available again after" in line]
    assert outages and len(outages) == len(recoveries), results["logs"]


def test_asynchronous_replication_loses_acknowledged_writes_on_failover(tmp_path):
    """The trade-off the README states: a lagging replica promoted loses what it lacked."""
    results = _ha(tmp_path, "off")
    lost = results["lost"]
    assert lost["enqueues_lost"], results  # acknowledged, then gone with the old primary
    # What survived is still consistent: no duplicate, no double run, all final.
    assert lost["enqueues_duplicated"] == []
    assert results["handler_runs_duplicated"] == []
    assert results["not_final"] == []


def test_crash_soak_across_namespace_hosts_with_cut_links_and_skewed_clocks():
    _require_setup()
    proc = _run(
        [
            "stress/crash_soak.py", "--hosts", "3", "--workers", "6", "--jobs", "1000",
            "--kill-every", "3", "--cut-every", "6", "--cut-for", "5", "--skew", "40",
            "--timeout", "300",
        ],
        timeout=420,
    )  # fmt: skip
    shown = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, shown
    assert "RESULT: OK" in proc.stdout, shown
    cuts = re.search(r"links cut: (\d+)", proc.stdout)
    killed = re.search(r"workers killed \(SIGKILL\): (\d+)", proc.stdout)
    assert cuts and int(cuts.group(1)) >= 1, shown
    assert killed and int(killed.group(1)) >= 1, shown
    assert "clock skew ±40s" in proc.stdout, shown
    print(proc.stdout)  # noqa: T201
