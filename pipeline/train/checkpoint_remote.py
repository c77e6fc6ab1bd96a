"""Checkpoints on an object store (``train.checkpoint_uri = s3://bucket/prefix``), where nothing is renamed into place.

A checkpoint is written as on a folder, in a node-local staging folder (``deployment.staging_dir``), then uploaded
to ``PREFIX/step-N/`` with its completion marker last: a folder without its marker (a writer killed mid-upload, the
store lost mid-write) is never resumed from, and the next prune removes it. An upload that cannot reach the store
tries again, backing off, for ``UPLOAD_PATIENCE_S`` (``storage.patiently``); training goes on meanwhile (the write is
in the background) and the next checkpoint waits for it; past that the rank fails as an infrastructure fault and the
attempt is restarted from the newest complete checkpoint. A resume downloads that checkpoint into the staging
folder once per node and verifies it against its marker like any other. A sharded checkpoint's files are uploaded
by each rank (its own), its state and marker by rank 0 once every rank's are in.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path

from pipeline import deployment, storage

UPLOAD_PATIENCE_S = 300.0  # how long an upload waits for an unreachable store before the rank fails (an infra fault)
STEP_DIR = re.compile(r"^step-(\d+)$")


def staging_for(uri: str) -> Path:
    """This node's folder for the checkpoints of ``uri``: written ones before their upload, resumed ones after
    their download."""
    return deployment.staging_dir() / "checkpoints" / hashlib.sha256(uri.encode()).hexdigest()[:16]


class RemoteCheckpoints:
    """The checkpoints of one job under ``uri``, with ``cache``, this node's staging folder for them."""

    def __init__(self, uri: str, marker: str, *, cache: Path | None = None):
        self.uri = uri.rstrip("/")
        self.marker = marker
        self.cache = Path(cache) if cache else staging_for(self.uri)

    def location(self, name: str) -> str:
        return storage.join(self.uri, name)

    def complete(self) -> list[tuple[int, str]]:
        """(step, location) of every checkpoint whose marker landed, newest first: one listing of the prefix."""
        found = set()
        for relative in self._patiently(lambda: storage.sizes(self.uri), "listing checkpoints"):
            folder, _, rest = relative.partition("/")
            match = STEP_DIR.match(folder)
            if match and rest == self.marker:
                found.add((int(match.group(1)), self.location(folder)))
        return sorted(found, reverse=True)

    def publish(self, folder: Path, name: str) -> str:
        """Upload ``folder``'s files as checkpoint ``name``, the marker last; the marker of an earlier save of the
        same step goes first, so its old marker never vouches for new files."""
        target = self.location(name)

        def put() -> None:
            storage.remove(storage.join(target, self.marker))
            storage.upload(folder, target, last=self.marker)

        self._patiently(put, f"uploading checkpoint {name} to {target}")
        return target

    def publish_part(self, folder: Path, name: str, part: str) -> None:
        """Upload ``folder``'s files into ``part`` of checkpoint ``name`` (a rank's shard files), no marker."""
        target = storage.join(self.location(name), part)
        self._patiently(lambda: storage.upload(folder, target), f"uploading {part} of checkpoint {name} to {target}")

    def sizes(self, name: str, part: str) -> dict[str, int]:
        return self._patiently(lambda: storage.sizes(storage.join(self.location(name), part)),
                               f"listing {part} of checkpoint {name}")

    def local_copy(self, name: str) -> Path:
        """Checkpoint ``name`` in this node's staging folder: downloaded unless a copy with the same marker is there.
        Ranks of one node may ask at once: each downloads to a folder of its own, the first rename wins."""
        local = self.cache / name
        marker = storage.read_bytes(storage.join(self.location(name), self.marker))
        if (local / self.marker).is_file() and (local / self.marker).read_bytes() == marker:
            return local
        tmp = self.cache / f".tmp-fetch-{name}-{uuid.uuid4().hex[:8]}"
        try:
            self._patiently(lambda: storage.download(self.location(name), tmp), f"downloading checkpoint {name}")
            if (local / self.marker).is_file() and (local / self.marker).read_bytes() == marker:
                return local  # another rank of this node renamed its copy in first
            shutil.rmtree(local, ignore_errors=True)
            try:
                os.rename(tmp, local)
            except OSError:  # another rank's copy landed between the two lines above
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return local

    def prune(self, keep: int) -> None:
        """Remove all but the newest ``keep`` complete checkpoints, every folder without a marker (a dead writer's:
        this job writes one checkpoint at a time, and prunes after it), and this node's copies of removed ones."""
        complete = self.complete()
        kept = {location for _, location in complete[:keep]}
        for _, location in complete[keep:]:
            self._patiently(lambda: storage.remove(location), f"removing checkpoint {location}")
        for name in self._patiently(lambda: storage.listing(self.uri), "listing checkpoints"):
            location = self.location(name)
            if STEP_DIR.match(name) and location not in {loc for _, loc in complete}:
                print(f"removing {location}: a checkpoint whose upload never finished (no {self.marker})", flush=True)
                self._patiently(lambda: storage.remove(location), f"removing checkpoint {location}")
        if self.cache.is_dir():
            for path in self.cache.iterdir():
                if STEP_DIR.match(path.name) and self.location(path.name) not in kept:
                    shutil.rmtree(path, ignore_errors=True)

    def _patiently(self, action, doing: str):
        return storage.patiently(action, doing=doing, patience_s=UPLOAD_PATIENCE_S)
