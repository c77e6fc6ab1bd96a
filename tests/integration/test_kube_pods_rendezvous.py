"""The pods' exact commands and environments (rendered from the Job manifest as the kubelet would) run
as 2 torchrun agents of 1 process each, rendezvousing through the rendered master address, and
reaching the same parameters as 1 node with 2 processes, the model replicated (ddp) or sharded (fsdp): the
pods are the same for both.

No cluster runs here: each "pod" is a network namespace (``ip netns``) joined to the other by a veth
pair, with the pod's hostname (``unshare --uts``) and an /etc/hosts in which the rendered
``JOB-0.SERVICE`` name resolves to pod 0, as a headless Service's DNS record does. Where network
namespaces cannot be created (no CAP_NET_ADMIN), both agents run on this machine's loopback with the
master address replaced by 127.0.0.1, and the test says so in its output and its report property.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from pipeline.job.kubernetes.place import manifests_for
from pipeline.job.spec import Attempt, JobSpec, launch_config
from tests.jobs import run_torchrun
from tests.kube_standin import rendered_pod
from tests.netns import Namespaces

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from pipeline.config import TrainConfig
    from pipeline.train import distributed
    from pipeline.train.parallel import parallelize

    ctx = distributed.setup("gloo")
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    parallel = parallelize(model, ctx, TrainConfig(parallelism=sys.argv[1]), bf16=False)  # ddp or fsdp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    for step in range(10):
        x = torch.randn(32, 8, generator=data)
        y = torch.randint(0, 3, (32,), generator=data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(parallel.wrapped(x), y).backward()
        optimizer.step()
    print(f"rank {rank} of {world}: host {os.uname().nodename}, master {os.environ['MASTER_ADDR']}", flush=True)
    whole = parallel.full_state_dict()  # every rank gathers; rank 0 holds it
    if rank == 0:
        params = [t.detach().double().flatten().tolist() for t in whole.values()]
        with open(os.environ["PIPELINE_RESULT_FILE"], "w") as fh:
            json.dump({"params": params, "world": world}, fh)
    distributed.teardown(ctx)
""")


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_rendered_pods_rendezvous_through_the_master_address_and_match_one_node(tmp_path, record_property,
                                                                                parallelism):
    script = tmp_path / "params.py"
    script.write_text(SCRIPT)

    reference = run_torchrun([str(script), parallelism], nproc_per_node=2, job_dir=tmp_path / "one-node",
                             emit=lambda line: None)
    assert reference["world"] == 2

    job_dir = tmp_path / "pods"
    launch = launch_config({"kind": "kubernetes", "nnodes": 2, "nproc_per_node": 1, "backend": "gloo",
                            "kubernetes": {"volumes": [f"runs:{tmp_path}"]}})
    spec = JobSpec(entry=[str(script), parallelism], job_dir=job_dir, launch=launch, name="pods-rdzv",
                   labels={"dag_id": "d", "run_id": "r", "task_id": "t", "try_number": "1"})
    m = manifests_for(Attempt(spec, 0))
    job_dir.mkdir(parents=True)
    pods = [rendered_pod(m, i) for i in (0, 1)]
    master = pods[0][1]["PET_MASTER_ADDR"]
    hostnames = [f"{m.name}-{i}" for i in (0, 1)]
    assert master == f"{hostnames[0]}.{m.service.metadata.name}"

    net = Namespaces(str(os.getpid()))
    # /etc/hosts stands in for the cluster's DNS too: the headless Service's records (pod 0's name is the
    # master address) forward and reverse, and a pod's own hostname.
    service = m.service.metadata.name
    records = "".join(f"{net.ips[i]} {hostnames[i]}.{service} {hostnames[i]}\n" for i in (0, 1))
    hosts = ["127.0.0.1 localhost\n" + records] * 2
    isolated = os.geteuid() == 0 and net.create(hosts)
    mode = "network namespaces joined by a veth pair" if isolated else "loopback (network namespaces unavailable)"
    record_property("rendezvous_mode", mode)
    print(f"rendezvous over {mode}")
    try:
        agents = []
        for index, (command, env) in enumerate(pods):
            assert command[0] == "python"  # the image's interpreter; this machine's here
            argv = [sys.executable, *command[1:]]
            env = {**os.environ, **env}
            if isolated:
                argv = net.wrap(index, hostnames[index], argv)
            else:
                env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(_free_port() if index == 0 else env_port))
            env_port = env["PET_MASTER_PORT"]
            agents.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [agent.communicate(timeout=150)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
        if isolated:
            net.remove()
    for index, (agent, output) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"pod {index} failed:\n{output}"
    if isolated:  # each agent ran as its pod, with the rendered DNS name as the master
        for index in (0, 1):
            assert f"host {hostnames[index]}, master {master}" in outputs[index], outputs[index]
    result = json.loads(spec.files.result.read_text())
    assert result["world"] == 2
    assert result["params"] == reference["params"]  # bitwise: the same seed, shards and reduction
