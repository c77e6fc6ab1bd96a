"""``pipeline.job.telemetry``: per-rank windows into metrics, the straggler rule, the run's summary."""

from __future__ import annotations

import json

import pytest

from pipeline.job.telemetry import RankTelemetry, describe_stragglers, summarize, summary_line
from pipeline.job_files import Heartbeat, read_heartbeats


def _beats(windows: dict[int, list[tuple[int, float]]]) -> dict[int, dict]:
    """Heartbeats as ranks write them: each rank's kept windows of (step, compute_s)."""
    return {rank: {"rank": rank, "host": f"node-{rank // 2}", "windows": [
        {"step": step, "compute_s": compute, "step_time_s": 0.1, "samples_per_s": 400.0, "data_wait_fraction": 0.1}
        for step, compute in kept]} for rank, kept in windows.items()}


def _feed(telemetry, computes: list[list[float]], every: int = 10) -> list[str]:
    """One update per window: ``computes[w][rank]`` is each rank's compute time in window ``w``."""
    lines, kept = [], {}
    for w, per_rank in enumerate(computes):
        for rank, compute in enumerate(per_rank):
            kept.setdefault(rank, []).append(((w + 1) * every, compute))
        lines += telemetry.update(_beats(kept))
    return lines


def test_a_rank_above_the_ratio_for_the_windows_in_a_row_is_named_once_and_recovers(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    telemetry = RankTelemetry(path, ratio=1.3, windows=3)
    even, slow = [0.010, 0.010, 0.011, 0.010], [0.010, 0.010, 0.010, 0.020]
    # Two slow windows, an even one, then three slow ones: only the three in a row name rank 3.
    lines = _feed(telemetry, [slow, slow, even, slow, slow])
    assert lines == []
    lines = telemetry.update(_beats({r: [(60, s)] for r, s in enumerate(slow)}))
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 3 on node-1 computes 2.00x")
    assert telemetry.update(_beats({r: [(70, s)] for r, s in enumerate(slow)})) == []  # named once
    lines = telemetry.update(_beats({r: [(80, s)] for r, s in enumerate(even)}))
    assert lines == ["rank 3 on node-1 is no longer a straggler at step 80 (1.00x the median of the other ranks)"]

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert rows[2]["metrics"]["rank_2/straggler_score"] == pytest.approx(0.011 / 0.010)  # the even window
    assert rows[0]["metrics"]["rank_0/samples_per_s"] == pytest.approx(100.0)  # the job's 400/s over 4 ranks
    assert "rank_3/straggler" not in rows[4]["metrics"] and rows[5]["metrics"]["rank_3/straggler"] == 2.0
    summary = summarize(path)
    assert summary["stragglers"] == {3: 2.0} and set(summary["ranks"]) == {0, 1, 2, 3}
    assert summary["ranks"][0]["compute_s"] == pytest.approx(0.010)
    assert summary_line(summary).endswith("stragglers: rank 3 (2.00x)")


def test_a_window_waits_for_every_rank_and_is_skipped_when_one_has_moved_past_it(tmp_path):
    telemetry = RankTelemetry(tmp_path / "telemetry.jsonl", ratio=1.3, windows=1)
    assert telemetry.update(_beats({0: [(10, 0.01)], 1: []})) == []
    assert not (tmp_path / "telemetry.jsonl").exists()  # rank 1 has not reported step 10 yet
    # Rank 1's window at step 10 never came (lost): once it reports step 20, step 10 is dropped, 20 is taken.
    assert telemetry.update(_beats({0: [(10, 0.01), (20, 0.01)], 1: [(20, 0.05)]})) != []
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [20]


def test_windows_kept_in_the_heartbeat_reach_a_reader_that_polls_rarely(tmp_path):
    telemetry = RankTelemetry(tmp_path / "telemetry.jsonl", ratio=1.3, windows=3)
    beats = [Heartbeat(tmp_path / "progress", rank) for rank in range(2)]
    for step in range(5, 45, 5):  # eight windows between two reads
        for heartbeat in beats:
            heartbeat.report(step, {"compute_s": 0.01, "step_time_s": 0.02, "samples_per_s": 100.0})
    telemetry.update(read_heartbeats(tmp_path / "progress"))
    rows = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(5, 45, 5))


