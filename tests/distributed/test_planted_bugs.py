"""Planted bugs: the parity checks fail when the parallel code is wrong (issue 24).

Each test trains a sharp parity model (tests/sharpness.py) twice under one layout, in the same
two gloo workers: once as it is, once with one bug planted in the real code inside every rank
(a method of the library replaced for the duration of the job), and compares both with one
device on the same global batch (``tests/parity.py``, 1e-5 relative per step). The clean run
must match and the planted run must not, by well over the tolerance (:data:`CAUGHT_BY`).

The bugs: positions shifted by one under context parallel and under sequence parallel, a
gradient reduction over dp skipped for one bucket, two shards of a column-parallel weight
swapped, microbatches paired with the wrong labels, one expert's tokens dropped, and the
pipeline's loss summed instead of averaged over microbatches. docs/planner.md ("What makes a
parity check able to fail") lists them with the step-0 differences at init 0.02 and 0.3.

Nothing mocks a collective: a planted bug changes what the library computes or which
collective it issues, never what a collective returns.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from tests.parity import FP32_RTOL, assert_losses_close, fit_job, fit_reference
from tests.sharpness import SHARP_STD

STEPS = 3
# A planted bug must move some step's loss by at least this much (10x the parity tolerance), so that
# "caught" does not depend on rounding. The smallest measured at init 0.3 is 6.7e-4 (an expert's
# tokens dropped); the clean runs stay within 6e-7.
CAUGHT_BY = 10 * FP32_RTOL


# ----------------------------------------------------------------------------- the planted bugs
@contextlib.contextmanager
def _replaced(owner: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` inside the block (restored even on error)."""
    had_own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def cp_positions_shifted() -> contextlib.AbstractContextManager:
    """Context parallel: every cp rank but the first numbers its tokens one too high (RoPE, learned
    positions and HF ``position_ids`` all read ``ContextParallelShard.position_ids``)."""
    from lightning_para.parallel.context import ContextParallelShard

    def make(original):
        def position_ids(self, seq_len, *, batch_size=None, device=None):
            return original(self, seq_len, batch_size=batch_size, device=device) + int(self.cp_rank > 0)

        return position_ids

    return _replaced(ContextParallelShard, "position_ids", make)


def sp_positions_shifted() -> contextlib.AbstractContextManager:
    """Sequence parallel: each tp rank's slice of the learned position embeddings starts one row late."""
    from lightning_para.parallel.tensor.sequence import SequenceSlice

    def make(original):
        def _slice(self, mesh, module, args, out):
            return original(self, mesh, module, args, out.roll(-1, dims=out.dim() - 2))

        return _slice

    return _replaced(SequenceSlice, "_slice", make)


def dp_reduction_skipped() -> contextlib.AbstractContextManager:
    """Data parallel (ZeRO-0): the first gradient bucket is treated as if its dp group had one rank,
    so its gradients are never all-reduced (each rank steps on its own half of the batch)."""
    from lightning_para.parallel.data.zero import ZeroDataParallel

    def make(original):
        def _launch(self, bucket):
            if bucket is not self.buckets[0]:
                return original(self, bucket)
            worlds = [slot.world for slot in bucket.slots]
            for slot in bucket.slots:
                slot.world = 1
            try:
                return original(self, bucket)
            finally:
                for slot, world in zip(bucket.slots, worlds):
                    slot.world = world

        return _launch

    return _replaced(ZeroDataParallel, "_launch", make)


def tp_shards_swapped() -> contextlib.AbstractContextManager:
    """Tensor parallel: a column-parallel weight marked ``_planted_swap`` gets the next tp rank's rows."""
    from lightning_para.parallel.tensor.styles import Colwise

    def make(original):
        def _partition_linear_fn(self, name, module, device_mesh):
            original(self, name, module, device_mesh)
            if getattr(module, "_planted_swap", False):
                with torch.no_grad():
                    shards = module.weight.full_tensor().chunk(device_mesh.size(), dim=0)
                    mine = shards[(device_mesh.get_local_rank() + 1) % device_mesh.size()]
                    module.weight.to_local().copy_(mine)

        return _partition_linear_fn

    return _replaced(Colwise, "_partition_linear_fn", make)


