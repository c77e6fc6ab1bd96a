"""A plain PyTorch DDP script, unaware of Airflow: what `TorchrunOperator` runs unchanged.

It reads only the torchrun environment (RANK, WORLD_SIZE, ...) and, when present, the folders
the launcher exports: checkpoints go to $PIPELINE_CHECKPOINT_DIR, so an Airflow retry resumes,
and rank 0 writes a small JSON result to $PIPELINE_RESULT_FILE (the task's XCom).

    torchrun --nproc-per-node=2 examples/ddp_regression.py --steps 200
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    true_w = torch.randn(8, 1)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = 0
    ckpt_dir = os.environ.get("PIPELINE_CHECKPOINT_DIR")
    ckpt = os.path.join(ckpt_dir, "last.pt") if ckpt_dir else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    generator = torch.Generator().manual_seed(rank)
    for step in range(start, args.steps):
        x = torch.randn(64, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and ckpt and (step + 1) % 50 == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    if rank == 0:
        print(f"trained {args.steps - start} steps on {world} ranks, final loss {loss.item():.5f}", flush=True)
        if os.environ.get("PIPELINE_RESULT_FILE"):
            with open(os.environ["PIPELINE_RESULT_FILE"], "w") as f:
                json.dump({"final_loss": loss.item(), "world_size": world, "start_step": start}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
