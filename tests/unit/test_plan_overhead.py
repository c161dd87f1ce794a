"""The planner's per-operator overhead (``lightning_para.plan.overhead``, issue 23 item 3): the
operator counts match the GPT recipe, and the cost model's arithmetic (no timing is asserted)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_para.plan import Cluster, Layout, Training, estimate, preset
from lightning_para.plan.overhead import (
    HEAD_OPS, LAYER_BACKWARD_OPS, LAYER_FORWARD_OPS, OPTIMIZER_OPS_PER_TENSOR, microbatch_ops, optimizer_ops,
    parameter_tensors,
)
from lightning_para.plan.pipeline import RankLayers, pipeline_ranks
from lightning_para.recipes import GPT


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_operator_counts_match_the_gpt_recipe():
    model = GPT(preset="tiny", sample_tokens=0)
    block = model.blocks[0]
    x = torch.randn(2, 16, model.blocks[0].ln_1.weight.numel(), requires_grad=True)
    with _Count() as forward:
        y = block(x)
    grad = torch.ones_like(y)
    with _Count() as backward:
        y.backward(grad)
    assert (forward.ops, backward.ops) == (LAYER_FORWARD_OPS, LAYER_BACKWARD_OPS)
    # the optimizer: one AdamW step per parameter tensor (less the profiler's record_function pair)
    params = list(block.parameters())
    one_layer = RankLayers(rank=0, layers=(0,), embedding=False, head=False, sends_forward=0, sends_backward=0,
                           in_flight=1.0)
    assert len(params) == parameter_tensors(preset("llama3-8b"), one_layer) == 9
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with _Count() as step:
        opt.step()
    assert step.ops - 2 == OPTIMIZER_OPS_PER_TENSOR * len(params)


def test_overhead_is_ops_times_op_seconds_and_zero_on_gpu_presets():
    model = preset("llama3-8b").with_changes(layers=4)
    training = Training(seq_len=128, global_batch=8, micro_batch=1, precision="32-true")
    layout = Layout(dp=1, tp=1, pp=2)
    gpu = Cluster.of("h100", nodes=1, gpus_per_node=2, elementwise_bandwidth=0.0)  # operators alone
    assert gpu.op_seconds == 0.0
    slow = dataclasses.replace(gpu, op_seconds=1e-4)
    base, priced = estimate(model, gpu, training, layout), estimate(model, slow, training, layout)
    parts = pipeline_ranks(model, layout.schedule, 2, 1, base.microbatches)
    for r0, r1, part in zip(base.ranks, priced.ranks, parts):
        ops = microbatch_ops(model, layout, part)
        assert ops == 2 * (LAYER_FORWARD_OPS + LAYER_BACKWARD_OPS) + (HEAD_OPS if part.head else 3)
        assert r1.compute_seconds - r0.compute_seconds == pytest.approx(ops * 1e-4)
        assert r1.optimizer_seconds == pytest.approx(optimizer_ops(model, part) * 1e-4) and r0.optimizer_seconds == 0
    # full recomputation replays each layer's forward once more
    full = dataclasses.replace(layout, activation_checkpointing="full")
    assert microbatch_ops(model, full, parts[0]) - microbatch_ops(model, layout, parts[0]) == 2 * LAYER_FORWARD_OPS
    # the step: microbatches x the slowest rank's microbatch / (1 - bubble), plus the optimizer step
    slowest = max(r.microbatch_seconds for r in priced.ranks)
    steps = base.microbatches * base.accumulation
    expected = steps * slowest / (1 - priced.bubble) + max(r.dp_exposed_seconds + r.optimizer_seconds for r in priced.ranks)
    assert priced.step_seconds == pytest.approx(expected)
    with pytest.raises(ValueError, match="op_seconds"):
        dataclasses.replace(gpu, op_seconds=-1.0)


@functools.lru_cache(maxsize=None)
def _tensor_parallel_counts() -> dict[bool, dict]:
    """Both cases' counts, each in a fresh process of its own (the fake process group is process-wide) from the tests'
    fork server, at once when the first case asks (the suite runs one test at a time: the other core is idle)."""
    from tests.harness import _worker_context
    from tests.unit.tp_op_counts import count_gpt_tensor_parallel

    with _worker_context().Pool(2, maxtasksperchild=1) as pool:
        return dict(zip((False, True), pool.map(count_gpt_tensor_parallel, (False, True), chunksize=1)))


@pytest.mark.slow  # a process of its own per case (the fake process group is process-wide)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_operator_counts_match_the_gpt_recipe(sequence_parallel):
    """The TP tables of plan/overhead.py, recounted on GPT(tiny) at tp=2 (fake process group, own process)."""
    from lightning_para.plan import overhead

    counts = _tensor_parallel_counts()[sequence_parallel]
    sp = sequence_parallel
    assert counts["layer_forward"] == overhead.TP_LAYER_FORWARD[sp]
    assert counts["layer_backward"] == overhead.TP_LAYER_BACKWARD[sp]
    assert counts["layer_optimizer"] == overhead.TP_LAYER_OPTIMIZER[sp]
    embedding = tuple(a + b for a, b in zip(counts["embedding_forward"], counts["embedding_backward"]))
    head = tuple(a + b for a, b in zip(counts["head_forward"], counts["head_backward"]))
    assert embedding == overhead.TP_EMBEDDING[sp] and head == overhead.TP_HEAD[sp]
    assert counts["rest_optimizer"] == overhead.TP_REST_OPTIMIZER[sp]


def test_dtensor_dispatch_is_priced_under_tensor_parallelism_only():
    from lightning_para.plan.overhead import (
        TP_HEAD, TP_LAYER_BACKWARD, TP_LAYER_FORWARD, TP_LAYER_OPTIMIZER, microbatch_dtensor_ops, optimizer_dtensor_ops,
    )

    model = preset("llama3-8b").with_changes(layers=4)
    training = Training(seq_len=128, global_batch=8, micro_batch=1, precision="32-true")
    cpu = dataclasses.replace(Cluster.of("h100", nodes=1, gpus_per_node=4), op_seconds=1e-5)
    priced = dataclasses.replace(cpu, dtensor_op_seconds=1e-4)
    for sp in (False, True):
        layout = Layout(dp=1, tp=2, pp=2, sequence_parallel=sp)
        base, with_dtensor = estimate(model, cpu, training, layout), estimate(model, priced, training, layout)
        parts = pipeline_ranks(model, layout.schedule, 2, 1, base.microbatches)
        for r0, r1, part in zip(base.ranks, with_dtensor.ranks, parts):
            dtensor = microbatch_dtensor_ops(model, layout, part)
            layers = len(part.layers)
            expected = layers * (TP_LAYER_FORWARD[sp][0] + TP_LAYER_BACKWARD[sp][0]) + (TP_HEAD[sp][0] if part.head else 1)
            assert dtensor == expected
            assert r1.compute_seconds - r0.compute_seconds == pytest.approx(dtensor * 1e-4)
            assert optimizer_dtensor_ops(model, layout, part) >= layers * TP_LAYER_OPTIMIZER[sp][0]
            assert r1.optimizer_seconds - r0.optimizer_seconds == pytest.approx(
                optimizer_dtensor_ops(model, layout, part) * 1e-4)
    # the optimizer step's DTensor operators at their own figure when calibrated apart
    layout = Layout(dp=1, tp=2, pp=2, sequence_parallel=True)
    apart = dataclasses.replace(priced, dtensor_optimizer_op_seconds=2.5e-5)
    with_dtensor, split = estimate(model, priced, training, layout), estimate(model, apart, training, layout)
    parts = pipeline_ranks(model, layout.schedule, 2, 1, with_dtensor.microbatches)
    for r1, r2, part in zip(with_dtensor.ranks, split.ranks, parts):
        assert r2.compute_seconds == r1.compute_seconds
        assert r1.optimizer_seconds - r2.optimizer_seconds == pytest.approx(
            optimizer_dtensor_ops(model, layout, part) * (1e-4 - 2.5e-5))
    # no tensor parallelism: nothing goes through DTensor's dispatch
    plain = Layout(dp=2, tp=1, pp=2)
    assert estimate(model, cpu, training, plain).step_seconds == estimate(model, priced, training, plain).step_seconds
    with pytest.raises(ValueError, match="dtensor_op_seconds"):
        dataclasses.replace(cpu, dtensor_op_seconds=-1.0)


def test_step_overhead_is_added_once_per_step():
    model = preset("llama3-8b").with_changes(layers=4)
    training = Training(seq_len=128, global_batch=8, micro_batch=1, precision="32-true")
    layout = Layout(dp=1, tp=2, pp=2)
    gpu = Cluster.of("h100", nodes=1, gpus_per_node=4)
    assert gpu.step_overhead_seconds == 0.0
    slow = dataclasses.replace(gpu, step_overhead_seconds=0.25)
    assert estimate(model, slow, training, layout).step_seconds == pytest.approx(
        estimate(model, gpu, training, layout).step_seconds + 0.25)
    with pytest.raises(ValueError, match="step_overhead_seconds"):
        dataclasses.replace(gpu, step_overhead_seconds=-1.0)


def _traffic(fn) -> float:
    from lightning_para.instrument.operators import TrafficCounter

    with TrafficCounter() as counter:
        fn()
    return float(counter.bytes)


def test_elementwise_traffic_coefficients_match_the_gpt_recipe():
    """plan/overhead.py's fp32 traffic coefficients, recounted on the recipe's block and head at two batch shapes
    (traffic = a x activation bytes + c x parameter bytes), its accumulation and AdamW's bytes per element."""
    from lightning_para.plan import overhead
    from lightning_para.calibrate.traffic import count_traffic_coefficients

    torch.manual_seed(0)
    counted = count_traffic_coefficients(GPT(preset="tiny", sample_tokens=0), "32-true")
    table = overhead.TRAFFIC_BY_PRECISION["32-true"]
    for name in ("layer_per_activation_byte", "head_per_activation_byte", "optimizer_bytes_per_param",
                 "accumulate_per_grad_byte"):
        assert getattr(counted, name) == pytest.approx(getattr(table, name), rel=0.01), name
    for name in ("layer_per_param_byte", "embedding_head_per_param_byte"):  # ~0: gradients come out of matmuls
        assert getattr(counted, name) == pytest.approx(getattr(table, name), abs=0.02), name
    # autocast adds a cast of each weight and of each weight gradient: 1.5 + 1.5 bytes per fp32 parameter byte,
    # as the table's CUDA-counted bf16-mixed row has it
    mixed = count_traffic_coefficients(GPT(preset="tiny", sample_tokens=0), "bf16-mixed")
    assert mixed.layer_per_param_byte == pytest.approx(overhead.TRAFFIC_BY_PRECISION["bf16-mixed"].layer_per_param_byte,
                                                       rel=0.02)