def test_an_attempt_on_fewer_ranks_starts_afresh_and_the_summary_spans_both(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    telemetry = RankTelemetry(path, ratio=1.3, windows=2)
    _feed(telemetry, [[0.01, 0.01, 0.01]] * 3)
    telemetry.new_attempt()  # resumed at step 20 on two ranks: its windows are read again from there
    assert telemetry.update(_beats({0: [(30, 0.01)], 1: [(30, 0.03)]})) == []
    lines = telemetry.update(_beats({0: [(40, 0.01)], 1: [(40, 0.03)]}))
    assert lines and lines[0].startswith("straggler: rank 1 ")
    summary = summarize(path)
    assert set(summary["ranks"]) == {0, 1, 2} and summary["stragglers"] == {1: 3.0}


def test_no_stragglers_reads_none():
    assert describe_stragglers({}) == "none"
    assert describe_stragglers({"2": 1.84}) == "rank 2 (1.84x)"  # keys as they come back from an XCom
    assert summary_line({"ranks": {}, "stragglers": {}}) is None


def test_flops_from_the_models_shape_and_a_configured_peak():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.train.throughput import peak_flops, training_flops

    mlp = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    assert training_flops(mlp, seq_len=128) == 6.0 * (10 * 20 + 20 + 20 * 3 + 3)  # no attention to count
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    params = sum(p.numel() for p in llama.parameters())
    assert training_flops(llama, seq_len=128) == 6.0 * params + 12.0 * 2 * 32 * 128
    assert peak_flops(torch.device("cpu")) is None  # no MFU on a CPU unless train.peak_tflops says its peak
    assert peak_flops(torch.device("cpu"), 1.5) == 1.5e12


def test_the_compute_clock_times_training_forward_passes_only(monkeypatch):
    import types

    import torch

    from pipeline.train import throughput
    from pipeline.train.throughput import Throughput

    now = [100.0]  # the host's clock, moved by the work below only
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def work(seconds: float) -> None:
        now[0] += seconds

    model = torch.nn.Linear(4, 4)
    model.register_forward_pre_hook(lambda module, args: work(0.25))  # the model's own work
    meter = Throughput(world_size=1)
    meter.watch(model)
    for _ in range(3):
        model(torch.zeros(1, 4))
        work(0.5)  # backward, the optimizer, the collectives: the step's, not the forward pass's
        meter.step(1)
    model.eval()
    model(torch.zeros(1, 4))  # validation: not this rank's training work
    figures = meter.window()
    assert figures["compute_s"] == 0.25  # per step: the three training forward passes, not the validation one
    assert figures["step_time_s"] == (3 * (0.25 + 0.5) + 0.25) / 3
    assert meter.window()["compute_s"] == 0.0  # each window its own


class FakeNvml:
    """NVML as nvidia-ml-py exposes it, for a node with two GPUs (no driver here)."""

    class Rates:
        def __init__(self, gpu):
            self.gpu, self.memory = gpu, 0

    class Memory:
        def __init__(self, used, total):
            self.used, self.total, self.free = used, total, total - used

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        return self.Rates([97, 12][handle])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self.Memory([60 << 30, 1 << 30][handle], 80 << 30)


def test_a_nodes_gpus_are_sampled_through_nvml():
    from pipeline.node_usage import NodeUsage

    figures = NodeUsage(nvml=FakeNvml()).sample()
    assert figures["gpu0_utilization"] == 97 and figures["gpu1_utilization"] == 12
    assert figures["gpu0_memory_gb"] == 60 and figures["gpu0_memory_percent"] == 75.0
    assert 0 <= figures["cpu_percent"] <= 100 and figures["memory_gb"] > 0


def test_each_nodes_local_rank_0_samples_once_and_the_samples_become_node_metrics(tmp_path, monkeypatch):
    import pipeline.node_usage

    monkeypatch.setattr(pipeline.node_usage, "_driver", FakeNvml)
    for rank in range(4):  # two nodes of two ranks
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        Heartbeat(tmp_path / "progress", rank).report(10, {"compute_s": 0.01, "step_time_s": 0.02})
    beats = read_heartbeats(tmp_path / "progress")
    assert [rank for rank, beat in sorted(beats.items()) if "node" in beat] == [0, 2]
    telemetry = RankTelemetry(tmp_path / "telemetry.jsonl", ratio=1.3, windows=3)
    telemetry.update(beats)
    telemetry.update(beats)  # the same samples: not again
    summary = summarize(tmp_path / "telemetry.jsonl")
    assert set(summary["nodes"]) == {0, 1} and summary["nodes"][1]["gpu0_utilization"] == 97
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert sum("node_0/cpu_percent" in row["metrics"] for row in rows) == 1
    assert "node 1: cpu " in summary_line(summary) and " gpu0 97%" in summary_line(summary)


def test_the_live_view_scores_the_newest_window_every_rank_has(tmp_path):
    from pipeline.job.live import live
    from pipeline.job_files import JobFiles

    files = JobFiles(tmp_path)
    files.progress.mkdir()
    # Rank 0 has already reported step 30; ranks 1 and 2 not yet: the scores are step 20's, for every rank.
    for rank, windows in _beats({0: [(10, 0.01), (20, 0.01), (30, 0.01)], 1: [(10, 0.01), (20, 0.04)],
                                 2: [(10, 0.01), (20, 0.01)]}).items():
        (files.progress / f"rank-{rank}.json").write_text(json.dumps(windows | {"step": 20, "total": 100, "time": 0.0}))
    view = live(files, now=1.0)
    assert [row["straggler_score"] for row in view["ranks"]] == [0.4, 4.0, 0.4]
    assert view["ranks"][0]["window_step"] == 30 and view["state"] == "running"
