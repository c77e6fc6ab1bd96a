"""Elastic torchrun (``launch.min_nnodes``) losing one of two nodes, for real: two local places, each with
its own torchrun agent, one in a network namespace (a second machine: its own address and ``/dev/shm``),
joined by the c10d rendezvous; one rank per node, a loader worker per rank, the job folder shared as the docs
ask. Mid-epoch, every process of the second node is SIGKILLed. The first node's rank sees its peer's death
in the next collective and fails; the launcher restarts the attempt; the new rendezvous closes with the one
node left (``min_nnodes = 1``), and the loop resumes from the last checkpoint at the same sample on half
the ranks, then finishes. A rank that hung on its way out (its loader worker blocks the SIGTERM that
multiprocessing's exit sends) would turn this into a stall, which the launcher does not restart on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline import stages
from pipeline.job_files import read_heartbeats
from pipeline.recipes import tabular_mlp
from tests.netns import NetworkNamespace

pytestmark = pytest.mark.distributed

HOST_IP, PEER_IP = "10.231.19.1", "10.231.19.2"
CHECKPOINT_EVERY = 100

# One node's launcher: the product's local place (torchrun under the supervisor), its lines on stdout,
# its result or error as the last line.
NODE = """
import json, sys
from pathlib import Path
from tests.jobs import run_torchrun
config, dataset, job, endpoint, rank = sys.argv[1:6]
try:
    result = run_torchrun(["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", config,
                           "--dataset", dataset, "--out", job], job_dir=Path(job), nproc_per_node=1, nnodes=2,
                          min_nnodes=1, node_rank=int(rank), rdzv_endpoint=endpoint, max_restarts=2,
                          grace_period_s=5, stall_timeout_s=60, emit=lambda line: print(line, flush=True))
    print("RESULT " + json.dumps(result), flush=True)
except Exception as error:
    print(f"FAILED {type(error).__name__}: {error}", flush=True)
    sys.exit(1)
"""


@pytest.fixture()
def namespace():
    ns = NetworkNamespace(f"trel{os.getpid() % 10000}", HOST_IP, PEER_IP)
    if not ns.create():
        pytest.skip("network namespaces need root and iproute2 (apt-get install -y iproute2)")
    yield ns
    for pid in ns.pids():
        os.kill(pid, signal.SIGKILL)
    ns.remove()


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _node(namespace: NetworkNamespace, rank: int, args: list[str], log: Path) -> subprocess.Popen:
    """Node 0 here, hosting the rendezvous store; node 1 inside the namespace. Each node advertises its own
    address to the rendezvous (torchrun's ``--local-addr``) and its ranks use its interface for gloo, as on
    machines with more than one network. The rendezvous closes 5 s after the fewest nodes have joined."""
    ip, dev, wrap = (HOST_IP, namespace.host_dev, []) if rank == 0 else (PEER_IP, namespace.dev, namespace.wrap())
    env = {"PET_LOCAL_ADDR": ip, "GLOO_SOCKET_IFNAME": dev,
           "PET_RDZV_CONF": f"last_call_timeout=5,is_host={int(rank == 0)}"}
    command = [*wrap, "env", *[f"{k}={v}" for k, v in env.items()], sys.executable, "-c", NODE, *args, str(rank)]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])


def _newest_checkpoint(folder: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in folder.glob("step-*") if re.fullmatch(r"step-\d{9}", p.name)]
    return max(steps, default=0)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_losing_one_of_two_nodes_resumes_on_the_other_at_the_same_sample(namespace, demo_parquet, tmp_path,
                                                                         parallelism):
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 1, "train.batch_size": 4, "train.num_workers": 1,
        "train.checkpoint_every_steps": CHECKPOINT_EVERY, "train.log_every_steps": 50,
        "train.parallelism": parallelism,  # fsdp: the 2 ranks' shards resharded onto the 1 left
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("elastic", "prep"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    job = tmp_path / "job"  # on storage both nodes mount
    args = [str(tmp_path / "config.json"), dataset.uri, str(job), f"{HOST_IP}:{_free_port(HOST_IP)}"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    # The second node first: a rendezvous client waits for the store, so both are in the first round.
    peer = _node(namespace, 1, args, logs[1])
    survivor = _node(namespace, 0, args, logs[0])
    try:
        # Mid-epoch, past a checkpoint: both ranks train, the newest checkpoint behind them.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and survivor.poll() is None:
            beats = read_heartbeats(job / "progress")
            if (sorted(beats) == [0, 1] and all(b["phase"] == "training" for b in beats.values())
                    and min(b["step"] for b in beats.values()) > CHECKPOINT_EVERY + 20):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the two nodes never trained past a checkpoint:\n" + logs[0].read_text()[-3000:])
        lost = namespace.pids()
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        resumable = _newest_checkpoint(job / "checkpoints")
        survivor.wait(timeout=300)
    finally:
        for proc in (peer, survivor):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    out = logs[0].read_text() + logs[1].read_text()
    last = logs[0].read_text().strip().splitlines()[-1]
    assert last.startswith("RESULT "), f"the surviving node's launcher did not finish the job:\n{out[-6000:]}"
    result = json.loads(last.removeprefix("RESULT "))
    assert lost and namespace.pids() == [], "processes of the lost node outlived the SIGKILL"

    # The first attempt ran on both nodes; its failure was the peer's death, restarted, not a stall.
    assert "training on 2 rank(s)" in out
    assert "restarting every rank (1 of 2)" in out
    assert "training stalled" not in out
    # The restart: one node, from the newest checkpoint, at the sample the two ranks had reached.
    steps_per_epoch = int(re.search(r"training on 1 rank\(s\).*?: \d+ train rows, (\d+) steps/epoch", out).group(1))
    assert result["world_size"] == 1
    assert result["start_step"] == resumable >= CHECKPOINT_EVERY
    assert result["resumed_from"].endswith(f"step-{resumable:09d}")
    in_epoch = 2 * resumable  # samples per step halve with the ranks
    assert f"step {resumable}, epoch 1 at its step {in_epoch} of {steps_per_epoch} on 1 rank(s)" in out
    assert result["steps"] == resumable + steps_per_epoch - in_epoch
    labels = pq.read_table(demo_parquet, columns=["label"]).column("label").to_numpy()
    majority = np.bincount(labels).max() / len(labels)
    assert result["metrics"]["val_accuracy"] > majority + 0.1, "the resumed run did not learn"
