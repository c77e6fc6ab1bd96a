"""A second machine on this one, for the multi-node tests: a network namespace joined by a veth pair, with
a /dev/shm of its own. Needs root and iproute2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def _private(folders) -> list[str]:
    """``folders``, each to become an empty tmpfs in a node: none may hold the checkout or the interpreter, which the
    node runs (a tmpfs over /tmp hid a clone under /tmp: "exec: .../.venv/bin/python: not found")."""
    from pipeline import deployment

    needed = [Path(deployment.PROJECT_ROOT).resolve(), Path(sys.executable).parent.resolve()]
    for folder in folders:
        over = Path(folder).resolve()
        hidden = [str(path) for path in needed if path == over or over in path.parents]
        if hidden:
            raise ValueError(f"a private tmpfs on {folder} would hide {', '.join(hidden)} from the node")
    return [str(folder) for folder in folders]


class NetworkNamespace:
    """A network namespace joined to this one by a veth pair: ``host_ip`` here, ``ip`` inside, a /24 between
    them (a second machine on the first's network, as far as its peers can tell)."""

    def __init__(self, name: str, host_ip: str, ip: str):
        self.name, self.host_ip, self.ip = name, host_ip, ip
        self.host_dev, self.dev = f"{name}h", f"{name}n"

    def create(self) -> bool:
        steps = [["ip", "netns", "add", self.name],
                 ["ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.dev],
                 ["ip", "link", "set", self.dev, "netns", self.name],
                 ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_dev], ["ip", "link", "set", self.host_dev, "up"],
                 ["ip", "-n", self.name, "addr", "add", f"{self.ip}/24", "dev", self.dev],
                 ["ip", "-n", self.name, "link", "set", self.dev, "up"], ["ip", "-n", self.name, "link", "set", "lo", "up"]]
        for step in steps:
            if shutil.which(step[0]) is None or subprocess.run(step, capture_output=True).returncode != 0:
                self.remove()
                return False
        return True

    def wrap(self, private: list[str] = ()) -> list[str]:
        """Run a command inside, with a /dev/shm of its own (``ip netns exec`` gives it a mount namespace): a
        second machine's shared memory is not the first's, and streaming's names would collide. Each folder of
        ``private`` is an empty tmpfs of its own too: a machine that does not share those folders with this one.
        Name them (the session's home, pytest's folders, the node's own), never a parent of the checkout: its
        interpreter must stay visible."""
        mounts = "".join(f' && mount -t tmpfs tmpfs "{folder}"' for folder in _private(private))
        return ["ip", "netns", "exec", self.name, "sh", "-c",
                f'mount -t tmpfs -o size=2g tmpfs /dev/shm{mounts} && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        """The processes running inside."""
        found = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
        return [int(pid) for pid in found.split()]

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class Namespaces:
    """Two network namespaces, a veth pair between them, and per-namespace /etc/hosts files."""

    def __init__(self, tag: str):
        self.names = [f"kpod{tag}a", f"kpod{tag}b"]
        self.ips = ["10.231.7.1", "10.231.7.2"]

    def create(self, hosts: list[str]) -> bool:
        a, b = self.names
        steps = [["ip", "netns", "add", a], ["ip", "netns", "add", b],
                 ["ip", "link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v"],
                 ["ip", "link", "set", f"{a}v", "netns", a], ["ip", "link", "set", f"{b}v", "netns", b]]
        for ns, dev, ip in ((a, f"{a}v", self.ips[0]), (b, f"{b}v", self.ips[1])):
            steps += [["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev], ["ip", "-n", ns, "link", "set", dev, "up"],
                      ["ip", "-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            if shutil.which(step[0]) is None or _quiet(step).returncode != 0:
                self.remove()
                return False
        try:
            for ns, text in zip(self.names, hosts):
                folder = Path("/etc/netns") / ns
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(text)
                # No DNS server in the namespace: lookups of other names fail at once instead of timing out.
                (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        except OSError:
            self.remove()
            return False
        return True

    def wrap(self, index: int, hostname: str, command: list[str]) -> list[str]:
        """Run ``command`` in namespace ``index`` with its own hostname, as a pod's container runs."""
        return ["ip", "netns", "exec", self.names[index], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', hostname, *command]

    def remove(self) -> None:
        for ns in self.names:
            _quiet(["ip", "netns", "del", ns])
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _quiet(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True)


class PodNetwork:
    """Pods on one network: a network namespace each, joined by veth pairs to a bridge that holds ``host_ip``, so
    the pods reach each other and this machine (a server here listens on ``host_ip``); per-pod /etc/hosts files
    stand in for the cluster's DNS."""

    def __init__(self, tag: str, pods: int = 2):
        self.bridge = f"pb{tag}"[:15]
        self.names = [f"pn{tag}{i}"[:15] for i in range(pods)]
        self.ips = [f"10.231.11.{i + 1}" for i in range(pods)]
        self.host_ip = "10.231.11.254"

    def create(self) -> bool:
        steps = [["ip", "link", "add", self.bridge, "type", "bridge"],
                 ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge], ["ip", "link", "set", self.bridge, "up"]]
        for ns, ip in zip(self.names, self.ips):
            host_dev, dev = f"{ns}h"[:15], f"{ns}n"[:15]
            steps += [["ip", "netns", "add", ns], ["ip", "link", "add", host_dev, "type", "veth", "peer", "name", dev],
                      ["ip", "link", "set", dev, "netns", ns], ["ip", "link", "set", host_dev, "master", self.bridge],
                      ["ip", "link", "set", host_dev, "up"], ["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev],
                      ["ip", "-n", ns, "link", "set", dev, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            if shutil.which(step[0]) is None or _quiet(step).returncode != 0:
                self.remove()
                return False
        try:
            self.set_hosts({})
        except OSError:
            self.remove()
            return False
        return True

    def set_hosts(self, names: dict[str, list[str]]) -> None:
        """Every pod's /etc/hosts: ``names`` of each pod's address (pod index -> names), as the cluster's DNS
        would answer; no DNS server, so other lookups fail at once."""
        records = "".join(f"{self.ips[int(i)]} {' '.join(n)}\n" for i, n in names.items())
        for ns in self.names:
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("127.0.0.1 localhost\n" + records)
            (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def wrap(self, index: int, hostname: str, private: list[str], command: list[str]) -> list[str]:
        """Run ``command`` in pod ``index``'s namespace, with its own hostname, and a mount namespace in which each
        folder of ``private`` and /dev/shm are empty tmpfs of its own: what it writes there no other pod (nor this
        machine) sees, and what is there it does not see. As with ``NetworkNamespace.wrap``, never a parent of the
        checkout."""
        mounts = " && ".join(f'mount -t tmpfs tmpfs "{folder}"' for folder in [*_private(private), "/dev/shm"])
        return ["ip", "netns", "exec", self.names[index], "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", f'hostname "$0" && {mounts} && exec "$@"', hostname, *command]

    def remove(self) -> None:
        for ns in self.names:
            _quiet(["ip", "netns", "del", ns])
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _quiet(["ip", "link", "del", self.bridge])