def test_count_traffic_coefficients_rejects_other_precisions():
    from lightning_para.calibrate.traffic import count_traffic_coefficients

    with pytest.raises(ValueError, match="precision='16-true'"):
        count_traffic_coefficients(GPT(preset="tiny", sample_tokens=0), "16-true")


def test_elementwise_traffic_is_bytes_over_bandwidth_for_eager_torch_code():
    from lightning_para.plan.rank import microbatch_traffic_bytes, optimizer_traffic_bytes
    from lightning_para.plan.shape import RankShape

    model = preset("llama3-8b").with_changes(layers=4)
    training = Training(seq_len=128, global_batch=8, micro_batch=1, precision="32-true")

    def shape(layout: Layout, part) -> RankShape:
        return RankShape(model, training, layout, part)

    layout = Layout(dp=2, tp=2, pp=2, zero=1)
    gpu = Cluster.of("h100", nodes=1, gpus_per_node=8)
    assert gpu.elementwise_bandwidth == pytest.approx(2.55e12)  # measured on an H100 (plan/cluster.py)
    unpriced = dataclasses.replace(gpu, elementwise_bandwidth=0.0)
    cpu = dataclasses.replace(gpu, elementwise_bandwidth=1e10)
    base, priced = estimate(model, unpriced, training, layout), estimate(model, cpu, training, layout)
    parts = pipeline_ranks(model, layout.schedule, 2, 1, base.microbatches)
    per_step = base.microbatches  # every microbatch after a step's first adds its gradients into those held
    for r0, r1, part in zip(base.ranks, priced.ranks, parts):
        traffic = microbatch_traffic_bytes(shape(layout, part), (per_step - 1) / per_step)
        assert traffic > microbatch_traffic_bytes(shape(layout, part)) > 0
        assert r1.compute_seconds - r0.compute_seconds == pytest.approx(traffic / 1e10)
        assert r1.optimizer_seconds - r0.optimizer_seconds == pytest.approx(
            optimizer_traffic_bytes(shape(layout, part)) / 1e10)
    # Megatron-LM's fused kernels: not priced (left in the matmul efficiency)
    megatron = dataclasses.replace(training, activation_profile="megatron")
    assert estimate(model, cpu, megatron, layout).step_seconds == pytest.approx(
        estimate(model, unpriced, megatron, layout).step_seconds)
    # tensor parallelism with SP divides every layer's activations by tp: half the traffic per rank, or less
    one = Layout(dp=1, tp=1, pp=2)
    sp = Layout(dp=1, tp=2, pp=2, sequence_parallel=True)
    part = pipeline_ranks(model, one.schedule, 2, 1, 2)[0]
    assert microbatch_traffic_bytes(shape(sp, part)) <= 0.5 * microbatch_traffic_bytes(shape(one, part)) * 1.001
    # ZeRO-1 steps a 1/dp shard of the parameters
    z0 = dataclasses.replace(layout, zero=0)
    assert optimizer_traffic_bytes(shape(layout, parts[0])) == pytest.approx(
        optimizer_traffic_bytes(shape(z0, parts[0])) / 2)
    with pytest.raises(ValueError, match="elementwise_bandwidth"):
        dataclasses.replace(gpu, elementwise_bandwidth=-1.0)
