"""Writes that fail for want of space: ENOSPC, EDQUOT and EROFS become ``OutOfSpace``, naming the path, the
bytes the write needed and the bytes free, wherever checkpoints, results, shards or model files are written.

Callers remove what the failed write left (a temporary file or folder), so no partial file stays behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path

from pipeline.errors import OutOfSpace

NO_SPACE = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only"}


def free_bytes(path: Path) -> int:
    """Bytes free to unprivileged writers on the file system of ``path`` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _no_space_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT/EROFS error behind ``exc``: torch.save, for one, raises a RuntimeError while the
    OSError is its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def space_checked(path: Path, needed_bytes: int | None):
    """Raise ``OutOfSpace`` for a write inside the block to ``path`` that failed for want of space."""
    try:
        yield
    except OutOfSpace:
        raise
    except Exception as exc:
        cause = _no_space_cause(exc)
        if cause is None:
            raise
        needed = f"{needed_bytes:,} bytes" if needed_bytes is not None else "more bytes than are free"
        raise OutOfSpace(
            f"{path}: the write failed: {NO_SPACE[cause.errno]} ({cause.strerror}); it needed {needed}, "
            f"{free_bytes(path):,} bytes are free there. Free space (or point the pipeline's folders at a "
            f"bigger file system), then clear the task: it is not retried, as a retry would meet the same disk"
        ) from exc


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, which appears whole or not at all (a failed write leaves no temporary)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with space_checked(path, len(data)):
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
