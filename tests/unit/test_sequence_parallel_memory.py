"""Under sequence parallelism the q/k/v and MLP projections save their input's sequence shard and all-gather it
again in backward (Megatron-SP, ``_KeepShardSaveGathered``). The gathered copy must be freed when the backward that
used it is done, by reference counting: not kept by a reference cycle until Python's garbage collector runs (on a
GPU the caching allocator cannot reuse it until then; the dry run of Llama 3 405B measured ~4 GiB per microbatch
held after its backward before the fix)."""

from __future__ import annotations


import json

import pytest

from tests.harness import run_code


CHILD = r"""
import gc, sys
import torch
from lightning_para.config import ParallelConfig
from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step
from lightning_para.parallel.tensor.styles import _KeepShardSaveGathered
from lightning_para.parallelize import parallelize
from lightning_para.simulate import start_fake_world
from lightning_para.recipes.gpt import GPT

start_fake_world(2, 0)
config = ParallelConfig(tp=2, sequence_parallel=True)
dims = config.resolve_dims(2)
dims.build_mesh("cpu")
module = GPT(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=128, block_size=32, mlp_hidden=128)
parallel = parallelize(module, dims, config)
tokens = torch.zeros(1, 32, dtype=torch.long)
gc.collect()
gc.disable()  # what a cycle would keep stays until the collector runs: here, never
with loss_parallel_step(parallel.loss_parallel):
    loss = module.loss_fn(module(tokens), tokens)
alive = lambda: sum(isinstance(o, _KeepShardSaveGathered) for o in gc.get_objects())
during = alive()
with loss_parallel_backward(parallel.loss_parallel):
    loss.backward()
del loss
print("ALIVE", during, alive())
"""


def test_the_regathered_input_is_freed_right_after_backward():
    proc = run_code(CHILD, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("ALIVE ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    during, after = map(int, line.split()[1:])
    assert during == 4  # attention and MLP of 2 blocks keep their input's shard for backward
    assert after == 0  # and nothing keeps them (nor the all-gathered input) once backward is done


META_CHILD = r"""
import json
from lightning_para.config import ParallelConfig
from lightning_para.plan.cluster import Training
from lightning_para.simulate.rank import dry_run_rank
from lightning_para.plan.model import ModelDesc
from lightning_para.recipes.gpt import GPT

# ffn / tp == hidden: the MLP's local activation has as many elements as the gathered [b, s, h] input.
desc = ModelDesc(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, name="tiny")
result = dry_run_rank(
    lambda: GPT(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=128, block_size=32, mlp_hidden=128),
    ParallelConfig(tp=2, sequence_parallel=True), 2, 0, seq_len=32, micro_batch=1, hidden=64, model=desc,
    training=Training(seq_len=32, global_batch=1, micro_batch=1, precision="32-true"),
)
print("RESULT " + json.dumps(result.to_dict()))
"""


def test_the_gathered_input_is_told_apart_by_its_storage_also_on_meta():
    """On the meta device every storage's data pointer is 0: matching the gathered input by pointer and size made
    the dry run re-gather, for the MLP's output (same element count when ffn / tp == hidden), a tensor of the wrong
    shape ("shape '[32, 128]' is invalid for input of size 2048"). The storage's identity tells them apart."""
    proc = run_code(META_CHILD, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["step_ran"] and result["measured"]["activations"] > 0
    assert result["measured"]["activations"] == pytest.approx(result["predicted"]["activations"], rel=0.2)
