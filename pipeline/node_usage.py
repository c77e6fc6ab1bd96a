"""A node's utilisation, sampled once per node (by its local rank 0's heartbeat, ``pipeline.job_files.Heartbeat``):
CPU and memory (psutil) and, where NVML answers (nvidia-ml-py), each GPU's utilisation and memory.

The samples ride in the heartbeat file as ``node``; the supervisor relays them as ``node_N/<figure>`` metrics
(``pipeline.job.telemetry``). Neither library is required: without psutil the node reports nothing, without a
driver no GPU figures. Standard library at import, like the heartbeat that uses it.
"""

from __future__ import annotations

import os
from typing import Any

GIB = 1 << 30


class NodeUsage:
    """Samples this node. ``nvml``: the NVML module (``pynvml``, or a stand-in in tests); by default nvidia-ml-py's,
    when it is installed and a driver answers."""

    def __init__(self, nvml: Any = None):
        try:
            import psutil
        except ImportError:  # a toolchain's interpreter without it: no node figures
            psutil = None
        self._psutil = psutil
        if psutil is not None:
            psutil.cpu_percent(interval=None)  # the first call starts the interval the next one measures
        self._nvml = nvml if nvml is not None else _driver()
        self._gpus = []
        if self._nvml is not None:
            self._gpus = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._nvml.nvmlDeviceGetCount())]

    def sample(self) -> dict[str, float]:
        """CPU busy share of the whole node since the last sample (percent), memory used (GiB, percent), and per
        GPU ``gpu<i>_utilization`` (percent of the time a kernel ran), ``gpu<i>_memory_gb`` and ``gpu<i>_memory_percent``."""
        figures: dict[str, float] = {}
        if self._psutil is not None:
            memory = self._psutil.virtual_memory()
            figures |= {"cpu_percent": float(self._psutil.cpu_percent(interval=None)),
                        "memory_gb": round((memory.total - memory.available) / GIB, 3),
                        "memory_percent": float(memory.percent)}
        for i, handle in enumerate(self._gpus):
            rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            figures |= {f"gpu{i}_utilization": float(rates.gpu), f"gpu{i}_memory_gb": round(memory.used / GIB, 3),
                        f"gpu{i}_memory_percent": round(100.0 * memory.used / max(memory.total, 1), 2)}
        return figures


def _driver():
    """nvidia-ml-py's NVML, initialised, or None (not installed, no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, or NVMLError: no driver on this node
        return None


def node_index() -> int | None:
    """This process's node in the job (its rank over the ranks per node) when it is its node's local rank 0, the
    one that samples; None for the others, and outside a launcher."""
    if os.environ.get("LOCAL_RANK") != "0" or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
