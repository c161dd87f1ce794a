"""ParaProfiler pieces without communication: timeline image, idle fractions, byte accounting,
and the callback on a plain single-device Trainer."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from lightning_para.instrument.collectives import classify, payload
from lightning_para.recipes.data import TextDataModule
from lightning_para.observe.profiler import ParaProfiler, detect_peak_flops
from lightning_para.observe.timeline import (
    COLORS, IDLE, PipelineEvent, as_events, draw_timeline, idle_fraction, pipeline_metrics, rank_pipeline_record,
)
from lightning_para.parallel.pipeline import PipelineStats, PipelineStepStats
from lightning_para.recipes.gpt import GPT


def _gpipe_events():
    """Two ranks, two microbatches, unit-time F and 2-unit B: a GPipe step spanning 0..9."""
    e = []
    for mb in range(2):
        e.append(PipelineEvent(0, 0, "F", mb, mb, mb + 1))
        e.append(PipelineEvent(1, 1, "F", mb, mb + 1, mb + 2))
    for mb in range(2):
        e.append(PipelineEvent(1, 1, "B", mb, 3 + 2 * mb, 5 + 2 * mb))
        e.append(PipelineEvent(0, 0, "B", mb, 5 + 2 * mb, 7 + 2 * mb))
    return e


def test_idle_fraction_from_events():
    # each rank is busy 1 + 1 + 2 + 2 = 6 of the 9 units -> idle 1/3 (GPipe: (p-1)/(m+p-1) = 1/3)
    fractions = idle_fraction(_gpipe_events())
    assert fractions == pytest.approx({0: 1 / 3, 1: 1 / 3})
    assert idle_fraction([]) == {}


def test_timeline_image_draws_each_action_where_it_ran():
    events = _gpipe_events()
    image = draw_timeline(events, width=800, row_height=30)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[1] == 800
    left, right, top = 90, 20, 40
    scale = (800 - left - right) / 9

    def pixel(rank, t):
        return tuple(image[top + rank * 30 + 15, int(left + t * scale)])

    assert pixel(0, 0.2) == COLORS["F"]  # rank 0 forwards mb 0 first
    assert pixel(1, 0.5) == IDLE  # rank 1 waits for it: the bubble
    assert pixel(1, 3.5) == COLORS["B"]
    assert pixel(0, 4.5) == IDLE
    # dicts and tuples are accepted too (what ranks send each other)
    assert as_events([e.__dict__ for e in events]) == events
    assert draw_timeline([], width=300).shape[1] == 300


def test_pipeline_records_share_one_clock_and_average_per_stage():
    """Two ranks per stage; each rank's events are relative to its own step start."""
    per_rank = []
    for rank, (stage, start_unix, idle) in enumerate([(0, 100.0, 0.2), (0, 100.5, 0.4), (1, 100.25, 0.1), (1, 100.0, 0.3)]):
        step = PipelineStepStats(
            step_time_s=1.0, busy_time_s=1.0 - idle, idle_time_s=idle, idle_fraction=idle, step_start_unix=start_unix,
            events=(PipelineEvent(0, stage, "F", 0, 0.5, 1.0), PipelineEvent(0, stage, "L", 0, 0.9, 1.0)),
        )
        stats = PipelineStats(
            schedule="gpipe", pp=2, pp_rank=stage, virtual_stages=1, microbatches=1, stages=[stage],
            stage_layers={stage: []}, expected_idle_fraction=1 / 3, steps=1, mean_idle_fraction=idle, last_step=step,
        )
        per_rank.append(rank_pipeline_record(stats, rank, stage))
    metrics, events = pipeline_metrics(per_rank)
    assert metrics == pytest.approx({"pipeline/idle_fraction/stage0": 0.3, "pipeline/idle_fraction/stage1": 0.2,
                                     "pipeline/expected_idle_fraction": 1 / 3})
    assert [e.action for e in events] == ["F"] * 4  # the loss ("L") runs inside the forward
    assert [e.start for e in events] == [100.5, 101.0, 100.75, 100.5]
    assert [e.rank for e in events] == [0, 1, 2, 3]  # the global rank each record was made for


def test_collective_byte_accounting_follows_the_zero_paper():
    t = torch.empty(10, dtype=torch.float32)  # 40 bytes
    big = torch.empty(40, dtype=torch.float32)  # 160 bytes
    assert classify("allreduce_", ([t], None)) == ("all_reduce", 80)  # 2 psi
    assert classify("_reduce_scatter_base_", (t, big)) == ("reduce_scatter", 160)  # the input
    assert classify("_allgather_base_", (big, t)) == ("all_gather", 160)  # the output
    assert classify("all_gather_into_tensor", (t, 4, "0")) == ("all_gather", 160)
    assert classify("alltoall_base_", (t, big)) == ("all_to_all", 160)
    assert classify("send", ([t], None, 1, 0)) == ("send", 40)
    assert classify("recv_", ([t], None, 1, 0)) == ("recv", 40)
    assert classify("wait_tensor", (t,)) is None


