"""ParaStrategy under each way of starting processes: Lightning's launcher, two-node torchrun, SLURM.

The launcher runs start real processes from scratch (about 15 s each on two cores).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from tests.models import RegressionNet, regression_dataset
from tests.parity import (
    LossRecorder,
    ShardedData,
    assert_losses_close,
    fit_reference,
    mean_over_dp,
    trainer_kwargs,
)

SCRIPT = Path(__file__).with_name("launch_train.py")
LAUNCH_TIMEOUT = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(SCRIPT.parents[2])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _infos(out: Path, world: int) -> list[dict]:
    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [i["world"] for i in infos] == [world] * world
    return infos


def _read(out: Path, world: int) -> tuple[list[float], set[str]]:
    infos = _infos(out, world)
    return mean_over_dp([i["losses"] for i in infos], [list(range(world))]), {i["environment"] for i in infos}


def _wait_all(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            p.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        output = p.stdout.read() if p.stdout else ""
        assert p.returncode == 0, output[-4000:]


def test_lightning_launcher_and_two_node_torchrun_agree(tmp_path):
    # Both launches train with hybrid sharding, dp_replicate=2 x dp_shard=2 (ZeRO-1): under torchrun
    # the shards stay inside a "node" and the replicate group spans the two (checked at the end).
    hsdp = ["--dp-replicate", "2"]
    # Lightning's own launcher: one command, `devices=4` spawns the other three processes.
    launcher = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--devices", "4", "--out", str(tmp_path / "lightning"), *hsdp],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    _wait_all([launcher])
    # torchrun, two "nodes" of two processes each, rendezvous over loopback.
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(SCRIPT), "--devices", "2", "--num-nodes", "2", "--out", str(tmp_path / "torchrun"), *hsdp],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    _wait_all(nodes)
    lightning_losses, lightning_env = _read(tmp_path / "lightning", 4)
    torchrun_losses, torchrun_env = _read(tmp_path / "torchrun", 4)
    assert lightning_env == {"LightningEnvironment"} and torchrun_env == {"TorchElasticEnvironment"}
    # Same layout, same math: the two launches agree to the last bit of fp32 printing.
    assert_losses_close(torchrun_losses, lightning_losses, rtol=1e-7)
    reference = fit_reference(RegressionNet, regression_dataset, 16, 10, {"gradient_clip_val": 1.0})
    assert_losses_close(lightning_losses, reference["losses"])
    # Hybrid sharding across real node boundaries: each replicate group has one rank per node,
    # each shard group lives in one node.
    infos = _infos(tmp_path / "torchrun", 4)
    node_of = {i["rank"]: i["node"] for i in infos}
    assert sorted(node_of.values()) == [0, 0, 1, 1]
    for info in infos:
        assert sorted(node_of[r] for r in info["replicate_group"]) == [0, 1], info
        assert {node_of[r] for r in info["shard_group"]} == {info["node"]} and len(info["shard_group"]) == 2, info


def _slurm_job() -> dict:
    from lightning_para import ParaStrategy

    strategy = ParaStrategy(zero=2)
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=2, strategy=strategy, max_steps=10, callbacks=[recorder], use_distributed_sampler=False,
                        **trainer_kwargs(gradient_clip_val=1.0))
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, 8))
    return {"losses": recorder.losses, "environment": type(strategy.cluster_environment).__name__,
            "rank": strategy.global_rank, "world": dist.get_world_size()}


def test_slurm_environment(pools):
    """Under srun-style variables Lightning picks its SLURMEnvironment; ranks and training are unchanged."""
    results = pools.get(2, env={"PARA_TEST_SLURM": "1"}).run(_slurm_job)
    assert {r["environment"] for r in results} == {"SLURMEnvironment"}
    assert [r["rank"] for r in results] == [0, 1]
    reference = fit_reference(RegressionNet, regression_dataset, 16, 10, {"gradient_clip_val": 1.0})
    assert_losses_close(mean_over_dp([r["losses"] for r in results], [[0, 1]]), reference["losses"])


