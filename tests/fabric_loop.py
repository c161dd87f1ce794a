"""A Fabric training loop written like LitGPT's ``litgpt/pretrain.py``, run under any strategy.

``fabric.init_module(empty_init=True)``, ``fabric.setup``, ``fabric.setup_optimizers``,
``fabric.setup_dataloaders``, accumulation under ``fabric.no_backward_sync``, ``fabric.backward``,
``fabric.clip_gradients``, ``optimizer.step()``: the calls LitGPT makes, in its order. Under
``pp > 1`` each micro-step is ``fabric.strategy.pipeline_step(model, batch)`` instead of the
forward and loss. ``fabric_job`` runs it in every worker of a pool under
``lightning_para.fabric.ParaStrategy``; ``fabric_reference`` runs it in the pytest process on one
device with the global batch. Both return per-micro-step losses.

Weights are sharp (std 0.3, ``tests/sharpness.py``) and identical everywhere: every Linear and
Embedding resets to N(0, 0.3) (LitGPT's ``initialize_weights`` pattern for meta-device init), and
materialisation walks the modules in the same order after the same seed.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from tests.sharpness import SHARP_STD

VOCAB, SEQ, LAYERS, HEADS, EMBD = 64, 16, 2, 4, 32


def token_dataset(n: int = 128, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def recipe_gpt() -> nn.Module:
    """This repo's GPT recipe (RMSNorm, RoPE, SwiGLU; its tensor-parallel plan and pipeline contract)."""
    from lightning_para.recipes.gpt import GPT

    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, init_std=SHARP_STD)


def litgpt_gpt() -> nn.Module:
    """LitGPT's ``GPT`` with a tiny ``Config`` (GQA: 4 query heads, 2 key/value groups)."""
    from litgpt.model import GPT, Config

    config = Config(
        block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
        n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
    )
    return GPT(config)


class PipelinedLitGPT(nn.Module):
    """LitGPT's ``GPT`` with the one-line pipeline contract (``lightning_para.integrations.litgpt.pipeline_spec``):
    what a Fabric user adds for ``pp > 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = litgpt_gpt()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def configure_pipeline(self) -> Any:
        from lightning_para.integrations.litgpt import pipeline_spec

        return pipeline_spec(self.model)


def recipe_moe(bias_update_rate: float = 0.0) -> nn.Module:
    """This repo's MoE recipe (4 experts, top-2, no capacity limit: no token is dropped)."""
    from lightning_para.recipes.moe import MoEGPT

    return MoEGPT(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, init_std=SHARP_STD,
                  bias_update_rate=bias_update_rate)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "recipe": recipe_gpt, "litgpt": litgpt_gpt, "litgpt_pp": PipelinedLitGPT, "moe": recipe_moe,
    "moe_biased": partial(recipe_moe, bias_update_rate=0.05),  # rate far above DeepSeek-V3's: routing moves in 4 steps
}


def to_float8_reference(model: nn.Module) -> nn.Module:
    """torchao's own float8 conversion of a materialised model (emulated on CPU; not the head, not widths that are
    not multiples of 16): what ``ParaStrategy(fp8="tensorwise")`` is compared with."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)

    def keep(module: nn.Module, fqn: str) -> bool:
        return "lm_head" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0

    return convert_to_float8_training(model, module_filter_fn=keep, config=config)


def _normal_reset(module: nn.Module, std: float) -> None:
    with torch.no_grad():
        nn.init.normal_(module.weight, 0.0, std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def sharp_resets(model: nn.Module, std: float = SHARP_STD) -> None:
    """Each Linear/Embedding's ``reset_parameters`` draws N(0, std) (materialisation calls it in module order)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.reset_parameters = partial(_normal_reset, module, std)


def reset_like_materialisation(model: nn.Module) -> None:
    """What materialising a meta model does after ``to_empty``: each module holding tensors resets them,
    in module order (``lightning.fabric.utilities.init._materialize_distributed_module``)."""
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def build(fabric: Optional[L.Fabric], model_name: str, empty_init: bool, seed: int = 0) -> nn.Module:
    """The model under ``fabric.init_module`` (meta with ``empty_init``: materialised by ``fabric.setup`` after
    the seed below), with sharp resets. Built for real (the reference, pp), the same resets run here."""
    if fabric is not None:
        with fabric.init_module(empty_init=empty_init):
            model = MODELS[model_name]()
    else:
        model = MODELS[model_name]()
    sharp_resets(model)
    torch.manual_seed(seed)  # the resets draw the same values on every rank and in the reference
    if fabric is None or not empty_init:
        reset_like_materialisation(model)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """LitGPT's ``chunked_cross_entropy`` with ``chunk_size=0``: the mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def lm_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The step a cp loop hands to ``fabric.strategy.run_step``: forward and loss on (its chunks of) a batch."""
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


