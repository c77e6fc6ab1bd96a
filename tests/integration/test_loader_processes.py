"""The batch path of TrainingData.loader where processes are started: loader workers keep the per-sample path's
batches and the mid-epoch resume, and a fresh interpreter reading batches imports no module. Everything else of
the loader is in tests/unit/test_loader.py."""

import subprocess
import sys

import pytest

from pipeline.data.read.training_data import TrainingData
from tests.datafiles import (
    assert_same_batches,
    both_paths,
    check_mid_epoch_resume,
    numbered_rows,
)


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> dict:
    return numbered_rows(tmp_path_factory.mktemp("tabular"))


def test_loader_workers_keep_the_order(tabular, tmp_path):
    data = TrainingData.open([tabular["uri"]], tmp_path / "cache")
    fast, slow = both_paths(data, tmp_path, batch_size=16, shuffle=True, seed=1, num_workers=2)
    assert_same_batches(fast, slow)


def test_mid_epoch_resume_with_loader_workers_delivers_exactly_the_remaining_samples(tabular, tmp_path):
    check_mid_epoch_resume(tabular, tmp_path, num_workers=2)


def test_reading_batches_imports_no_module(tabular, tmp_path):
    """A module imported inside a run's first batch is counted as waiting for data (pandas through pyarrow's
    to_numpy was 0.3-0.7 s of it, pyarrow.compute 40-90 ms): whatever reading needs is imported when the loader
    is made. Text columns come out of the batch path, and out of read_split, as str."""
    script = (
        "import sys\n"
        "from pipeline.data.read.training_data import TrainingData\n"
        f"data = TrainingData.open([{tabular['uri']!r}], {str(tmp_path / 'cache')!r})\n"
        "loader = data.loader('train', batch_size=32, shuffle=True, seed=3, transform=dict)\n"
        "before = set(sys.modules)\n"
        "batch = next(iter(loader))\n"
        "split = data.read_split('val')\n"
        "assert isinstance(batch['color'][0], str) and isinstance(split['color'][0], str)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
