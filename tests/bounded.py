"""A preparation run in a child process of its own, so that a test can see how it ended and how much memory it
took: ``run_prepare(path, out)`` -> ``{"type", "message", "peak_growth_bytes"}``.

The growth is the child's peak resident memory (``VmHWM``, reset with ``/proc/self/clear_refs`` once the
modules are imported) above its resident memory at that moment: what the preparation itself added.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline import deployment

HANG_GUARD_S = 300  # far past any preparation of these inputs: only a hang reaches it


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def run_prepare(path: Path, out: Path, **overrides) -> dict:
    command = [sys.executable, "-m", "tests.bounded", str(path), str(out), json.dumps(overrides)]
    done = subprocess.run(command, cwd=deployment.PROJECT_ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise AssertionError(f"the child preparation crashed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _child(path: str, out: str, overrides: str) -> None:
    import PIL.Image  # noqa: F401  (imported before the baseline, as the preparation's workers would)

    from pipeline.data.prepare.version import prepare
    from pipeline.errors import UserError
    from tests.datafiles import cfg

    Path("/proc/self/clear_refs").write_text("5")  # the peak so far is the imports': start counting here
    baseline = _status_kib("VmRSS")
    result = {"type": None, "message": ""}
    try:
        prepare(cfg(path, **json.loads(overrides)), name="t", out_root=Path(out))
    except UserError as exc:
        result = {"type": type(exc).__name__, "message": str(exc)}
    result["peak_growth_bytes"] = max(0, _status_kib("VmHWM") - baseline) * 1024
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