def train(
    fabric: L.Fabric, model: nn.Module, optimizer: Any, loader: Any, *, steps: int, accumulate: int,
    pipeline: bool, max_norm: float = 1.0, first_step: int = 0, save_at: Optional[int] = None,
    save_path: Optional[str] = None, data_from_start: bool = False,
) -> list[float]:
    """LitGPT's inner loop: ``accumulate`` micro-steps, then clip and step. Returns each micro-step's loss."""
    losses = []
    batches = iter(loader)
    # ParaStrategy(loss_parallel=True): vocab-sharded logits, the cross-entropy inside the strategy's context.
    loss_context = getattr(fabric.strategy, "loss_parallel", None)
    sharded_loss = loss_context is not None and fabric.strategy.config.loss_parallel
    # ParaStrategy: MoE layers scale their aux-loss gradient over the accumulation as the loss is scaled.
    backward_kwargs = {"accumulate": accumulate} if loss_context is not None else {}
    # ParaStrategy(cp>1): the forward and the loss run through `run_step` on this rank's sequence chunks.
    context_parallel = loss_context is not None and fabric.strategy.config.cp > 1
    for _ in range(0 if data_from_start else first_step * accumulate):  # a resumed run continues the data
        next(batches)
    for step in range(first_step, steps):
        for micro in range(accumulate):
            inputs, targets = next(batches)
            accumulating = micro < accumulate - 1
            with fabric.no_backward_sync(model, enabled=accumulating):
                if pipeline:
                    loss = fabric.strategy.pipeline_step(model, (inputs, targets), accumulate=accumulate)
                    fabric.backward(loss)
                elif sharded_loss:
                    logits = model(inputs)
                    assert isinstance(logits, DTensor) and logits.placements[-1].is_shard(logits.ndim - 1), logits.placements
                    with loss_context():
                        loss = loss_fn(logits, targets)
                    fabric.backward(loss / accumulate, **backward_kwargs)
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                elif context_parallel:
                    loss = fabric.strategy.run_step(model, lm_step, (inputs, targets))
                    fabric.backward(loss / accumulate, **backward_kwargs)
                else:
                    loss = loss_fn(model(inputs), targets)
                    fabric.backward(loss / accumulate, **backward_kwargs)
            losses.append(float(loss.detach()))
        fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            fabric.save(save_path, {"model": model, "optimizer": optimizer, "step": step + 1})
    return losses


def make_optimizer(params: Any, sgd: bool = False) -> torch.optim.Optimizer:
    """LitGPT's AdamW; ``sgd``: the fp32 parity runs' SGD (tests/tp_models.make_optimizer), for float8 parity
    (AdamW amplifies a float8 rounding flip: tests/parity.py, FP8_PARAM_MARGIN)."""
    if sgd:
        from tests.tp_models import SHARP_LR, make_optimizer as parity_optimizer

        return parity_optimizer(params, "sgd", SHARP_LR)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def muon_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """lightning_para.optim.Muon (hidden matrices) and AdamW (the rest), both at lr 1e-3."""
    from lightning_para.optim import Muon

    return Muon(model, lr=1e-3, adamw_lr=1e-3)


def setup(
    fabric: L.Fabric, model_name: str, micro_batch: int, empty_init: bool, seed: int = 0, per_process: bool = False,
    joint: bool = False, sgd: bool = False, muon: bool = False,
) -> tuple:
    """LitGPT's order (model, then its optimizer); ``joint``: ``fabric.setup(model, optimizer)`` with an optimizer
    made from the model before it was parallelized."""
    L.seed_everything(seed, verbose=False)
    model = build(fabric, model_name, empty_init, seed)
    if joint:
        optimizer = muon_optimizer(model) if muon else make_optimizer(model.parameters(), sgd)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup(model)
        optimizer = fabric.setup_optimizers(muon_optimizer(model) if muon else make_optimizer(model.parameters(), sgd))
    if per_process:
        from torch.utils.data import DistributedSampler

        sampler = DistributedSampler(token_dataset(), num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=False)
        loader = DataLoader(token_dataset(), batch_size=micro_batch, sampler=sampler)
        return model, optimizer, fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    loader = fabric.setup_dataloaders(DataLoader(token_dataset(), batch_size=micro_batch, shuffle=False))
    return model, optimizer, loader


