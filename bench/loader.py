"""Data loading against what a training step consumes: the batch path of ``TrainingData.loader``
(``pipeline.data.read.loader``) and streaming's own per-sample path (``StreamingDataset`` and ``StreamingDataLoader``
over the same streams), for tabular rows, 28x28 array images (IDX) and 28x28 PNG images (an image folder);
with ``--baseline DIR`` (a checkout of another revision: ``git worktree add DIR REV``) that revision's own
bench runs on the same sizes, after this one, and its batch path is printed beside this tree's.

    .venv/bin/python bench/loader.py [--rows 60000 --images 60000 --pngs 6000 --batch-size 256
                                      --threads 1 --workers 0,1 --rounds 3 --ddp-epochs 2 --baseline DIR]

Each dataset is prepared once with ``pipeline.data.prepare.version`` under a temporary PIPELINE_HOME; then, in this one
process, with ``torch.set_num_threads(--threads)`` (1: what each of 2 ranks gets on 2 cores), each figure the
best of --rounds rounds:

  reader      samples/s of the loader over the shuffled train split, the recipe-like transform to tensors
              included: the batch path (``loader``) and the per-sample path (streaming's ``StreamingDataLoader``,
              its ``__getitem__`` then ``decode_columns``); shards already in the local cache (2nd epoch on)
  in-memory   samples/s of batches of the same shapes sliced, in random order, from tensors already in
              memory (no reading at all)
  step        samples/s of forward + backward + AdamW on one batch held in memory: ``TabularMLP`` (hidden
              128, 64) for rows, a small conv net (two 3x3 conv layers, 16 and 32 channels) for images
  train       samples/s of loader + step together, and data-wait: the fraction of the time spent blocked on
              the loader (as the training loop logs it); ``wN`` = N loader workers
  2 ranks     the tabular recipe's real training entrypoint under ``torchrun --nproc-per-node=2`` (gloo),
              --ddp-epochs epochs, with each path: samples/s and data-wait from its result.json

reader/step is how many times faster the loader delivers than the step consumes: a loader in the training
process (``num_workers=0``) keeps data-wait under 10% only when it is about 9x or more. A benchmark, not a
test: figures vary with the machine and its load.
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
    parser.add_argument("--rows", type=int, default=60_000, help="tabular demo rows (0 skips)")
    parser.add_argument("--images", type=int, default=60_000, help="28x28 images in IDX files (0 skips)")
    parser.add_argument("--pngs", type=int, default=6_000, help="28x28 PNG files in class folders (0 skips)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a rank of 2 on 2 cores)")
    parser.add_argument("--workers", default="0,1", help="loader workers for the train figures, comma-separated")
    parser.add_argument("--per-sample-batches", type=int, default=30, help="batches the slow path is timed over")
    parser.add_argument("--train-batches", type=int, default=150, help="most batches of a train measurement")
    parser.add_argument("--ddp-epochs", type=int, default=2, help="epochs of the 2-rank training runs (0 skips)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of measurements; each figure is the best")
    parser.add_argument("--ddp-rounds", type=int, default=1, help="2-rank runs of each path; the best is reported")
    parser.add_argument("--keep", action="store_true", help="keep the data folder (removed by default)")
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision: its bench on the same sizes")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    os.environ["PIPELINE_HOME"] = str(home)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    print(f"batch {args.batch_size}, torch threads {args.threads}, {os.cpu_count()} CPUs; data under {home}",
          flush=True)

    results, ddp = [], {}
    if args.rows:
        case = _tabular(home, args.rows)
        results.append(_bench(case, args, workers))
        if args.ddp_epochs:
            for _ in range(args.ddp_rounds):  # alternating; the best run of each path is reported
                for path in ("batch", "per-sample"):
                    figures = _ddp(home, case["uri"], path, args)
                    if figures["samples_per_s"] > ddp.get(path, {}).get("samples_per_s", 0):
                        ddp[path] = figures
    if args.images:
        results.append(_bench(_idx(home, args.images), args, workers))
    if args.pngs:
        results.append(_bench(_png_folder(home, args.pngs), args, workers))
    _report(results, workers, ddp)
    if args.baseline:
        _compare(results, workers, _baseline(args))
    if not args.keep:
        import shutil

        shutil.rmtree(home, ignore_errors=True)


# -- datasets ---------------------------------------------------------------------------------------------

def _prepare(home: Path, name: str, input_path: Path):
    from pipeline.config import DataConfig
    from pipeline.data.prepare.version import prepare
    from pipeline.data.read.training_data import TrainingData

    started = time.perf_counter()
    manifest = prepare(DataConfig(input_path=str(input_path), label_column="label", workers=1),
                            name=name, out_root=home / "data")
    print(f"{name}: {manifest['splits']['train']:,} train rows, {manifest['schema']['encodings']} "
          f"(prepared in {time.perf_counter() - started:.1f} s)", flush=True)
    return lambda tag: TrainingData.open([manifest["uri"]], home / "cache" / name / tag)


def _synthetic_images(count: int, seed: int = 0):
    """Digit-like 28x28 uint8 images (a bright blob on black), so that PNGs compress as MNIST's do."""
    import numpy as np

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:28, 0:28]
    images = np.empty((count, 28, 28), np.uint8)
    for at in range(0, count, 4096):
        n = min(4096, count - at)
        cy, cx = rng.uniform(8, 20, (2, n, 1, 1))
        ry, rx = rng.uniform(3, 9, (2, n, 1, 1))
        d = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
        images[at:at + n] = np.clip(255 * (1.3 - d), 0, 255).astype(np.uint8) * (d < 1.3)
    return images, rng.integers(0, 10, count)


