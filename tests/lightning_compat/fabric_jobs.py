"""Jobs for ``test_fabric_strategies.py``: Lightning's Fabric strategy tests (2.6.x,
``tests/tests_fabric/strategies/test_model_parallel_integration.py`` and ``test_fsdp_integration.py``)
adapted to CPU and gloo, run against ``lightning_para.fabric.ParaStrategy``.

The adaptation, once for all of them: Lightning's strategies take a ``parallelize_fn`` (the user
applies TP/FSDP2 by hand); ParaStrategy applies the same layout from its degrees, so
``ModelParallelStrategy(_parallelize_feed_forward_fsdp2_tp, data_parallel_size=2, tensor_parallel_size=2)``
becomes ``ParaStrategy(dp=2, tp=2, zero=3, tp_plan=FEED_FORWARD_PLAN)`` and ``FSDPStrategy()`` becomes
``ParaStrategy(zero=3)``. ``accelerator="cuda"`` becomes ``"cpu"``. Each other difference is named
where it occurs (and in ``docs/fabric.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_para.checkpoint.run import RUN_KEY
from tests.lightning_compat.common import FeedForward

# Lightning's `_parallelize_feed_forward_tp`: w1, w2 column-wise, w3 row-wise.
FEED_FORWARD_PLAN = {"w1": "colwise", "w2": "colwise", "w3": "rowwise"}
TP_FSDP = {"dp": 2, "tp": 2, "zero": 3, "tp_plan": FEED_FORWARD_PLAN}  # _parallelize_feed_forward_fsdp2_tp
FSDP = {"dp": 2, "zero": 3}  # _parallelize_feed_forward_fsdp2 / FSDPStrategy


def _fabric(strategy_kwargs: dict[str, Any], **fabric_kwargs: Any) -> L.Fabric:
    from lightning_para.fabric import ParaStrategy

    # With the default watchdog: Fabric never tears its strategy down, and the time between these jobs is the
    # loop's own code (never a stall); the next job's strategy stops this one's watchdog.
    strategy = ParaStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, **fabric_kwargs)
    fabric.launch()
    return fabric


def _random_dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.randn(size, 32, generator=torch.Generator().manual_seed(0)))


def _train(fabric: L.Fabric, model: Any = None, optimizer: Any = None) -> tuple:
    """Lightning's `_train`: one step of AdamW on `output.sum()`."""
    fabric.seed_everything(0)
    if model is None:
        with fabric.init_module(empty_init=True):
            model = FeedForward()
        model = fabric.setup(model)
    if optimizer is None:
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    output = model(torch.rand(2, 32, device=fabric.device))
    fabric.backward(output.sum())
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _full(model: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for p in model.parameters()]


