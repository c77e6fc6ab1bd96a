"""Training epochs from a dataset version on an object store against the same version on local disk: the first
epoch (shards downloaded from S3 by streaming's downloader into the node-local cache, checked, decompressed) and a
cached epoch (shards already in the cache), each beside the same epoch from a local folder.

    .venv/bin/python bench/object_store.py [--rows 200000 --images 60000 --batch-size 256 --shard-mib 1 --rounds 3]

The store is an S3 API server on 127.0.0.1 (``pipeline.dev.s3_server``: moto's, in a process of its own); each
dataset is published once to it and once to a local folder (the same version), under a temporary PIPELINE_HOME.
An epoch is what a rank of the recipe does with ``num_workers=0``: the loader over the shuffled train split, the
recipe-like transform to tensors, and forward + backward + AdamW of a small model on each batch (``bench/loader.py``
has the models); one torch thread, as each of 2 ranks gets on 2 cores. Each figure is the best of ``--rounds``
rounds, each round with a new, empty cache. Targets: first epoch from S3 >= 0.8x the local first epoch's
samples/s, cached epochs >= 0.95x.

A loopback server has none of a real store's latency (tens of ms to the first byte) nor its bandwidth limits; what
this measures is the cost of the object-store path itself (requests, the downloader, checks), not a network. A
benchmark, not a test: figures vary with the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="tabular demo rows (0 skips)")
    parser.add_argument("--images", type=int, default=60_000, help="28x28 images in IDX files (0 skips)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shard-mib", type=float, default=1.0,
                        help="largest shard before compression (data.shard_size_limit_bytes), in MiB: a dataset of "
                             "real size has hundreds of shards, these have several")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of measurements; each figure is the best")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-object-store-"))
    os.environ["PIPELINE_HOME"] = str(home)
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import torch

    import loader as cases  # bench/loader.py: the datasets, transforms and models
    from pipeline.dev.s3_server import S3Server

    torch.set_num_threads(1)
    server = S3Server(home / "logs")
    server.start()
    os.environ.update(server.env())
    bucket = server.bucket("bench")
    print(f"S3 API server at {server.endpoint}; batch {args.batch_size}, 1 torch thread, {os.cpu_count()} CPUs; "
          f"data under {home}", flush=True)
    try:
        rows = []
        if args.rows:
            from pipeline.data import demo

            source = demo.write_parquet(home / "raw" / "tabular.parquet", args.rows, seed=0)
            rows.append(_measure(f"tabular ({args.rows:,} rows)", source, "tabular", home, bucket, args,
                                 cases.tabular_case))
        if args.images:
            from pipeline.data import demo

            images, labels = cases._synthetic_images(args.images)
            source = demo.write_idx(home / "raw" / "idx", "train", images, labels)
            rows.append(_measure(f"28x28 images ({args.images:,})", source, "idx", home, bucket, args,
                                 lambda opener: cases._image_bench("idx", opener)))
        _print(rows)
    finally:
        server.stop()


def _opener(home: Path, name: str, where: str):
    """Opens the ``where`` copy (local or s3) of dataset ``name`` with a cache of the given tag."""
    from pipeline.data.read.training_data import TrainingData

    uri = _URIS[(name, where)]
    return lambda tag: TrainingData.open([uri], home / "cache" / name / where / tag)


_URIS: dict[tuple[str, str], str] = {}


def _measure(title: str, source: Path, name: str, home: Path, bucket: str, args, case_of) -> dict:
    import torch

    from pipeline.config import DataConfig
    from pipeline.data.prepare.version import prepare

    cfg = DataConfig(input_path=str(source), label_column="label", workers=1,
                     shard_size_limit_bytes=int(args.shard_mib * 2**20))
    for where, root in (("local", home / "data"), ("s3", f"{bucket}/data")):
        started = time.perf_counter()
        manifest = prepare(cfg, name=name, out_root=root)
        _URIS[(name, where)] = manifest["uri"]
        size = sum(s["bytes"] for s in manifest["shards"]["train"])
        print(f"{title}: published to {where} in {time.perf_counter() - started:.1f} s "
              f"({len(manifest['shards']['train'])} train shards, {size / 2**20:.1f} MiB)", flush=True)
    case = case_of(_opener(home, name, "local"))
    net, forward = case["model"]()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def epoch(data) -> float:
        loader = data.loader("train", batch_size=args.batch_size, shuffle=True, seed=0, transform=case["transform"])
        started, samples = time.perf_counter(), 0
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(forward(batch), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(batch["label"])
        return samples / (time.perf_counter() - started)

    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for where in ("local", "s3"):  # alternating: the machine's load falls on both alike
            data = _opener(home, name, where)(f"round-{r}")
            for kind, rate in (("first", epoch(data)), ("cached", epoch(data))):
                best[(where, kind)] = max(best.get((where, kind), 0.0), rate)
        print(f"{title}: round {r + 1} of {args.rounds} done", flush=True)
    return {"title": title, **{f"{w}_{k}": v for (w, k), v in best.items()}}


def _print(rows: list[dict]) -> None:
    print()
    print(f"{'dataset':<26} {'epoch':<7} {'local samples/s':>16} {'S3 samples/s':>13} {'S3/local':>9} {'target':>7}")
    for row in rows:
        for kind, target in (("first", 0.8), ("cached", 0.95)):
            local, remote = row[f"local_{kind}"], row[f"s3_{kind}"]
            print(f"{row['title']:<26} {kind:<7} {local:>16,.0f} {remote:>13,.0f} {remote / local:>9.3f} "
                  f"{'>= ' + str(target):>7}")


if __name__ == "__main__":
    main()
