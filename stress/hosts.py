"""Worker "hosts" as Linux network namespaces, and a PostgreSQL they reach over their links.

``Hosts(n)`` makes ``n`` network namespaces ``awa-h1``..``awa-hN``, each joined
to this machine by a veth pair: 10.213.I.1 on the machine's side, 10.213.I.2
inside. A process run through ``prefix(i)`` (``ip netns exec``) sees only its
loopback and its link, so it reaches PostgreSQL at ``gateway(i)`` over that
link; ``cut(i)`` (``ip link set DEV down``) isolates the host and
``restore(i)`` brings it back. ``skew_env(seconds)`` gives a Python process a
wall clock off by that much (an injected offset; the monotonic clock is left
alone).
Everything is removed by ``close()``, also after a failure; the addresses
exist only inside what is made here.

``Server`` is a private PostgreSQL 15 (initdb under a temp dir, run as the
``postgres`` user) listening on 127.0.0.1 and on the hosts' gateways, with
any settings of one's own (``benchmarks/where_time_goes.py`` preloads
``pg_stat_statements``).
Needs root and ``iproute2``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from stress.cluster import PG_BIN, SETPRIV, port_free

IP = "/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else "/sbin/ip"
SKEW_DIR = Path(__file__).resolve().parent / "skew"
SERVER_PORT = 15436
SUBNET = "10.213.0.0/16"


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run([IP, *args], check=check, capture_output=True, timeout=30)  # noqa: S603


class Hosts:
    """``n`` network namespaces with a veth link each; ``close()`` removes them."""

    def __init__(self, n: int = 3) -> None:
        if not Path(IP).exists():
            raise RuntimeError("missing Debian package: iproute2")
        self.n = n
        self.names = [f"awa-h{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            for i, name in enumerate(self.names):
                self._make(i, name)
        except BaseException:
            self.close()
            raise

    def _make(self, i: int, name: str) -> None:
        outside, inside = self.device(i), f"{name}b"
        _ip("netns", "del", name, check=False)  # left by a run that was SIGKILLed
        _ip("link", "del", outside, check=False)
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{self.gateway(i)}/24", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", name, IP, "addr", "add", f"10.213.{i + 1}.2/24", "dev", inside)
        _ip("netns", "exec", name, IP, "link", "set", inside, "up")
        _ip("netns", "exec", name, IP, "link", "set", "lo", "up")

    def device(self, i: int) -> str:
        return f"{self.names[i]}a"

    def gateway(self, i: int) -> str:
        """The machine's address on host ``i``'s link: where the host reaches PostgreSQL."""
        return f"10.213.{i + 1}.1"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process on host ``i``."""
        return [IP, "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its processes can reach nothing."""
        _ip("link", "set", self.device(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.device(i), "up")

    def close(self) -> None:
        for i, name in enumerate(self.names):
            _ip("link", "del", self.device(i), check=False)
            if name in self._made:
                _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def skew_env(seconds: float, pythonpath: str = "") -> dict[str, str]:
    """Environment giving a Python process a wall clock ``seconds`` off: an injected
    offset (``stress/skew/sitecustomize.py``), the monotonic clock left alone."""
    if not seconds:
        return {}
    path = os.pathsep.join(filter(None, [str(SKEW_DIR), pythonpath]))
    return {"AWA_CLOCK_SKEW": f"{seconds:+.0f}", "PYTHONPATH": path}


class Server:
    """A private PostgreSQL 15 on ``SERVER_PORT``, listening on loopback and ``addresses``."""

    def __init__(
        self, addresses: list[str], port: int = SERVER_PORT, settings: dict[str, str] | None = None
    ) -> None:
        """``settings``: more ``postgresql.conf`` lines (name to value, written as given)."""
        if not port_free(port):
            raise RuntimeError(f"port {port} is in use")
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix="awa-hosts-pg-"))
        self.data = self.dir / "data"
        shutil.chown(self.dir, "postgres", "postgres")
        self._run(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8")
        listen = ",".join(["127.0.0.1", *addresses])
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {port}\nlisten_addresses = '{listen}'\n"
                f"unix_socket_directories = '{self.dir}'\nmax_connections = 300\n"
                "autovacuum = on\n"
            )
            conf.writelines(f"{name} = {value}\n" for name, value in (settings or {}).items())
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET} trust\n")
        self.started = False

    def _run(self, *cmd: Any) -> None:
        subprocess.run(  # noqa: S603 - fixed binaries and arguments
            [SETPRIV, "--reuid=postgres", "--regid=postgres", "--init-groups", *map(str, cmd)],
            check=True, capture_output=True, timeout=120, cwd=self.dir,
        )  # fmt: skip

    def start(self) -> None:
        self._run(
            PG_BIN / "pg_ctl", "-D", self.data, "-l", self.dir / "log", "-w", "-t", "60", "start"
        )
        self.started = True

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the server: the postmaster, its live processes, and
        (in the postmaster's children times) the backends that have exited."""
        tick = os.sysconf("SC_CLK_TCK")
        data = str(self.data).encode()
        total = 0.0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                cmdline = (stat.parent / "cmdline").read_bytes()
                fields = stat.read_text().rsplit(")", 1)[1].split()
                parent = Path(f"/proc/{fields[1]}/cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if data in cmdline:  # the postmaster
                total += sum(int(f) for f in fields[11:15]) / tick
            elif data in parent:
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def url(self, database: str, host: str = "127.0.0.1") -> str:
        return (
            f"postgresql://postgres@{host}:{self.port}/{database}?connect_timeout=3"
            "&keepalives=1&keepalives_idle=5&keepalives_interval=2&keepalives_count=2"
            "&tcp_user_timeout=8000"
        )

    def close(self) -> None:
        if self.started:
            with contextlib.suppress(subprocess.SubprocessError):
                self._run(
                    PG_BIN / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "-t", "60", "stop"
                )
        shutil.rmtree(self.dir, ignore_errors=True)


def running_as_root() -> bool:
    return os.geteuid() == 0