class OneBlock(torch.nn.Module):
    """The FeedForward as the one block of a ModuleList: what ``compile=True`` compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([FeedForward()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# ----------------------------------------------------------------------------- test_setup_device_mesh
def setup_device_mesh_job() -> dict[str, Any]:
    """The mesh has Lightning's dim names as aliases ("data_parallel", "tensor_parallel") beside
    lightning-para's own; Lightning's mesh is 2-D, ours holds every dimension (design difference)."""
    from torch.distributed.device_mesh import DeviceMesh

    out = {}
    world = dist.get_world_size()
    for dp, tp in ((1, world), (world, 1), (2, world // 2)):
        fabric = _fabric({"dp": dp, "tp": tp})
        mesh = fabric.strategy.device_mesh
        assert isinstance(mesh, DeviceMesh) and mesh.device_type == fabric.device.type
        out[(dp, tp)] = (mesh["data_parallel"].size(), mesh["tensor_parallel"].size())
        fabric.barrier()
    return out


# ----------------------------------------------------------------------------- test_tensor_parallel / fsdp2_tp
def tensor_parallel_job(strategy_kwargs: dict[str, Any], compile: bool) -> dict[str, Any]:
    """With ``compile``: ParaStrategy compiles each block of a ModuleList/Sequential after TP (not the user's
    ``torch.compile(model)`` around it), so the FeedForward is the one block of a ModuleList (:class:`OneBlock`)."""
    from torch.distributed.tensor import DTensor

    kwargs = dict(strategy_kwargs, compile={"backend": "eager"} if compile else False)
    if compile:
        kwargs["tp_plan"] = {f"blocks.0.{name}": style for name, style in kwargs["tp_plan"].items()}
    fabric = _fabric(kwargs)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = OneBlock() if compile else FeedForward()
    model = fabric.setup(model)
    block = model.blocks[0] if compile else model
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    mesh = fabric.strategy.device_mesh
    tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
    assert all(isinstance(w, DTensor) for w in model.parameters())
    assert all(isinstance(t, DTensor) for t in optimizer.param_groups[0]["params"])
    assert all(w.device.type != "meta" for w in model.parameters())
    dataset_size = 8
    dataloader = fabric.setup_dataloaders(DataLoader(_random_dataset(dataset_size), batch_size=2))
    # No data sharding across the TP dimension, sharding across the data-parallel dimension only
    assert len(dataloader) == dataset_size // dataloader.batch_size // dp_mesh.size()
    assert isinstance(dataloader.sampler, DistributedSampler)
    for (batch,) in dataloader:
        batches = fabric.all_gather(batch)  # (world, ...) in rank order
        tp_ranks, dp_ranks = tp_mesh.mesh.tolist(), dp_mesh.mesh.tolist()
        assert all(torch.equal(batches[tp_ranks[0]], batches[r]) for r in tp_ranks[1:])
        assert all(not torch.equal(batches[dp_ranks[0]], batches[r]) for r in dp_ranks[1:])
        output = model(batch)
        fabric.backward(output.sum())
        assert isinstance(block.w1.weight.grad, DTensor)
        optimizer.step()
        optimizer.zero_grad()
    return {"w1_mesh_shape": tuple(block.w1.weight.device_mesh.shape), "compiled": len(fabric.strategy.parallel_model.compiled)}


# ----------------------------------------------------------------------------- test_train_save_load
def train_save_load_job(tmp: str, strategy_kwargs: dict[str, Any], precision: str = "32-true") -> dict[str, Any]:
    import pytest

    fabric = _fabric(strategy_kwargs, precision=precision)
    model, optimizer = _train(fabric)
    checkpoint_path = fabric.broadcast(str(Path(tmp) / "dist-checkpoint"))
    params_before = _full(model)
    state = {"model": model, "optimizer": optimizer, "steps": 1}
    fabric.save(checkpoint_path, state)
    files = set(os.listdir(checkpoint_path))

    # re-init all objects and resume
    fabric = _fabric(strategy_kwargs, precision=precision)
    model, optimizer = _train(fabric)
    state = {"model": model, "optimizer": optimizer, "steps": 0}
    metadata = fabric.load(checkpoint_path, state)
    for p0, p1 in zip(params_before, _full(model)):
        torch.testing.assert_close(p0, p1, atol=0, rtol=0, equal_nan=True)
    assert state["steps"] == 1
    assert not metadata

    state = {"model": model, "coconut": 11}
    with pytest.raises(KeyError, match="The requested state contains a key 'coconut' that does not exist"):
        fabric.load(checkpoint_path, state)
    state = {"model": model, "coconut": 11}
    fabric.load(checkpoint_path, state, strict=False)
    assert state["coconut"] == 11
    return {"files": files}


# ----------------------------------------------------------------------------- test_save_full_state_dict
def save_full_state_dict_job(tmp: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fabric = _fabric(dict(FSDP, save_distributed_checkpoint=False))
    model, optimizer = _train(fabric)
    checkpoint_path = Path(fabric.broadcast(str(Path(tmp) / "fsdp-checkpoint.pt")))
    fabric.save(checkpoint_path, {"model": model, "optimizer": optimizer, "steps": 1})

    checkpoint = torch.load(checkpoint_path, weights_only=True)
    assert checkpoint["steps"] == 1
    loaded_state_dict = checkpoint["model"]
    state_dict = model.state_dict()
    assert set(loaded_state_dict.keys()) == set(state_dict.keys())
    for name in state_dict:
        assert torch.equal(loaded_state_dict[name], state_dict[name].full_tensor().cpu())
    params_before = _full(model)
    optimizer_state_before = get_optimizer_state_dict(model, optimizer)
    assert set(checkpoint["optimizer"].keys()) == set(optimizer_state_before.keys()) == {"state", "param_groups"}

    # 1. the full file loads back into the sharded layout
    fabric = _fabric(FSDP)
    model, optimizer = _train(fabric)
    metadata = fabric.load(checkpoint_path, {"model": model, "optimizer": optimizer})
    assert metadata == {"steps": 1}
    assert all(torch.equal(p0, p1) for p0, p1 in zip(params_before, _full(model)))
    optimizer_state_after = get_optimizer_state_dict(model, optimizer)
    optimizer_state_after["param_groups"][0]["betas"] = tuple(optimizer_state_after["param_groups"][0]["betas"])
    torch.testing.assert_close(optimizer_state_after["state"], optimizer_state_before["state"], atol=0, rtol=0)
    assert optimizer_state_after["param_groups"] == optimizer_state_before["param_groups"]
    _train(fabric, model, optimizer)

    # 2. a single-device Fabric loads it (Fabric's own single-file layout); its plain save loads back sharded (3.)
    single = L.Fabric(accelerator="cpu", devices=1)
    single_model, single_optimizer = _train_single(single)
    metadata = single.load(checkpoint_path, {"model": single_model, "optimizer": single_optimizer})
    # Every checkpoint records the run that wrote it (issue 37); a plain Fabric returns that record as metadata.
    assert metadata.pop(RUN_KEY)["run"] and metadata == {"steps": 1}
    assert all(torch.equal(p0, p1) for p0, p1 in zip(params_before, single_model.parameters()))
    normal_checkpoint_path = Path(fabric.broadcast(str(Path(tmp) / "normal-checkpoint.pt")))
    if fabric.global_rank == 0:
        single.save(normal_checkpoint_path, {"model": single_model, "optimizer": single_optimizer, "steps": 2})
    fabric.barrier()
    saved = torch.load(normal_checkpoint_path, weights_only=True)["optimizer"]
    assert torch.equal(
        saved["state"][0]["exp_avg"], optimizer_state_before["state"]["_forward_module.w1.weight"]["exp_avg"].full_tensor().cpu()
    )

    # 3. the single-device checkpoint loads into the sharded layout
    fabric = _fabric(FSDP)
    model, optimizer = _train(fabric)
    metadata = fabric.load(normal_checkpoint_path, {"model": model, "optimizer": optimizer})
    assert metadata == {"steps": 2}
    assert all(torch.equal(p0, p1) for p0, p1 in zip(params_before, _full(model)))
    optimizer_state_after = get_optimizer_state_dict(model, optimizer)
    optimizer_state_after["param_groups"][0]["betas"] = tuple(optimizer_state_after["param_groups"][0]["betas"])
    torch.testing.assert_close(optimizer_state_after["state"], optimizer_state_before["state"], atol=0, rtol=0)
    _train(fabric, model, optimizer)
    return {"ok": True}


def _train_single(fabric: L.Fabric) -> tuple:
    """`_train` on a single-device Fabric (in a worker, whose process group it must not use)."""
    fabric.seed_everything(0)
    model = fabric.setup(FeedForward())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    model(torch.rand(2, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


# ----------------------------------------------------------------------------- test_load_full_state_dict_into_sharded_model
def load_full_into_sharded_job(tmp: str) -> dict[str, Any]:
    checkpoint_path = Path(tmp) / "full-checkpoint.pt"
    single = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = _train_single(single)
    if dist.get_rank() == 0:
        single.save(checkpoint_path, {"model": model, "optimizer": optimizer, "steps": 1})
    dist.barrier()
    params_before = torch.cat([p.detach().view(-1) for p in model.parameters()])

    fabric = _fabric(FSDP)
    model, optimizer = _train(fabric)
    state = {"model": model, "optimizer": optimizer, "steps": 44}
    fabric.load(checkpoint_path, state)
    assert state["steps"] == 1
    assert torch.equal(params_before, torch.cat([p.view(-1) for p in _full(model)]))

    raw_checkpoint_path = checkpoint_path.with_name("model-state-dict")
    if fabric.global_rank == 0:
        torch.save(torch.load(checkpoint_path, weights_only=True)["model"], raw_checkpoint_path)
    fabric.barrier()
    _train(fabric, model, optimizer)
    fabric.load_raw(raw_checkpoint_path, model)
    assert torch.equal(params_before, torch.cat([p.view(-1) for p in _full(model)]))
    return {"ok": True}


# ----------------------------------------------------------------------------- test_module_init_context
def module_init_context_job(precision: str) -> dict[str, Any]:
    """Lightning asserts the parameters' dtype after setup; ParaStrategy keeps fp32 masters as FSDP2's
    shards under ``*-true`` (the ZeRO paper's layout) unless ``ParaPrecision(master_weights=False)``."""
    fabric = _fabric(FSDP, precision=precision)
    result = {}
    for empty_init in (False, True):
        with fabric.init_module(empty_init=empty_init):
            model = FeedForward()
        before = {(p.device.type, p.dtype) for p in model.parameters()}
        model = fabric.setup(model)
        after = {(p.device.type, p.dtype) for p in model.parameters()}
        result[empty_init] = (before, after)
    return result


# ----------------------------------------------------------------------------- test_save_filter
def save_filter_job(tmp: str) -> dict[str, Any]:
    import pytest

    fabric = _fabric(dict(FSDP, save_distributed_checkpoint=False))
    model = fabric.setup_module(FeedForward())
    tmp_path = Path(fabric.broadcast(tmp))
    state = {"model": model}
    keep_bias = {"model": lambda k, v: "bias" in k}
    fabric.save(tmp_path / "full.pth", state, filter=keep_bias)
    checkpoint = torch.load(tmp_path / "full.pth", weights_only=True)["model"]
    keys = set(checkpoint)
    assert type(checkpoint["w1.bias"]) is torch.Tensor
    fabric.strategy.save_distributed_checkpoint = True  # Lightning flips `_save_distributed_checkpoint`
    with pytest.raises(NotImplementedError, match="cannot load filtered sharded checkpoints"):
        fabric.save(tmp_path / "distributed", state, filter=keep_bias)
    return {"keys": keys}


# ----------------------------------------------------------------------------- test_clip_gradients
def clip_gradients_job(clip_type: str, precision: str) -> dict[str, Any]:
    """A single Linear, column-wise over tp and sharded over dp (Lightning's `_parallelize_single_linear_tp_fsdp2`
    on 2 devices: dp=1 x tp=2 there); every gradient entry is equal, so clipping is checked exactly.
    Lightning skips the norm case ("not correct"); ParaStrategy clips to the global norm, so it runs here."""
    fabric = _fabric({"tp": 2, "zero": 3, "tp_plan": {"0": "colwise"}}, precision=precision)
    in_features, out_features = 32, 2
    # A plan names submodules: the Linear is the one entry of an nn.Sequential (Lightning plans the root itself).
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False))
    model[0].weight.data.fill_(0.01)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    loss = model(torch.full((1, in_features), 0.1, device=fabric.device)).sum()
    fabric.backward(loss)
    linear = model.module[0]
    grad = lambda: linear.weight.grad.full_tensor().detach().cpu().float()  # noqa: E731
    if clip_type == "norm":
        norm = torch.linalg.vector_norm(grad(), 2).item()
        new_norm = norm / 10
        returned = fabric.clip_gradients(model, optimizer, max_norm=new_norm)
        torch.testing.assert_close(returned.float().cpu(), torch.tensor(norm), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.linalg.vector_norm(grad(), 2), torch.tensor(new_norm), rtol=1e-4, atol=0)
    else:
        new_val = grad()[0, 0].item() / 2.0
        fabric.clip_gradients(model, optimizer, clip_val=new_val)
        assert torch.allclose(grad(), torch.full_like(grad(), new_val))
    optimizer.step()
    optimizer.zero_grad()
    return {"ok": True}