def fabric_job(
    model_name: str, strategy_kwargs: dict[str, Any], global_batch: int, *, steps: int = 4, accumulate: int = 2,
    empty_init: bool = True, save_at: Optional[int] = None, save_path: Optional[str] = None,
    resume: Optional[str] = None, resume_step: int = 0, seed: int = 0, planted_sampler_per_process: bool = False, joint_setup: bool = False,
    data_from_start: bool = False, planted_local_positions: bool = False, sgd: bool = False, muon: bool = False,
) -> dict[str, Any]:
    """Inside a worker: the loop under ``lightning_para.fabric.ParaStrategy``; losses and this rank's dp coordinate.

    Planted bugs: ``planted_sampler_per_process``, one sample stream per process instead of per dp rank
    (tensor-parallel ranks of one dp rank then compute on different samples); ``planted_local_positions``,
    LitGPT's cp adapter left out, so under cp each chunk's RoPE starts at position 0."""
    from lightning_para.fabric import ParaStrategy

    if planted_local_positions:
        from lightning_para.integrations.litgpt import context

        context._global_rope = lambda *args, **kwargs: None

    strategy = ParaStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    dims = strategy.parallel_dims
    pipeline = dims.pp > 1
    model, optimizer, loader = setup(
        fabric, model_name, global_batch // dims.dp, empty_init and not pipeline, seed, planted_sampler_per_process,
        joint=joint_setup, sgd=sgd, muon=muon,
    )
    first = 0
    if resume is not None:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(resume, state)
        first = state["step"]
        assert first == resume_step, (first, resume_step)
    losses = train(
        fabric, model, optimizer, loader, steps=steps, accumulate=accumulate,
        pipeline=pipeline, first_step=first, save_at=save_at, save_path=save_path, data_from_start=data_from_start,
    )
    result = {"losses": losses, "dp_rank": dims.local_rank("dp"), "dp": dims.dp, "rank": dist.get_rank()}
    if sgd:  # a float8 parity run: its parameters too (tests.parity.assert_float8_close)
        from tests.parity import full_parameters

        result["params"] = full_parameters(model.module)
    if pipeline:  # the forward-only loss of the first batch, on every rank
        inputs, targets = next(iter(loader))
        result["eval_loss"] = float(fabric.strategy.pipeline_eval_step(model, (inputs, targets)))
        try:  # no rank holds the whole model: a direct call says what to call instead
            model(inputs)
        except RuntimeError as error:
            result["direct_call"] = str(error)
    return result


def fabric_direct_call_job(strategy_kwargs: dict[str, Any]) -> None:
    """Inside a worker: the set-up model called directly (not through ``run_step``)."""
    from lightning_para.fabric import ParaStrategy

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs))
    fabric.launch()
    model = fabric.setup(build(fabric, "recipe", empty_init=True))
    inputs, _ = token_dataset(2)[:]
    model(inputs)


def fabric_reference(
    model_name: str, global_batch: int, *, steps: int = 4, accumulate: int = 2, fp8: bool = False, sgd: bool = False,
    muon: bool = False,
) -> Any:
    """In the pytest process: the same loop on one device with the global batch (``fp8``: torchao's float8).
    The per-micro-step losses; with ``sgd``, ``{"losses": ..., "params": ...}``."""
    assert "LOCAL_RANK" not in os.environ, "the reference must not run inside a worker"
    fabric = L.Fabric(accelerator="cpu", devices=1)
    L.seed_everything(0, verbose=False)
    model = build(None, model_name, empty_init=False)
    if fp8:
        model = to_float8_reference(model)
    from lightning_para.moe import set_aux_loss_grad_scale, update_expert_bias

    set_aux_loss_grad_scale(model, 1.0 / accumulate)  # MoE layers: their aux gradient scaled as the loss is
    model = fabric.setup(model)
    optimizer = muon_optimizer(model) if muon else make_optimizer(model.parameters(), sgd)
    optimizer.register_step_post_hook(lambda *_: update_expert_bias([model]))  # what ParaStrategy does (no-op without)
    optimizer = fabric.setup_optimizers(optimizer)
    loader = fabric.setup_dataloaders(DataLoader(token_dataset(), batch_size=global_batch, shuffle=False))
    losses = train(fabric, model, optimizer, loader, steps=steps, accumulate=accumulate, pipeline=False)
    if not sgd:
        return losses
    from tests.parity import full_parameters

    return {"losses": losses, "params": full_parameters(model.module)}


