"""FSDP2 (``train.parallelism = fsdp``) on real ranks (gloo): the same losses as DDP for the same seed and data,
sharded checkpoints that resume on another number of ranks at the exact global sample, and the whole model
exported from the shards."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.recipes import tabular_mlp
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed


def _prepare(demo_parquet, name: str, **overrides):
    cfg = tabular_mlp.config("tiny").with_overrides({"data.input_path": str(demo_parquet), **overrides})
    return cfg, stages.prepare_data(cfg, stages.RunInfo("fsdp", name))


def _train(cfg, dataset, out: Path, nproc: int, lines: list[str] | None = None, entry: str = "pipeline.rank") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config_path = out.parent / f"{out.name}-config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    run_torchrun(["-m", entry, "--recipe", "tabular_mlp", "--config", str(config_path), "--dataset", dataset.uri,
                  "--out", str(out)], job_dir=out, nproc_per_node=nproc, emit=None if lines is None else lines.append)
    return json.loads((out / "result.json").read_text())


def _step_losses(out: Path) -> dict[int, float]:
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step_loss" in record.get("metrics", {}):
            losses[record["step"]] = record["metrics"]["step_loss"]
    return losses


def test_fsdp_losses_match_ddp_over_the_first_20_steps(demo_parquet, tmp_path):
    overrides = {"train.epochs": 1, "train.log_every_steps": 1, "train.batch_size": 32}
    ddp_cfg, dataset = _prepare(demo_parquet, "match", **overrides)
    fsdp_cfg = ddp_cfg.with_overrides({"train.parallelism": "fsdp"})
    lines: list[str] = []
    ddp = _train(ddp_cfg, dataset, tmp_path / "ddp", 2)
    fsdp = _train(fsdp_cfg, dataset, tmp_path / "fsdp", 2, lines)
    assert fsdp["parallelism"] == "fsdp" and ddp["parallelism"] == "ddp"
    # The default blocks: each categorical column's embedding (3 here, out of a ModuleList) and the MLP; then the
    # model's own unit.
    assert any("fsdp over 5 units" in line for line in lines), "\n".join(lines[-30:])
    ddp_losses, fsdp_losses = _step_losses(tmp_path / "ddp"), _step_losses(tmp_path / "fsdp")
    first = sorted(ddp_losses)[:20]
    assert len(first) == 20 and first == sorted(fsdp_losses)[:20]
    for step in first:  # fp32 on both; only the order of the gradient sums differs (reduce-scatter vs all-reduce)
        assert fsdp_losses[step] == pytest.approx(ddp_losses[step], rel=1e-4, abs=1e-6), step
    # The whole model, gathered from the shards, is what was exported and registered.
    assert Path(fsdp["model_files"]["network"]).exists()
    assert len(fsdp["param_digests"]) == 1


SAVED = 20  # the checkpoint resumed: mid-way through the first epoch of the 4-rank run


def _samples(out: Path, rank: int) -> list[list[tuple]]:
    """The training samples ``rank`` was given, one list per micro-batch (``tests.recording_rank``)."""
    return [[tuple(row) for row in json.loads(line)]
            for line in (out / f"samples-rank-{rank}.jsonl").read_text().splitlines()]


def _lrs(out: Path) -> dict[int, float]:
    return {json.loads(line)["step"]: json.loads(line)["metrics"]["lr"]
            for line in (out / "metrics.jsonl").read_text().splitlines() if "lr" in json.loads(line)["metrics"]}


def _only_checkpoint(source: Path, out: Path, step: int) -> Path:
    name = f"step-{step:09d}"
    shutil.copytree(source / "checkpoints" / name, out / "checkpoints" / name)
    return out / "checkpoints" / name


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_a_checkpoint_of_4_ranks_resumes_on_2_at_the_same_global_sample(demo_parquet, tmp_path, parallelism):
    cfg, dataset = _prepare(demo_parquet, f"resize-{parallelism}", **{
        "train.epochs": 2, "train.batch_size": 32, "train.checkpoint_every_steps": 10, "train.keep_checkpoints": 100,
        "train.log_every_steps": 1, "train.lr_schedule": "cosine", "train.warmup_steps": 3,
        "train.parallelism": parallelism})
    four, two = tmp_path / "four", tmp_path / "two"
    _train(cfg, dataset, four, 4, entry="tests.recording_rank")  # uninterrupted, its checkpoints kept
    checkpoint = _only_checkpoint(four, two, SAVED)
    assert (checkpoint / "shards").is_dir() == (parallelism == "fsdp")
    lines: list[str] = []
    resumed = _train(cfg, dataset, two, 2, lines, entry="tests.recording_rank")
    assert resumed["start_step"] == SAVED and resumed["resumed_from"] == str(two / "checkpoints" / checkpoint.name)

    # Samples: what the 4 ranks trained on before the checkpoint and what the 2 ranks trained on after it, in the
    # first epoch, are each of the epoch's samples exactly once.
    rows = dataset.rows["train"]
    four_steps = math.ceil(math.ceil(rows / 4) / 32)
    two_steps = math.ceil(math.ceil(rows / 2) / 32)
    four_batches = [_samples(four, rank) for rank in range(4)]
    epoch = {s for batches in four_batches for batch in batches[:four_steps] for s in batch}
    assert len(epoch) == rows  # the features tell every sample apart
    before = [s for batches in four_batches for batch in batches[:SAVED] for s in batch]
    resumed_in_epoch = SAVED * 4 // 2  # the same samples are twice the steps on half the ranks
    after = [s for rank in range(2) for batch in _samples(two, rank)[:two_steps - resumed_in_epoch] for s in batch]
    assert not set(before) & set(after), "a sample trained before the checkpoint was trained again after it"
    assert set(before) | set(after) == epoch, f"{len(epoch - set(before) - set(after))} samples skipped"
    assert len(before) == len(set(before)) and len(after) - len(set(after)) <= 2  # at most the padding repeats
    assert any(f"at its step {resumed_in_epoch} of {two_steps} on 2 rank(s)" in line for line in lines)
    # One unit of steps in the log: the plan names whose steps came before and where the run ends.
    assert any(f"resumed from step {SAVED}, steps taken by 4 rank(s)" in line and
               f"so the run ends at step {resumed['steps']}" in line for line in lines), lines

    # The LR schedule goes on by the samples trained: step 21 on 2 ranks is step 20.5 of the 4-rank schedule,
    # and both runs end at its end.
    four_lrs, two_lrs = _lrs(four), _lrs(two)
    assert four_lrs[SAVED] > two_lrs[SAVED + 1] > four_lrs[SAVED + 1]
    assert two_lrs[max(two_lrs)] == pytest.approx(four_lrs[max(four_lrs)], abs=1e-4)
    assert resumed["steps"] == SAVED + (two_steps - resumed_in_epoch) + two_steps
    if parallelism == "fsdp":
        _same_as_from_the_whole_checkpoint(cfg, dataset, checkpoint, resumed, tmp_path / "whole")


def _same_as_from_the_whole_checkpoint(cfg, dataset, checkpoint: Path, resumed: dict, out: Path) -> None:
    """The 4 ranks' shards, resharded for 2 by torch.distributed.checkpoint, reach the same final parameters as a
    2-rank continuation from the same checkpoint consolidated into whole tensors (which each rank cuts itself)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from pipeline.train.checkpoint import CheckpointStore, load_state

    dcp_to_torch_save(checkpoint / "shards", out.parent / "whole.pt")
    whole = torch.load(out.parent / "whole.pt", weights_only=True)
    assert sorted(whole) == ["model", "optimizer"]
    CheckpointStore(out / "checkpoints").save(SAVED, load_state(checkpoint) | whole)
    reference = _train(cfg, dataset, out, 2)
    assert reference["start_step"] == SAVED and reference["steps"] == resumed["steps"]
    assert reference["param_digests"] == resumed["param_digests"]


