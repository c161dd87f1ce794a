"""A dry run of the real code at any scale: one rank of an N-rank job, on the meta device.

:func:`dry_run_rank` runs in a process of its own (the fake process group is process-wide):

1. ``torch.distributed`` is started with torch's **fake** backend at world size ``N`` and this
   rank; collectives return at once, so no other rank needs to exist.
2. The real :class:`~lightning_para.mesh.ParallelDims` mesh is built (device type ``meta``),
   and the model (built by the caller on the meta device) goes through the same
   :func:`~lightning_para.parallelize.parallelize` ``ParaStrategy`` calls: the real stage split,
   tensor/sequence/expert plans, activation checkpointing and ZeRO sharding, in the run's precision
   (``training.precision``: ``bf16-true`` -- bf16 weights, fp32 masters -- ``16-true`` or ``32-true``; the
   planner is asked for the same one). Meta tensors have shapes and no memory, so a 405B model costs
   nothing: the pipeline split keeps only this rank's stage before anything else.
3. One training step. Under a pipeline, the real
   :class:`~lightning_para.parallel.pipeline.runner.PipelineRunner` runs it as ``ParaStrategy`` routes
   ``training_step`` to it: torch's schedule over all the step's microbatches, in its order, then the runner's
   ``finish_backward`` (the gradient sync), then ``optimizer.step()`` (AdamW). Meta tensors have no values for
   torch's run-time shape exchange (a vote read with ``.item()``, metadata sent as pickled objects), so the
   stages' shapes are given to the runner up front (``PipelineRunner.use_static_shapes``), and the fake backend
   also serves the meta device, where the schedule batches its sends and receives. Without a pipeline: the
   module's forward, loss and backward, then the ZeRO gradient sync and the optimizer step.
4. Measured: parameters, gradients and optimizer state this rank holds after the step (bytes of
   distinct storages), the activations held when all in-flight microbatches have run forward
   (what the schedule's peak keeps), the peak of all live bytes during the step (a steady-state
   step's: the optimizer moments this first step creates count as held through forward and
   backward, without a pipeline the last step's gradients count as held through the forward (Lightning's
   ``zero_grad`` comes after it), with one through the whole schedule (the pipeline runner sets them aside
   until ``zero_grad``)), and every collective with its bytes per mesh dimension.
5. Modelled: the CUDA caching allocator's reserved peak (``MeasuredMemory.reserved``, and
   ``reserved_expandable`` with ``expandable_segments``): the step's storages are recorded in the order they
   are allocated and freed, with the stream current at each, and replayed as steady-state steps through
   :mod:`lightning_para.simulate.allocator`.

The planner's prediction for the same pipeline rank sits beside each figure
(:func:`~lightning_para.plan.cost.estimate`: ``resident`` states, ``memory.activations``).

MoE models: a router picks experts by their values, and expert parallelism's all-to-all
split sizes are those picks counted, which meta tensors do not have. During the step every MoE layer
routes with :func:`~lightning_para.moe.balanced_routing`: token ``t``'s ``j``-th choice is expert
``(t * top_k + j) mod E``, so each expert gets ``T k / E`` rows (to one), the perfectly balanced
load the planner assumes; the rows per expert are host integers and the real dispatch, grouped
experts and combine run with their real all-to-alls (counts, tokens, outputs, and their backward)
on the fake process group. A real run's imbalance (and capacity drops) are not modelled. A
``transformers`` MoE model's experts made expert-parallel (``integrations.transformers.experts``)
take the same switch.

``transformers`` models (an ordinary LightningModule around one, e.g.
:class:`~lightning_para.recipes.HFCausalLM`): without a pipeline the step calls the module on the
token ids and takes transformers' causal-LM loss of the logits (:func:`causal_lm_step_loss`); under
a pipeline the module's own ``configure_pipeline()`` (``pipeline_spec``) gives the stages and loss.
transformers branches on data in its mask code ("one sequence per row?", "no padding?"); on meta
tensors those checks, and only transformers' own, answer yes (the answer the transformers integration registers, ``integrations/transformers/dry_run.py``): the
dry run's batches are plain token windows.

ZeRO-3 runs on FSDP2 itself (:func:`_fsdp_on_meta`): the meta device gets the device module FSDP2 asks
for (CPU's no-op streams and events), FSDP2's refusal of meta parameters is lifted for the step, and the
gathered weights, which FSDP2 allocates and frees by resizing their storages in place, are counted while
held. One microbatch (ParaStrategy runs ZeRO-3 without a pipeline), its backward reduce-scattering each
unit's gradients as a step without accumulation does; the measured activations leave out the units kept
gathered from forward to backward (weights, which the planner prices with the gathered buffers).

The package: :mod:`.world` (the fake process group and the lifts for meta), :mod:`.kernels` (the fused kernels'
saved-tensor profiles), :mod:`.step` (the rank's forwards and backwards), this module (the driver); the counters
and records are :mod:`lightning_para.instrument`'s, the planner's side :func:`~lightning_para.instrument.compare.predicted_rank`.
"""

