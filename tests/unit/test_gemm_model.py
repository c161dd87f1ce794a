"""The GEMM curve per GPU and shape (``plan/gemm.py``) against the GEMMs measured on the lent H100 and H200."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_para.plan import Cluster, Layout, Training, estimate, preset
from lightning_para.plan.cluster import AT_SCALE_EFFICIENCY, MEASURED_LLAMA_GEMM_EFFICIENCY
from lightning_para.plan.gemm import (
    GPU_FIXED_SECONDS, GPU_TILE, GPU_UNITS, MEASURED_GEMMS, MEASURED_PEAK_FLOPS, Gemm, GemmMeasurement, GemmModel, fit_gemm_model,
    gpu_gemm_model, model_gemms,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_measured_table_is_the_records():
    """Each measured GEMM is the forward / input-gradient / weight-gradient seconds of a JSON record, to 1e-6."""
    for gpu, measured in MEASURED_GEMMS.items():
        for i in range(0, len(measured), 3):
            record = json.loads((ROOT / measured[i].source).read_text())
            tokens = record["args"]["batch"] * record["args"]["seq"]
            assert record["device"].lower().startswith(f"nvidia {gpu}")
            assert (measured[i].m, measured[i].n, measured[i].k) == (tokens, record["args"]["ffn"], record["args"]["hidden"])
            for got, key in zip(measured[i:i + 3], ("forward_s", "backward_input_s", "backward_weight_s")):
                assert got.seconds == pytest.approx(record["matmul"][key], rel=1e-6), (got.source, key)


@pytest.mark.parametrize("gpu", sorted(MEASURED_GEMMS))
def test_the_curve_reproduces_every_measured_gemm(gpu):
    """Fitted per GPU (a plateau, no fixed cost): every measured shape within 6% (measured spread: 0.75-0.82; each
    was timed alone between two synchronizations, so the 8,192-row ones carry more of the host's per-call time)."""
    model = gpu_gemm_model(gpu, MEASURED_PEAK_FLOPS, 0.0)
    assert model.fixed_seconds == GPU_FIXED_SECONDS == 0.0
    for g in MEASURED_GEMMS[gpu]:
        measured = g.flops / g.seconds / MEASURED_PEAK_FLOPS
        assert model.efficiency(g.m, g.n, g.k) == pytest.approx(measured, rel=0.06), g
    assert 0.75 < MEASURED_LLAMA_GEMM_EFFICIENCY < 0.82


SIDES = (64, 128, 200, 256, 384, 1000, 1024, 2048, 4096, 8192, 14336, 16896)


def _growing_gets_faster(model: GemmModel) -> list[tuple[tuple[int, int, int], int]]:
    """``((m, n, k), axis)`` where growing ``axis`` to the next of :data:`SIDES` makes the GEMM faster."""
    found = []
    for m in SIDES:
        for n in SIDES:
            for k in SIDES:
                now = model.seconds(Gemm(m, n, k))
                for axis in range(3):
                    shape = [m, n, k]
                    if shape[axis] == SIDES[-1]:
                        continue
                    shape[axis] = SIDES[SIDES.index(shape[axis]) + 1]
                    if model.seconds(Gemm(*shape)) < now * (1 - 1e-12):
                        found.append(((m, n, k), axis))
    return found


@pytest.mark.parametrize("gpu", ["h100", "h200", "a100-80gb", "b200"])
def test_a_gemm_never_gets_faster_as_it_grows(gpu):
    """Wave quantization counts whole tiles and whole waves, and the fixed cost is added once: a GEMM with more rows,
    columns or depth never takes less time (partial tiles and partial waves included)."""
    curve = Cluster.of(gpu, nodes=1, gpus_per_node=1).gemm
    assert _growing_gets_faster(curve) == []
    assert _growing_gets_faster(replace(curve, fixed_seconds=100e-6)) == []


def test_planted_bug_a_fixed_cost_spread_over_the_waves_is_caught():
    """The old curve's saturation term, ``(F + F_half) / (peak x plateau x waves)`` with a tile count's wave fraction,
    made a 1024 x 2048 x 2048 GEMM slower than a 1024 x 4096 x 4096 one: the check finds such shapes."""

    class SpreadFixedCost(GemmModel):
        def seconds(self, gemm: Gemm) -> float:
            import math

            tiles = math.ceil(gemm.m / self.tile[0]) * math.ceil(gemm.n / self.tile[1])
            waves = tiles / (math.ceil(tiles / self.units) * self.units)
            return (2 * gemm.m * gemm.n * gemm.k + 87e9) / (self.peak_flops * self.plateau * waves) * gemm.count

    curve = Cluster.of("h100", nodes=1, gpus_per_node=1).gemm
    planted = SpreadFixedCost(curve.peak_flops, curve.plateau, units=curve.units, tile=curve.tile)
    assert planted.seconds(Gemm(1024, 2048, 2048)) > planted.seconds(Gemm(1024, 4096, 4096))
    assert _growing_gets_faster(planted)


def test_fit_recovers_a_known_curve_and_wave_quantization_and_roofline_bind():
    truth = GemmModel(1e15, 0.8, 60e-6, units=132, tile=GPU_TILE)
    shapes = [(8192, 14336, 4096), (16384, 14336, 4096), (16384, 4096, 14336), (4096, 14336, 16384)]
    measured = [GemmMeasurement(m, n, k, truth.seconds(Gemm(m, n, k)), "synthetic") for m, n, k in shapes]
    fitted = fit_gemm_model(measured, 1e15, units=132, tile=GPU_TILE)
    assert fitted.plateau == pytest.approx(0.8) and fitted.fixed_seconds == pytest.approx(60e-6, rel=1e-6)
    # 133 tiles on 132 SMs: two waves, the second nearly idle.
    assert truth.wave_fraction(128 * 133, 256) == pytest.approx(133 / 264)
    assert truth.wave_fraction(128 * 132, 256) == 1.0
    # The roofline: 16 rows against a 4096 x 14336 weight are bound by reading the weight.
    bound = replace(truth, fixed_seconds=0.0, bandwidth=2.55e12)
    weight_read = 2 * (16 * 4096 + 4096 * 14336 + 16 * 14336) / 2.55e12
    assert bound.seconds(Gemm(16, 14336, 4096)) == pytest.approx(weight_read)
    assert bound.efficiency(16, 14336, 4096) < 0.05 < bound.efficiency(16384, 14336, 4096)


def test_model_gemms_count_every_matmul_parameter():
    """Forward GEMM FLOPs = 2 x tokens x the model's matmul weights (dense and MoE), divided by tp."""
    for name, tp, ep in (("llama3-8b", 1, 1), ("llama3-8b", 4, 1), ("mixtral-8x7b", 2, 4)):
        model = preset(name)
        tokens = 4096
        flops = sum(g.flops for g in model_gemms(model, tokens, tp, ep))
        matmul_weights = model.flops_params()
        assert flops == pytest.approx(2 * tokens * matmul_weights / tp, rel=1e-3), name


def test_presets_price_matmuls_by_shape_and_efficiency_overrides_the_curve():
    model = preset("llama3-8b")
    h100 = Cluster.of("h100", nodes=1, gpus_per_node=1)
    small, large = (h100.matmul_efficiency(t, model_gemms(model, t)) for t in (1024, 16384))
    assert small < large  # saturation: fewer rows, fixed costs weigh more
    assert large == pytest.approx(MEASURED_LLAMA_GEMM_EFFICIENCY, rel=0.03)  # one GPU: no at-scale factor
    node = Cluster.of("h100", nodes=1)
    assert node.matmul_efficiency(16384, model_gemms(model, 16384)) == pytest.approx(large * AT_SCALE_EFFICIENCY["h100"])
    assert large * AT_SCALE_EFFICIENCY["h100"] == pytest.approx(0.5, rel=0.03)  # issue 23's constant, decomposed
    fixed = Cluster.of("h100", nodes=1, efficiency=0.6)  # `lightning-para plan --efficiency 0.6`
    assert fixed.gemm is None and fixed.matmul_efficiency(1024, model_gemms(model, 1024)) == 0.6
    # The A100 takes the H100's fraction of its own peak, on 108 SMs.
    a100 = Cluster.of("a100-80gb", nodes=1, gpus_per_node=1)
    assert a100.gemm.units == GPU_UNITS["a100-80gb"] and a100.gemm.peak_flops == 312e12


def test_planted_bug_a_curve_that_ignores_the_shape_is_caught():
    """A curve stuck at its plateau (no wave quantization) would put the 8,192-row GEMMs 5-8% above what the H100
    measured; the curve with it is within -4.6% to +4.3% of every measured GEMM."""
    model = gpu_gemm_model("h100", MEASURED_PEAK_FLOPS, 0.0)
    flat = replace(model, fixed_seconds=0.0, units=1, tile=(1, 1))
    small = [g for g in MEASURED_GEMMS["h100"] if 8192 in (g.m, g.k)]
    errors = [flat.efficiency(g.m, g.n, g.k) / (g.flops / g.seconds / MEASURED_PEAK_FLOPS) - 1 for g in small]
    assert min(errors) > 0.05


def test_a_single_gpu_step_is_priced_from_the_curve():
    """The 4-layer bf16-mixed H100 record (0.392 s measured) from the preset alone, no measured figure passed."""
    record = json.loads((ROOT / "benchmarks/results/gpu_step_model_h100_l4_bf16_mixed.json").read_text())
    model = preset("llama3-8b").with_changes(layers=4)
    training = Training(seq_len=8192, global_batch=2, micro_batch=2, precision="bf16-mixed")
    est = estimate(model, Cluster.of("h100", nodes=1, gpus_per_node=1), training,
                   Layout(activation_checkpointing="selective_op"))
    assert est.step_seconds / record["recipe"]["step_seconds"] - 1 == pytest.approx(-0.04, abs=0.05)


FAKE_WORLD = sorted((ROOT / "benchmarks" / "results").glob("gpu_fake_world_h*.json"))


@pytest.mark.parametrize("record", FAKE_WORLD, ids=lambda p: p.stem.removeprefix("gpu_fake_world_"))
def test_the_curve_prices_a_full_depth_rank_with_free_collectives(record):
    """Rank 0 of 8 or 128 (ZeRO-3 at 32 layers; ZeRO-1/2 at 8), real kernels under the fake process group, so the step
    is compute alone (``benchmarks/gpu_fake_world.py``): the preset's curve, communication made free, within -12% to
    +5% (measured: -11% to +4%). The tp=2 rank is a gap (-35%): recorded, not gated."""
    run = json.loads(record.read_text())
    gpu = "h200" if "h200" in record.name else "h100"
    world, tp = run["world"], run.get("tp", 1)
    model = preset("llama3-8b").with_changes(layers=run["layers"], loss_upcast=run.get("loss_upcast", False))
    # Each data-parallel rank (world / tp of them) ran one microbatch of `batch` sequences per step.
    training = Training(seq_len=run["seq"], global_batch=run["batch"] * world // tp, micro_batch=run["batch"],
                        precision=run["precision"])
    layout = Layout(dp=world // tp, tp=tp, zero=run.get("zero", 3), sequence_parallel=tp > 1,
                    activation_checkpointing=run["recompute"])
    # One GPU's compute: no collectives' bytes, and none of what a real multi-GPU run loses (`at_scale_efficiency`).
    free = Cluster.of(gpu, nodes=max(1, world // 8), intra_node_bw=1e18, inter_node_bw=1e18, intra_node_latency=0.0,
                      inter_node_latency=0.0, at_scale_efficiency=1.0)
    error = estimate(model, free, training, layout).step_seconds / min(s["seconds"] for s in run["steps"][1:]) - 1
    if tp > 1:
        # The gap as measured (-35%), not measured apart: likely DTensor's per-operator dispatch on the host, priced at 0
        # on the GPU presets (launches assumed hidden behind the device's queue). Closing it updates docs/planner.md.
        assert -0.45 < error < -0.25, error
    else:
        assert -0.12 <= error <= 0.05, error


STEP_RECORDS = sorted((ROOT / "benchmarks" / "results").glob("gpu_step_model_h*.json"))


@pytest.mark.parametrize("record", STEP_RECORDS, ids=lambda p: p.stem.removeprefix("gpu_step_model_"))
def test_the_curve_reproduces_the_matmul_kernel_time_profiled_inside_each_step(record):
    """The GEMMs of a whole recorded step (forward, both backward products, the recomputed forwards; the head), priced
    on the curve, against the matmul kernels' time the profiler summed in that step (no launch gaps, no other
    kernels): measured 0.98-1.08, within 10%. The curve was fitted to isolated GEMMs, not to these steps."""
    run = json.loads(record.read_text())
    args, gpu = run["args"], run["args"].get("gpu", "h100")
    curve = gpu_gemm_model(gpu, MEASURED_PEAK_FLOPS, Cluster.of(gpu, nodes=1).elementwise_bandwidth)
    model = preset("llama3-8b").with_changes(layers=args["layers"])
    tokens, layers = args["batch"] * args["seq"], args["layers"]
    gemms = model_gemms(model, tokens)
    recomputed = {  # the forwards each policy replays: torchtitan's per-op policy recomputes k, o and one h x f
        "selective_op": [Gemm(tokens, model.kv_dim, model.hidden, layers), Gemm(tokens, model.hidden, model.q_dim, layers),
                         Gemm(tokens, model.ffn, model.hidden, layers)],
        "full": list(gemms[:-1]), None: [],
    }[args["recompute"]]
    seconds = sum(curve.seconds(g) for forward in gemms for g in forward.training())
    seconds += sum(curve.seconds(g) for g in recomputed)
    assert seconds / run["recipe"]["kernel_seconds"]["matmul"] == pytest.approx(1.0, abs=0.10)


def test_a_detected_gpu_gets_its_curve(monkeypatch):
    """What the profiler's check prices a run on a real H100 with: the preset's curve and at-scale factor."""
    import torch

    from lightning_para.calibrate import machine

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(machine, "detect_peak_flops", lambda device: 989e12)
    cluster = machine.local_cluster(8, 8, torch.device("cuda", 0), memory_bytes=80e9)
    preset_cluster = Cluster.of("h100", nodes=1)
    assert cluster.gemm == preset_cluster.gemm and cluster.at_scale_efficiency == preset_cluster.at_scale_efficiency
