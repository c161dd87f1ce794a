"""``lightning-para dryrun --config CFG.yaml`` (issue 23): a LightningCLI config's model, strategy layout and
data, scaled to ``--gpus``; bad configs exit with status 2 naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from lightning_para.cli import dryrun
from lightning_para.cli.run_config import describe_config_model, load_config, model_from_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "recipes" / "gpt-cpu-demo.yaml")


def _job(*argv: str) -> dryrun.DryRunJob:
    args: argparse.Namespace = dryrun._parser().parse_args(list(argv))
    return dryrun._setup(args)


def test_config_gives_the_model_layout_and_batch_scaled_to_gpus():
    """gpt-cpu-demo (tp=2 x pp=2 on 4 devices, 16 sequences of 64 tokens) on 8 ranks: dp=2 derived, each dp
    rank loads 8 sequences in the default 2 pipeline microbatches of 4; the model is the config's GPT."""
    job = _job("--config", DEMO, "--gpus", "8")
    dims = job.config.resolve_dims(job.gpus)
    assert (job.gpus, dims.tp, dims.pp, dims.dp, job.config.zero) == (8, 2, 2, 2, 0)
    assert job.config.pipeline_microbatches == 2
    training = job.training
    assert (training.seq_len, training.global_batch, training.micro_batch, training.precision) == (64, 16, 4, "32-true")
    assert job.model == describe_config_model(model_from_config(load_config(DEMO)))
    # --layout replaces single arguments of the config's strategy; --gpus defaults to devices x num_nodes.
    job = _job("--config", DEMO, "--layout", "zero=1,sp=true,m=4", "--precision", "bf16-true")
    dims = job.config.resolve_dims(job.gpus)
    assert (job.gpus, dims.tp, dims.pp, dims.dp) == (4, 2, 2, 1)
    assert (job.config.zero, job.config.sequence_parallel, job.config.pipeline_microbatches) == (1, True, 4)
    assert (job.training.micro_batch, job.training.precision) == (4, "bf16-true")
    # Without a pipeline the whole per-rank batch is one forward (gpt-125m-8gpu: 128 sequences over dp=8).
    job = _job("--config", str(ROOT / "recipes" / "gpt-125m-8gpu.yaml"), "--precision", "bf16-true")
    assert (job.gpus, job.config.zero, job.config.resolve_dims(job.gpus).dp) == (8, 1, 8)
    assert (job.training.seq_len, job.training.global_batch, job.training.micro_batch) == (1024, 128, 16)