def pp_microbatches_reordered() -> contextlib.AbstractContextManager:
    """Pipeline: the labels' microbatches reach the loss in reverse order (microbatch i scored
    against the labels of microbatch m-1-i)."""
    from lightning_para.parallel.pipeline.runner import PipelineRunner

    def make(original):
        def _split(self, batch):
            inputs, targets = original(self, batch)
            return inputs, torch.cat(targets.tensor_split(self.microbatches)[::-1])

        return _split

    return _replaced(PipelineRunner, "_split", make)


def ep_expert_tokens_dropped() -> contextlib.AbstractContextManager:
    """Expert parallel: the last ep rank drops the tokens dispatched to its first local expert
    (their expert output is zero; the block's residual carries them on)."""
    from lightning_para.parallel.expert.dispatch import AllToAllDispatcher

    def make(original):
        def __call__(self, experts, routed, counts):
            def run(rows, per_expert):
                out = experts(rows, per_expert)
                if self.rank == self.size - 1 and per_expert[0] > 0:
                    out = torch.cat([torch.zeros_like(out[: per_expert[0]]), out[per_expert[0] :]])
                return out

            return original(self, run, routed, counts)

        return __call__

    return _replaced(AllToAllDispatcher, "__call__", make)


def pp_loss_summed() -> contextlib.AbstractContextManager:
    """Pipeline: each microbatch's loss is not divided by the number of microbatches (the step's
    gradient is the sum over microbatches, m times the one-device gradient)."""
    from lightning_para.parallel.pipeline.runner import PipelineRunner

    def make(original):
        def _scaled_loss(self, outputs, targets):
            return original(self, outputs, targets) * self.microbatches

        return _scaled_loss

    return _replaced(PipelineRunner, "_scaled_loss", make)


PLANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "cp_positions": cp_positions_shifted,
    "sp_positions": sp_positions_shifted,
    "dp_reduction": dp_reduction_skipped,
    "tp_shards": tp_shards_swapped,
    "pp_microbatch_order": pp_microbatches_reordered,
    "ep_tokens_dropped": ep_expert_tokens_dropped,
    "pp_loss_normalisation": pp_loss_summed,
}