def _tabular(home: Path, rows: int) -> dict:
    from pipeline.data import demo

    opener = _prepare(home, "tabular", demo.write_parquet(home / "raw" / "tabular.parquet", rows, seed=0))
    return {"name": f"tabular rows ({rows:,})", "open": opener, **tabular_case(opener),
            "uri": str(opener("probe").dirs[0])}


def tabular_case(opener) -> dict:
    """The tabular recipe's transform and model (``TabularMLP``, hidden 128, 64), and batches of its shapes in
    memory, for the version ``opener`` opens."""
    import numpy as np
    import torch

    from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP

    data = opener("probe")
    prep = data.preprocessing

    def model():
        spec = ModelSpec(num_numeric=len(prep["mean"]), cardinalities=[len(prep["vocab"][c]) for c in
                                                                       prep["categorical_columns"]],
                         num_classes=len(prep["label_classes"]), hidden_sizes=[128, 64], dropout=0.1)
        net = TabularMLP(spec, prep["mean"], prep["std"])
        return net, lambda batch: net(batch["num"], batch["cat"])

    def memory(n: int) -> dict:
        rng = np.random.default_rng(0)
        return {"num": torch.from_numpy(rng.normal(size=(n, len(prep["mean"]))).astype(np.float32)),
                "cat": torch.from_numpy(rng.integers(0, 3, (n, len(prep["categorical_columns"])))),
                "label": torch.from_numpy(rng.integers(0, len(prep["label_classes"]), n))}

    return {"transform": TabularTransform(data), "model": model, "memory": memory}


def _idx(home: Path, count: int) -> dict:
    from pipeline.data import demo

    images, labels = _synthetic_images(count)
    opener = _prepare(home, "idx", demo.write_idx(home / "raw" / "idx", "train", images, labels))
    return _image_bench(f"28x28 ndarray:uint8 ({count:,})", opener)


def _png_folder(home: Path, count: int) -> dict:
    from PIL import Image

    images, labels = _synthetic_images(count, seed=1)
    root = home / "raw" / "png"
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i:06d}.png")
    return _image_bench(f"28x28 png ({count:,})", _prepare(home, "png", root))


