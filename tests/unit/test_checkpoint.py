"""Checkpoint store, RNG capture and throughput figures, without torchrun."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.train.checkpoint import (
    MARKER,
    STATE_FILE,
    CheckpointStore,
    capture_rng,
    restore_rng,
)
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


def test_a_background_save_writes_the_state_as_it_was_when_asked(tmp_path):
    store = CheckpointStore(tmp_path)
    weights = torch.zeros(4)
    optimizer_state = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    written: list = []
    store.save_in_background(5, {"model": {"w": weights}, "optimizer": optimizer_state, "rng": (1, (2, 3), None)},
                             done=written.append)
    weights += 7.0  # what the next optimizer step does to the live tensors, at once
    optimizer_state["state"][0]["exp_avg"].mul_(0)
    store.wait()
    assert written == [tmp_path / "step-000000005"]
    state = store.load_latest().state
    assert torch.equal(state["model"]["w"], torch.zeros(4))
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    assert state["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}] and state["rng"] == (1, (2, 3), None)


def test_a_background_save_waits_for_the_one_before_and_raises_its_failure(tmp_path, monkeypatch):
    import threading

    store = CheckpointStore(tmp_path, keep=5)
    release, order = threading.Event(), []
    write = store._write

    def slow_write(step, state, final):
        if step == 1:
            release.wait(timeout=10)
            order.append("1 written")
            raise OSError("the disk went away")
        write(step, state, final)

    monkeypatch.setattr(store, "_write", slow_write)
    store.save_in_background(1, _state(1))
    second = threading.Thread(target=lambda: order.append(_raised(lambda: store.save_in_background(2, _state(2)))))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and order == []  # the second save waits for the first write
    release.set()
    second.join(timeout=10)
    assert order == ["1 written", "OSError: the disk went away"]  # the first's failure, raised by the next save
    assert [step for step, _ in store.complete()] == []  # nothing of the failed write; the second not begun
    store.save_in_background(3, _state(3))
    store.wait()
    assert [step for step, _ in store.complete()] == [3]


def _raised(call) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


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