# ----------------------------------------------------------------------------- test_save_sharded_and_consolidate_and_load
def save_sharded_consolidate_load_job(tmp: str) -> dict[str, Any]:
    """Consolidated with lightning-para's own `consolidate_checkpoint` (the Trainer's tool; Lightning's
    `_load_distributed_checkpoint` reads the same DCP folder)."""
    from lightning_para.checkpoint import consolidate_checkpoint

    fabric = _fabric(TP_FSDP)
    model = fabric.setup(FeedForward())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "steps": 1}
    fabric.backward(model(torch.rand(1, 32, device=fabric.device)).sum())
    optimizer.step()
    sharded = fabric.broadcast(str(Path(tmp) / "checkpoint_sharded"))
    fabric.save(sharded, state)
    params_before = _full(model)
    full = fabric.broadcast(str(Path(tmp) / "checkpoint_full.pt"))
    if fabric.global_rank == 0:
        consolidate_checkpoint(sharded, full)
    fabric.barrier()

    fabric = _fabric(TP_FSDP)
    model = fabric.setup(FeedForward())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "steps": 0}
    fabric.load(full, state)
    assert state["steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(params_before, _full(model)))
    return {"files": set(os.listdir(sharded))}


# ----------------------------------------------------------------------------- test_setup_module_move_to_device
def setup_module_move_to_device_job(move_to_device: bool) -> dict[str, Any]:
    """test_setup_module_move_to_device (fsdp): ``move_to_device`` changes nothing; ZeRO-3 shards the Linear's
    100 weights 50 per rank, a DTensor ``Parameter`` on this rank's device."""
    from torch.distributed.tensor import DTensor

    fabric = _fabric(FSDP)
    fabric_model = fabric.setup_module(torch.nn.Linear(10, 10, bias=False), move_to_device=move_to_device)
    param = next(fabric_model.parameters())
    assert len(list(fabric_model.parameters())) == 1
    assert isinstance(param, torch.nn.Parameter) and isinstance(param, DTensor)
    assert param.device == fabric.device and fabric_model.device == fabric.device
    return {"local_numel": param.to_local().numel()}


# ----------------------------------------------------------------------------- test_setup_with_orig_params_and_multiple_param_groups
def multiple_param_groups_job(zero: int) -> dict[str, Any]:
    """Joint setup with two param groups (lr 1e-2 and 1e-6): the groups survive, pointing at the parallel
    parameters (FSDP2 DTensors under ZeRO-3; ZeRO-1 puts its fp32 shards in, as ``optimizer.param_groups``)."""
    fabric = _fabric({"dp": 2, "zero": zero})
    model = torch.nn.Sequential(torch.nn.Linear(10, 10, bias=False), torch.nn.Linear(10, 2, bias=False))
    optimizer = torch.optim.Adam([
        {"params": model[0].parameters(), "lr": 1e-2},
        {"params": model[1].parameters(), "lr": 1e-6},
    ])
    wrapped_model, wrapped_optimizer = fabric.setup(model, optimizer)
    assert len(wrapped_optimizer.param_groups) == 2
    assert [g["lr"] for g in wrapped_optimizer.param_groups] == [1e-2, 1e-6]
    before = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in wrapped_model.parameters()]
    fabric.backward(wrapped_model(torch.randn(4, 10)).sum())
    wrapped_optimizer.step()
    after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in wrapped_model.parameters()]
    moved = [float((a - b).abs().max()) for a, b in zip(after, before)]
    return {"moved": moved, "dtensor": zero == 3 and all(hasattr(p, "full_tensor") for p in wrapped_model.parameters())}