def test_llm_sft_with_lora_trains_sharded_by_decoder_layer_and_exports_the_whole_merged_model(pipeline_home,
                                                                                              tmp_path):
    """The language model sharded one unit per decoder layer (the recipe's ``shard_units``), activations
    recomputed per layer, LoRA's adapters trained on frozen shards; the baseline generates text on each rank from
    the gathered model; the export is the merged whole model, as with DDP."""
    from pipeline.recipes import get_recipe
    from pipeline.recipes.llm_sft import demo

    data = demo.write_addition(pipeline_home / "inputs" / "llm_fsdp" / "additions.jsonl", rows=400)
    cfg = get_recipe("llm_sft").config("tiny").with_overrides({
        "data.input_path": str(data), "model.lora": True, "model.lora_rank": 4, "train.epochs": 2,
        "model.eval_max_examples": 8, "train.parallelism": "fsdp", "train.activation_checkpointing": True})
    dataset = stages.prepare_data(cfg, stages.RunInfo("llm_fsdp", "prep"))

    def train(cfg, out: Path, lines: list[str]) -> dict:
        out.mkdir()
        (out.parent / f"{out.name}.json").write_text(json.dumps(cfg.to_dict()))
        run_torchrun(["-m", "pipeline.rank", "--recipe", "llm_sft", "--config", str(out.parent / f"{out.name}.json"),
                      "--dataset", dataset.uri, "--out", str(out)], job_dir=out, nproc_per_node=2,
                     emit=lines.append)
        return json.loads((out / "result.json").read_text())

    lines: list[str] = []
    result = train(cfg, tmp_path / "fsdp", lines)
    ddp = train(cfg.with_overrides({"train.parallelism": "ddp"}), tmp_path / "ddp", [])
    layers = cfg.model.num_layers
    assert any(f"fsdp over {layers + 1} units" in line for line in lines), "\n".join(lines[-20:])
    assert result["baseline_metrics"] == pytest.approx(ddp["baseline_metrics"], rel=1e-4)
    assert result["metrics"]["val_loss"] < result["baseline_metrics"]["test_loss"]
    assert result["metrics"] == pytest.approx(ddp["metrics"], rel=1e-3)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result["model_files"]["model_dir"])
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged into the base weights
    assert sum(p.numel() for p in model.parameters()) > 0
