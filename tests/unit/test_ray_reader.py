"""The Ray Data loader's position: what the training loop saves in a checkpoint and resumes from."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.read.ray_data import RayDataLoader


class _Split:
    """A rank's Ray Data iterator over ``rows`` numbered rows, in order."""

    def __init__(self, rows: int):
        self.rows, self.epochs = rows, 0

    def iter_torch_batches(self, *, batch_size, collate_fn, **shuffle):
        self.epochs += 1
        for at in range(0, self.rows, batch_size):
            yield collate_fn({"x": np.arange(at, min(at + batch_size, self.rows))})


def _loader(world_size: int = 2) -> RayDataLoader:
    return RayDataLoader(_Split(40), rows=40, world_size=world_size, batch_size=8, shuffle=False, seed=0,
                         transform=lambda columns: columns["x"].tolist())


def test_a_resumed_epoch_skips_the_batches_already_trained_on():
    loader = _loader()
    batches = iter(loader)
    seen = [next(batches), next(batches)]
    state = loader.state_dict()
    assert state == {"epoch": 0, "sample_in_epoch": 2 * 8 * 2}  # over both ranks
    resumed = _loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest[0] == list(range(16, 24)) and seen[-1] == list(range(8, 16))
    assert len(rest) == len(resumed) - 2
    assert len(list(resumed)) == len(resumed)  # the next epoch is whole again


@pytest.mark.parametrize("world_size, skipped", [(1, 4), (4, 1)])
def test_the_position_is_kept_in_samples_so_another_world_size_resumes_at_the_same_sample(world_size, skipped):
    resumed = _loader(world_size)
    resumed.load_state_dict({"epoch": 0, "sample_in_epoch": 32})  # 2 batches of 8 on each of 2 ranks
    assert len(list(resumed)) == len(resumed) - skipped
