"""dp=2 ZeRO-1 training with ``async_save=True`` under the Trainer or Fabric, for the asynchronous-save tests.

:func:`train` runs in every worker of a pool (``tests/harness.py``), or as a separately started rank
(``python async_train.py --out LOG '<options as JSON>'``, started by ``kill_helpers.launch``), which writes what
:func:`train` returns into ``LOG/rank<r>.json`` (and the losses so far into ``rank<r>.steps.json``). Options:

* ``front_end``: ``"trainer"`` (the GPT recipe on ``TextDataModule``; ``ParaModelCheckpoint`` every ``every``
  steps into ``ckpt``, ``save_top_k`` of them) or ``"fabric"`` (the recipe GPT of ``tests/fabric_loop.py``;
  ``fabric.save(ckpt/step=N.ckpt)`` every ``every`` steps; ``ckpt/preempted.ckpt`` after SIGTERM);
* ``root`` (the Trainer's ``default_root_dir``), ``ckpt``, ``log`` (where ranks note their losses), ``steps``, ``every``, ``save_top_k``, ``async_save``,
  ``watchdog_timeout``;
* ``resume``: the Trainer's ``ckpt_path``; under Fabric a path, or ``"newest"``: the newest complete checkpoint in ``ckpt``;
* ``sigterm``: rank 0 sends itself SIGTERM as the step after global step ``sigterm`` starts;
* ``slow_write``: each checkpoint write waits this long before this rank's shards are written (a save stays in flight
  while training goes on); ``kill_write``: ``[rank, n]``: that rank SIGKILLs itself once its shards of its ``n``-th
  write are written (before the marker and the swap);
* ``planted_no_staging``: the planted bug: the background writes the live tensors, not a staged copy.

The hooks wrap the library's functions from outside (nothing in the library knows), as ``reliability_train.py``'s do.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402


class _Losses(Callback):
    def __init__(self, options: dict[str, Any], losses: dict[int, float]) -> None:
        self.options, self.losses = options, losses

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.options.get("sigterm") == trainer.global_step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        _progress(self.options, self.losses)


def _progress(options: dict[str, Any], losses: dict[int, float]) -> None:
    if options.get("log"):
        (Path(options["log"]) / f"rank{dist.get_rank()}.steps.json").write_text(json.dumps({"losses": losses}))


def _hooks(options: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """Install the test hooks; returns what to restore."""
    from lightning_para.checkpoint.async_save import AsyncSaver
    from lightning_para.checkpoint.checksums import ChecksummingWriter

    restore = [(ChecksummingWriter, "write_data", ChecksummingWriter.write_data), (AsyncSaver, "_stage", AsyncSaver._stage)]
    original, writes = ChecksummingWriter.write_data, {"n": 0}

    def write_data(self, plan, planner):
        time.sleep(options.get("slow_write", 0.0))  # training goes on meanwhile (an asynchronous save)
        result = original(self, plan, planner)  # this rank's shards written, fsynced and checksummed
        writes["n"] += 1
        if options.get("kill_write") == [dist.get_rank(), writes["n"]]:
            sys.stderr.write(f"[kill] rank {dist.get_rank()} SIGKILLs itself in checkpoint write {writes['n']}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    ChecksummingWriter.write_data = write_data
    if options.get("planted_no_staging"):
        AsyncSaver._stage = lambda self, tensors: tensors
    return restore


def _trainer(options: dict[str, Any], losses: dict[int, float]) -> None:
    from lightning_para import ParaStrategy
    from lightning_para.checkpoint import ParaModelCheckpoint
    from lightning_para.recipes import GPT, TextDataModule

    L.seed_everything(0, verbose=False)
    model = GPT(preset="tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, warmup_steps=2, sample_tokens=0)
    callbacks: list[Callback] = [_Losses(options, losses)]
    if options.get("every"):
        callbacks.append(ParaModelCheckpoint(
            dirpath=options["ckpt"], filename="{step}", every_n_train_steps=options["every"],
            save_top_k=options.get("save_top_k", 1),
        ))
    strategy = ParaStrategy(dp=2, zero=1, async_save=options.get("async_save", True),
                            watchdog_timeout=options.get("watchdog_timeout", 60.0))
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=options["steps"],
        callbacks=callbacks, logger=False, enable_checkpointing=bool(options.get("every")), enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=options["root"],
    )
    trainer.fit(model, datamodule=TextDataModule(seq_len=32, global_batch_size=8, max_bytes=40_000),
                ckpt_path=options.get("resume"))


def _fabric(options: dict[str, Any], losses: dict[int, float]) -> None:
    from lightning_para.checkpoint import newest_complete_checkpoint
    from lightning_para.fabric import ParaStrategy
    from tests.fabric_loop import loss_fn, setup

    strategy = ParaStrategy(dp=2, zero=1, async_save=options.get("async_save", True), on_sigterm="checkpoint",
                            watchdog_timeout=options.get("watchdog_timeout", 60.0))
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    try:
        model, optimizer, loader = setup(fabric, "recipe", 4, empty_init=True)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        ckpt = Path(options["ckpt"])
        if options.get("resume"):
            fabric.load(newest_complete_checkpoint(ckpt) if options["resume"] == "newest" else options["resume"], state)
        batches = iter(loader)
        for _ in range(state["step"]):
            next(batches)
        for step in range(state["step"], options["steps"]):
            if options.get("sigterm") == step and fabric.global_rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            inputs, targets = next(batches)
            loss = loss_fn(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step + 1
            losses[state["step"]] = float(loss.detach())
            _progress(options, losses)
            if strategy.preempted:  # settles the save in flight, then saves and waits for the write
                fabric.save(ckpt / "preempted.ckpt", state)
                raise SystemExit(143)
            if options.get("every") and state["step"] % options["every"] == 0:
                fabric.save(ckpt / f"step={state['step']}.ckpt", state)
        strategy.wait_for_checkpoint()
    finally:
        strategy.teardown()  # settles; restores a pool worker's SIGTERM handler


def train(options: dict[str, Any]) -> dict[str, Any]:
    """Inside a worker (see the module docstring): this rank's losses by global step, and how the run ended."""
    torch.set_num_threads(1)
    losses: dict[int, float] = {}
    result: dict[str, Any] = {"losses": losses, "exit_code": None, "error": None, "rank": dist.get_rank()}
    restore = _hooks(options)
    try:
        (_trainer if options["front_end"] == "trainer" else _fabric)(options, losses)
    except SystemExit as stop:
        result["exit_code"] = stop.code
    except Exception as error:  # noqa: BLE001 - the test reads which error every rank raised, and when
        result["error"] = (type(error).__name__, str(error), max(losses, default=0))
    finally:
        for owner, name, value in restore:
            setattr(owner, name, value)
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("options")
    args = parser.parse_args()
    options = {**json.loads(args.options), "log": args.out}
    dist.init_process_group("gloo")
    Path(options["log"]).mkdir(parents=True, exist_ok=True)
    (Path(options["log"]) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    outcome = train(options)
    (Path(options["log"]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(outcome))
    sys.exit(outcome["exit_code"] or (1 if outcome["error"] else 0))
