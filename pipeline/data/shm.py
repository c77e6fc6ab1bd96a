"""Remove shared memory that dead readers (StreamingDataset in training ranks) left behind, and only that.

StreamingDataset coordinates the ranks of a node through named shared memory (``/dev/shm/000000_locals``
...) and file locks in the temp folder. A rank killed with SIGKILL leaves them behind, and the next
attempt then trips over them. streaming's own ``clean_stale_shared_memory`` unlinks every such name,
including those of another job running on the same machine; here a segment counts as stale only
when no live process has it mapped or open.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# streaming.base.constant.SHM_TO_CLEAN and its file locks, named "<6-digit prefix>_<name>".
_SEGMENT = re.compile(
    r"^(\d{6})_(locals|barrier|next_epoch|cache_usage|shard_states|shard_access_times|resume|epoch_shape|epoch_data)$"
)
_FILELOCK = re.compile(r"^(\d{6})_(barrier_filelock|cache_filelock)$")


def clean_stale_shared_memory(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink streaming's segments that no live process uses, and their orphaned file locks."""
    if not shm_dir.is_dir():
        return []
    segments = [p for p in shm_dir.iterdir() if _SEGMENT.match(p.name)]
    in_use = _paths_in_use() if segments else set()
    removed, live_prefixes = [], set()
    for path in segments:
        if str(path) in in_use:
            live_prefixes.add(_SEGMENT.match(path.name).group(1))
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
        except PermissionError:  # another user's: not ours to judge
            live_prefixes.add(_SEGMENT.match(path.name).group(1))
    for path in Path(tempfile.gettempdir()).iterdir():
        match = _FILELOCK.match(path.name)
        if match and match.group(1) not in live_prefixes and not (shm_dir / f"{match.group(1)}_locals").exists():
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    if removed:
        log.info("removed stale shared memory of dead processes: %s", ", ".join(sorted(removed)))
    return removed


def _paths_in_use() -> set[str]:
    """Every file under /dev/shm that a live process maps or holds open (what this user may see)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    index = line.find("/dev/shm/")
                    if index >= 0:
                        used.add(line[index:].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue
    return used
