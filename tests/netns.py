"""A second machine on this one, for the multi-node tests: a network namespace joined by a veth pair, with
a /dev/shm of its own. Needs root and iproute2."""

from __future__ import annotations

import shutil
import subprocess


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

    def wrap(self) -> list[str]:
        """Run a command inside, with a /dev/shm of its own (``ip netns exec`` gives it a mount namespace): a
        second machine's shared memory is not the first's, and streaming's names would collide."""
        return ["ip", "netns", "exec", self.name, "sh", "-c", 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"',
                "sh"]

    def pids(self) -> list[int]:
        """The processes running inside."""
        found = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
        return [int(pid) for pid in found.split()]

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