def test_every_collective_op_counts_by_the_one_table_in_both_conventions():
    """Every op of the table, by schema name and with its real argument layout: ``classify``'s bus bytes (the ZeRO
    paper's accounting) and ``payload``'s local tensor (what the planner's ``Collective.payload`` prices)."""
    a, b, c = (torch.empty(n, dtype=torch.float32) for n in (10, 20, 40))  # 40, 80, 160 bytes
    pg, name = None, "0"  # a c10d op's process group, a functional op's group name (neither is read)
    cases = {  # op: (args, bus, payload)
        "allreduce_": (([a, b], pg, None, None), ("all_reduce", 240), ("all_reduce", 40)),
        "allreduce_coalesced_": (([a, b], pg, None), ("all_reduce", 240), None),
        "all_reduce": ((a, "sum", name), ("all_reduce", 80), ("all_reduce", 40)),
        "all_reduce_": ((a, "sum", name), ("all_reduce", 80), None),
        "all_reduce_coalesced": (([a, b], "sum", name), ("all_reduce", 240), None),
        "_reduce_scatter_base_": ((a, c, pg, None), ("reduce_scatter", 160), ("reduce_scatter", 160)),
        "reduce_scatter_": (([a], [[a, b]], pg, None), ("reduce_scatter", 120), ("reduce_scatter", 80)),
        "reduce_scatter_tensor_coalesced_": (([a], [c], pg, None), ("reduce_scatter", 160), ("reduce_scatter", 160)),
        "reduce_scatter_tensor": ((c, "sum", 4, name), ("reduce_scatter", 160), ("reduce_scatter", 160)),
        "reduce_scatter_tensor_coalesced": (([c, b], "sum", 4, name), ("reduce_scatter", 240), None),
        "_allgather_base_": ((c, a, pg), ("all_gather", 160), ("all_gather", 160)),
        "allgather_": (([[a, b]], [a], pg), ("all_gather", 120), ("all_gather", 40)),
        "allgather_into_tensor_coalesced_": (([c], [a], pg), ("all_gather", 160), ("all_gather", 160)),
        "all_gather_into_tensor": ((a, 4, name), ("all_gather", 160), ("all_gather", 40)),
        "all_gather_into_tensor_coalesced": (([a, b], 2, name), ("all_gather", 240), None),
        "alltoall_base_": ((b, c, pg, [], []), ("all_to_all", 160), ("all_to_all", 160)),
        "alltoall_": (([a, b], [b, a], pg), ("all_to_all", 120), None),
        "all_to_all_single": ((c, [], [], name), ("all_to_all", 160), ("all_to_all", 160)),
        "broadcast_": (([a], pg, 0, 0), ("broadcast", 40), ("broadcast", 40)),
        "broadcast": ((a, 0, name), ("broadcast", 40), ("broadcast", 40)),
        "send": (([a], pg, 1, 0), ("send", 40), ("send_recv", 40)),
        "recv_": (([a], pg, 1, 0), ("recv", 40), None),  # the sender's send counts the exchange once
        "recv_any_source_": (([a], pg, 0), ("recv", 40), None),
        "reduce_": (([a], pg, None, 0, 0), ("reduce", 40), None),
        "scatter_": (([a], [[a, b]], pg, 0), ("scatter", 40), None),
        "gather_": (([[a, b]], [a], pg, 0), ("gather", 120), None),
        "isend": ((a, 1, 0, name), ("isend", 40), None),  # not in the table: its first argument, its own name
    }
    for op, (args, bus, local) in cases.items():
        assert (classify(op, args), payload(op, args, {})) == (bus, local), op
    for op in ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"):  # bookkeeping
        assert classify(op, (a,)) is None and payload(op, (a,), {}) is None, op


def test_profiler_arguments_and_peak_detection():
    with pytest.raises(ValueError, match="comm_every_n_steps=-1"):
        ParaProfiler(comm_every_n_steps=-1)
    assert detect_peak_flops(torch.device("cpu")) is None


def test_profiler_on_a_plain_trainer(tmp_path):
    """No ParaStrategy: throughput, MFU (peak given), a torch.profiler trace window, the summary
    and TensorBoard still work."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    L.seed_everything(0)
    profiler = ParaProfiler(peak_flops=1e12, log_every_n_steps=2, trace_start_step=1, trace_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, limit_val_batches=1, val_check_interval=4, num_sanity_val_steps=0,
        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[profiler], log_every_n_steps=2,
    )
    model = GPT(n_layer=1, n_embd=32, n_head=2, block_size=32, sample_tokens=4)
    trainer.fit(model, datamodule=TextDataModule(max_bytes=50_000, seq_len=32, global_batch_size=4))
    summary = json.loads((profiler.log_dir / "para_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["train_losses"]) == 4
    assert summary["final_val_loss"] is not None and summary["tokens_per_s"] > 0
    events = EventAccumulator(str(profiler.log_dir))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"perf/tokens_per_s", "perf/lr", "perf/mfu", "train_loss", "val_loss", "val_ppl"} <= scalars, scalars
    assert "samples/text/text_summary" in events.Tags()["tensors"]
    (trace,) = (profiler.log_dir / "traces").glob("rank0*.pt.trace.json")
    assert '"ProfilerStep' in trace.read_text() or "aten::" in trace.read_text()
    mfu = events.Scalars("perf/mfu")[-1].value
    tokens_per_s = events.Scalars("perf/tokens_per_s")[-1].value
    assert mfu == pytest.approx(model.flops_per_token(32) * tokens_per_s / 1e12, rel=1e-4)
