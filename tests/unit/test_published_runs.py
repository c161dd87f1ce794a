"""The planner against published training runs (issue 23): one row per run, each with its source.

The rows and the tolerances are the issue's. Every row is priced with the same global
constants (the GPU presets of ``plan/cluster.py``: each GEMM on the GPU's measured curve, ``plan/gemm.py``, times
the one ``AT_SCALE_EFFICIENCY``; issue 23's ``Cluster.efficiency = 0.5`` before); nothing is tuned per row. A row either meets its tolerance (asserted) or is a documented gap: its test
pins the gap as measured, so a planner change that closes (or widens) it shows up here and the
table in ``docs/planner.md`` must be updated. ``print_table`` writes that table:
``python -m pytest -q -s tests/unit/test_published_runs.py -k table``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Optional

import pytest

from lightning_para.plan import Cluster, Layout, Training, estimate, preset
from tests.unit.test_allocator_model import _dry_run_rank0

GIB = 2**30
LLAMA3 = "Llama 3 paper (Dubey et al. 2024), Table 4"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1, H100 96 GB)"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str
    gpu: str
    gpus: int
    layout: Layout
    training: Training
    published_mfu: Optional[float] = None  # fraction
    published_tps: Optional[float] = None  # tokens/s per GPU
    published_gib: Optional[float] = None  # peak memory, GiB
    features_match: bool = True  # False: the run used torch.compile / Float8 / async TP
    gap: str = ""  # why the row misses its tolerance (empty: it meets it)
    loss_upcast: bool = False  # the run's loss casts the logits to fp32 first (`ModelDesc.loss_upcast`)


def _llama3(name: str, gpus: int, seq: int, cp: int, dp: int, mfu: float, gap: str = "") -> Run:
    # Llama 3 paper Sec. 3.3.2: bf16 weights with fp32 master/optimizer state (ZeRO's
    # mixed-precision Adam = bf16-true), interleaved 1F1B schedule, sequence-parallel TP. Their FSDP shards the
    # optimizer state and the gradients, not the weights (not resharded after forward): ZeRO-2; gradients that
    # are sharded under pipelining are reduce-scattered after each microbatch's backward and accumulate as
    # shards (`zero_accumulation="reduce_each_microbatch"`, which ParaStrategy runs). The number of virtual stages
    # is not printed; we take v = 8 (one unit per chunk: 128 units / (16 x 8)). Batch: 16M tokens per step, one
    # sequence per microbatch. Sec. 3.3.2 "Numerical stability": FP32 gradient accumulation over the
    # microbatches and FP32 reduce-scatter (`fp32_grad_accumulation`).
    layout = Layout(tp=8, pp=16, cp=cp, dp=dp, zero=2, sequence_parallel=True, schedule="interleaved",
                    virtual_stages=8, zero_accumulation="reduce_each_microbatch")
    # Meta's stack is not torch's: its activations are priced with Megatron-LM's saved tensors
    # (Korthikanti et al. 2022: sequence-sharded projection inputs, fused SwiGLU, fp32 cross-entropy),
    # not ParaStrategy's (issue 23: `Training.activation_profile`).
    training = Training(seq_len=seq, global_batch=16 * 2**20 // seq, micro_batch=1, precision="bf16-true",
                        activation_profile="megatron", fp32_grad_accumulation=True)
    return Run(name, LLAMA3, "llama3-405b", "h100", gpus, layout, training, published_mfu=mfu, gap=gap)


def _titan(name: str, model: str, gpus: int, layout: Layout, seq: int, global_batch: int, micro_batch: int,
           recompute: Optional[str], tps: float, gib: float, features_match: bool, gap: str = "",
           precision: str = "bf16-true") -> Run:
    # torchtitan's FSDP2 mixed precision, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` without
    # autocast: fp32 shards, bf16 gathers, bf16 compute and residual stream. That is ParaStrategy's ZeRO-3 in
    # `bf16-true` (fp32 shards as masters), not its `bf16-mixed` (autocast over fp32 weights: fp32 gathers and
    # residual stream, measured on an H100 with `benchmarks/gpu_fake_world.py`).
    training = Training(seq_len=seq, global_batch=global_batch, micro_batch=micro_batch, precision=precision)
    # torchtitan's loss at the benchmarked commit: `cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))`.
    return Run(name, TITAN, model, "h100-96gb", gpus, replace(layout, activation_checkpointing=recompute), training,
               published_tps=tps, published_gib=gib, features_match=features_match, gap=gap, loss_upcast=True)


_OP_SAC = ("priced with torchtitan's own per-op policy ('selective_op'), precision (FSDP2's bf16 gathers and compute: "
           "bf16-true) and loss (fp32 logits); tokens/s within 20% once eager code's element-wise bytes are priced at "
           "the H100's measured bandwidth; the planner counts tensors (within 1.3% of what ParaStrategy's code "
           "allocated at these layouts on the lent H200), torchtitan publishes the caching allocator's reserved peak: "
           "14-17% above. The dry run's allocation trace through the allocator model predicts that reserved peak "
           "(test_torchtitan_8b_reserved_memory_by_the_dry_run)")
RUNS = [
    # The tightest row: rank 1 holds 2(p-i-1) + (v-1)p + 1 = 141 chunk-microbatches of activations (Narayanan et
    # al. 2021), each with Korthikanti's Llama terms; it fits because no rank keeps whole gradients.
    _llama3("405B, 8,192 GPUs, TP8 PP16 DP64, seq 8K", 8192, 8192, 1, 64, 0.43),
    # 16 microbatches per step: the warm-up covers every forward, and the peak comes before most gradients exist.
    _llama3("405B, 16,384 GPUs, TP8 PP16 DP128, seq 8K", 16384, 8192, 1, 128, 0.41),
    # Printed DP=4; 16,384 / (8 x 16 x 16) = 8.
    _llama3("405B, 16,384 GPUs, TP8 CP16 PP16 DP8, seq 131K", 16384, 131072, 16, 8, 0.38),
    _titan("8B FSDP, 8 GPUs (Table 1)", "llama3-8b", 8, Layout(dp=8, zero=3), 8192, 16, 2, "selective_op",
           5762, 82.4, True, gap=_OP_SAC),
    _titan("8B FSDP, 128 GPUs (Table 3)", "llama3-8b", 128, Layout(dp=128, zero=3), 8192, 256, 2, "selective_op",
           5605, 67.0, True, gap=_OP_SAC),
    *(
        _titan(f"8B FSDP{8 // cp} CP{cp}, seq {seq // 1024}K (Table 2)", "llama3-8b", 8, Layout(dp=8 // cp, cp=cp, zero=3),
               seq, 8 // cp, 1, "full", tps, gib, False)
        for cp, seq, tps, gib in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                  (8, 262144, 548, 84.5))
    ),
    _titan("70B FSDP32 TP8, 256 GPUs (Table 4)", "llama3-70b", 256, Layout(dp=32, tp=8, zero=3, sequence_parallel=True),
           8192, 512, 16, "full", 829, 71.9, False),
    # torchtitan runs FSDP (zero=3) under PP; ParaStrategy rejects zero=3 with pp>1 and the planner
    # prices zero=2: the same peak memory (FSDP2 under PP keeps the stage's weights gathered
    # across the microbatches, reshard_after_forward=False), the same reduce-scatter bytes. In `bf16-mixed`: ZeRO-2
    # keeps no gathered copy, and its whole fp32 weights stand in for FSDP2's gathered bf16 weights plus the
    # unsharded gradients it accumulates over the microbatches in fp32 (`reduce_dtype`).
    _titan("405B FSDP8 TP8 PP8 1F1B, 512 GPUs (Table 5)", "llama3-405b", 512,
           Layout(dp=8, tp=8, pp=8, zero=2, sequence_parallel=True, schedule="1f1b"), 8192, 256, 1, "full",
           100, 82.5, False, precision="bf16-mixed"),
    _titan("405B FSDP8 TP8 PP8 interleaved v2, 512 GPUs (Table 5)", "llama3-405b", 512,
           Layout(dp=8, tp=8, pp=8, zero=2, sequence_parallel=True, schedule="interleaved", virtual_stages=2),
           8192, 256, 1, "full", 128, 72.7, False, precision="bf16-mixed"),
]


def predict(run: Run) -> dict:
    cluster = Cluster.of(run.gpu, nodes=run.gpus // 8)
    est = estimate(replace(preset(run.model), loss_upcast=run.loss_upcast), cluster, run.training, run.layout)
    tokens = run.training.tokens_per_step
    return {
        "mfu": est.mfu, "tps": tokens / est.step_seconds / run.gpus, "gib": est.memory.total / GIB,
        "fits": est.fits, "gb": est.memory.total / 1e9,
    }


@pytest.mark.parametrize("run", [r for r in RUNS if r.source == LLAMA3], ids=lambda r: r.name)
def test_llama3_table4(run: Run) -> None:
    got = predict(run)
    assert abs(got["mfu"] / run.published_mfu - 1) <= 0.15, got  # the tolerance: 15% relative
    # "Each layout must fit in 80 GB, as it did": the H100's 80 GiB, of which `fits` allows what torch could
    # allocate on one (84.37e9 bytes, measured: `Cluster.usable_memory`).
    assert got["fits"] and got["gib"] < 80.0, got


def test_llama3_8k_row_fits_because_gradients_are_sharded_per_microbatch() -> None:
    """What makes the 8,192-GPU row fit: with one reduction per step (ZeRO-1, or ZeRO-2's "no_sync") every chunk's
    fp32 gradients exist through the schedule, 12.75 GB on rank 1, and it does not (94.9 GB, measured by the planner
    before ParaStrategy had "reduce_each_microbatch"); sharded per microbatch they are 0.2 GB plus one chunk's."""
    run = RUNS[0]
    once = replace(run, layout=replace(run.layout, zero=1, zero_accumulation="no_sync"))
    got, got_once = predict(run), predict(once)
    usable = Cluster.of(run.gpu, nodes=1).usable_memory
    assert got["fits"] and not got_once["fits"]
    assert 1.10 < got_once["gb"] * 1e9 / usable < 1.15, got_once
    assert abs(got["mfu"] / got_once["mfu"] - 1) < 0.03  # the m-fold reductions hide behind the microbatches' compute


@pytest.mark.parametrize("run", [r for r in RUNS if r.source == TITAN], ids=lambda r: r.name)
def test_torchtitan_benchmarks(run: Run) -> None:
    got = predict(run)
    mem_err, tps_err = got["gib"] / run.published_gib - 1, got["tps"] / run.published_tps - 1
    if run.features_match:
        assert abs(tps_err) <= 0.20, got  # the tolerance: tokens/s within 20%
        if run.gap:  # the planner's tensors against a reserved figure (see `_OP_SAC`): pinned as measured (-17%/-14%);
            assert -0.20 < mem_err < -0.10, got  # the tolerance is met by the dry run's reserved memory (test below)
        else:
            assert abs(mem_err) <= 0.10, got
    else:  # compile/Float8/async TP runs: shown in the table, not gated; still a sane prediction
        assert 0.3 < got["tps"] / run.published_tps < 3 and got["gib"] < 96e9 / GIB, got


@pytest.mark.slow  # ~10 s each: a dry run of Llama 3 8B on the meta device (shared with test_allocator_model.py)
@pytest.mark.parametrize("run", [r for r in RUNS if r.source == TITAN and r.features_match], ids=lambda r: r.name)
def test_torchtitan_8b_reserved_memory_by_the_dry_run(run: Run) -> None:
    """torchtitan's memory column is the caching allocator's peak reserved memory. The dry run of the same layout
    (rank 0, ParaStrategy's code in torchtitan's precision and loss) replays its step's allocations through
    ``simulate.allocator`` (within +0.2% to +2.2% of what an H100/H200 reserved: tests/unit/test_allocator_model.py):
    the issue's tolerance, 10%, against the published figure."""
    assert (run.training.seq_len, run.training.micro_batch, run.training.precision) == (8192, 2, "bf16-true")
    # ZeRO-3 without tp: the jobs of `h200_titan_w8` / `_w128` there, whose dry runs a full run shares.
    measured = _dry_run_rank0(str(run.gpus), str(preset(run.model).layers), "1", "3", "1")
    # torchtitan's launcher sets `expandable_segments:True` (run_llama_train.sh); whether the published runs did is
    # not said, so both settings are held to the tolerance (measured: -2.6% / -2.9% default, -6.5% / -6.3% expandable).
    for setting in ("reserved", "reserved_expandable"):
        reserved = measured[setting] / GIB
        assert abs(reserved / run.published_gib - 1) <= 0.10, (setting, reserved, run.published_gib)
    assert predict(run)["gib"] < 0.9 * run.published_gib  # the tensors alone are not what torchtitan reads


def test_table() -> None:
    """Prints the docs/planner.md table (run with ``-s``) and checks every row is priced."""
    lines = ["| run | source | published | predicted | within tolerance |", "|---|---|---|---|---|"]
    for run in RUNS:
        got = predict(run)
        if run.published_mfu is not None:
            pub = f"MFU {run.published_mfu:.0%}"
            pred = f"MFU {got['mfu']:.1%} ({got['mfu'] / run.published_mfu - 1:+.0%}), {got['gb']:.1f} GB"
            ok = "MFU yes; " + ("fits" if got["fits"] else "does not fit") + " 84.37e9 allocatable bytes"
        else:
            pub = f"{run.published_tps:,.0f} tok/s/GPU, {run.published_gib} GiB"
            pred = (f"{got['tps']:,.0f} ({got['tps'] / run.published_tps - 1:+.0%}),"
                    f" {got['gib']:.1f} GiB ({got['gib'] / run.published_gib - 1:+.0%})")
            ok = ("tokens/s yes; reserved memory yes, by the dry run" if run.gap else "yes") if run.features_match \
                else "not gated (compile/Float8)"
        lines.append(f"| {run.name} | {run.source} | {pub} | {pred} | {ok} |")
    print("\n".join(lines))
    assert len(lines) == len(RUNS) + 2


def test_model_from_hugging_face_config(tmp_path, capsys) -> None:
    """``--model config.json``: Llama 3.1 8B's published config gives the preset's shape and count."""
    import json

    from lightning_para.cli import main
    from lightning_para.plan.hf_config import from_hf_config

    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
    path = tmp_path / "llama-3.1-8b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    model = from_hf_config(path)
    assert model.total_params() == preset("llama3-8b").total_params() and model.name == "llama-3.1-8b"
    argv = ["plan", "--model", str(path), "--gpus", "8", "--gpu", "h200", "--seq-len", "8192", "--global-batch", "64",
            "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-3.1-8b: 8.03B params") and "149.5 GB usable each" in out
    with pytest.raises(ValueError, match="lacks"):
        from_hf_config({"hidden_size": 8})


def test_cli_prices_the_llama3_stack(capsys) -> None:
    """`lightning-para plan` reproduces the Llama 3 8K row's question from the command line: Meta's saved tensors and
    fp32 gradients (`--activation-profile megatron --fp32-grad-accumulation`) fit only with ZeRO-2 sharding the
    gradients of every microbatch; ParaStrategy's own activations (the default profile) need recomputation there."""
    from lightning_para.cli import main

    argv = ["plan", "--model", "llama3-405b", "--gpus", "8192", "--gpu", "h100", "--seq-len", "8192",
            "--global-batch", "2048", "--micro-batch", "1", "--tp", "8", "--pp", "16", "--recompute", "none",
            "--precision", "bf16-true"]
    assert main(argv + ["--zero", "1,2", "--activation-profile", "megatron", "--fp32-grad-accumulation"]) == 0
    ranked = capsys.readouterr().out.split("Excluded layouts:")[0]
    assert "reduce-each-microbatch" in ranked.splitlines()[4]  # the best layout
    assert main(argv + ["--zero", "1", "--activation-profile", "megatron", "--fp32-grad-accumulation"]) == 0
    assert "No layout fits" not in capsys.readouterr().out  # 1F1B / zero-bubble fit with whole gradients (38% MFU)
    assert main(argv + ["--zero", "1,2"]) == 0
    assert "No layout fits" in capsys.readouterr().out
