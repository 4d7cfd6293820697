"""A highly available PostgreSQL on this machine: Patroni, etcd and HAProxy from Debian.

``Cluster`` runs one etcd member, three Patroni nodes of PostgreSQL 15 and an
HAProxy that sends connections to the node whose Patroni REST API says
``/primary``; all on 127.0.0.1 (HAProxy also on extra addresses given, for
the network-namespace hosts of ``stress/hosts.py``). Data lives in a temp
dir; every process is started here, stopped here by its pid, and every wait
is bounded. Patroni runs under Debian's ``/usr/bin/python3`` as the
``postgres`` user (it needs root to switch user); clients use any psycopg 3.

Needs the Debian packages ``patroni``, ``etcd-server``, ``etcd-client``,
``haproxy`` and ``python3-etcd``: ``missing_packages()`` names those absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PATRONI = Path("/usr/bin/patroni")
PATRONICTL = Path("/usr/bin/patronictl")
ETCD = Path("/usr/bin/etcd")
HAPROXY = Path("/usr/sbin/haproxy")
SYSTEM_PYTHON = Path("/usr/bin/python3")
SETPRIV = "/usr/bin/setpriv"

# Ports clear of the machine's services (5432, 6379, 5672, 1883, 4222, 3306).
HAPROXY_PORT = 15432
NODE_PORTS = (15433, 15434, 15435)
REST_PORTS = (18008, 18009, 18010)
ETCD_CLIENT, ETCD_PEER = 12379, 12380

# libpq options for clients: fail a connect or a silent network fast instead
# of waiting for TCP's own timeouts (minutes), so reconnects are prompt.
CLIENT_OPTIONS = (
    "connect_timeout=3&keepalives=1&keepalives_idle=5&keepalives_interval=2"
    "&keepalives_count=2&tcp_user_timeout=8000"
)


def missing_packages() -> list[str]:
    """The Debian packages this needs that are not installed."""
    missing = []
    for package, path in (
        ("patroni", PATRONI),
        ("etcd-server", ETCD),
        ("haproxy", HAPROXY),
        ("postgresql-15", PG_BIN / "postgres"),
    ):
        if not path.exists():
            missing.append(package)
    if not Path("/usr/lib/python3/dist-packages/etcd").exists():
        missing.append("python3-etcd")
    return missing


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25
) -> Any:
    """``predicate()``'s first true value, checked every ``interval`` for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - not yet: a service still starting
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 15) -> None:
    """SIGTERM ``proc`` (its process group), SIGKILL after ``timeout``; reap it."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class Node:
    """One Patroni node: its config, its Patroni process, its PostgreSQL data dir."""

    def __init__(self, index: int, root: Path) -> None:
        self.name = f"node{index + 1}"
        self.port = NODE_PORTS[index]
        self.rest = REST_PORTS[index]
        self.dir = root / self.name
        self.data = self.dir / "data"
        self.config = self.dir / "patroni.yml"
        self.log = self.dir / "patroni.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


class Cluster:
    """etcd, three Patroni nodes and HAProxy; ``start()``, faults, ``stop()`` (always)."""

    def __init__(
        self,
        *,
        synchronous: bool = True,
        listen: Iterable[str] = (),
        hba: Iterable[str] = (),
        maximum_lag_on_failover: int = 1048576,
    ) -> None:
        self.synchronous = synchronous
        self.listen = list(listen)  # extra addresses HAProxy binds (namespace hosts)
        self.hba = ["127.0.0.1/32", *hba]
        self.maximum_lag_on_failover = maximum_lag_on_failover
        self.root = Path(tempfile.mkdtemp(prefix="awa-ha-"))
        self.nodes = [Node(i, self.root) for i in range(len(NODE_PORTS))]
        self.etcd: subprocess.Popen[bytes] | None = None
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.ctl_config = self.root / "patronictl.yml"

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 180) -> None:
        missing = missing_packages()
        if missing:
            raise RuntimeError(f"missing Debian packages: {' '.join(missing)}")
        busy = [
            p for p in (HAPROXY_PORT, *NODE_PORTS, *REST_PORTS, ETCD_CLIENT, ETCD_PEER)
            if not port_free(p)
        ]  # fmt: skip
        if busy:
            raise RuntimeError(f"ports in use: {busy}")
        shutil.chown(self.root, "postgres", "postgres")
        self._start_etcd(timeout)
        for node in self.nodes:
            node.dir.mkdir()
            shutil.chown(node.dir, "postgres", "postgres")
            node.config.write_text(self._patroni_config(node))
            self.start_node(node)
        self.ctl_config.write_text(self._patroni_config(self.nodes[0]))
        self._start_haproxy()
        self.wait_ready(timeout)

    def _start_etcd(self, timeout: float) -> None:
        data = self.root / "etcd"
        log = (self.root / "etcd.log").open("wb")
        client = f"http://127.0.0.1:{ETCD_CLIENT}"
        peer = f"http://127.0.0.1:{ETCD_PEER}"
        self.etcd = subprocess.Popen(  # noqa: S603 - fixed binary and arguments
            [
                str(ETCD), "--name", "e1", "--data-dir", str(data),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"e1={peer}", "--initial-cluster-state", "new",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_until(lambda: _http_json(f"{client}/health").get("health") == "true", timeout, "etcd")

    def start_node(self, node: Node) -> None:
        """Start (or start again) ``node``'s Patroni, as the postgres user."""
        log = node.log.open("ab")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(node.dir), "LANG": "C.UTF-8"}
        node.proc = subprocess.Popen(  # noqa: S603 - fixed binaries and arguments
            [
                SETPRIV, "--reuid=postgres", "--regid=postgres", "--init-groups",
                str(SYSTEM_PYTHON), str(PATRONI), str(node.config),
            ],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip

    def _patroni_config(self, node: Node) -> str:
        hba = ["local all all trust"] + [
            f"host {db} all {net} trust" for net in self.hba for db in ("all", "replication")
        ]
        config: dict[str, Any] = {
            "scope": "awa",
            "name": node.name,
            "log": {"level": "WARNING"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest}",
                "connect_address": f"127.0.0.1:{node.rest}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{ETCD_CLIENT}"},
            "bootstrap": {
                "dcs": {
                    "ttl": 10,
                    "loop_wait": 1,
                    "retry_timeout": 4,
                    "maximum_lag_on_failover": self.maximum_lag_on_failover,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                            "autovacuum": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(node.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "postgres", "password": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(node.dir)},
                "pg_hba": hba,
            },
        }
        return json.dumps(config, indent=1)  # JSON is YAML

    def _start_haproxy(self) -> None:
        binds = "\n".join(
            f"    bind {address}:{HAPROXY_PORT}" for address in ["127.0.0.1", *self.listen]
        )
        servers = "\n".join(
            f"    server {n.name} 127.0.0.1:{n.port} maxconn 200 check port {n.rest}"
            for n in self.nodes
        )
        config = self.root / "haproxy.cfg"
        config.write_text(
            f"""global
    maxconn 1000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
{binds}
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server inter 500ms fastinter 250ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""
        )
        log = (self.root / "haproxy.log").open("wb")
        self.haproxy = subprocess.Popen(  # noqa: S603 - fixed binary and arguments
            [str(HAPROXY), "-db", "-f", str(config)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop everything started here, by pid, and remove the data."""
        stop_process(self.haproxy)
        for node in self.nodes:
            stop_process(node.proc, timeout=20)
            # A postmaster whose Patroni was SIGKILLed lives on: stop it too.
            pid = node.postmaster_pid()
            if pid is not None and _is_postgres(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGQUIT)
                with contextlib.suppress(TimeoutError):
                    wait_until(lambda p=pid: not _alive(p), 15, "postmaster exit")
                with contextlib.suppress(ProcessLookupError):
                    if _is_postgres(pid):
                        os.kill(pid, signal.SIGKILL)
        stop_process(self.etcd)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- state --------------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``GET /cluster`` members, from the first node that answers."""
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                return list(_http_json(f"http://127.0.0.1:{node.rest}/cluster")["members"])
        return []

    def leader(self) -> str | None:
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                return str(member["name"])
        return None

    def healthy(self) -> bool:
        """One running leader, every other node a running replica (one of them sync)."""
        members = self.members()
        leaders = [m for m in members if m.get("role") == "leader" and m["state"] == "running"]
        replicas = [m for m in members if m.get("role") in ("replica", "sync_standby")]
        running = [m for m in replicas if m.get("state") in ("running", "streaming")]
        if len(leaders) != 1 or len(running) != len(self.nodes) - 1:
            return False
        return not self.synchronous or any(m.get("role") == "sync_standby" for m in members)

    def wait_ready(self, timeout: float = 180) -> None:
        wait_until(self.healthy, timeout, f"a healthy cluster ({self.members()})", interval=0.5)
        wait_until(self._haproxy_primary, timeout, "HAProxy routing to the primary")

    def _haproxy_primary(self) -> bool:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return row is not None and row[0] is False

    def url(self, database: str, host: str = "127.0.0.1") -> str:
        """A libpq URL through HAProxy to the primary."""
        return f"postgresql://postgres@{host}:{HAPROXY_PORT}/{database}?{CLIENT_OPTIONS}"

    def node_url(self, name: str, database: str) -> str:
        node = self.node(name)
        return f"postgresql://postgres@127.0.0.1:{node.port}/{database}?connect_timeout=3"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- faults -------------------------------------------------------------------------

    def switchover(self) -> str:
        """A planned switchover to a replica (``patronictl switchover --force``); the old leader."""
        old = self.leader()
        if old is None:
            raise RuntimeError("no leader to switch over from")
        subprocess.run(  # noqa: S603 - fixed binaries and arguments
            [
                SETPRIV, "--reuid=postgres", "--regid=postgres", "--init-groups",
                str(SYSTEM_PYTHON), str(PATRONICTL), "-c", str(self.ctl_config),
                "switchover", "--force", "--leader", old, "awa",
            ],
            check=True, timeout=60, capture_output=True,
        )  # fmt: skip
        return old

    def kill_primary(self) -> str:
        """SIGKILL the leader's Patroni and then its postmaster: an unplanned failover."""
        old = self.leader()
        if old is None:
            raise RuntimeError("no leader to kill")
        node = self.node(old)
        pid = node.postmaster_pid()
        if node.proc is not None and node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait(10)
        if pid is not None and _is_postgres(pid):
            os.kill(pid, signal.SIGKILL)
        return old

    def walsenders(self, name: str) -> list[int]:
        """The pids of ``name``'s walsender processes (to stop them: a lagging replica)."""
        import psycopg

        with psycopg.connect(self.node_url(name, "postgres"), autocommit=True) as conn:
            rows = conn.execute("SELECT pid FROM pg_stat_replication").fetchall()
        return [int(row[0]) for row in rows]

    def rejoin(self, name: str, timeout: float = 180) -> None:
        """Start a killed node's Patroni again and wait until it is a healthy replica."""
        node = self.node(name)
        pid = node.postmaster_pid()
        if pid is not None and _is_postgres(pid):
            # Its postmaster's children may outlive a SIGKILLed postmaster.
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not _alive(pid), 15, "the old postmaster's exit")
        self.start_node(node)
        self.wait_ready(timeout)


def _http_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our loopback URL
        return dict(json.loads(response.read()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


def _is_postgres(pid: int) -> bool:
    """Whether ``pid`` is (still) a postgres process: a pid file may name a reused pid."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in ("postgres", "postmaster")
    except OSError:
        return False
