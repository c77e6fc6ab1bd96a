"""The Lightning callback's checkpoints reach the job's store through Lightning's public ``CheckpointIO`` plugin
API, and a Trainer built without that plugin is refused before it trains."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.train import callbacks


class _Store:
    location = "memory://checkpoints"

    def __init__(self):
        self.saved = {}

    def save(self, step, state):
        self.saved[step] = state


@pytest.fixture
def callback(monkeypatch):
    # The real one takes SIGTERM for the whole process: not in the test runner's.
    monkeypatch.setattr(callbacks.preemption, "install", lambda: SimpleNamespace(take_signal=lambda: None))
    beats = []
    ctx = SimpleNamespace(checkpoints=_Store(), heartbeat=SimpleNamespace(beat=lambda *a, **k: beats.append(a)))
    return callbacks.lightning_callback(ctx, every_steps=1, log_every_steps=1), ctx


def _trainer(**kwargs):
    import pytorch_lightning as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_a_trainer_without_the_plugin_is_a_config_error_saying_to_pass_it(callback):
    cb, _ = callback
    with pytest.raises(ConfigError, match=r"plugins=\[callback.checkpoint_io\]"):
        cb.setup(_trainer(callbacks=[cb]), None, "fit")
    cb.setup(_trainer(callbacks=[cb], plugins=[cb.checkpoint_io]), None, "fit")


def test_the_callbacks_saves_go_to_the_store_and_other_saves_to_files(callback, tmp_path):
    cb, ctx = callback
    trainer = _trainer(callbacks=[cb], plugins=[cb.checkpoint_io])
    assert trainer.strategy.checkpoint_io is cb.checkpoint_io
    state = {"state_dict": {"w": torch.ones(2)}, "global_step": 7}
    cb.checkpoint_io.save_checkpoint(state, ctx.checkpoints.location, storage_options=callbacks._ToStore(7))
    assert ctx.checkpoints.saved == {7: state}
    cb.checkpoint_io.save_checkpoint(state, tmp_path / "other.ckpt")  # a ModelCheckpoint's, say
    assert torch.equal(cb.checkpoint_io.load_checkpoint(tmp_path / "other.ckpt")["state_dict"]["w"], torch.ones(2))
    assert list(ctx.checkpoints.saved) == [7]
