"""Build and lock toolchain environments (``pipeline.toolchains``).

    python -m pipeline.toolchains build NAME|all   # make toolchain NAME=...: once per lock, into the cache
    python -m pipeline.toolchains lock NAME        # requirements.in -> requirements.txt, resolved on PyPI
    python -m pipeline.toolchains list [NAME]      # each toolchain: its key, folder, build record, image
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.toolchains import BUILT_MARKER, Toolchain, cache_root, get, names


def find_python(version: str) -> str:
    """An interpreter of ``version`` (``3.12``): ``pythonX.Y`` on ``PATH``, else a pyenv installation of it."""
    candidates = [shutil.which(f"python{version}"), *sorted(glob.glob(
        os.path.expanduser(f"{os.environ.get('PYENV_ROOT', '~/.pyenv')}/versions/{version}.*/bin/python{version}")))]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    raise ConfigError(f"no Python {version} found (python{version} on PATH, or under $PYENV_ROOT/versions): "
                      f"install it to build the toolchains that need it")


def _received_bytes() -> int:
    """Bytes this machine has received on its network interfaces (Linux), to report a build's download."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return 0
    return sum(int(line.split(":", 1)[1].split()[0]) for line in lines if not line.strip().startswith("lo:"))


def _disk_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _run(command: list[str], **kwargs) -> None:
    print("+ " + " ".join(map(str, command)), flush=True)
    subprocess.run(command, check=True, **kwargs)


@contextlib.contextmanager
def _exclusive(path: Path):
    """One build of an environment at a time on this machine (two clones, or CI beside a session)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build(toolchain: Toolchain) -> dict:
    """Build the toolchain's environment from its lock (``pip --require-hashes --no-deps``) unless this lock's is
    already complete; returns the build's record. A build that fails leaves nothing behind."""
    with _exclusive(cache_root() / f".{toolchain.name}-{toolchain.key}.lock"):
        record = toolchain.built()
        if record is not None:
            print(f"toolchain {toolchain.name}: built at {toolchain.env_dir} (key {toolchain.key}); nothing to do")
            return record
        target = toolchain.env_dir
        if target.exists():  # a build that did not finish
            shutil.rmtree(target)
        python = find_python(toolchain.python_version)
        print(f"toolchain {toolchain.name}: building {target} with {python} from {toolchain.lock}", flush=True)
        started, received = time.monotonic(), _received_bytes()
        try:
            _run([python, "-m", "venv", str(target)])
            _run([str(toolchain.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                  "--require-hashes", "--progress-bar=off", "-r", str(toolchain.lock)])
            _run([str(toolchain.python), "-c", f"import {toolchain.spec['import']}"],
                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
            record = {"toolchain": toolchain.name, "key": toolchain.key, "python": toolchain.python_version,
                      "build_s": round(time.monotonic() - started, 1),
                      "received_mb": round((_received_bytes() - received) / 2**20, 1),  # the whole machine's
                      "disk_mb": round(_disk_bytes(target) / 2**20, 1)}
            tmp = target / (BUILT_MARKER + ".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(target / BUILT_MARKER)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        print(f"toolchain {toolchain.name}: built in {record['build_s']} s, {record['received_mb']} MB received, "
              f"{record['disk_mb']} MB on disk", flush=True)
        return record


def lock(toolchain: Toolchain) -> Path:
    """Resolve ``requirements.in`` on PyPI alone (this machine's pip configuration ignored, so that the lock
    names what any machine downloads) for the toolchain's Python on this platform, and write
    ``requirements.txt``: every package pinned with its hash."""
    python = find_python(toolchain.python_version)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        _run([python, "-m", "venv", f"{tmp}/venv"])
        report = Path(tmp) / "report.json"
        _run([f"{tmp}/venv/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--dry-run",
              "--ignore-installed", "--report", str(report), "-r", str(toolchain.folder / "requirements.in")], env=env)
        resolved = json.loads(report.read_text())["install"]
    lines = [f"# The {toolchain.name} toolchain's environment: Python {toolchain.python_version}, Linux x86_64, "
             f"every package pinned and hashed.", f"# Written by `python -m pipeline.toolchains lock {toolchain.name}` from "
             f"requirements.in; do not edit.", ""]
    for item in sorted(resolved, key=lambda i: i["metadata"]["name"].lower()):
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{item['metadata']['name']}=={item['metadata']['version']} \\\n    --hash=sha256:{digest}")
    toolchain.lock.write_text("\n".join(lines) + "\n")
    print(f"toolchain {toolchain.name}: {len(resolved)} packages locked in {toolchain.lock}")
    return toolchain.lock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.toolchains", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "lock", "list"])
    parser.add_argument("name", nargs="?", help="a toolchain, or all")
    args = parser.parse_args(argv)
    chosen = names() if args.name in (None, "all") else [args.name]
    try:
        for name in chosen:
            toolchain = get(name)
            if args.command == "build":
                build(toolchain)
            elif args.command == "lock":
                lock(toolchain)
            else:
                print(json.dumps({"toolchain": name, "key": toolchain.key, "env": str(toolchain.env_dir),
                                  "built": toolchain.built(), "image": toolchain.image,
                                  "docker_build": toolchain.docker_build}))
    except ConfigError as exc:
        sys.exit(f"{type(exc).__name__}: {exc}")
    except subprocess.CalledProcessError as exc:
        sys.exit(f"toolchain build failed: {' '.join(map(str, exc.cmd))} exited with {exc.returncode}")


if __name__ == "__main__":
    main()
