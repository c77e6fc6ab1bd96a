"""data.split_by=files: a data set's own test files (Fashion-MNIST's t10k pair) are the test split, written as
real MDS and read back; the rest go to train and val by the hash. And the packaged data sets' folder: linked
when installed, a clear error naming the package when it is not and cannot be."""

import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import packaged
from pipeline.data.demo import write_idx
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.errors import ConfigError, DataError
from tests.datafiles import cfg


def _idx_pairs(folder: Path, *, train: int = 400, test: int = 150, seed: int = 0) -> dict[bytes, str]:
    """A train and a t10k IDX pair of unique random images; each image's bytes -> the file it is in."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (train + test, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, train + test)
    write_idx(folder, "train", images[:train], labels[:train])
    write_idx(folder, "t10k", images[train:], labels[train:])
    return {image.tobytes(): ("train" if i < train else "t10k") for i, image in enumerate(images)}


def _rows_by_split(manifest, cache: Path) -> dict[str, list[bytes]]:
    data = TrainingData.open([manifest["uri"]], cache)
    return {split: [np.asarray(image).tobytes() for image in data.read_split(split)["image"]]
            for split in ("train", "val", "test") if manifest["splits"][split]}


def test_the_files_test_files_names_are_the_test_split_and_the_rest_train_and_val(tmp_path):
    origin = _idx_pairs(tmp_path / "fashion")
    manifest = prepare(cfg(tmp_path / "fashion", split_by="files", test_files=["t10k-*"], val_fraction=0.1,
                           unit_bytes=64 * 785, shard_size_limit_bytes=1 << 15),
                       name="f", out_root=tmp_path / "out")
    rows = _rows_by_split(manifest, tmp_path / "cache")
    assert manifest["file_split"] == {"by": "files", "test_files": ["t10k-*"]}
    assert sorted(rows["test"]) == sorted(k for k, f in origin.items() if f == "t10k")
    held_in = rows["train"] + rows["val"]
    assert sorted(held_in) == sorted(k for k, f in origin.items() if f == "train")
    assert 10 <= len(rows["val"]) <= 80  # about val_fraction of the 400 training images, by the hash

    # The same input split by the hash mixes the files: the split above is the files', not the hash's.
    hashed = prepare(cfg(tmp_path / "fashion", test_fraction=0.3, unit_bytes=64 * 785,
                         shard_size_limit_bytes=1 << 15), name="h", out_root=tmp_path / "out")
    assert {origin[k] for k in _rows_by_split(hashed, tmp_path / "cache-h")["test"]} == {"train", "t10k"}


def test_test_files_that_match_no_file_or_every_file_are_an_error_naming_the_files(tmp_path):
    _idx_pairs(tmp_path / "fashion", train=20, test=10)
    for patterns, word in ((["test-*"], "no"), (["*-images-*"], "every")):
        with pytest.raises(DataError, match=rf"data.test_files {re.escape(str(patterns))} match {word} input file "
                                            rf".*train-images-idx3-ubyte.gz"):
            prepare(cfg(tmp_path / "fashion", split_by="files", test_files=patterns), name="f",
                    out_root=tmp_path / "out")
    with pytest.raises(ConfigError, match="split_by='files' needs data.test_files"):
        prepare(cfg(tmp_path / "fashion", split_by="files"), name="f", out_root=tmp_path / "out")
    assert not (tmp_path / "out" / "f").exists() or not any((tmp_path / "out" / "f").iterdir())


def test_a_packaged_data_set_is_linked_when_installed_and_named_when_it_cannot_be(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    for name in ("a.gz", "b.gz"):
        (tmp_path / "pkg" / name).write_bytes(name.encode())
    installed = packaged.DebianData("dataset-made-up", tmp_path / "pkg", ("a.gz", "b.gz"))
    linked = packaged.link_files(installed, tmp_path / "raw" / "made-up")
    assert sorted(p.name for p in linked.iterdir()) == ["a.gz", "b.gz"]
    assert (linked / "b.gz").read_bytes() == b"b.gz" and (linked / "b.gz").is_symlink()

    missing = packaged.DebianData("dataset-made-up", tmp_path / "nowhere", ("a.gz",))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # neither apt-get nor sudo
    with pytest.raises(DataError, match=r"nowhere: the Debian package dataset-made-up is not installed"):
        packaged.link_files(missing, tmp_path / "raw" / "other")
    assert not (tmp_path / "raw" / "other").exists()
