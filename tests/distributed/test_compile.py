"""``ParaStrategy(compile=...)`` (issue 25): per-step loss of every layout equals the EAGER single-device run.

Each layout trains the tiny GPT recipe (2 layers, width 32) for 3 steps with each block compiled
after TP/SP, CP and recomputation and before data parallelism, and compares each step's loss
with one uncompiled process on the same global batch (fp32, 1e-5 relative). Compilation on a
loaded 2-core CPU is slow, so the layout matrix compiles with ``{"backend": "aot_eager"}``
(dynamo's graph capture and AOTAutograd's joint forward/backward graph, the same traced graphs
inductor would lower, without the C++ code generation); one check runs inductor itself.
Only the dp2 z1 check is in the default tier (``tests/distributed/test_default_tier.py``); the
4-process layouts come last, so each world size spawns once.

Every layout but those in ``UNCOUNTED`` also counts dynamo's graphs: one per block class (an MoE
block: four pieces, see ``lightning_para/parallel/compile.py``) and no recompilation over the
steps. Those jobs start from a fresh dynamo state, as a new process would (the workers are reused
across layouts, and blocks of one class share one code cache, which would otherwise carry the
previous layout's graphs).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_para.recipes.gpt import GPT
from lightning_para.recipes.moe import MoEGPT
from tests.hf_models import hf_tokens, llama
from tests.parity import assert_losses_close, fit_reference, mean_over_dp
from tests.tp_models import token_dataset

GLOBAL_BATCH = 8
STEPS = 3
SEQ = 16
AOT = {"backend": "aot_eager"}
# Cases written but not yet seen passing when this module landed (a 2-core machine under load).
# Graphs per block class: a dense block is one graph; an MoE block four (the block up to the MoE call,
# the MoE layer up to its eager expert dispatch, the MoE layer after it, the rest of the block).
GRAPHS_PER_BLOCK_TYPE = {"moe_gpt": 4}
# Layouts whose graphs are not counted (parity only), with what was measured (issue 25, open):
UNCOUNTED = {
    # ring attention breaks the block's graph and recompiles per Python branch (first-step cp_check mode,
    # diagonal/past chunk kinds): 23-24 graphs for 2 blocks over 3 steps.
    "cp2": "ring attention graph breaks",
    # transformers builds a DynamicCache in training (use_cache=True): dynamo guards on
    # cache.layers[i].is_initialized, so the second decoder layer recompiles (2 graphs for 2 layers).
    "hf-llama-tp2-sp": "transformers' DynamicCache in training",
}
# A compiled layout's first step compiles from scratch: up to ~5 min on the loaded 2-core machine (cp2).
JOB_TIMEOUT = 600


def gpt() -> GPT:
    return GPT(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=64, sample_tokens=0, warmup_steps=2)


def moe_gpt() -> MoEGPT:
    return MoEGPT(n_layer=2, n_embd=32, n_head=4, block_size=SEQ, vocab_size=64, sample_tokens=0, warmup_steps=2,
                  num_experts=4, top_k=2)


_references: dict = {}


def reference(model) -> list[float]:
    if model not in _references:
        _references[model] = fit_reference(model, hf_tokens if model is llama else token_dataset, GLOBAL_BATCH, STEPS)["losses"]
    return _references[model]


def _compiled_job(model, kwargs: dict, fresh: bool = True) -> dict:
    """fit_job plus what the strategy compiled and how often dynamo compiled since."""
    import lightning as L

    import torch

    from lightning_para import ParaStrategy
    from tests.parity import LossRecorder, ShardedData, trainer_kwargs

    if fresh:
        torch._dynamo.reset()  # as a new process: no graphs (nor recompile budget) left from the previous layout
    strategy = ParaStrategy(**kwargs)
    L.seed_everything(0, verbose=False)
    module = model()
    recorder = LossRecorder()
    trainer = L.Trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS, callbacks=[recorder],
                        use_distributed_sampler=False, **trainer_kwargs())
    dp = strategy.config.resolve_dp(dist.get_world_size())
    data = hf_tokens if model is llama else token_dataset
    trainer.fit(module, datamodule=ShardedData(data, GLOBAL_BATCH // dp))
    watch = strategy.compile_watch
    return {
        "losses": recorder.losses,
        "block_types": watch.block_types if watch else [],
        "graphs": watch.graphs() if watch else 0,
        "recompiles": dict(watch.recompiles()) if watch else {},
        "blocks": sum(len(info.blocks) for info in strategy.parallel_model.compiled),
    }


def check(results: list[dict], model, dp_groups: list[list[int]], count: bool = True) -> None:
    per_type = GRAPHS_PER_BLOCK_TYPE.get(model.__name__, 1)
    for r in results:
        assert r["blocks"] >= 1, "nothing was compiled"
        if count:
            assert not r["recompiles"], r["recompiles"]  # blocks of one class share their graphs, over all steps
            assert r["graphs"] == per_type * len(r["block_types"]), r
    assert_losses_close(mean_over_dp([r["losses"] for r in results], dp_groups), reference(model))


# ============================================================================ 2 processes
def test_dp2_zero1_compiled_matches_eager_one_device(pools):
    """The representative: and blocks of one class share one graph (2 blocks, 1 compilation)."""
    results = pools.get(2).run(_compiled_job, gpt, {"dp": 2, "zero": 1, "compile": AOT})
    check(results, gpt, [[0, 1]])
    for r in results:
        assert r["block_types"] == ["Block"] and r["blocks"] == 2
        assert r["graphs"] == len(r["block_types"]), r  # one compiled graph per block class, no recompile
        assert not r["recompiles"]


LAYOUTS_2 = [
    pytest.param("dp2-z3", gpt, {"dp": 2, "zero": 3}, [[0, 1]], id="dp2-z3"),
    pytest.param("tp2-sp", gpt, {"tp": 2, "sequence_parallel": True}, [[0]], id="tp2-sp"),
    pytest.param("pp2-1f1b", gpt, {"pp": 2, "schedule": "1f1b", "microbatches": 2}, [[0]], id="pp2-1f1b"),
    # 4 stages over 2 ranks: each rank holds a block in one stage, the embedding or the head in the other.
    pytest.param("pp2-interleaved", gpt, {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}, [[0]], id="pp2-interleaved"),
    pytest.param("cp2", gpt, {"cp": 2}, [[0]], id="cp2"),
    pytest.param("hf-llama-tp2-sp", llama, {"tp": 2, "sequence_parallel": True}, [[0]], id="hf-llama-tp2-sp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, model, kwargs, groups", LAYOUTS_2)
def test_compiled_layouts_two_processes(pools, name, model, kwargs, groups):
    count = name not in UNCOUNTED
    results = pools.get(2).run(_compiled_job, model, {**kwargs, "compile": AOT}, count, timeout=JOB_TIMEOUT)
    if name.startswith("pp2"):  # the last stage reports the loss (each stage's graphs are counted)
        for r in results[:1]:
            assert not r["recompiles"] and r["graphs"] == len(r["block_types"]), r
        results = [results[1]]
        groups = [[0]]
    check(results, model, groups, count)


@pytest.mark.slow
def test_inductor_dp2_zero1(pools):
    """compile=True as it is: inductor (C++ code generation on CPU)."""
    results = pools.get(2).run(_compiled_job, gpt, {"dp": 2, "zero": 1, "compile": True})
    check(results, gpt, [[0, 1]])


# ============================================================================ 4 processes
LAYOUTS_4 = [
    # The experts (fp32 grouped_mm, all-to-all dispatch) run eagerly between the compiled pieces of each block.
    pytest.param("dp4-ep2", moe_gpt, {"dp": 4, "ep": 2}, [[0, 1, 2, 3]], id="dp4-ep2"),
    pytest.param("dp2-tp2-z3", gpt, {"dp": 2, "tp": 2, "zero": 3}, [[0, 2]], id="dp2-tp2-z3"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, model, kwargs, groups", LAYOUTS_4)
def test_compiled_layouts_four_processes(pools, name, model, kwargs, groups):
    results = pools.get(4).run(_compiled_job, model, {**kwargs, "compile": AOT}, timeout=JOB_TIMEOUT)
    check(results, model, groups)