def _write(tmp_path: Path, edit) -> str:  # noqa: ANN001
    config = yaml.safe_load(Path(DEMO).read_text())
    edit(config)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("edit, names", [
    (lambda c: c["trainer"]["strategy"]["init_args"].update(tpp=2), "trainer.strategy.init_args.tpp"),
    (lambda c: c["trainer"].update(precision="bf16-mixed"), "trainer.precision: bf16-mixed"),
    (lambda c: c["data"]["init_args"].pop("seq_len"), "data.init_args.seq_len"),
    (lambda c: c["data"]["init_args"].update(global_batch_size=6), "data.init_args.global_batch_size: 6"),
    (lambda c: c["trainer"]["strategy"]["init_args"].update(zero=7), "zero=7"),
    (lambda c: c["model"].update(class_path="lightning_para.recipes.NoSuchModel"), "model.class_path"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path, capsys, edit, names):
    code = dryrun.main(["--config", _write(tmp_path, edit), "--gpus", "8"])
    err = capsys.readouterr().err
    assert code == 2 and names in err, err


def test_shape_arguments_are_refused_with_config(capsys):
    assert dryrun.main(["--config", DEMO, "--layers", "4"]) == 2
    assert "--layers" in capsys.readouterr().err


@pytest.mark.slow  # ~60 s on 2 cores (two rank processes import torch and Lightning); the default tier stays short
def test_dryrun_config_prints_per_rank_figures(capsys, monkeypatch):
    """The command itself: gpt-cpu-demo on 8 ranks, its first and last rank (one process each, at once),
    each with its states, activations and peak beside the planner's."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert dryrun.main(["--config", DEMO, "--gpus", "8", "--ranks", "first,last"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 8 (pp=0 dp=0 tp=0; pipeline rank 0, 2 layers, 2 microbatch(es) through the pipeline runner, 2 in flight)" in out
    assert "rank 7 of 8 (pp=1 dp=1 tp=1; pipeline rank 1, 2 layers, 2 microbatch(es) through the pipeline runner, 1 in flight)" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["params"], ["grads"], ["optimizer"])]
    assert len(rows) == 6
    for name, measured, predicted, diff in rows:
        assert float(measured) > 0 and diff == "+0.0%", (name, measured, predicted)  # 32-true states: exact
    activations = [line.split() for line in out.splitlines() if line.split()[:1] == ["activations"]]
    assert len(activations) == 2 and all(abs(float(a[3].rstrip("%"))) < 20 for a in activations)


@pytest.mark.parametrize("recipe, layout, key", [
    ("gpt-cpu-demo", "zero=3", "`zero=3` with `pp>1`"),
    ("gpt-cpu-demo", "pp=1,cp=3", "cp"),
])
def test_configs_the_dry_run_cannot_run_are_refused_with_their_key(capsys, recipe, layout, key):
    """A layout the strategy refuses (ZeRO-3 under the demo's pipeline; cp=3 splits no 64-token sequence in
    2 x 3 chunks) is refused before any process starts, naming the key. (ZeRO-3 without a pipeline runs:
    tests/unit/test_dryrun.py.)"""
    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--gpus", "8"] + (["--layout", layout] if layout else [])
    assert dryrun.main(argv) == 2
    assert key in capsys.readouterr().err


def _figures(out: str, name: str) -> list[tuple[float, float, float]]:
    """``(dry run, planner, diff %)`` of every rank's ``name`` row (memory) in the printed tables."""
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == [name]]
    return [(float(r[1]), float(r[2]), float(r[3].rstrip("%"))) for r in rows]


@pytest.mark.slow  # ~50 s: two configs, two rank processes each
def test_dryrun_runs_hugging_face_models(capsys, monkeypatch):
    """A transformers model in an ordinary LightningModule (`HFCausalLM`, no `loss_fn`): the dense Llama demo at
    tp2 x pp2 (its `configure_pipeline()` is transformers' `pipeline_spec`) on 8 ranks, and the Mixtral demo with
    its experts over ep=2 (routed by the dry run's balanced assignment). States exact (32-true), activations
    within 5% of the planner's (transformers' RMSNorm keeps an fp32 copy of its input, `ModelDesc.norm_upcast`:
    +12% and +9% before the planner priced it), the experts' all-to-all bytes the planner's."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert dryrun.main(["--config", str(ROOT / "recipes" / "hf-llama-cpu-demo.yaml"), "--gpus", "8",
                        "--ranks", "first,last"]) == 0
    out = capsys.readouterr().out
    assert "rank 7 of 8 (pp=1 dp=1 tp=1; pipeline rank 1, 2 layers, 2 microbatch(es) through the pipeline runner, 1 in flight)" in out, out
    for name in ("params", "grads", "optimizer"):
        assert [f[2] for f in _figures(out, name)] == [0.0, 0.0], (name, out)
    assert len(_figures(out, "activations")) == 2 and all(abs(f[2]) < 5 for f in _figures(out, "activations")), out
    assert dryrun.main(["--config", str(ROOT / "recipes" / "hf-mixtral-cpu-demo.yaml"), "--ranks", "first"]) == 0
    out = capsys.readouterr().out
    for name in ("params", "grads", "optimizer"):
        assert abs(_figures(out, name)[0][2]) == 0.0, (name, out)
    assert abs(_figures(out, "activations")[0][2]) < 5, out
    all_to_all = next(line.split() for line in out.splitlines() if line.split()[:2] == ["ep", "all_to_all"])
    assert all_to_all[2] == all_to_all[4].rstrip(",") and all_to_all[3] == all_to_all[5], all_to_all


@pytest.mark.slow  # ~30 s: two rank processes, each dry run twice
def test_dryrun_runs_context_parallelism_ring_and_ulysses(capsys, monkeypatch):
    """gpt-long-context-cpu (cp=2 x tp=2, 256 tokens) on 8 ranks: the strategy's head-tail batch split and the cp
    step mode run on meta tensors, ring attention's K/V sends (one at a time on the fake group) and Ulysses'
    all-to-alls. States exact, activations within 10% of the planner's, the cp bytes the planner's."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = str(ROOT / "recipes" / "gpt-long-context-cpu.yaml")
    for layout, op in (("cp_method=ring", "send_recv"), ("cp_method=all_to_all,zero=1", "all_to_all")):
        assert dryrun.main(["--config", config, "--gpus", "8", "--ranks", "first", "--layout", layout]) == 0
        out = capsys.readouterr().out
        assert "rank 0 of 8 (dp=0 cp=0 tp=0;" in out, out
        for name in ("params", "grads", "optimizer"):
            assert _figures(out, name)[0][2] == 0.0, (layout, name, out)
        assert abs(_figures(out, "activations")[0][2]) < 10, (layout, out)
        row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["cp", op])
        assert row[3] == row[5], (layout, row)  # bytes: the dry run's (sent) against the planner's
        dp = next(line.split() for line in out.splitlines() if line.split()[:1] == ["dp"])
        assert dp[3] == dp[5], (layout, dp)  # the gradient sync over dp x cp, the planner's "dp"