from __future__ import annotations

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lightning_para.config import ParallelConfig
from lightning_para.instrument.collectives import CollectiveCounter, group_labels
from lightning_para.instrument.compare import Comparison, memory_comparisons, predicted_rank
from lightning_para.instrument.live_bytes import LiveBytes, local_shard, storage_key
from lightning_para.instrument.records import CommFigure
from lightning_para.memory import measure_states
from lightning_para.spec.dims import COORDINATES
from lightning_para.spec.memory import MeasuredMemory, PredictedMemory
from lightning_para.moe import balanced_routing
from lightning_para.parallel.tensor import step_mixed_groups_per_tensor
from lightning_para.parallelize import parallelize
from lightning_para.simulate.allocator import AllocationTrace, steady_state_peaks
from lightning_para.plan.cluster import Training
from lightning_para.plan.model import ModelDesc
from lightning_para.precision import ParaPrecision
from lightning_para.simulate.kernels import FusedKernels
from lightning_para.simulate.step import finish_step, in_flight_microbatches, train_step
from lightning_para.simulate.world import (
    count_loss_parallel,
    fsdp_on_meta,
    start_fake_world,
    uncounted_sharding_propagation,
)


@dataclass
class RankDryRun:
    """What one simulated rank did, beside what the planner predicts for it."""

    rank: int
    world_size: int
    coordinates: dict[str, int]
    pipeline_rank: int
    layers: int
    in_flight: int
    measured: MeasuredMemory
    # The planner's records of the same pipeline rank: the states held between steps, and the step's peak.
    predicted_resident: PredictedMemory
    predicted_peak: PredictedMemory
    comm: list[CommFigure] = field(default_factory=list)
    predicted_comm: list[CommFigure] = field(default_factory=list)
    step_ran: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    # The microbatches the step ran (the pipeline's whole schedule; 1 without a pipeline); `in_flight`: those whose
    # activations the schedule holds at once on this rank.
    microbatches: int = 1

    def memory_rows(self) -> list[Comparison]:
        """Measured against predicted, part by part: params, grads, optimizer, activations, peak."""
        return memory_comparisons(self.rank, self.measured, self.predicted_resident, self.predicted_peak)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, and under ``"predicted"`` the planner's figure for each part ``"measured"``
        names (read from :meth:`memory_rows`; :meth:`from_dict` does not need it back)."""
        return {**asdict(self), "predicted": {row.name: row.predicted for row in self.memory_rows()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankDryRun":
        data = {key: value for key, value in data.items() if key != "predicted"}
        data["measured"] = MeasuredMemory(**data["measured"])
        data["predicted_resident"] = PredictedMemory(**data["predicted_resident"])
        data["predicted_peak"] = PredictedMemory(**data["predicted_peak"])
        data["comm"] = [CommFigure(**c) for c in data["comm"]]
        data["predicted_comm"] = [CommFigure(**c) for c in data["predicted_comm"]]
        return cls(**data)


def dry_run_rank(
    build_model: Callable[[], nn.Module],
    config: ParallelConfig,
    world_size: int,
    rank: int,
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    model: ModelDesc,
    training: Training,
    run_step: bool = True,
) -> RankDryRun:
    """Dry-run ``rank`` of a ``world_size``-rank job of the model ``build_model()`` makes (on the
    meta device: a module with ``loss_fn(logits, targets)``, or one whose forward returns logits; under
    ``pp > 1`` a LightningModule with ``configure_pipeline``).

    ``model``/``training`` describe the same run to the planner; ``training.precision`` is also the
    precision the rank runs in: a ``*-true`` one (``*-mixed`` runs under autocast, which does not act on
    meta tensors, so it would measure fp32 activations).
    Call once per process: it starts the fake process group (and leaves it for the caller).
    """
    if not training.precision.endswith("-true"):
        raise ValueError(
            f"The dry run cannot run `precision={training.precision!r}`: autocast does not act on meta tensors."
            " Choose 'bf16-true', '16-true' or '32-true'."
        )
    precision = ParaPrecision(training.precision)
    clock: dict[str, float] = {}
    t0 = time.perf_counter()
    start_fake_world(world_size, rank)
    dims = config.resolve_dims(world_size)
    dims.build_mesh("meta")
    clock["mesh"] = time.perf_counter() - t0
    t = time.perf_counter()
    with torch.device("meta"):
        module = build_model()
    # As ParaStrategy calls it: `bf16-true` gives bf16 weights and (ZeRO 0-2) fp32 masters taken before the cast.
    # Activation recomputation runs the forward again in backward, where the fused-kernel mode is not active.
    parallel = parallelize(
        module, dims, config, param_dtype=precision.param_dtype, master_dtype=precision.master_dtype,
        recompute_context=FusedKernels,
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    if parallel.data_parallel is not None:
        parallel.data_parallel.attach_optimizer(optimizer, is_expert=parallel.expert_predicate())
    step_mixed_groups_per_tensor(optimizer)  # as ParaStrategy does
    for group in optimizer.param_groups:
        # Torch's choice on a GPU (its multi-tensor step for CUDA tensors; the for-loop one on meta and CPU), whose
        # step makes one fp32 temporary per element it steps (`_foreach_sqrt` of the second moments).
        if group["foreach"] is None:
            group["foreach"] = True
    clock["parallelize"] = time.perf_counter() - t
    pp_rank = dims.local_rank("pp") if dims.pp > 1 else 0
    microbatches = config.pipeline_microbatches if dims.pp > 1 else 1
    in_flight = in_flight_microbatches(config.schedule, dims.pp, pp_rank, microbatches, config.virtual_stages) \
        if dims.pp > 1 else 1
    live, comm = LiveBytes(), CollectiveCounter(group_labels(dims, planner=True), time_collectives=False)
    live.exclude = {storage_key(local_shard(p)) for p in module.parameters()}
    live.exclude |= {storage_key(local_shard(q)) for g in optimizer.param_groups for q in g["params"]}
    # The step's allocations in order, for the caching allocator's reserved peak (`simulate.allocator`); the weights and
    # masters exist before it.
    states = {storage_key(local_shard(t)): local_shard(t).untyped_storage().nbytes() for t in
              [*module.parameters(), *(q for g in optimizer.param_groups for q in g["params"])]}
    live.trace = AllocationTrace(states=list(states.values()))
    states_before = measure_states(module, optimizer, key=storage_key)  # weights and fp32 masters, made before the step
    before = states_before.model_states
    t = time.perf_counter()
    activations, schedule_peak, backward_peak = 0.0, 0, 0
    if run_step:
        # MoE layers route with a fixed balanced assignment: meta tensors have no values to route by.
        with FusedKernels(), comm, live, balanced_routing(*parallel.parts), fsdp_on_meta(live), \
                count_loss_parallel(live), uncounted_sharding_propagation():
            activations, live.trace.made_once = train_step(
                module, parallel, dims, seq_len, micro_batch, hidden, live, precision.param_dtype or torch.float32,
            )
            schedule_peak = live.peak
            live.mark("schedule_end")
            finish_step(parallel)
            backward_peak = live.peak
            live.mark("optimizer_start")
            optimizer.step()
            live.mark("step_end")
    clock["step"] = time.perf_counter() - t
    states = measure_states(module, optimizer, key=storage_key)
    params, grads, opt = states.params, states.grads, states.optimizer
    # The peak: what existed before the step (weights, masters) plus the step's own live peak (which
    # counts the accumulated gradients while they live). The optimizer's moments appear in this first
    # step's `optimizer.step()`; from the second step on they exist through forward and backward too,
    # so the steady-state peak adds them to backward's peak. Without a pipeline, Lightning calls `zero_grad`
    # after the training step's forward, so from the second step on the last step's gradients, as the rank
    # keeps them between steps (`grads`), are held through the forward too (measured on an H100: the forward's
    # peak holds them). A pipeline's schedule runs before it, and ParaStrategy's runner sets those gradients aside
    # while the schedule runs: held through its forwards and backwards, gone by the gradient sync.
    moments = opt - states_before.optimizer
    if dims.pp == 1:
        steady = max(live.forward_peak + moments + grads, backward_peak + moments, live.peak)
    else:
        steady = max(schedule_peak + moments + grads, backward_peak + moments, live.peak)
    peak = before + steady if run_step else params + grads + opt
    # The last step's gradients go at `zero_grad`: after the forward without a pipeline, after the schedule with one.
    reserved = [float(steady_state_peaks(
        live.trace, gradients_freed_at="schedule_end" if dims.pp > 1 else "forward_end", expandable_segments=expand,
    ).reserved) if run_step else None for expand in (False, True)]
    measured = MeasuredMemory(float(params), float(grads), float(opt), float(activations), float(peak), *reserved)
    resident, step_peak, predicted_comm, layers = predicted_rank(model, config, dims, training, pp_rank, microbatches)
    coords = {name: dims.local_rank(name) for name in COORDINATES if getattr(dims, name) > 1}
    clock["total"] = time.perf_counter() - t0
    return RankDryRun(
        rank=rank, world_size=world_size, coordinates=coords, pipeline_rank=pp_rank, layers=layers,
        in_flight=in_flight, microbatches=microbatches, measured=measured,
        predicted_resident=resident, predicted_peak=step_peak,
        comm=comm.payload_figures(), predicted_comm=predicted_comm, step_ran=run_step, seconds=clock,
    )


__all__ = ["RankDryRun", "dry_run_rank", "in_flight_microbatches"]