def planted_fit_job(plant: Optional[str], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Inside every worker: :func:`tests.parity.fit_job` with ``PLANTS[plant]`` in force (none: as it is)."""
    with PLANTS[plant]() if plant else contextlib.nullcontext():
        return fit_job(*args, **kwargs)


# ----------------------------------------------------------------------------- models (sharp by default)
def cp_gpt(init_std: float = SHARP_STD):
    from tests.sharpness import sharp_gpt

    return sharp_gpt(init_std, n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, sample_tokens=0,
                     warmup_steps=0)


def nano_gpt(init_std: float = SHARP_STD):
    from tests.tp_models import NanoGPT

    return NanoGPT(n_layer=1, init_std=init_std, lr=0.3)  # 3 steps: lr 0.3 is not yet chaotic (clean: 2e-7)


def llama_with_marked_q(init_std: float = SHARP_STD):
    """LlamaLike whose first query projection is the column-parallel weight the tp plant swaps: a wrong
    query shard changes only the attention scores, which a blunt model hardly uses."""
    from tests.tp_models import LlamaLike

    model = LlamaLike(num_layers=1, init_std=init_std, lr=0.3)
    model.model.layers[0].self_attn.q_proj._planted_swap = True
    return model


def sgd_token_model(init_std: float = SHARP_STD):
    """The pipeline test model with SGD: AdamW's update does not depend on the gradient's scale, so
    a wrong loss normalisation would hide from it (only eps sees the scale)."""
    from tests.distributed.pp_models import TinyTokenModel

    class SGDTokenModel(TinyTokenModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return SGDTokenModel(depth=2, init_std=init_std)


def moe_transformer(init_std: float = SHARP_STD):
    from tests.distributed.test_expert_parallel import TinyMoETransformer

    return TinyMoETransformer(depth=1, init_std=init_std)


def _tokens():
    from tests.tp_models import token_dataset

    return token_dataset()


def _pp_tokens():
    from tests.distributed.pp_models import token_dataset

    return token_dataset(n=64)


def _ep_tokens():
    from tests.distributed.test_expert_parallel import token_dataset

    return token_dataset()


# name -> (model factory taking init_std, strategy kwargs, dataset, global batch)
CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], Callable[[], Any], int]] = {
    # cp_check=False: the first-step check (parallel/context/check.py) stops shifted positions with an error
    # before any comparison; turned off here so that the parity check itself is what must fail.
    "cp_positions": (cp_gpt, {"cp": 2, "cp_check": False}, _tokens, 8),
    "sp_positions": (nano_gpt, {"tp": 2, "sequence_parallel": True}, _tokens, 8),
    "dp_reduction": (nano_gpt, {"dp": 2, "zero": 0, "bucket_size_mb": 0.01}, _tokens, 8),
    "tp_shards": (llama_with_marked_q, {"tp": 2}, _tokens, 8),
    "pp_microbatch_order": (sgd_token_model, {"pp": 2, "microbatches": 4}, _pp_tokens, 16),
    "ep_tokens_dropped": (moe_transformer, {"ep": 2}, _ep_tokens, 8),
    "pp_loss_normalisation": (sgd_token_model, {"pp": 2, "microbatches": 4}, _pp_tokens, 16),
}

_references: dict[tuple[str, float], list[float]] = {}


def reference_losses(case: str, init_std: float = SHARP_STD) -> list[float]:
    factory, _, dataset, batch = CASES[case]
    key = (factory.__name__, init_std, batch)
    if key not in _references:
        _references[key] = fit_reference(functools.partial(factory, init_std), dataset, batch, STEPS)["losses"]
    return _references[key]


def run_case(pool, case: str, plant: Optional[str], init_std: float = SHARP_STD) -> list[float]:
    """Per-step losses of the parallel run: the mean over ranks (cp, tp and pp peers report the same
    loss; dp and ep ranks each their own part of the batch)."""
    factory, kwargs, dataset, batch = CASES[case]
    results = pool.run(planted_fit_job, plant, functools.partial(factory, init_std), kwargs, dataset, batch, STEPS,
                       None, ("losses",))
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in results))]


def relative_differences(actual: list[float], expected: list[float]) -> list[float]:
    return [abs(a - e) / abs(e) for a, e in zip(actual, expected)]


def check_caught(pools, case: str) -> None:
    pool = pools.get(2)
    expected = reference_losses(case)
    assert_losses_close(run_case(pool, case, None), expected)  # as it is: parity holds
    planted = run_case(pool, case, case)
    with pytest.raises(AssertionError, match="per-step loss differs"):
        assert_losses_close(planted, expected)  # the parity check fails...
    worst = max(relative_differences(planted, expected))
    assert worst >= CAUGHT_BY, f"{case}: caught only by {worst:.2e} relative"  # ...by far


# ----------------------------------------------------------------------------- tests (all on 2 ranks)
def test_cp_positions_shifted_by_one_fail_parity(pools):
    """The family's representative, also run by the default tier (test_default_tier.py)."""
    check_caught(pools, "cp_positions")


@pytest.mark.parametrize(
    "case", ["sp_positions", "dp_reduction", "tp_shards", "pp_microbatch_order", "ep_tokens_dropped",
             "pp_loss_normalisation"]
)
def test_planted_bug_fails_parity(pools, case):
    check_caught(pools, case)