def mean_over_dp(results: list[dict[str, Any]]) -> list[float]:
    """The global batch's loss per micro-step: the mean of one rank per dp coordinate."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    per = list(by_dp.values())
    return [sum(values) / len(per) for values in zip(*per)]


def checkpoint_path(folder: Path, name: str) -> str:
    return str(folder / name)


# ----------------------------------------------------------------------------- the same run under the Trainer
def trainer_gpt(loss_fp32: bool = False) -> nn.Module:
    """The GPT recipe trained as the Fabric loop trains it: plain AdamW (lr 3e-3, decay 0.1 on every
    parameter, no schedule), the same sharp weights."""
    from lightning_para.recipes.gpt import GPT

    class _LoopGPT(GPT):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))

        def setup(self, stage: str) -> None:
            pass

    torch.manual_seed(0)
    model = _LoopGPT(
        vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, init_std=SHARP_STD, loss_fp32=loss_fp32
    )
    sharp_resets(model)
    torch.manual_seed(0)
    reset_like_materialisation(model)
    return model


def trainer_job(strategy_kwargs: dict[str, Any], global_batch: int, *, steps: int = 4, accumulate: int = 2,
                ckpt_dir: Optional[str] = None, loss_fp32: bool = False, init_in_half: bool = False,
                resume: Optional[str] = None) -> dict[str, Any]:
    """Inside a worker: the Fabric loop's training under the Trainer's ParaStrategy (accumulation 2, clipping at
    norm 1); per-micro-step losses, and with ``ckpt_dir`` a checkpoint at the end and the full parameters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_para import ParaStrategy
    from tests.parity import LossRecorder, ShardedData, full_parameters, trainer_kwargs

    strategy = ParaStrategy(**strategy_kwargs)
    if init_in_half:  # what `trainer.init_module()` does under bf16-true: weights made (and masters upcast) in bf16
        from lightning.fabric.plugins.precision.utils import _DtypeContextManager

        with _DtypeContextManager(torch.bfloat16):
            module = trainer_gpt(loss_fp32)
    else:
        module = trainer_gpt(loss_fp32)
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    overrides: dict[str, Any] = {}
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="last", save_top_k=1, every_n_train_steps=steps))
        overrides["enable_checkpointing"] = True
    trainer = L.Trainer(
        devices=dist.get_world_size(), strategy=strategy, max_steps=steps, callbacks=callbacks,
        use_distributed_sampler=False, accumulate_grad_batches=accumulate, gradient_clip_val=1.0,
        **trainer_kwargs(**overrides),
    )
    dp = strategy.config.resolve_dp(dist.get_world_size())
    trainer.fit(module, datamodule=ShardedData(token_dataset, global_batch // dp), ckpt_path=resume)
    params = full_parameters(module)
    return {"losses": recorder.losses, "dp_rank": strategy.parallel_dims.local_rank("dp"), "params": params}


def fabric_load_params_job(model_name: str, strategy_kwargs: dict[str, Any], path: str) -> dict[str, Any]:
    """Inside a worker: load a checkpoint (the Trainer's or Fabric's) into a Fabric model and optimizer of
    another layout; the full parameters after loading."""
    from lightning_para.fabric import ParaStrategy
    from tests.parity import full_parameters

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs))
    fabric.launch()
    model, optimizer, _ = setup(fabric, model_name, 4, empty_init=True, seed=99)
    state = {"model": model, "optimizer": optimizer}
    rest = fabric.load(path, state, strict=False)
    return {"params": full_parameters(model.module), "rest": sorted(rest)}


