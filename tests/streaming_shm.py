"""StreamingDataset's shared memory, for the tests that open streaming's own ``StreamingDataset`` (the reference
the pipeline's batch reader is held to, ``tests.datafiles.streaming_loader``): its prefixes registered one
job at a time on a machine, and which ``/dev/shm`` files live processes hold. The pipeline itself reads
without streaming's shared memory (``pipeline.data.read.loader``).

Registering is streaming's too: every rank looks for the first prefix with no ``NNNNNN_locals``, then the
node's local leader creates it. Two jobs that do so at once on one machine pick the same prefix, and the
second one's leader fails (``FileExistsError``). ``registering`` makes them take turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# streaming.base.constant.SHM_TO_CLEAN and its file locks, named "<6-digit prefix>_<name>".
_SEGMENT = re.compile(
    r"^(\d{6})_(locals|barrier|next_epoch|cache_usage|shard_states|shard_access_times|resume|epoch_shape|epoch_data)$"
)
_FILELOCK = re.compile(r"^(\d{6})_(barrier_filelock|cache_filelock)$")


def paths_in_use(pids: Iterable[int] | None = None) -> set[str]:
    """Every file under /dev/shm that a live process (one of ``pids``, when given) maps or holds open (what this
    user may see)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")) if pids is None else map(str, pids):
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


def registration_lock_path(shm_dir: Path = SHM_DIR) -> Path:
    """Beside the prefixes it guards: one lock per /dev/shm, as streaming's names are (two nodes on one machine,
    each with a /dev/shm of its own, as in a container or a network namespace, have one each: they share /tmp)."""
    return (shm_dir if shm_dir.is_dir() else Path(tempfile.gettempdir())) / "pipeline_streaming_prefix.lock"


@contextlib.contextmanager
def registering(lock_path: Path | None = None) -> Iterator[None]:
    """Hold this machine's turn to register a StreamingDataset's prefix while the block constructs one.

    The node's local leader takes an exclusive lock (a file in /dev/shm, beside the prefixes) before any rank of
    the job looks for a free prefix, and gives it back once the dataset is made: another job's leader, waiting
    for the lock, then sees this job's prefix taken. With ranks, every local leader of the job (one per node)
    must hold its node's lock before any rank looks: a leader that cannot take it at once lets go, and all
    try again a little later, so that two jobs sharing nodes never hold one lock each while waiting on the
    other's. ``lock_path`` is ``registration_lock_path()`` unless given (the tests hold a lock of their own)."""
    from streaming.base.world import World

    leader = World.detect().is_local_leader
    distributed = _distributed()
    path = registration_lock_path() if lock_path is None else lock_path
    lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666) if leader else None
    try:
        while not _every_rank_says(_try_lock(lock, wait=not distributed) if leader else True, distributed):
            if leader:
                fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(random.uniform(0.05, 0.25))
        yield
    finally:
        if lock is not None:
            os.close(lock)  # releases the lock


def _try_lock(lock: int, *, wait: bool) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


def _every_rank_says(mine: bool, distributed: bool) -> bool:
    """Whether every rank of the job says ``mine`` is true (this process's answer alone outside a job)."""
    if not distributed:
        return mine
    import torch.distributed as dist

    answers: list = [None] * dist.get_world_size()
    dist.all_gather_object(answers, mine)
    return all(answers)


def _distributed() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no job to agree with
    return dist is not None and dist.is_available() and dist.is_initialized()
