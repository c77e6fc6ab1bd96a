"""The process table helpers on real processes: zombies are not alive, descendants come parents first."""

import os
import subprocess
import sys
import time

from pipeline.process_table import alive, descendants, stat
from tests.processes import cmdline, parent, pids_with, wait_until_gone

# A child that starts a grandchild, which starts a great-grandchild; all sleep with the marker in argv.
_TREE = """
import subprocess, sys, time
depth = int(sys.argv[1])
if depth:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2], sys.argv[3]])
time.sleep(60)
"""


def test_a_zombie_and_a_reaped_process_are_not_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while alive(proc.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.05)
    assert not alive(proc.pid) and stat(proc.pid) is not None
    assert descendants(os.getpid()).count(proc.pid) == 0
    proc.wait()
    assert stat(proc.pid) is None and not alive(proc.pid)
    assert alive(os.getpid()) and not alive(0) and not alive(-1)


def test_descendants_come_parents_before_children_and_are_found_by_marker(tmp_path):
    marker = f"tree-{tmp_path.name}"
    root = subprocess.Popen([sys.executable, "-c", _TREE, "2", _TREE, marker])
    try:
        deadline = time.monotonic() + 20
        while len(pids_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendants(os.getpid())
        tree = [root.pid] + [p for p in found if p != root.pid and marker.encode() in cmdline(p)]
        assert len(tree) == 3 and sorted(pids_with(marker)) == sorted(tree)
        assert all(found.index(parent(child)) < found.index(child) for child in tree[1:])
        assert descendants(root.pid) == tree[1:] and parent(root.pid) == os.getpid()
        assert cmdline(root.pid).split(b"\0")[-2] == marker.encode()
        assert stat(root.pid)[1:] == (os.getpid(), os.getpgid(root.pid))
    finally:
        for pid in reversed(descendants(root.pid) + [root.pid]):
            os.kill(pid, 9)
        root.wait()
    assert wait_until_gone(marker, timeout_s=10) == []