def _image_bench(name: str, opener) -> dict:
    import numpy as np
    import torch

    data = opener("probe")
    column = next(c for c in data.schema["columns"] if c != data.schema["label_column"])
    classes = data.preprocessing["label_classes"]

    def model():
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, len(classes)))
        return net, lambda batch: net(batch["pixels"] / 255.0)

    def memory(n: int) -> dict:
        rng = np.random.default_rng(0)
        return {"pixels": torch.from_numpy(rng.integers(0, 256, (n, 1, 28, 28)).astype(np.float32)),
                "label": torch.from_numpy(rng.integers(0, len(classes), n))}

    return {"name": name, "open": opener, "transform": ImageTransform(column, data.schema["label_column"], classes),
            "model": model, "memory": memory}


class TabularTransform:
    """What the tabular recipe's transform does: columns -> ``num``, ``cat``, ``label`` tensors."""

    def __init__(self, data):
        self.encoder = data.encoder

    def __call__(self, columns):
        import torch

        num, cat, label = self.encoder.encode_columns(columns)
        return {"num": torch.from_numpy(num), "cat": torch.from_numpy(cat), "label": torch.from_numpy(label)}


class ImageTransform:
    """What the image recipe's transform does: uint8 [B, H, W] -> float32 [B, 1, H, W], labels -> indices."""

    def __init__(self, column: str, label_column: str, classes: list):
        self.column, self.label_column = column, label_column
        self.index = {c: i for i, c in enumerate(classes)}

    def __call__(self, columns):
        import numpy as np
        import torch

        pixels = torch.from_numpy(np.asarray(columns[self.column], dtype=np.float32)[:, None])
        labels = np.array([self.index[v.item() if hasattr(v, "item") else v] for v in columns[self.label_column]])
        return {"pixels": pixels, "label": torch.from_numpy(labels)}


# -- measurements -----------------------------------------------------------------------------------------

def _bench(case: dict, args, workers: list[int]) -> dict:
    """Every figure of one dataset, each the best of --rounds rounds (others' load on the machine only
    ever slows a measurement down)."""
    import torch

    bs = args.batch_size
    fast = case["open"]("fast").loader("train", batch_size=bs, shuffle=True, seed=0, transform=case["transform"])
    _drain(fast)  # the first epoch copies and decompresses the shards into the local cache
    slow = _per_sample(case["open"]("slow"), "train", batch_size=bs, shuffle=True, seed=0,
                       transform=case["transform"])
    _drain(slow, args.per_sample_batches)
    trained = {w: case["open"](f"w{w}").loader("train", batch_size=bs, shuffle=True, seed=0, num_workers=w,
                                                transform=case["transform"]) for w in workers}
    for loader in trained.values():
        _drain(loader, 2)
    memory = case["memory"](len(fast.dataset))
    net, forward = case["model"]()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batch = next(iter(fast))  # a real batch, in memory
    _stop(fast)
    out: dict = {"name": case["name"]}

    def best(key, value):
        if key not in out or (value[0] if isinstance(value, tuple) else value) > \
                (out[key][0] if isinstance(out[key], tuple) else out[key]):
            out[key] = value

    for _ in range(args.rounds):
        best("reader_fast", _reader_rate(fast))
        best("reader_slow", _reader_rate(slow, args.per_sample_batches))
        best("memory", _memory_rate(memory, bs))
        best("step", _step_rate(net, forward, optimizer, batch))
        for w, loader in trained.items():
            best(f"train_fast_w{w}", _train_rate(loader, net, forward, optimizer, args.train_batches))
        best("train_slow_w0", _train_rate(slow, net, forward, optimizer, args.per_sample_batches))
    print(f"  {case['name']}: done", flush=True)
    return out


def _ddp(home: Path, uri: str, path: str, args) -> dict:
    """The tabular recipe trained by 2 ranks under torchrun, reading through ``path``."""
    import json
    import subprocess

    from pipeline.recipes import tabular_mlp

    cfg = tabular_mlp.config().with_overrides({"train.epochs": args.ddp_epochs, "train.batch_size": args.batch_size})
    config = home / "ddp-config.json"
    config.write_text(json.dumps(cfg.to_dict()))
    out = Path(tempfile.mkdtemp(prefix=f"ddp-{path}-", dir=home))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node=2", __file__, "--rank-entry", path,
               "--recipe", "tabular_mlp", "--config", str(config), "--dataset", uri, "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"2-rank training ({path} path) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    print(f"  2 ranks, {path} path: done in {time.perf_counter() - started:.1f} s", flush=True)
    return result["throughput"]


