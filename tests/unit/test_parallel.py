"""``train.parallelism`` and its options checked before anything runs; the blocks FSDP shards by default;
activation checkpointing's same gradients; the LR schedule across a change of world size."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError
from pipeline.recipes import get_recipe
from pipeline.train.distributed import DistContext
from pipeline.train.lr import LrFactor
from pipeline.train.parallel import Sharded, default_units, parallelize


def test_fsdp_with_a_recipe_that_keeps_its_own_loop_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"train.parallelism='fsdp': the two_tower recipe .*expected train.parallelism='ddp'"):
        get_recipe("two_tower").config("tiny").with_overrides({"train.parallelism": "fsdp"})
    assert get_recipe("image_classifier").config("tiny").with_overrides({"train.parallelism": "fsdp"})


def test_cpu_offload_without_fsdp_and_an_unknown_parallelism_are_config_errors():
    with pytest.raises(ConfigError, match=r"train.cpu_offload=true: .*train.parallelism='ddp'"):
        get_recipe("tabular_mlp").config("tiny").with_overrides({"train.cpu_offload": True})
    with pytest.raises(ConfigError, match=r"train.parallelism.*'zero3'"):
        get_recipe("tabular_mlp").config("tiny").with_overrides({"train.parallelism": "zero3"})


def test_fsdp_refuses_cpu_offload_on_a_cpu_and_a_process_without_a_group():
    model = nn.Sequential(nn.Linear(2, 2))
    offload = TrainConfig(parallelism="fsdp", cpu_offload=True)
    with pytest.raises(ConfigError, match=r"train.cpu_offload=true: .*run on cpu"):
        Sharded(model, [], DistContext(0, 0, 2, torch.device("cpu"), "gloo"), offload, bf16=False)
    with pytest.raises(ConfigError, match=r"train.parallelism='fsdp' .*no.*process group|has none"):
        Sharded(model, [], DistContext(0, 0, 1, torch.device("cpu"), None), TrainConfig(parallelism="fsdp"), bf16=False)


def test_the_default_blocks_are_the_children_with_parameters_and_a_containers_members():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = nn.ModuleList([nn.Embedding(3, 2), nn.Embedding(4, 2)])
            self.act = nn.ReLU()  # no parameters: not a block
            self.head = nn.Linear(4, 1)

    net = Net()
    assert default_units(net) == [net.embeddings[0], net.embeddings[1], net.head]


def test_activation_checkpointing_keeps_the_state_dict_keys_and_the_gradients():
    class Counted(nn.Linear):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    torch.manual_seed(0)
    plain = nn.Sequential(Counted(4, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped = nn.Sequential(Counted(4, 8), nn.Tanh(), nn.Linear(8, 1))
    wrapped.load_state_dict(plain.state_dict())
    parallelize(wrapped, DistContext(0, 0, 1, torch.device("cpu"), None), TrainConfig(activation_checkpointing=True),
                bf16=False)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [name for name, _ in wrapped.named_parameters()] == [name for name, _ in plain.named_parameters()]
    x = torch.randn(5, 4)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert (plain[0].calls, wrapped[0].calls) == (1, 2)  # the block's forward ran again in the backward
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.allclose(a.grad, b.grad)
    fresh = nn.Sequential(Counted(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fresh.load_state_dict(wrapped.state_dict())  # what the export of a checkpointed model does


def test_the_lr_goes_on_by_the_samples_trained_when_the_world_halves():
    tc = TrainConfig(lr_schedule="cosine", warmup_steps=10)
    uninterrupted, resized = LrFactor(tc, 1000), LrFactor(tc, 1000)
    resized.rescale(400, 0.5)  # from step 400 on, a step is half the samples of one before
    assert resized(400) == uninterrupted(400)
    assert resized(600) == pytest.approx(uninterrupted(500))
    assert resized(1600) == pytest.approx(uninterrupted(1000)) == pytest.approx(0.0)
    resized.rescale(1000, 4.0)  # and back up to twice the first world
    assert resized(1050) == pytest.approx(uninterrupted(800))
    assert math.isclose(LrFactor(tc, 1000)(4), 0.5)  # warm-up unchanged without a resize
