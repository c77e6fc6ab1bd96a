"""Atomic, self-verifying training checkpoints in ``step-N/`` folders; resume picks the newest good one.

A checkpoint is written under a temporary name, fsynced, given a completion marker last, and
renamed into place, so a crash mid-write leaves at most a temporary folder that readers skip.
``save_in_background`` takes the write off the training's path: the state's tensors are copied to host
memory at once, and a thread writes the copy while training goes on.
A sharded checkpoint (``train.parallelism = fsdp``: ``save_sharded_in_background``) holds every rank's
shards of the model and optimizer in ``shards/``, written by each rank with ``torch.distributed.checkpoint``
(which resumes them on any number of ranks), beside rank 0's ``state.pt`` with the rest (step, loader,
RNG, schedule); its marker lists every shard file's size.
On an object store (``train.checkpoint_uri = s3://...``) the same checkpoint is written in a node-local staging
folder, then uploaded with its marker last (``pipeline.train.checkpoint_remote``).
Loading uses ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain Python values
only, never pickled objects. When the newest checkpoint cannot be read (truncated, damaged), the
previous complete one is used and the damage is logged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline import storage
from pipeline.diskspace import space_checked
from pipeline.train.checkpoint_remote import STEP_DIR, RemoteCheckpoints

STATE_FILE = "state.pt"
SHARDS_DIR = "shards"  # a sharded checkpoint's torch.distributed.checkpoint folder
MARKER = "COMPLETE"  # written last; holds the state file's size and sha256


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path  # on this node (an object store's checkpoint is downloaded first)
    state: dict[str, Any]
    location: str  # where the job keeps it: ``path``, or its URI on an object store

    @property
    def sharded(self) -> bool:
        """Whether the model and optimizer are in ``shards/`` (load them with ``load_shards``), not in ``state``."""
        return is_sharded(self.path)


class CheckpointStore:
    """The checkpoints of one training job (keyed by the job, not by the attempt) in ``location``: a folder, or an
    object-store prefix (``s3://bucket/prefix``: then ``root`` is this node's staging folder for them)."""

    def __init__(self, location: Path | str, *, keep: int = 3, cache: Path | None = None):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least one checkpoint must be kept")
        self.remote = RemoteCheckpoints(str(location), MARKER, cache=cache) if storage.is_remote(location) else None
        self.root = self.remote.cache if self.remote else Path(location)
        self.keep = keep
        self._writing: tuple[threading.Thread, dict[str, BaseException]] | None = None

    @property
    def location(self) -> str:
        return self.remote.uri if self.remote else str(self.root)

    def where(self, name: str) -> str:
        """Where the job keeps checkpoint ``name`` (``step-N``): a folder or a URI."""
        return self.remote.location(name) if self.remote else str(self.root / name)

    def local_copy(self, name: str) -> Path:
        """Checkpoint ``name`` on this node: its folder, or its download from the object store."""
        return self.remote.local_copy(name) if self.remote else self.root / name

    def save(self, step: int, state: dict[str, Any]) -> Path | str:
        """Write ``state`` as checkpoint ``step`` (call on one rank only) and prune to the last ``keep``; returns
        where it is (``where``).

        A save that fails (a full disk: ``OutOfSpace``, naming the bytes it needed and the bytes free; an object
        store unreachable for longer than it waits) leaves nothing that looks complete, and the checkpoints before
        it as they were."""
        final = self.root / f"step-{step:09d}"
        with space_checked(final, state_bytes(state)):
            self._write(step, state, final)
        if self.remote:
            try:
                location = self.remote.publish(final, final.name)
            finally:
                shutil.rmtree(final, ignore_errors=True)  # the staging copy: resumes download what they need
        self._prune()
        return location if self.remote else final

    def save_in_background(self, step: int, state: dict[str, Any], *,
                           done: Callable[[Path], None] | None = None) -> None:
        """``save`` off the caller's path: ``state``'s tensors are copied to host memory now (the caller may
        change its own at once: the next optimizer step), and a thread writes the copy, then calls ``done``
        with the checkpoint's folder. One write at a time: a save first waits for the one before it, and
        raises what that one raised (``OutOfSpace``). Call ``wait`` before anything that needs the
        checkpoint on disk; a process that ends waits for the thread, so a write under way is finished."""
        self.wait()
        copy = _host_copy(state)
        failure: dict[str, BaseException] = {}

        def write() -> None:
            try:
                path = self.save(step, copy)
                if done is not None:
                    done(path)
            except BaseException as exc:  # raised in the caller's thread by the next save or wait
                failure["error"] = exc

        thread = threading.Thread(target=write, name=f"checkpoint-step-{step}")
        thread.start()
        self._writing = (thread, failure)

    def save_sharded_in_background(self, step: int, shards: dict[str, Any], state: dict[str, Any], dist, *,
                                   group=None, done: Callable[[Path], None] | None = None) -> None:
        """Every rank: checkpoint ``step`` with each rank's ``shards`` (DTensors; ``torch.distributed.checkpoint``
        writes its own) and rank 0's ``state`` (small: step, loader, RNG). The shards are copied to host memory
        now and written by a background thread while training goes on, over ``group`` (a process group of the
        checkpoint's own, so its collectives never interleave with training's); once every rank's are written,
        rank 0 adds ``state.pt`` and the marker, renames the folder into place and prunes. ``wait`` on every rank
        before anything that needs it on disk."""
        import torch.distributed.checkpoint as dcp

        from pipeline.train.distributed import broadcast_object

        self.wait()
        tmp = self.root / broadcast_object(dist, f".tmp-step-{step:09d}-{uuid.uuid4().hex[:8]}")
        final = self.root / f"step-{step:09d}"
        # On an object store each rank writes its shards in a folder of its own (nodes share no folder), then
        # uploads them into the checkpoint's shards/.
        own = tmp / (f"{SHARDS_DIR}-rank-{dist.rank}" if self.remote else SHARDS_DIR)
        own.mkdir(parents=True, exist_ok=True)
        copy = _host_copy(state) if dist.is_main else None
        with space_checked(final, state_bytes(shards) if dist.is_main else None):
            written = dcp.async_save(shards, checkpoint_id=str(own), process_group=group)
        failure: dict[str, BaseException] = {}

        def finish() -> None:
            try:
                written.result()  # rank 0's ends after every rank's shards and the metadata are written
                if self.remote:
                    self.remote.publish_part(own, final.name, SHARDS_DIR)
                    torch.distributed.barrier(group=group)  # every rank's shards are in before the marker
                if dist.is_main:
                    with space_checked(final, state_bytes(copy)):
                        if self.remote:
                            _write_state(step, copy, tmp / "state", self.remote.sizes(final.name, SHARDS_DIR))
                            location = self.remote.publish(tmp / "state", final.name)
                        else:
                            self._complete(step, copy, tmp, final)
                    self._prune()
                    if done is not None:
                        done(location if self.remote else final)
            except BaseException as exc:
                failure["error"] = exc
                if dist.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
            finally:
                if self.remote:
                    shutil.rmtree(tmp if dist.is_main else own, ignore_errors=True)

        thread = threading.Thread(target=finish, name=f"checkpoint-step-{step}")
        thread.start()
        self._writing = (thread, failure)

    def wait(self) -> None:
        """Until the background write under way, if any, has ended; re-raise its failure here."""
        if self._writing is None:
            return
        (thread, failure), self._writing = self._writing, None
        thread.join()
        if "error" in failure:
            raise failure["error"]

    def _write(self, step: int, state: dict[str, Any], final: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:09d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self._complete(step, state, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _complete(self, step: int, state: dict[str, Any], tmp: Path, final: Path) -> None:
        """``state.pt`` into ``tmp``, then the marker (with the shard files' sizes, if any), then the rename."""
        shards = tmp / SHARDS_DIR
        _write_state(step, state, tmp, {p.name: p.stat().st_size for p in sorted(shards.iterdir())}
                     if shards.is_dir() else None)
        if final.exists():  # the same step saved again (a resumed attempt reached it once more)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)

    def complete(self) -> list[tuple[int, Path | str]]:
        """(step, where) of every checkpoint with its completion marker, newest first: its folder, or its URI."""
        if self.remote:
            return self.remote.complete()
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and (path / MARKER).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def load_latest(self, map_location: str | torch.device = "cpu") -> Checkpoint | None:
        """The newest checkpoint that reads back intact, or None; damaged ones are skipped with a warning."""
        for step, where in self.complete():
            try:
                path = self.local_copy(Path(str(where)).name)
                state = _load_verified(path, map_location)
            except Exception as exc:  # a damaged file must not end the job: an older one may be fine
                print(f"WARNING: checkpoint {where} is damaged ({type(exc).__name__}: {exc}); "
                      f"falling back to the previous one", flush=True)
                continue
            return Checkpoint(step=step, path=path, state=state, location=str(where))
        return None

    def _prune(self) -> None:
        if self.remote:
            self.remote.prune(self.keep)
        else:
            for _, path in self.complete()[self.keep:]:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(".tmp-step-*"):
            # Temporary folders of writers that died; this process is the only writer of the job now.
            shutil.rmtree(path, ignore_errors=True)


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists, tuples): about what saving it writes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _host_copy(state: Any) -> Any:
    """``state`` with every tensor copied to host memory (nested dicts, lists, tuples); other values as they are."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _host_copy(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_host_copy(value) for value in state]
    if type(state) is tuple:
        return tuple(_host_copy(value) for value in state)
    return state


def load_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state of one checkpoint folder, verified against its marker."""
    return _load_verified(Path(path), map_location)


def capture_rng() -> dict[str, Any]:
    """This process's random streams (torch CPU and CUDA, numpy, random) as checkpointable values."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS_DIR).is_dir()


def load_shards(path: Path, shards: dict[str, Any]) -> None:
    """Every rank: fill ``shards`` (this run's sharded state, any number of ranks: ``parallel.sharded_state``)
    from checkpoint ``path``'s shard files in place; torch.distributed.checkpoint reshards them."""
    import torch.distributed.checkpoint as dcp

    dcp.load(shards, checkpoint_id=str(Path(path) / SHARDS_DIR))


def _write_state(step: int, state: dict[str, Any], folder: Path, shards: dict[str, int] | None) -> None:
    """``state.pt`` into ``folder``, then the marker: its size and sha256, and the shard files' sizes, if any."""
    folder.mkdir(parents=True, exist_ok=True)
    state_path = folder / STATE_FILE
    with open(state_path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    marker = {"step": step, "size": state_path.stat().st_size, "sha256": _sha256(state_path)}
    if shards is not None:
        marker["shards"] = shards
    _write_synced(folder / MARKER, json.dumps(marker).encode())
    _fsync_dir(folder)


def _load_verified(path: Path, map_location) -> dict[str, Any]:
    marker = json.loads((path / MARKER).read_text())
    for name, expected in marker.get("shards", {}).items():
        size = (path / SHARDS_DIR / name).stat().st_size
        if size != expected:
            raise ValueError(f"{path / SHARDS_DIR / name} is {size} bytes, the marker says {expected}")
    state_path = path / STATE_FILE
    size = state_path.stat().st_size
    if size != marker["size"]:
        raise ValueError(f"{state_path} is {size} bytes, the marker says {marker['size']}")
    if _sha256(state_path) != marker["sha256"]:
        raise ValueError(f"{state_path} does not match the sha256 in its marker")
    return torch.load(state_path, map_location=map_location, weights_only=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