# ----------------------------------------------------------------------------- test_reapply_compile
def reapply_compile_job() -> dict[str, Any]:
    """test_reapply_compile: Fabric unwraps a ``torch.compile``d model, the strategy parallelizes the original,
    Fabric compiles it again over the parallel model; forward and backward run."""
    from torch._dynamo import OptimizedModule

    fabric = _fabric(FSDP)
    model = FeedForward()
    compiled = torch.compile(model, backend="eager")
    fabric_model = fabric.setup(compiled, _reapply_compile=True)
    assert isinstance(fabric_model._forward_module, OptimizedModule)
    assert fabric_model._forward_module._orig_mod is model and fabric_model._original_module is model
    for _ in range(3):
        fabric.backward(fabric_model(torch.randn(2, 32, device=fabric.device)).sum())
    return {"ok": True}


# ----------------------------------------------------------------------------- test_load_raw_module_state
def load_raw_module_state_job(tmp: str) -> dict[str, Any]:
    """test_load_raw_module_state, through ``fabric.load_raw`` (Lightning tests its private ``_load_raw_module_state``):
    a plain state dict, with a parameter, a tp-sharded layer, a plain layer and a persistent buffer, loads into
    the tensor-parallel model; a missing key raises under ``strict=True`` and is skipped under ``strict=False``."""
    import pytest

    class CustomModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parameter = torch.nn.Parameter(torch.rand(2, 2))
            self.layer1 = torch.nn.Linear(4, 4)
            self.layer2 = torch.nn.Linear(4, 4)
            self.register_buffer("persistent_buffer", torch.rand(2), persistent=True)
            self.register_buffer("non_persistent_buffer", torch.rand(2), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer2(self.layer1(x)) + self.parameter.sum()

    torch.manual_seed(0)
    state_dict = {k: v.clone() for k, v in CustomModel().state_dict().items()}
    path = Path(tmp) / "raw.pt"
    if dist.get_rank() == 0:
        torch.save(state_dict, path)
    dist.barrier()
    fabric = _fabric({"tp": 2, "tp_plan": {"layer1": "colwise"}, "tp_unplanned": "replicate"})
    model = fabric.setup(CustomModel())
    fabric.load_raw(path, model)
    inner = model.module
    assert torch.equal(inner.parameter.full_tensor() if hasattr(inner.parameter, "full_tensor") else inner.parameter, state_dict["parameter"])
    assert torch.equal(inner.layer1.weight.full_tensor(), state_dict["layer1.weight"])
    assert torch.equal(inner.persistent_buffer, state_dict["persistent_buffer"])
    state_dict.pop("parameter")
    if dist.get_rank() == 0:
        torch.save(state_dict, path)
    dist.barrier()
    with pytest.raises(Exception, match="parameter"):
        fabric.load_raw(path, model, strict=True)
    fabric.load_raw(path, model, strict=False)
    return {"ok": True}


# ----------------------------------------------------------------------------- collectives
def collectives_job() -> dict[str, Any]:
    """``fabric.all_reduce`` / ``all_gather`` / ``broadcast`` / ``barrier`` over the world, as Lightning's strategies."""
    fabric = _fabric({"tp": 2})
    rank = fabric.global_rank
    value = torch.tensor([float(rank + 1)])
    fabric.barrier()
    return {
        "mean": fabric.all_reduce(value.clone()).item(),
        "sum": fabric.all_reduce(value.clone(), reduce_op="sum").item(),
        "gathered": fabric.all_gather(value.clone()).flatten().tolist(),
        "broadcast": fabric.broadcast({"from": rank}, src=1),
    }
