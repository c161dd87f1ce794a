"""Fabric: a pretrained transformers folder loaded sharded inside ``fabric.init_module(empty_init=True)``.

``HFCausalLM(pretrained=DIR)`` built under Fabric's meta context asks for its weights
(``pretrained_weights()``); ``fabric.setup`` parallelizes the model first and then each rank reads only its own
slices of the safetensors (the engine's path, the same as under the Trainer). A plain Fabric loop (AdamW, next-token
cross-entropy) then trains to the per-step losses of one device that loaded the folder with ``from_pretrained``
(FP32_RTOL), under ZeRO-3 and dp2 x tp2 ZeRO-3. The planted bug (every rank reads rank 0's slice) fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.distributed.test_pretrained_sharded import plant_first_slice_everywhere, write_llama  # noqa: E402
from tests.fabric_loop import mean_over_dp  # noqa: E402
from tests.hf_models import hf_tokens  # noqa: E402
from tests.parity import FP32_RTOL, assert_losses_close  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8


def _train(fabric: Any, module: Any, micro_batch: int) -> list[float]:
    from torch.utils.data import DataLoader

    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(hf_tokens(), batch_size=micro_batch, shuffle=False))
    losses = []
    for _, (input_ids, _) in zip(range(STEPS), loader):
        logits = module(input_ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def fabric_pretrained_job(folder: str, strategy_kwargs: dict[str, Any], planted: bool = False) -> dict[str, Any]:
    """In every worker: the model built on meta inside ``init_module``, loaded sharded by ``fabric.setup``."""
    import lightning as L

    from lightning_para.fabric import ParaStrategy
    from lightning_para.recipes import HFCausalLM

    if planted:
        plant_first_slice_everywhere()
    strategy = ParaStrategy(**strategy_kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        module = HFCausalLM(pretrained=folder)
    assert all(p.is_meta for p in module.parameters())  # nothing read yet: the sharded path, not from_pretrained
    module = fabric.setup(module)
    dims = strategy.parallel_dims
    return {"losses": _train(fabric, module, GLOBAL_BATCH // dims.dp), "dp_rank": dims.local_rank("dp")}


def reference(folder: Path) -> list[float]:
    """One device, ``from_pretrained`` (eager), the same loop on the global batch."""
    import lightning as L

    from lightning_para.recipes import HFCausalLM

    fabric = L.Fabric(accelerator="cpu", devices=1)
    module = fabric.setup(HFCausalLM(pretrained=str(folder)))
    return _train(fabric, module, GLOBAL_BATCH)


@pytest.mark.parametrize(
    "world,layout", [(2, {"zero": 3}), (4, {"dp": 2, "tp": 2, "zero": 3})], ids=["dp2-zero3", "dp2-tp2-zero3"]
)
def test_fabric_loads_pretrained_sharded_inside_init_module(pools, tmp_path, world, layout):
    folder = write_llama(tmp_path / "llama")
    results = pools.get(world).run(fabric_pretrained_job, str(folder), layout)
    assert_losses_close(mean_over_dp(results), reference(folder), rtol=FP32_RTOL)


def test_planted_bug_reading_rank0s_slice_everywhere_fails_fabric_parity(pools, tmp_path):
    folder = write_llama(tmp_path / "llama")
    results = pools.get(2).run(fabric_pretrained_job, str(folder), {"zero": 3}, planted=True)
    with pytest.raises(AssertionError):
        assert_losses_close(mean_over_dp(results), reference(folder), rtol=FP32_RTOL)
