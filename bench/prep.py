"""Benchmark of data preparation: rows/s and peak memory, against a plain MDSWriter loop.

    .venv/bin/python bench/prep.py                      # 1,000,000 tabular rows, 60,000 28x28 images
    .venv/bin/python bench/prep.py --rows 5000000       # the memory target: peak RSS <= 1 GiB

For each workload it makes the input once (Parquet for the tabular rows, gzipped IDX files for the
images), then runs, each in a fresh process: the baseline (one process reading the same input in
record batches and calling ``MDSWriter.write`` per row, with no validation, splits or statistics),
and the pipeline (``prep.prepare``) with 1 and with 2 workers. Rows/s count input rows over the
conversion's wall time (input hashing, validation, splits, statistics, index merge included; the
interpreter's start-up not). Memory is sampled every 20 ms over the process and all its children: the
summed PSS (shared pages split between their sharers) and the largest single process's RSS. Prints a
table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_inputs(work: Path, rows: int, images: int) -> dict[str, Path]:
    import numpy as np

    from pipeline.data import demo

    tabular = demo.write_parquet(work / "tabular" / "rows.parquet", rows, row_group_rows=50_000)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (images, 28, 28), dtype=np.uint8)
    # Blobs rather than noise: PNG-like structure does not matter for ndarray columns, but keeps the
    # images compressible as real ones are.
    pixels[:, :, :14] //= 8
    labels = rng.integers(0, 10, images).astype(np.uint8)
    idx = demo.write_idx(work / "fashion", "train", pixels, labels, gz=True)
    return {"tabular": tabular, "images": idx}


# --- what each measured process runs ---------------------------------------------------------------

def run_baseline(kind: str, path: str, out: str) -> dict:
    import numpy as np
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    from pipeline.data.prepare.mds_writer import (
        HASHES,  # the digests the pipeline computes, so both pay for the same
    )

    started = time.perf_counter()
    rows = 0
    if kind == "tabular":
        pf = pq.ParquetFile(path)
        columns = {f"x{i}": "float64" for i in range(6)} | {"region": "str", "device": "str", "plan": "str",
                                                             "label": "int64"}
        with MDSWriter(out=out, columns=columns, compression="zstd", hashes=HASHES, size_limit=1 << 26) as w:
            for batch in pf.iter_batches(batch_size=65_536):
                for row in batch.to_pylist():
                    w.write(row)
                    rows += 1
    else:
        from pipeline.data.prepare import idx

        images = idx.read(str(Path(path) / "train-images-idx3-ubyte.gz"), 0x803)  # whole file
        labels = idx.read(str(Path(path) / "train-labels-idx1-ubyte.gz"), 0x801)
        with MDSWriter(out=out, columns={"image": "ndarray:uint8:28,28", "label": "int64"}, compression="zstd",
                       hashes=HASHES, size_limit=1 << 26) as w:
            for image, label in zip(images, labels):
                w.write({"image": image, "label": np.int64(label)})
                rows += 1
    return {"rows": rows, "wall_s": time.perf_counter() - started}


def run_pipeline(kind: str, path: str, out: str, workers: int) -> dict:
    from pipeline.config import DataConfig
    from pipeline.data.prepare.version import prepare

    started = time.perf_counter()
    cfg = DataConfig(input_path=path, workers=workers)
    manifest = prepare(cfg, name=kind, out_root=Path(out))
    return {"rows": sum(manifest["splits"].values()), "wall_s": time.perf_counter() - started,
            "timings_s": manifest["timings_s"], "units": manifest["units"]}


def _child(argv: list[str]) -> None:
    mode, kind, path, out = argv[:4]
    result = run_baseline(kind, path, out) if mode == "baseline" else run_pipeline(kind, path, out, int(mode))
    print("RESULT " + json.dumps(result), flush=True)


# --- the driver ------------------------------------------------------------------------------------

def measure(mode: str, kind: str, path: Path, out: Path) -> dict:
    import psutil

    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, __file__, "--child", mode, kind, str(path), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    peak = {"pss": 0, "rss": 0}

    def sample() -> None:
        # Summed RSS would count the pages that forked workers share several times; PSS splits each
        # shared page between its sharers, so the sum is the memory the job really holds.
        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [parent, *parent.children(recursive=True)]
                infos = [p.memory_full_info() for p in tree]
                peak["pss"] = max(peak["pss"], sum(i.pss for i in infos))
                peak["rss"] = max(peak["rss"], *(i.rss for i in infos))
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{mode} {kind} failed with exit code {proc.returncode}")
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    shutil.rmtree(out, ignore_errors=True)
    return {**result, "rows_per_s": result["rows"] / result["wall_s"], "pss_mib": peak["pss"] / 2**20,
            "rss_mib": peak["rss"] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="tabular rows (default 1,000,000)")
    parser.add_argument("--images", type=int, default=60_000, help="28x28 images (default 60,000, FashionMNIST's training set)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-prep-"))
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}; inputs under {work}", flush=True)
    started = time.perf_counter()
    inputs = make_inputs(work, args.rows, args.images)
    print(f"made inputs in {time.perf_counter() - started:.1f} s: {args.rows:,} tabular rows "
          f"({inputs['tabular'].stat().st_size / 2**20:.0f} MiB Parquet), {args.images:,} images (IDX, gzip)", flush=True)

    header = (f"{'workload':<10}{'rows':>11}{'baseline r/s':>14}{'1 worker r/s':>14}{'x base':>8}"
              f"{'2 workers r/s':>15}{'x base':>8}{'x 1w':>7}   peak MiB, PSS summed (largest process RSS): base / 1w / 2w")
    lines = []
    for kind in ("tabular", "images"):
        base = measure("baseline", kind, inputs[kind], work / "out-base")
        one = measure("1", kind, inputs[kind], work / "out-1")
        two = measure("2", kind, inputs[kind], work / "out-2")
        lines.append(
            f"{kind:<10}{base['rows']:>11,}{base['rows_per_s']:>14,.0f}{one['rows_per_s']:>14,.0f}"
            f"{one['rows_per_s'] / base['rows_per_s']:>8.2f}{two['rows_per_s']:>15,.0f}"
            f"{two['rows_per_s'] / base['rows_per_s']:>8.2f}{two['rows_per_s'] / one['rows_per_s']:>7.2f}"
            "   " + " / ".join(f"{r['pss_mib']:,.0f} ({r['rss_mib']:,.0f})" for r in (base, one, two))
        )
        print(f"{kind}: baseline {base['wall_s']:.1f} s, 1 worker {one['wall_s']:.1f} s {one['timings_s']}, "
              f"2 workers {two['wall_s']:.1f} s {two['timings_s']}; {two['units']} units", flush=True)
    print()
    print(header)
    for line in lines:
        print(line)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
