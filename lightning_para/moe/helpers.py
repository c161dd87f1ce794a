"""What a LightningModule (or a training loop) uses around MoE layers: the aux-loss value, the
aux-gradient scale, the selection-bias update, pausing statistics, and the Lightning callbacks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_para.moe.layer import MoE


def moe_layers(module: nn.Module) -> Iterator[tuple[str, MoE]]:
    """``(name, layer)`` for every :class:`MoE` inside ``module``."""
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            yield name, m


def aux_loss(module: nn.Module) -> Tensor:
    """The auxiliary losses of ``module``'s MoE layers in this step's forwards, as a value.

    Its gradient is **already applied**: every :class:`MoE` attaches ``d aux`` to its output's
    backward, so calling ``loss.backward()`` on the task loss trains the routers too (also
    inside pipeline stages, where no single loss sees every layer). Add this value to the loss
    you return so that logs and checkpoint monitors show the whole objective::

        loss = F.cross_entropy(logits, targets) + aux_loss(self)

    It is detached: adding it cannot count the gradient twice. Sums over layers; each layer
    contributes the mean over the forwards since the previous call (microbatches).
    """
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    total = torch.zeros((), device=device)
    for _, layer in moe_layers(module):
        value = layer.pop_aux_loss()
        if value is not None:
            total = total + value.to(device)
    return total


@contextlib.contextmanager
def moe_stats_paused(module: nn.Module) -> Iterator[None]:
    """Forwards inside do not count towards :func:`aux_loss`, the metrics and the selection biases' load (e.g. a
    pipeline's shape inference), in MoE layers and in the routers of LitGPT and transformers models alike."""
    layers = [layer for _, layer in moe_layers(module)]
    routers = [router for router in biased_routers(module) if not isinstance(router, MoE)]
    previous = [layer.set_recording(False) for layer in layers]
    counting = [router.counting_load for router in routers]
    for router in routers:
        router.counting_load = False
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer.set_recording(value)
        for router, value in zip(routers, counting):
            router.counting_load = value


@contextlib.contextmanager
def balanced_routing(*modules: nn.Module) -> Iterator[None]:
    """Inside, every MoE layer of ``modules`` (e.g. a rank's pipeline stages) routes with a fixed, perfectly balanced assignment.

    For the dry run (``lightning_para.simulate.rank``) only: on the meta device the router's top-k and
    expert parallelism's all-to-all split sizes would read tensor values, which meta tensors do not
    have. Here token ``t``'s ``j``-th choice is expert ``(t * top_k + j) mod E``
    (:func:`~lightning_para.moe.layer.balanced_assignment`), the gates are the router's probabilities
    of those experts, and the rows per expert are host integers: every expert gets ``T k / E`` rows
    (to one), which is the load the planner prices. The real dispatch and combine, with their
    collectives, then run on those sizes. Routing statistics are not recorded. Training never enters
    this: it is an explicit, per-layer switch, restored on exit.
    """
    # Every module with the switch: the MoE layers, and transformers' expert modules made expert-parallel
    # (`integrations.transformers.experts`), which carry the same one.
    layers: list[Any] = list({id(m): m for module in modules for m in module.modules()
                              if isinstance(getattr(m, "balanced_routing", None), bool)}.values())
    previous = [layer.balanced_routing for layer in layers]
    for layer in layers:
        layer.balanced_routing = True
    try:
        yield
    finally:
        for layer, value in zip(layers, previous):
            layer.balanced_routing = value


def aux_loss_grad_scale(*, loss_scale: float = 1.0, accumulate: int = 1, microbatches: int = 1) -> float:
    """``d(loss that backward starts from) / d(task loss)``: the one formula for the aux-gradient scale.

    Lightning's backward starts from ``loss / accumulate_grad_batches`` (automatic optimization),
    times the ``16-mixed`` loss scale; a pipeline schedule also divides by its ``microbatches``.
    ``ParaStrategy`` (pp=1, before backward), its pipeline runner (pp>1, before the schedule) and
    :class:`MoEAuxLossScale` all set the scale from this.
    """
    return loss_scale / (microbatches * accumulate)


def set_aux_loss_grad_scale(module: nn.Module, scale: float) -> None:
    """Set ``d(loss that backward starts from) / d(task loss)`` for the attached aux gradients
    (:func:`aux_loss_grad_scale`); the only writer of ``MoE.aux_loss_grad_scale``.

    ``ParaStrategy`` does this before each backward (loss scale of ``16-mixed`` divided by
    ``accumulate_grad_batches``). Call it yourself in a custom loop that scales its loss.
    """
    for _, layer in moe_layers(module):
        layer.aux_loss_grad_scale = float(scale)


