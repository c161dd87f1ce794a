"""The per-step hot path reads no value the step itself computed (no device-to-host sync), as Lightning's loop.

On a GPU, ``.item()``, ``.tolist()``, ``.cpu()`` (and ``bool()``/``float()`` of a tensor) on a tensor the current
step produced block the host until the device has run the step so far. On CPU there is no device to wait for, so
the test counts what would be one: a read (``aten::_local_scalar_dense``, a copy to another device, ``tolist``)
of a tensor whose storage an operator of the *current* training step created. The step guard's agreement is read
one step late (``reliability/step_guard.py``): it reads the previous step's flags, which is no such read.
Counted over several steps of a real ``Trainer.fit`` (warm-up steps left out), against Lightning's own loop on the
same model, with and without clipping, under the Trainer and under Fabric; and the old synchronous read, planted
back, is counted (so the counter sees what it must).
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_para import ParaStrategy
from lightning_para.reliability.step_guard import StepGuard

STEPS, WARM_UP = 6, 2


class _Created(TorchDispatchMode):
    """Storages created by the operators of the current step; reads of them (``_local_scalar_dense``, copies to
    another device)."""

    def __init__(self, counter: "SameStepReads") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.counter.read(args[0], "item")
        elif name in ("_to_copy", "copy_") and args:
            source = args[1] if name == "copy_" else args[0]
            target = kwargs.get("device") if name == "_to_copy" else args[0].device
            if isinstance(source, torch.Tensor) and target is not None and torch.device(target) != source.device:
                self.counter.read(source, "copy to another device")
        out = func(*args, **kwargs)
        # New storages only: an in-place update (AdamW's step count) or a view writes into an older tensor.
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.counter.created.add(ptr)
        return out


class _Reads(TorchFunctionMode):
    """``tolist`` does not reach the dispatcher: caught at the Python level."""

    def __init__(self, counter: "SameStepReads") -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.Tensor.tolist and isinstance(args[0], torch.Tensor):
            self.counter.read(args[0], "tolist")
        return func(*args, **(kwargs or {}))


class SameStepReads(L.Callback):
    """Counts, per training step after the warm-up, the host reads of tensors that step created."""

    def __init__(self) -> None:
        self.created: set[int] = set()
        self.step = 0
        self.reads: list[tuple[int, str]] = []
        self.modes = (_Reads(self), _Created(self))

    def read(self, tensor: torch.Tensor, how: str) -> None:
        if self.step > WARM_UP and tensor.untyped_storage().data_ptr() in self.created:
            self.reads.append((self.step, how))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.step += 1
        self.created = set()

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        # After the loop (before the strategy's own on_train_end, which settles the last step's check): not per step.
        self.steps_run, self.step = self.step, 0


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)


def _reads(strategy, *, clip: bool = False) -> list[tuple[int, str]]:  # noqa: ANN001
    counter = SameStepReads()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[counter],
        gradient_clip_val=1.0 if clip else None,
    )
    try:
        with counter.modes[0], counter.modes[1]:
            trainer.fit(Tiny())
    finally:
        if dist.is_initialized():  # ParaStrategy's one-process group: the next test starts its own
            dist.destroy_process_group()
    assert counter.steps_run == STEPS
    return counter.reads


def _fabric_reads(strategy, *, clip: bool = False) -> list[tuple[int, str]]:  # noqa: ANN001
    """The same count over a Fabric loop: forward, ``fabric.backward``, (clipping), ``optimizer.step``."""
    from lightning.fabric import Fabric

    counter = SameStepReads()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    module = Tiny()
    model, optimizer = fabric.setup(module.net, module.configure_optimizers())
    loader = fabric.setup_dataloaders(module.train_dataloader())
    try:
        with counter.modes[0], counter.modes[1]:
            for step, (x, y) in zip(range(STEPS), loader):
                counter.on_train_batch_start(None, None, None, step)
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                if clip:
                    fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert counter.step == STEPS
    return counter.reads


def _front_end(name: str):  # noqa: ANN202
    """``(count the reads of a short run, ParaStrategy)`` of the Trainer or of Fabric."""
    if name == "trainer":
        return _reads, ParaStrategy
    from lightning_para.fabric import ParaStrategy as FabricParaStrategy

    return _fabric_reads, FabricParaStrategy


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_the_step_guard_adds_no_same_step_read_to_lightnings_loop(front_end, clip):
    """The same step guard (finite check, preemption flag) under both front ends; clipping too: ParaPrecision
    clips by the global norm without reading it on the host."""
    count, para_strategy = _front_end(front_end)
    lightning = count("auto", clip=clip)
    para = count(para_strategy(), clip=clip)
    assert lightning == [] and para == [], (para, lightning)


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_the_counter_sees_a_synchronous_read(monkeypatch, front_end):
    """The planted bug: the step guard reading its own step's flags (the old ``flags.tolist()``) is counted."""
    count, para_strategy = _front_end(front_end)
    original = StepGuard.check

    def synchronous(self, step, params=None):  # noqa: ANN001
        original(self, step, params)
        self.settle()

    monkeypatch.setattr(StepGuard, "check", synchronous)
    reads = count(para_strategy())
    assert len(reads) >= STEPS - WARM_UP and {how for _, how in reads} == {"tolist"}, reads


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_the_spike_guard_reads_nothing_to_clip_and_once_per_step_to_skip_without_found_inf(front_end):
    """Clip mode scales the gradients on the device; skip mode with an optimizer that takes no ``found_inf`` (AdamW
    without ``fused=True``) reads the decision on the host once per step: its documented cost."""
    count, para_strategy = _front_end(front_end)
    assert count(para_strategy(spike_guard="clip"), clip=True) == []
    reads = count(para_strategy(spike_guard="skip"))
    assert len(reads) >= STEPS - WARM_UP and {how for _, how in reads} == {"item"}, reads
