"""Train the GPT recipe for the reliability tests and the kill campaign (``scripts/kill_campaign.py``).

Runs under Lightning's launcher (``--devices 4`` in one process) or as separately started ranks
(``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the caller). Each rank writes ``rank<r>.pid`` once
training starts and, if it finishes, ``rank<r>.json`` with the ``train_loss`` it logged per
global step. ``--kill POINT:RANK:NTH`` SIGKILLs rank RANK at POINT of its NTH checkpoint save:
the points wrap the library's own functions from the outside (nothing in the library knows).
``--sigterm RANK:STEP`` makes rank RANK send itself SIGTERM (as SLURM or Kubernetes would) after
global step STEP. Each rank also keeps ``rank<r>.steps.json``, the losses so far. ``--bad-id STEP`` puts token id 10000 (the vocabulary has 256) into the batch of
dp rank 0 at global step STEP.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

LAYOUTS = {
    "pp2dp2": {"pp": 2, "dp": 2}, "dp2tp2": {"dp": 2, "tp": 2}, "dp2tp2z3": {"dp": 2, "tp": 2, "zero": 3},
    "pp2tp2": {"pp": 2, "tp": 2},
}
# Where a save can be cut, in the order a save passes them (rank 0 passes all; others the DCP ones).
KILL_POINTS = (
    "save-start",  # ParaStrategy.save_checkpoint entered
    "shard-partly-written",  # inside DCP's write of this rank's shard file (after its first item)
    "shards-written",  # this rank's shards on disk, DCP's .metadata not yet
    "dcp-and-meta-written",  # save_sharded returned (rank 0: .metadata and meta.pt written)
    "before-marker",  # after the barrier, before rank 0 writes the completion marker
    "marker-written",  # complete and marked, not yet swapped into place
    "swapped-old-not-deleted",  # the new checkpoint in place, the previous copy not yet deleted
    "committed",  # swapped in and cleaned, before the closing barrier
)


class StepLosses(Callback):
    """``train_loss`` as logged after each step, by global step; optionally slows steps down."""

    def __init__(self, out: Path, sleep: float, sigterm: str = "") -> None:
        self.out, self.sleep, self.losses = out, sleep, {}
        self.sigterm = tuple(int(v) for v in sigterm.split(":")) if sigterm else None

    def on_train_start(self, trainer, pl_module) -> None:
        (self.out / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # "After step STEP" is sent as the next step starts: the same moment in a fresh run, and a run
        # resumed at STEP can be signalled in its first step (the step guard reads the flag a step late).
        if self.sigterm is not None and self.sigterm == (trainer.global_rank, trainer.global_step):
            sys.stderr.write(f"[sigterm] rank {trainer.global_rank} sends itself SIGTERM after step {trainer.global_step}\n")
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        # So far (a rank killed later still tells which steps it ran): rank<r>.steps.json.
        (self.out / f"rank{trainer.global_rank}.steps.json").write_text(json.dumps({"losses": self.losses}))
        if self.sleep:
            time.sleep(self.sleep)


def install_kill(point: str, rank: int, nth: int) -> None:
    """SIGKILL this process at ``point`` of its ``nth`` checkpoint save, if it is global rank ``rank``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from lightning_para import strategy as strategy_module
    from lightning_para.checkpoint import atomic, save as ckpt_save, swap

    saves = {"n": 0}

    def here(name: str) -> None:
        if name == point and saves["n"] == nth and dist.get_rank() == rank:
            sys.stderr.write(f"[kill] rank {rank} SIGKILLs itself at {name} of save {nth}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, before=None, after=None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if before:
                here(before)
            result = original(*args, **kwargs)
            if after:
                here(after)
            return result

        setattr(owner, name, wrapped)

    original_save = strategy_module.ParaStrategy.save_checkpoint

    def save_checkpoint(self, *args, **kwargs):
        saves["n"] += 1
        items["n"] = 0  # the shard items of this save
        here("save-start")
        return original_save(self, *args, **kwargs)

    strategy_module.ParaStrategy.save_checkpoint = save_checkpoint
    items = {"n": 0}
    original_item = dcp_fs._write_item

    def write_item(*args, **kwargs):
        result = original_item(*args, **kwargs)
        items["n"] += 1
        if items["n"] == 1:
            args[1].flush()  # the first item reaches the file: a truncated shard, as a kill mid-write leaves
            here("shard-partly-written")
        return result

    dcp_fs._write_item = write_item
    wrap(dcp_fs.FileSystemWriter, "write_data", after="shards-written")
    wrap(ckpt_save, "save_sharded", after="dcp-and-meta-written")
    wrap(atomic, "write_marker", before="before-marker", after="marker-written")
    wrap(swap, "_remove", before="swapped-old-not-deleted")
    wrap(swap, "commit", after="committed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2dp2")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--watchdog-timeout", type=float, default=10.0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--kill", default=None, help="POINT:RANK:NTH")
    parser.add_argument("--sigterm", default="", help="RANK:STEP")
    parser.add_argument("--bad-id", type=int, default=-1, help="STEP")
    parser.add_argument("--root-dir", default=None, help="Trainer's default_root_dir (default: OUT)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint's folder (default: OUT/ckpt)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-file", action="store_true", help="save_distributed_checkpoint=False")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.kill:
        point, rank, nth = args.kill.split(":")
        assert point in KILL_POINTS, point
        install_kill(point, int(rank), int(nth))

    from lightning_para import ParaStrategy
    from lightning_para.recipes import GPT, TextDataModule

    L.seed_everything(args.seed, verbose=False)
    class Model(GPT):
        def on_after_batch_transfer(self, batch, dataloader_idx):  # before the step, under pp too
            if self.trainer.training and self.trainer.global_step == args.bad_id \
                    and self.trainer.strategy.parallel_dims.local_rank("dp") == 0:
                batch = (batch[0].clone(), batch[1])
                batch[0][0, 3] = 10_000
            return batch

    model = Model(preset="tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, warmup_steps=2, sample_tokens=0)
    losses = StepLosses(out, args.step_sleep, args.sigterm)
    callbacks: list[Callback] = [losses]
    if args.save_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir or out / "ckpt", filename="{step}", every_n_train_steps=args.save_every,
                                         save_top_k=-1, save_last=True))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=ParaStrategy(
            **LAYOUTS[args.layout], watchdog_timeout=args.watchdog_timeout,
            save_distributed_checkpoint=not args.single_file,
        ),
        max_steps=args.steps, callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(args.save_every), limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=args.root_dir or out,
    )
    data = TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000)
    ckpt_path = args.resume
    if ckpt_path == "last" and not args.save_every:
        raise SystemExit("--resume last needs --save-every (ModelCheckpoint finds `last`)")
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"losses": losses.losses}))


if __name__ == "__main__":
    main()
