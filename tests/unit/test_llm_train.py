"""The llm_sft hooks of the generic loop: token batches, the completion-only loss, the model from a config, a
local checkpoint or LoRA, the errors for a hub name and wrong LoRA modules, MFU per token."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.recipes import get_recipe
from pipeline.recipes.llm_sft import train as hooks
from pipeline.train.throughput import Throughput


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A stand-in for TrainingData: the tokenizer folder and the schema's sequence length are all the model needs."""
    from pipeline.data.prepare.transform import FOLDER
    from pipeline.recipes.llm_sft.demo import train_tokenizer
    from pipeline.recipes.llm_sft.tokenize import TOKENIZER

    root = tmp_path_factory.mktemp("version")
    train_tokenizer([f"{a}+{b}={a + b}" for a in range(10, 30) for b in range(10, 30)], root / FOLDER / TOKENIZER)
    return SimpleNamespace(dirs=[root], schema={"encodings": {"input_ids": "ndarray:int32:16"}})


def _cfg(**overrides):
    return get_recipe("llm_sft").config("tiny").with_overrides(overrides)


def test_batches_are_cut_to_their_longest_row_and_the_loss_counts_completion_tokens_only(data):
    torch.manual_seed(0)
    model = hooks.build_model(_cfg(), data)
    ids = np.zeros((2, 16), np.int32)
    ids[0, :5], ids[1, :7] = [1, 5, 6, 7, 2], [1, 5, 6, 7, 8, 9, 2]
    labels = np.full((2, 16), -100, np.int32)
    labels[0, 3:5], labels[1, 5:7] = [7, 2], [9, 2]
    batch = hooks.ToTensors()({"input_ids": ids, "labels": labels, "num_tokens": np.array([5, 7], np.int32)})
    assert batch["input_ids"].shape == (2, 7) and batch["attention_mask"].sum().item() == 12
    assert hooks.tokens(_cfg(), batch) == 12
    loss_sum, stats = hooks.loss(_cfg(), model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = [(0, 2, 7), (0, 3, 2), (1, 4, 9), (1, 5, 2)]  # (row, position predicting, token)
    expected = np.mean([-torch.log_softmax(logits[r, p], -1)[t].item() for r, p, t in targets])
    assert loss_sum.item() / 2 == pytest.approx(expected, rel=1e-4)  # the loop divides by the rows
    assert 0.0 <= stats["token_accuracy"].item() / 2 <= 1.0


def test_lora_trains_adapters_only_and_a_wrong_module_name_is_refused(data):
    model = hooks.build_model(_cfg(**{"model.lora": True, "model.lora_rank": 4}), data)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with pytest.raises(ConfigError, match=r"lora_target_modules: \['query'\] name no module.*q_proj"):
        hooks.build_model(_cfg(**{"model.lora": True, "model.lora_target_modules": ["query"]}), data)
    with pytest.raises(ConfigError, match=r"lora_layers=\[0, 3\]: the model has 1 decoder layers; expected indices in 0..0"):
        hooks.build_model(_cfg(**{"model.lora": True, "model.lora_layers": [0, 3]}), data)


def test_a_pretrained_path_must_be_a_local_checkpoint_and_one_loads(data, tmp_path):
    from pipeline.data.prepare.transform import FOLDER
    from pipeline.recipes.llm_sft.demo import write_tiny_checkpoint
    from pipeline.recipes.llm_sft.tokenize import TOKENIZER

    with pytest.raises(ConfigError, match="meta-llama/Llama-3.2-1B.*nothing is fetched from a hub"):
        hooks.build_model(_cfg(**{"model.pretrained_path": "meta-llama/Llama-3.2-1B"}), data)
    checkpoint = write_tiny_checkpoint(data.dirs[0] / FOLDER / TOKENIZER, tmp_path / "tiny", hidden_size=16)
    model = hooks.build_model(_cfg(**{"model.pretrained_path": str(checkpoint)}), data)
    assert model.config.hidden_size == 16


def test_mfu_of_a_language_model_counts_flops_per_token():
    meter = Throughput(world_size=1, flops_per_token=6e9, peak_flops_per_s=1e12)
    meter.step(samples=4, tokens=1000)
    figures = meter.summary()
    assert figures["tokens_per_s"] > 0
    assert figures["mfu"] == pytest.approx(figures["tokens_per_s"] * 6e9 / 1e12, rel=1e-3)
