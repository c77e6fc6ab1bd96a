"""The baseline of bench/train_overhead.py: a minimal hand-written DDP loop over the same MDS data.

No checkpoints, no heartbeats, no metrics logging, no resume: model, optimizer, loader, steps and a
validation pass per epoch, as a user would write it. Run under torchrun; rank 0 writes
``{"samples_per_s": ..., "data_wait_fraction": ...}`` to OUT/result.json (the share of its time rank 0 waited for
the loader's next training batch, as the pipeline's loop reports its own).
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from pipeline.data.read.training_data import TrainingData
from pipeline.recipes.tabular_mlp import TabularConfig
from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP
from pipeline.recipes.tabular_mlp.train import Encode


def waited(batches, seconds: list[float]):
    """``batches``' items, adding the time each took to arrive to ``seconds[0]``."""
    items = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(items)
        except StopIteration:
            return
        finally:
            seconds[0] += time.perf_counter() - started
        yield batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = TabularConfig.from_dict(json.loads(args.config.read_text()))
    tc = cfg.train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TrainingData.open([args.dataset], args.out / "cache")
    prep = data.preprocessing
    torch.manual_seed(tc.seed)
    spec = ModelSpec(num_numeric=len(prep["mean"]), cardinalities=[len(prep["vocab"][c]) for c in prep["categorical_columns"]],
                     num_classes=len(prep["label_classes"]), hidden_sizes=list(cfg.model.hidden_sizes),
                     dropout=cfg.model.dropout)
    model = DistributedDataParallel(TabularMLP(spec, prep["mean"], prep["std"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.learning_rate, weight_decay=tc.weight_decay)
    # The same reader and batch transform as the pipeline: the comparison is of the loop around them.
    encode = Encode(data.preprocessing, data.schema["label_column"])
    train = data.loader("train", shuffle=True, seed=tc.seed, batch_size=tc.batch_size, transform=encode)
    val = data.loader("val", shuffle=False, seed=tc.seed, batch_size=tc.batch_size, transform=encode)
    samples, data_wait = 0, [0.0]
    started = time.perf_counter()
    for _ in range(tc.epochs):
        model.train()
        for batch in waited(train, data_wait):
            loss = F.cross_entropy(model(batch["num"], batch["cat"]), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += batch["label"].shape[0]
        model.eval()
        with torch.no_grad():
            for batch in val:
                model(batch["num"], batch["cat"])
    wall = time.perf_counter() - started
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps({"samples_per_s": samples * world / wall, "wall_s": wall,
                                                        "data_wait_fraction": data_wait[0] / wall}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
