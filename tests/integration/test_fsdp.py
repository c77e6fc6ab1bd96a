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