def _rank_entry(path: str, argv: list[str]) -> None:
    """One rank of ``_ddp``: ``python -m pipeline.rank ARGV``, its loader on the batch or the per-sample path."""
    import runpy

    sys.path.insert(0, str(ROOT))
    if path == "per-sample":
        from pipeline.data.read.training_data import TrainingData

        TrainingData.loader = _per_sample
    sys.argv = ["pipeline.rank", *argv]
    runpy.run_module("pipeline.rank", run_name="__main__", alter_sys=True)


def _per_sample(data, split: str, **kwargs):
    """streaming's own loader over ``data``'s versions of ``split`` (the reference the tests hold the batch path to)."""
    sys.path.insert(0, str(ROOT))
    from tests.datafiles import streaming_loader

    return streaming_loader(data, data.cache_dir / "streaming", split, **kwargs)


def _baseline(args) -> dict[str, dict[str, float]]:
    """The revision at ``--baseline``: its own bench, same sizes, no 2-rank runs; its batch-path figures by dataset."""
    import re
    import subprocess

    argv = [sys.executable, str(args.baseline / "bench" / "loader.py"), "--rows", str(args.rows), "--images",
            str(args.images), "--pngs", str(args.pngs), "--batch-size", str(args.batch_size), "--threads",
            str(args.threads), "--workers", args.workers, "--rounds", str(args.rounds), "--ddp-epochs", "0",
            "--per-sample-batches", str(args.per_sample_batches), "--train-batches", str(args.train_batches)]
    print(f"\nbaseline: {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, cwd=args.baseline, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the baseline's bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures: dict[str, dict[str, float]] = {}
    name = None
    for line in done.stdout.splitlines():
        if line and not line.startswith(" ") and not line.startswith("samples/s"):
            name = line.strip()
        elif name and (m := re.match(r"\s+reader\s+batch path\s+([\d,]+)/s", line)):
            figures.setdefault(name, {})["reader"] = float(m.group(1).replace(",", ""))
        elif name and (m := re.match(r"\s+train\s+batch path (w\d+)\s+([\d,]+)/s\s+data-wait\s+([\d.]+)%", line)):
            figures.setdefault(name, {})[m.group(1)] = float(m.group(2).replace(",", ""))
            figures[name][f"{m.group(1)}_wait"] = float(m.group(3)) / 100
    return figures


def _compare(results: list[dict], workers: list[int], baseline: dict[str, dict[str, float]]) -> None:
    print("\nbatch path: this tree beside the baseline (samples/s; ratio this / baseline)")
    for r in results:
        base = baseline.get(r["name"], {})
        if "reader" in base:
            print(f"  {r['name']:<40} reader   {r['reader_fast']:>11,.0f}/s  {base['reader']:>11,.0f}/s  "
                  f"{r['reader_fast'] / base['reader']:6.2f}x")
        for w in workers:
            if f"w{w}" in base:
                sps, wait = r[f"train_fast_w{w}"]
                print(f"  {r['name']:<40} train w{w} {sps:>11,.0f}/s  {base[f'w{w}']:>11,.0f}/s  "
                      f"{sps / base[f'w{w}']:6.2f}x   data-wait {wait:5.1%} vs {base[f'w{w}_wait']:5.1%}")


def _drain(loader, batches: int | None = None) -> None:
    for i, _ in enumerate(loader):
        if batches is not None and i + 1 >= batches:
            break
    _stop(loader)


def _stop(loader) -> None:
    """End the download threads of an epoch left unfinished. Streaming's own keep calling prepare_shard (a
    file lock) per sample up to ``predownload`` ahead; while they run, every GIL hand-off of the training
    step waits for them, which made the step here up to 12x slower."""
    it = getattr(loader.dataset, "_iterator", None)
    if it is not None:
        it.exit()


def _size(batch) -> int:
    return len(batch["label"])


def _reader_rate(loader, batches: int | None = None) -> float:
    """samples/s over a whole epoch (epoch start included), or over its first ``batches``."""
    started, samples = time.perf_counter(), 0
    for i, batch in enumerate(loader):
        samples += _size(batch)
        if batches is not None and i + 1 >= batches:
            break
    rate = samples / (time.perf_counter() - started)
    _stop(loader)
    return rate


def _memory_rate(tensors: dict, batch_size: int) -> float:
    import torch

    n = len(tensors["label"])
    started = time.perf_counter()
    order = torch.randperm(n)
    for at in range(0, n, batch_size):
        index = order[at:at + batch_size]
        {k: v[index] for k, v in tensors.items()}
    return n / (time.perf_counter() - started)


def _step(net, forward, optimizer, batch) -> None:
    import torch.nn.functional as F

    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(forward(batch), batch["label"]).backward()
    optimizer.step()


def _step_rate(net, forward, optimizer, batch, seconds: float = 1.0) -> float:
    for _ in range(5):
        _step(net, forward, optimizer, batch)
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        _step(net, forward, optimizer, batch)
        steps += 1
    return steps * _size(batch) / (time.perf_counter() - started)


def _train_rate(loader, net, forward, optimizer, batches: int) -> tuple[float, float]:
    """(samples/s, data-wait fraction) of loader + step over up to ``batches`` batches."""
    started, waited, samples = time.perf_counter(), 0.0, 0
    it = iter(loader)
    for _ in range(batches):
        t = time.perf_counter()
        batch = next(it, None)
        waited += time.perf_counter() - t
        if batch is None:
            break
        _step(net, forward, optimizer, batch)
        samples += _size(batch)
    wall = time.perf_counter() - started
    del it
    _stop(loader)
    return samples / wall, waited / wall


def _report(results: list[dict], workers: list[int], ddp: dict) -> None:
    def rate(x: float) -> str:
        return f"{x:>11,.0f}/s"

    print()
    print("samples/s in one process; ratios are of the samples/s figures")
    for r in results:
        print(f"\n{r['name']}")
        print(f"  reader   batch path       {rate(r['reader_fast'])}")
        print(f"  reader   per-sample path  {rate(r['reader_slow'])}   batch/per-sample  "
              f"{r['reader_fast'] / r['reader_slow']:7.1f}x")
        print(f"  in-memory tensors         {rate(r['memory'])}   batch path/in-memory "
              f"{r['reader_fast'] / r['memory']:7.3f}x")
        print(f"  step (fwd+bwd+AdamW)      {rate(r['step'])}   batch path/step   {r['reader_fast'] / r['step']:7.1f}x"
              f"   per-sample/step {r['reader_slow'] / r['step']:6.2f}x")
        for w in workers:
            sps, wait = r[f"train_fast_w{w}"]
            print(f"  train    batch path w{w}    {rate(sps)}   data-wait {wait:6.1%}   of step-only "
                  f"{sps / r['step']:6.1%}")
        sps, wait = r["train_slow_w0"]
        print(f"  train    per-sample w0    {rate(sps)}   data-wait {wait:6.1%}   of step-only {sps / r['step']:6.1%}")
        best = max(r[f"train_fast_w{w}"][0] for w in workers) if workers else sps
        print(f"  train    batch path / per-sample path {best / sps:6.1f}x")
    if ddp:
        print("\ntabular recipe, 2 ranks (torchrun, gloo), samples/s over both ranks")
        for path, figures in ddp.items():
            print(f"  {path + ' path':<17}        {rate(figures['samples_per_s'])}   data-wait "
                  f"{figures['data_wait_fraction']:6.1%}")
        ratio = ddp["batch"]["samples_per_s"] / ddp["per-sample"]["samples_per_s"]
        print(f"  batch path / per-sample path {ratio:6.1f}x")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-entry":
        _rank_entry(sys.argv[2], sys.argv[3:])
    else:
        main()
