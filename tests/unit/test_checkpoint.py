"""Checkpoint store, RNG capture and throughput figures, without torchrun."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.train.checkpoint import MARKER, STATE_FILE, CheckpointStore, capture_rng, restore_rng
from pipeline.train.throughput import Throughput


def _state(step: int) -> dict:
    return {"step": step, "weights": torch.full((4,), float(step)), "note": f"step {step}"}


def test_keeps_the_last_k_and_loads_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(step, _state(step))
    assert [step for step, _ in store.complete()] == [30, 20]
    latest = store.load_latest()
    assert latest.step == 30 and torch.equal(latest.state["weights"], torch.full((4,), 30.0))


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "no marker"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, _state(1))
    newest = store.save(2, _state(2))
    data = (newest / STATE_FILE).read_bytes()
    if damage == "truncated":
        (newest / STATE_FILE).write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        (newest / STATE_FILE).write_bytes(data[:-20] + bytes([data[-20] ^ 0xFF]) + data[-19:])
    else:
        (newest / MARKER).unlink()  # a writer that died before its last write
    assert store.load_latest().step == 1


def test_a_temporary_folder_of_a_dead_writer_is_ignored_then_removed(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, _state(1))
    leftover = tmp_path / ".tmp-step-000000002-deadbeef"
    leftover.mkdir()
    (leftover / STATE_FILE).write_bytes(b"partial")
    assert store.load_latest().step == 1
    store.save(3, _state(3))
    assert not leftover.exists()


class Custom:
    """Any class: a checkpoint must not be able to make the loader run its code."""


def test_pickled_objects_are_refused_on_load(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, {"object": Custom()})
    assert store.load_latest() is None  # weights_only=True will not unpickle arbitrary classes


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    store = CheckpointStore(tmp_path)
    store.save(1, {"rng": capture_rng()})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    restore_rng(store.load_latest().state["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_throughput_figures(monkeypatch):
    from pipeline.train import throughput

    clock = [1000.0]  # a clock the test moves: the figures are checked against known seconds
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    meter = Throughput(world_size=2, flops_per_sample=1e6, peak_flops_per_s=1e9)
    meter.data_wait(0.05)
    meter.step(samples=100, tokens=1000)
    clock[0] += 0.25
    figures = meter.window()
    elapsed = 0.25
    assert figures["samples_per_s"] == pytest.approx(100 * 2 / elapsed)
    assert figures["tokens_per_s"] == pytest.approx(10 * figures["samples_per_s"])
    assert figures["data_wait_fraction"] == pytest.approx(0.05 / elapsed)
    assert figures["mfu"] == pytest.approx(100 * 1e6 / elapsed / 1e9)
    assert meter.window()["samples_per_s"] == 0  # a new window starts empty
    assert meter.summary()["samples_per_s"] > 0


def test_throughput_reports_the_share_of_each_phase_of_the_loops_own_work(monkeypatch):
    from pipeline.train import throughput

    clock = [1000.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    meter = Throughput(world_size=1)
    meter.spent("checkpoint", 0.1)
    meter.spent("checkpoint", 0.1)
    meter.step(samples=10)
    clock[0] += 1.0
    first = meter.window()
    assert first["checkpoint_fraction"] == pytest.approx(0.2)
    assert "validation_fraction" not in first  # a phase with no time in the window is not reported
    meter.spent("validation", 0.5)
    clock[0] += 1.0
    second = meter.window()
    assert second["validation_fraction"] == pytest.approx(0.5)
    assert "checkpoint_fraction" not in second  # the window starts empty
    total = meter.summary()
    assert total["checkpoint_fraction"] == pytest.approx(0.2 / 2.0)
    assert total["validation_fraction"] == pytest.approx(0.5 / 2.0)