def fabric_reliability_job(part: str) -> dict[str, Any]:
    """Inside a worker (dp2, ZeRO-0: replicas step independently). ``"nan"``: a NaN loss on rank 1 stops every
    rank at that step's ``optimizer.step()`` with ``NonFiniteError`` (nothing stepped; the run is meant to end
    there). ``"flip"``: a weight flipped on rank 1 is reported by the scheduled integrity check
    (``integrity_check_every_n_steps=1``, warn mode) after the next step."""
    from lightning_para.fabric import ParaStrategy
    from lightning_para.reliability.step_guard import NonFiniteError

    strategy = ParaStrategy(dp=2, zero=0, integrity_check_every_n_steps=1, integrity_action="warn")
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    model, optimizer, loader = setup(fabric, "recipe", 4, empty_init=True)
    inputs, targets = next(iter(loader))
    result: dict[str, Any] = {}
    if part == "nan":  # the agreement is read a step late (reliability/step_guard.py): step 1's check raises
        for step in range(2):
            loss = loss_fn(model(inputs), targets)
            fabric.backward(loss * (float("nan") if fabric.global_rank == 1 and step == 0 else 1.0))
            try:
                optimizer.step()
            except NonFiniteError as error:
                result["error"], result["at"] = str(error), step
                break
            optimizer.zero_grad()
        return result
    with torch.no_grad():  # a replicated weight flipped on one replica (a silent data corruption)
        if fabric.global_rank == 1:
            model.module.blocks[0].attn.c_proj.weight.view(-1)[0] += 1.0
    fabric.backward(loss_fn(model(inputs), targets))
    optimizer.step()
    result["reports"] = list(strategy.core.run_guard.integrity.reports)
    return result


def fabric_idle_rank_job(timeout: float) -> dict[str, Any]:
    """Inside a worker (dp2, ``watchdog_timeout=timeout``): one rank spends 2x the timeout in the loop's own code
    twice, first while the other waits in ``fabric.barrier()``, then while the other is blocked in its next step's
    gradient all-reduce: neither is a hang. A second Fabric marked launched without ``launch()`` (as one of
    Lightning's tests does) sets up and steps. Returns the names of our threads before and after the teardown."""
    import threading
    import time

    from lightning_para.fabric import ParaStrategy

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("lightning-para") and t.is_alive()]

    def step(fabric: L.Fabric, model: nn.Module, optimizer: Any, batch: tuple) -> None:
        fabric.backward(loss_fn(model(batch[0]), batch[1]))
        optimizer.step()
        optimizer.zero_grad()

    strategy = ParaStrategy(dp=2, zero=0, watchdog_timeout=timeout)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    model, optimizer, loader = setup(fabric, "recipe", 4, empty_init=True)
    batch = next(iter(loader))
    for idle_rank in (1, 0):
        step(fabric, model, optimizer, batch)
        if fabric.global_rank == idle_rank:
            time.sleep(2 * timeout)  # evaluating, generating, writing files ...
        if idle_rank == 1:
            fabric.barrier()
    step(fabric, model, optimizer, batch)
    threads = {"during": [(t.name, t.daemon, callable(getattr(t, "stop", None))) for t in ours()]}
    second = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ParaStrategy(dp=2, zero=0))
    second._launched = True
    model2 = second.setup(build(second, "recipe", empty_init=False))
    optimizer2 = second.setup_optimizers(torch.optim.SGD(model2.parameters(), lr=0.1))
    step(second, model2, optimizer2, batch)
    strategy.teardown()
    second.strategy.teardown()
    threads["after"] = [t.name for t in ours()]
    return threads


def fabric_preemption_job(
    path: str, on_sigterm: str, *, steps: int, signal_after: Optional[int] = None, resume: bool = False
) -> dict[str, Any]:
    """Inside a worker (dp2, ZeRO-1): a loop that saves and stops when ``fabric.strategy.preempted`` turns true.
    ``signal_after``: rank 1 sends itself a real SIGTERM after that step's ``optimizer.step()``; ``resume``: load
    ``path`` first and continue the data where it stopped. Returns the losses, the step each rank stopped after
    (``None``: ran to the end) and, under ``on_sigterm="exit"``, the exit code the strategy raised."""
    import signal

    from lightning_para.fabric import ParaStrategy

    strategy = ParaStrategy(dp=2, zero=1, on_sigterm=on_sigterm)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    model, optimizer, loader = setup(fabric, "recipe", 4, empty_init=True)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(path, state)
    batches = iter(loader)
    for _ in range(state["step"]):
        next(batches)
    result: dict[str, Any] = {"losses": [], "stopped_after": None, "exit_code": None, "dp_rank": strategy.parallel_dims.local_rank("dp")}
    try:
        for step in range(state["step"], steps):
            inputs, targets = next(batches)
            loss = loss_fn(model(inputs), targets)
            fabric.backward(loss)
            result["losses"].append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step + 1
            if step == signal_after and fabric.global_rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if strategy.preempted:
                fabric.save(path, state)
                result["stopped_after"] = state["step"]
                break
    except SystemExit as stop:
        result["exit_code"], result["stopped_after"] = stop.code, state["step"]
    finally:
        strategy.teardown()  # restores the SIGTERM handler of this pool worker
    return result
