"""Step-level throughput: samples/s, tokens/s, step time, data-wait fraction, the shares of the loop's own
work (checkpoints, validation, preemption checks), each rank's own compute time and, on GPUs, MFU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.stopwatch import lap

# Dense bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12,
    "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12,
}


def peak_flops(device, configured_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: ``train.peak_tflops`` when set, else a CUDA device's bf16 peak from the table, or
    None when unknown (then no MFU is reported)."""
    import torch

    if configured_tflops:
        return configured_tflops * 1e12
    if getattr(device, "type", None) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def training_flops(model, seq_len: int | None = None) -> float:
    """FLOPs of a forward and backward pass per sample, or per token for a language model, from the model's shape:
    6 per parameter (a multiply-add forward, two backward), plus, for a transformer whose config names its layers and
    width (Hugging Face's ``num_hidden_layers``, ``hidden_size``) trained on ``seq_len``-token sequences, attention's
    12 x layers x width x sequence length per token (PaLM's accounting, appendix B)."""
    flops = 6.0 * sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if seq_len and layers and width:
        flops += 12.0 * layers * width * seq_len
    return flops


def _empty() -> dict:
    return {"steps": 0, "samples": 0, "tokens": 0, "compute_s": 0.0, "phases": {"data_wait": 0.0},
            "start": time.perf_counter()}


class ComputeClock:
    """Times one rank's own work, the training forward passes of its model (``watch``: the model inside the DDP
    wrapper, whose buffer broadcast is a collective), on the device's clock: CUDA events on a GPU (recorded without
    waiting, read once per window), the host's otherwise. Step times are the same on every rank of a synchronous
    job (the fast ones wait for the slowest in the collectives); this time is not, which is what names a slow rank
    (``pipeline.job.telemetry``)."""

    def __init__(self, device=None):
        self.cuda = getattr(device, "type", None) == "cuda"
        self._events: list = []
        self._seconds = 0.0
        self._began: float | object | None = None

    def watch(self, module) -> None:
        """Time every forward pass of ``module`` in training mode (hooks; with activation checkpointing the
        recomputation in backward counts too)."""
        module.register_forward_pre_hook(lambda mod, args: self.start() if mod.training else None, prepend=True)
        module.register_forward_hook(lambda mod, args, out: self.stop() if mod.training else None)

    def start(self) -> None:
        if self.cuda:
            import torch

            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        if self._began is None:
            return
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._began, end))
        else:
            self._seconds += time.perf_counter() - self._began
        self._began = None

    def take(self) -> float:
        """Seconds timed since the last call (on a GPU this waits for the last timed pass to finish)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
            self._events = []
        seconds, self._seconds = self._seconds, 0.0
        return seconds


@dataclass
class Throughput:
    """Accumulates one rank's timings between ``window()`` calls and over the whole run.

    ``flops_per_sample`` (forward + backward, e.g. 6 x parameters for a dense network) or, for
    language models, ``flops_per_token`` (6 x parameters) with ``peak_flops_per_s`` make MFU
    available; all are optional.
    """

    world_size: int = 1
    flops_per_sample: float | None = None
    peak_flops_per_s: float | None = None
    flops_per_token: float | None = None
    device: object = None
    _window: dict = field(default_factory=lambda: _empty())
    _total: dict = field(default_factory=lambda: _empty())

    def __post_init__(self) -> None:
        self.clock = ComputeClock(self.device)

    def watch(self, module) -> None:
        """Time ``module``'s training forward passes as this rank's own work (``compute_s``: seconds per step)."""
        self.clock.watch(module)

    def data_wait(self, seconds: float) -> None:
        """Time this rank spent blocked on the data loader (``data_wait_fraction``, reported always)."""
        self.spent("data_wait", seconds)

    def spent(self, phase: str, seconds: float) -> None:
        """Time this rank spent in ``phase``: the data wait, or the loop's own work (``checkpoint``,
        ``validation``, ``preemption_check``), reported as ``<phase>_fraction`` of the elapsed time."""
        for acc in (self._window, self._total):
            acc["phases"][phase] = acc["phases"].get(phase, 0.0) + seconds

    def timed(self, phase: str):
        """``spent(phase, ...)`` of the time the block takes."""
        return lap(lambda seconds: self.spent(phase, seconds))

    def step(self, samples: int, tokens: int = 0) -> None:
        """One optimizer step of ``samples`` samples (``tokens`` tokens) on this rank."""
        for acc in (self._window, self._total):
            acc["steps"] += 1
            acc["samples"] += samples
            acc["tokens"] += tokens

    def window(self) -> dict[str, float]:
        """Figures since the previous call (for progress lines and step metrics); starts a new window."""
        seconds = self.clock.take()
        for acc in (self._window, self._total):
            acc["compute_s"] += seconds
        figures = self._figures(self._window)
        self._window = _empty()
        return figures

    def summary(self) -> dict[str, float]:
        """Figures over the whole run."""
        return self._figures(self._total)

    def _figures(self, acc: dict) -> dict[str, float]:
        elapsed = max(time.perf_counter() - acc["start"], 1e-9)
        figures = {
            "samples_per_s": acc["samples"] * self.world_size / elapsed,
            "step_time_s": elapsed / max(acc["steps"], 1),
            "compute_s": acc["compute_s"] / max(acc["steps"], 1),
        } | {f"{phase}_fraction": min(seconds / elapsed, 1.0) for phase, seconds in acc["phases"].items()}
        if acc["tokens"]:
            figures["tokens_per_s"] = acc["tokens"] * self.world_size / elapsed
        if self.peak_flops_per_s and (self.flops_per_token or self.flops_per_sample):
            work = acc["tokens"] * self.flops_per_token if self.flops_per_token else acc["samples"] * self.flops_per_sample
            figures["mfu"] = work / elapsed / self.peak_flops_per_s  # per device
        return figures
