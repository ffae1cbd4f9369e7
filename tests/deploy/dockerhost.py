"""Docker on this machine for the deployment test: dockerd started (and installed, with
deploy/local/install-docker.sh) when it is not running, and the machine left as it was
found: dockerd stopped again if the test started it, and the kernel state dockerd
changes put back (its iptables rules; net.ipv4.ip_forward, which it turns on, and then the
FORWARD policy, which it sets to DROP when it did; net.bridge.bridge-nf-call-iptables,
which it turns on), since other tests here need forwarding between their own bridges."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.factories import ROOT

# Each holds "0" or "1"; dockerd sets both to 1.
SYSCTLS = (Path("/proc/sys/net/ipv4/ip_forward"),
           Path("/proc/sys/net/bridge/bridge-nf-call-iptables"))
# The tables dockerd writes to (IPv4; it leaves ip6tables alone without --ipv6).
TABLES = {"filter": ("INPUT", "FORWARD", "OUTPUT"),
          "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")}


def run(*args: str, check: bool = True, timeout: float = 600,
        **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check,
                          timeout=timeout, **kwargs)  # type: ignore[call-overload]


def docker_answers() -> bool:
    return shutil.which("docker") is not None and run(
        "docker", "info", check=False, timeout=30).returncode == 0


def why_not() -> str:
    """"" when this machine can run the deployment test, else why not."""
    if os.geteuid() != 0:
        return "needs root (dockerd, iptables)"
    if not docker_answers() and shutil.which("apt-get") is None:
        return "no dockerd running and no apt-get to install Debian's docker.io"
    return ""


def iptables_tables() -> dict[str, str]:
    """`iptables-save` of each table dockerd writes to; an absent table as an empty one."""
    saved = {}
    for table, chains in TABLES.items():
        dump = run("iptables-save", "-t", table, check=False).stdout \
            if shutil.which("iptables-save") else ""
        if f"*{table}" not in dump:
            dump = "".join([f"*{table}\n", *(f":{c} ACCEPT [0:0]\n" for c in chains),
                            "COMMIT\n"])
        saved[table] = dump
    return saved


class DockerHost:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.daemon: subprocess.Popen[bytes] | None = None
        self.firewall: dict[str, str] = {}
        self.sysctls: dict[Path, str] = {}

    def up(self) -> None:
        if docker_answers():
            # Someone else's dockerd: its firewall is theirs, and so is stopping it.
            return
        # The state before dockerd: what .down() puts back. (br_netfilter may be loaded
        # only by dockerd: then its switch appears only now, and goes back to off.)
        self.sysctls = {path: path.read_text().strip() if path.exists() else "0"
                        for path in SYSCTLS}
        run("sh", str(ROOT / "deploy" / "local" / "install-docker.sh"), timeout=900)
        self.firewall = iptables_tables()
        log = (self.log_dir / "dockerd.log").open("wb")
        self.daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        deadline = time.monotonic() + 60
        while not docker_answers():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start; see {self.log_dir}/dockerd.log")
            time.sleep(0.5)

    def down(self) -> None:
        if self.daemon is None:
            return
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        self.daemon = None
        # iptables-restore replaces each table it is given whole: dockerd's chains and
        # rules go, the policies come back.
        for dump in self.firewall.values():
            subprocess.run(["iptables-restore"], input=dump, text=True, check=True)
        run("ip", "link", "delete", "docker0", check=False)
        for path, value in self.sysctls.items():
            if path.exists():
                path.write_text(value)