def biased_routers(*modules: nn.Module) -> list[nn.Module]:
    """The modules inside ``modules`` that balance by a selection bias (:func:`~lightning_para.moe.routing.add_expert_bias`)."""
    return list({id(m): m for module in modules for m in module.modules() if getattr(m, "bias_update_rate", 0.0)}.values())


def keep_expert_biases_fp32(module: nn.Module) -> None:
    """Every selection bias in ``module`` back in float32 after a half-precision cast (``module.to(bf16)`` casts
    buffers too; torchtitan keeps its expert bias in fp32 as well): bf16 holds 8 significant bits, so from about
    0.25 on DeepSeek-V3's 0.001 steps are rounded to nothing or to a whole bf16 step."""
    for router in biased_routers(module):
        bias = getattr(router, router.bias_buffer)
        if bias.is_floating_point() and bias.dtype != torch.float32:
            setattr(router, router.bias_buffer, bias.float())


@torch.no_grad()
def update_expert_bias(modules: Sequence[nn.Module], groups: Sequence[Any] = ()) -> None:
    """After an optimizer step: ``expert_bias += rate * sign(mean load - load)`` in every biased router of
    ``modules`` (DeepSeek-V3's auxiliary-loss-free balancing), then the load counts restart.

    The load is the assignments per expert since the last update, summed over ``groups`` (the ranks that
    route different tokens: data parallel, with ep inside it, and cp) in one all-reduce for all layers, so
    every rank applies the same update. ``ParaStrategy`` calls this after each optimizer step.
    """
    routers = biased_routers(*modules)
    if not routers:
        return
    load = torch.cat([r.expert_load for r in routers])
    for group in groups:
        dist.all_reduce(load, group=group)
    for router, counts in zip(routers, load.float().split([r.expert_load.numel() for r in routers])):
        getattr(router, router.bias_buffer).add_(torch.sign(counts.mean() - counts), alpha=router.bias_update_rate)
        router.global_load = counts  # summed over the ranks already, for the profiler (no kernel of its own)
        router.expert_load.zero_()


class MoEBiasUpdate(Callback):
    """For strategies other than ``ParaStrategy`` (which does this itself): :func:`update_expert_bias` after each
    step of the first optimizer, with the loads summed over the default process group (if any)."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        groups = [dist.group.WORLD] if dist.is_initialized() else []
        self._hook = trainer.optimizers[0].register_step_post_hook(lambda *_: update_expert_bias([pl_module], groups))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._hook.remove()


class MoEAuxLossScale(Callback):
    """For strategies other than ``ParaStrategy`` (which does this itself): before each backward, set the
    MoE aux-gradient scale the way Lightning scales the loss (``/ accumulate_grad_batches``, times the
    ``16-mixed`` GradScaler's scale), so accumulation and fp16 train the routers correctly."""

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        loss_scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        accumulate = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        set_aux_loss_grad_scale(pl_module, aux_loss_grad_scale(loss_scale=loss_scale, accumulate=accumulate))


class MoEMetrics(Callback):
    """Logs each MoE layer's routing statistics through ``LightningModule.log`` after every training batch.

    Keys: ``moe/<layer>/balance_loss``, ``z_loss``, ``dropped_fraction``, ``load_imbalance`` and,
    with ``per_expert=True``, ``tokens_expert_<i>`` (assignments this rank routed to expert i).
    Values are this rank's; ``sync_dist=True`` averages them over all ranks (one all-reduce each).
    """

    def __init__(self, per_expert: bool = False, sync_dist: bool = False, prefix: str = "moe") -> None:
        self.per_expert, self.sync_dist, self.prefix = per_expert, sync_dist, prefix

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for name, layer in moe_layers(pl_module):
            stats = layer.pop_stats()
            if stats is None:
                continue
            key = f"{self.prefix}/{name}"
            values = {
                f"{key}/{s}": float(getattr(stats, s)) for s in ("balance_loss", "z_loss", "dropped_fraction", "load_imbalance")
            }
            if self.per_expert:
                values.update({f"{key}/tokens_expert_{i}": float(c) for i, c in enumerate(stats.tokens_per_expert)})
            pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=self.sync_dist, batch_size=1)


__all__ = ["moe_layers", "aux_loss", "aux_loss_grad_scale", "moe_stats_paused", "set_aux_loss_grad_scale", "MoEAuxLossScale",
           "MoEMetrics", "biased_routers", "update_expert_bias", "MoEBiasUpdate"]
