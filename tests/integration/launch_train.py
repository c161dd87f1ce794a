"""Train ``RegressionNet`` under ParaStrategy and write each rank's per-step losses to JSON.

Used by the launcher tests: the same script runs under Lightning's own launcher
(``--devices 4``) and under ``torchrun --nnodes 2 --nproc-per-node 2``.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_para import ParaStrategy  # noqa: E402
from tests.models import RegressionNet, regression_dataset  # noqa: E402
from tests.parity import LossRecorder, ShardedData, trainer_kwargs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=None)  # hybrid sharding: replicas of the ZeRO shards
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = ParaStrategy(zero=args.zero, dp_replicate=args.dp_replicate)
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_steps=args.steps,
                        callbacks=[recorder], use_distributed_sampler=False, **trainer_kwargs(gradient_clip_val=1.0))
    world = args.devices * args.num_nodes
    trainer.fit(RegressionNet(), datamodule=ShardedData(regression_dataset, 16 // world))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = strategy.parallel_dims
    info = {"losses": recorder.losses, "environment": type(strategy.cluster_environment).__name__,
            "rank": trainer.global_rank, "world": trainer.world_size, "node": trainer.node_rank,
            "replicate_group": dims.get_mesh("dp_replicate").mesh.flatten().tolist(),
            "shard_group": dims.get_mesh("dp_shard").mesh.flatten().tolist()}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
