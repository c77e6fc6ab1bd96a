"""Benchmark of version verification: what checking a published version's digests costs against preparing it.

    .venv/bin/python bench/verify_versions.py                   # 5,000,000 tabular rows, 60,000 28x28 images
    .venv/bin/python bench/verify_versions.py --rows 1000000    # quicker

The inputs are bench/prep.py's (Parquet rows, gzipped IDX images). For each workload it prepares the version
once (``prep.prepare``, its ``prep_wall_s``), then times ``integrity.check_version`` over it with the shards in
the page cache (a reuse right after a run) and with them evicted from it (``posix_fadvise(DONTNEED)``: read
from the disk, as a reuse days later would), and a whole reuse (``prepare`` again: the inputs' sha256, which
names the version, plus the check). The target: the check costs at most 10% of the preparation. Then the
same shard files are hashed, page cache warm, with each candidate digest, to show why xxh3-128 was chosen
(blake3 only where its package is installed). Prints one table per question; asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _files(dataset_dir: Path, manifest: dict) -> list[Path]:
    from pipeline.data.versions import integrity

    return [dataset_dir / split / name for split in manifest["shards"]
            for name in integrity.expected_files(manifest, split)]


def _evict(paths: list[Path]) -> None:
    os.sync()  # written pages must be clean before they can be dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _candidates() -> dict:
    import xxhash

    found = {"sha1": hashlib.sha1, "blake2b": hashlib.blake2b, "xxh64": xxhash.xxh64, "xxh3_64": xxhash.xxh3_64,
             "xxh3_128": xxhash.xxh3_128}
    try:
        import blake3

        found["blake3"] = blake3.blake3
    except ImportError:
        pass
    return found


def _hash_all(paths: list[Path], make) -> float:
    started = time.perf_counter()
    block = bytearray(8 << 20)
    view = memoryview(block)
    for path in paths:
        hasher = make()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(block):
                hasher.update(view[:n])
        hasher.hexdigest()
    return time.perf_counter() - started


def measure(kind: str, path: Path, out: Path) -> dict:
    from pipeline.config import DataConfig
    from pipeline.data import local_path
    from pipeline.data.prepare.version import prepare
    from pipeline.data.versions import integrity

    shutil.rmtree(out, ignore_errors=True)
    cfg = DataConfig(input_path=str(path))
    manifest = prepare(cfg, name=kind, out_root=out)
    dataset_dir = local_path(manifest["uri"])
    paths = _files(dataset_dir, manifest)
    result = {"kind": kind, "rows": sum(manifest["splits"].values()), "prep_s": manifest["prep_wall_s"],
              "files": len(paths), "mib": sum(p.stat().st_size for p in paths) / 2**20}

    started = time.perf_counter()
    assert not integrity.check_version(dataset_dir, manifest)
    result["warm_s"] = time.perf_counter() - started
    _evict(paths)
    started = time.perf_counter()
    assert not integrity.check_version(dataset_dir, manifest)
    result["cold_s"] = time.perf_counter() - started
    started = time.perf_counter()
    assert prepare(cfg, name=kind, out_root=out)["skipped"]
    result["reuse_s"] = time.perf_counter() - started
    result["algorithms"] = {name: _hash_all(paths, make) for name, make in _candidates().items()}
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    from prep import make_inputs  # bench/prep.py

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=5_000_000, help="tabular rows (default 5,000,000)")
    parser.add_argument("--images", type=int, default=60_000, help="28x28 images (default 60,000)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-verify-"))
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}; inputs under {work}", flush=True)
    inputs = make_inputs(work, args.rows, args.images)
    results = []
    for kind in ("tabular", "images"):
        results.append(measure(kind, inputs[kind], work / "out"))
        print(f"{kind}: done", flush=True)

    print()
    print(f"{'workload':<10}{'rows':>11}{'prep s':>9}{'files':>7}{'MiB':>8}"
          f"{'check warm s':>14}{'% prep':>8}{'check cold s':>14}{'% prep':>8}{'whole reuse s':>15}{'% prep':>8}")
    for r in results:
        print(f"{r['kind']:<10}{r['rows']:>11,}{r['prep_s']:>9.1f}{r['files']:>7}{r['mib']:>8.1f}"
              f"{r['warm_s']:>14.3f}{100 * r['warm_s'] / r['prep_s']:>7.2f}%"
              f"{r['cold_s']:>14.3f}{100 * r['cold_s'] / r['prep_s']:>7.2f}%"
              f"{r['reuse_s']:>15.3f}{100 * r['reuse_s'] / r['prep_s']:>7.2f}%")
    print()
    names = list(results[0]["algorithms"])
    print("hashing the same shard files, page cache warm (s, and GiB/s):")
    print(f"{'workload':<10}" + "".join(f"{n:>18}" for n in names))
    for r in results:
        print(f"{r['kind']:<10}" + "".join(
            f"{s:>9.3f} ({r['mib'] / 1024 / s:>5.1f})" for s in (r["algorithms"][n] for n in names)))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
