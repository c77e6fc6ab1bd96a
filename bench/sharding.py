"""Memory per rank, DDP against FSDP2, on the language-model recipe's model scaled up (a Llama of a few hundred
million parameters), at 2 and 4 ranks on gloo.

    .venv/bin/python bench/sharding.py [--hidden 1024 --layers 12 --vocab 32000 --steps 3 --ranks 2 4]

Each case is its own torchrun job of this file's worker: the model built as ``llm_sft`` builds it (a
``LlamaConfig``), held as ``pipeline.train.parallel.parallelize`` holds it for ``train.parallelism`` (fsdp: one
unit per decoder layer, the recipe's ``shard_units``), AdamW, a few steps of random tokens. After the last step
each rank counts the bytes of what it holds: parameters, gradients and optimizer state (its shards' local
tensors with fsdp), and its peak resident memory (``ru_maxrss``: the process's whole footprint, activations,
the gathered units, gloo's buffers and the interpreter included). The table prints rank 0's figures per case,
the FSDP/DDP ratio of model+gradient+optimizer bytes against the target 1/N + 0.05, and the step time ratio.
DDP's gradient buckets (a second copy of the gradients that it all-reduces) are not in its gradient bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from pipeline.config import TrainConfig
    from pipeline.recipes.llm_sft.train import shard_units
    from pipeline.train import distributed
    from pipeline.train.parallel import parallelize

    dist = distributed.setup("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    parallel = parallelize(model, dist, TrainConfig(parallelism=args.parallelism), bf16=False,
                           units=lambda m: shard_units(None, m))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.rank)
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = parallel.wrapped(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    figures = {
        "parameters": parameters,
        "param_bytes": sum(_local_bytes(p) for p in model.parameters()),
        "grad_bytes": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer_bytes": sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values()
                               if isinstance(v, torch.Tensor)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times[1:] or times),
    }
    every = distributed.gather(dist, figures)
    if dist.is_main:
        Path(args.out).write_text(json.dumps(every))
    distributed.teardown(dist)


def run_case(args: argparse.Namespace, parallelism: str, ranks: int, folder: Path) -> list[dict]:
    out = folder / f"{parallelism}-{ranks}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               __file__, "--worker", "--parallelism", parallelism, "--out", str(out),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
               "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps)]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    print(f"  {parallelism} on {ranks} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parallelism", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    gib = 1024 ** 3
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            cases = {p: run_case(args, p, ranks, Path(tmp)) for p in ("ddp", "fsdp")}
            rows.append((ranks, cases))
    print(f"\nLlama {rows[0][1]['ddp'][0]['parameters'] / 1e6:.0f}M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}), fp32, AdamW; rank 0's figures, GiB\n")
    print(f"{'ranks':>5} {'mode':>5} {'params':>7} {'grads':>7} {'optim':>7} {'total':>7} {'peak RSS':>9} "
          f"{'step s':>7}   fsdp/ddp total (target <= 1/N + 0.05)   step time fsdp/ddp")
    for ranks, cases in rows:
        totals = {}
        for mode in ("ddp", "fsdp"):
            f = cases[mode][0]
            totals[mode] = f["param_bytes"] + f["grad_bytes"] + f["optimizer_bytes"]
            line = (f"{ranks:>5} {mode:>5} {f['param_bytes'] / gib:>7.3f} {f['grad_bytes'] / gib:>7.3f} "
                    f"{f['optimizer_bytes'] / gib:>7.3f} {totals[mode] / gib:>7.3f} "
                    f"{f['peak_rss_bytes'] / gib:>9.2f} {f['step_s']:>7.2f}")
            if mode == "fsdp":
                ratio, target = totals["fsdp"] / totals["ddp"], 1 / ranks + 0.05
                step_ratio = f["step_s"] / cases["ddp"][0]["step_s"]
                line += (f"   {ratio:.3f} vs {target:.3f}: {'met' if ratio <= target else 'NOT met'}"
                         f"{'':>16}{step_ratio:.2f}x")
            print(line)
        largest = max(sum(f[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) for f in cases["fsdp"])
        print(f"{'':>11}fsdp's largest rank holds {largest / gib:.3f} GiB (shards are even to a row)")


if __name__ == "__main__":
    main()
