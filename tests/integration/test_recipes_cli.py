"""The recipes under the ``lightning-para`` CLI: a few steps of each demo config in real gloo
groups, what reaches TensorBoard, equivalence with one device, and bad configurations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from tests.parity import FP32_RTOL, assert_losses_close

REPO = Path(__file__).resolve().parents[2]
GPT_DEMO = REPO / "recipes" / "gpt-cpu-demo.yaml"
MOE_DEMO = REPO / "recipes" / "moe-cpu-demo.yaml"
# A few steps of a demo: validation twice, every profiling feature on at least once.
FAST = [
    "--trainer.max_steps", "20", "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
    "--profiling.comm_every_n_steps", "4", "--profiling.timeline_every_n_steps", "4",
    "--profiling.memory_every_n_steps", "6",
    "--model.init_args.sample_tokens", "6", "--data.init_args.max_bytes", "300000",
]


class LoggedLosses(Callback):
    """What this rank's loggers see as ``train_loss`` and ``train_aux_loss`` (MoE only) after every step."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.aux: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss.append(float(trainer.callback_metrics["train_loss"]))
        value = trainer.callback_metrics.get("train_aux_loss")
        if value is not None:
            self.aux.append(float(value))


def cli_fit_job(args: list[str]) -> dict:
    """In every worker: run the CLI (the workers already form the process group, as torchrun would)."""
    from lightning_para.cli import run_cli
    from lightning_para.observe.profiler import ParaProfiler

    cli = run_cli([*args, "--trainer.callbacks+=tests.integration.test_recipes_cli.LoggedLosses"])
    profiler = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ParaProfiler))
    logged = next(cb for cb in cli.trainer.callbacks if isinstance(cb, LoggedLosses))
    return {"rank": dist.get_rank(), "summary": profiler.last_summary, "sample": cli.model.last_sample,
            "logged_loss": logged.loss, "aux": logged.aux}


def _events(root: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = sorted((root / "lightning_logs").glob("version_*"))
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return log_dir, events


def _fit_demo(pools, config: Path, root: Path, *overrides: str, world: int = 4) -> list[dict]:
    """A few steps (``FAST``) of a demo config under the CLI in a pool of ``world`` processes."""
    return pools.get(world).run(
        cli_fit_job, ["fit", "--config", str(config), *FAST, "--trainer.default_root_dir", str(root), *overrides]
    )


def _one_device(pools, config: Path, root: Path, *degrees_to_one: str) -> dict:
    """The same demo on one device (the named degrees set to 1): rank 0's result."""
    overrides = ["--trainer.devices", "1", "--trainer.strategy.dp", "auto"]
    for degree in degrees_to_one:
        overrides += [f"--trainer.strategy.{degree}", "1"]
    return _fit_demo(pools, config, root, *overrides, world=1)[0]


def _assert_same_train_and_val_losses(actual: dict, expected: dict) -> None:
    assert len(expected["train_losses"]) == 20
    assert_losses_close(actual["train_losses"], expected["train_losses"], rtol=FP32_RTOL)
    assert_losses_close([v for _, v in actual["val_losses"]], [v for _, v in expected["val_losses"]], rtol=FP32_RTOL)


@pytest.fixture(scope="module")
def gpt_parallel_run(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_demo")
    return root, _fit_demo(pools, GPT_DEMO, root)


def test_gpt_demo_trains_and_reports_to_tensorboard(gpt_parallel_run):
    root, results = gpt_parallel_run
    summary = results[0]["summary"]
    assert summary["steps"] == 20 and len(summary["val_losses"]) == 2
    assert summary["final_val_loss"] < 0.8 * summary["first_loss"]  # 20 steps cut it by more than 40%
    # The planner's prediction for the demo holds, although the run ends with validation (which frees
    # the pipeline's gradients): memory is measured as training holds it between steps.
    rows = summary["prediction"]["rows"]
    assert {r["name"] for r in rows if r["kind"] == "memory"} == {"params", "grads", "optimizer"}
    assert [r for r in rows if r["kind"] in ("memory", "comm") and not r["ok"]] == []
    # generation ran under the strategy on every rank, from the same broadcast tokens
    assert len({r["sample"] for r in results}) == 1 and results[0]["sample"].startswith("def ")
    log_dir, events = _events(root)
    assert (log_dir / "para_summary.json").is_file()
    scalars = set(events.Tags()["scalars"])
    expected = {"train_loss", "val_loss", "val_ppl", "perf/lr", "perf/tokens_per_s", "perf/step_ms"}
    expected |= {f"memory/rank{r}/{k}_MiB" for r in range(4) for k in ("params", "grads", "optimizer", "total")}
    expected |= {f"memory/rank{r}/expected_total_MiB" for r in range(4)}
    assert expected <= scalars, expected - scalars
    comm = {t for t in scalars if t.startswith("comm/")}
    assert any(t.endswith("_MB") for t in comm) and any(t.endswith("_ms") for t in comm), comm
    tensors = events.Tags()["tensors"]
    assert "samples/text/text_summary" in tensors and "memory/breakdown/text_summary" in tensors
    ppl, loss = events.Scalars("val_ppl")[-1].value, events.Scalars("val_loss")[-1].value
    assert abs(ppl - 2.718281828 ** loss) < 1e-3 * ppl  # perplexity = exp(mean token NLL)
    # the demo pipelines the model: idle fraction per stage and the measured timeline image
    pp = _degrees(GPT_DEMO).get("pp", 1)
    assert pp > 1, "the CPU demo is meant to show pipeline parallelism"
    assert {f"pipeline/idle_fraction/stage{s}" for s in range(pp)} | {"pipeline/expected_idle_fraction"} <= scalars
    assert {"comm/pp/send_MB", "comm/pp/recv_MB"} <= scalars
    (timeline,) = events.Tags()["images"]
    assert timeline == "pipeline/timeline" and events.Images(timeline)[-1].width == 1200


def cli_eval_job(args: list[str]) -> dict:
    """Run an evaluation subcommand; return the logged metrics and the prediction shapes."""
    from lightning_para.cli import run_cli

    cli = run_cli(args)
    predictions = cli.trainer.predict_loop.predictions if args[0] == "predict" else []
    return {"metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items()},
            "predictions": [tuple(p.shape) for p in predictions]}


def test_validate_and_predict_from_the_demo_checkpoint(pools, gpt_parallel_run, tmp_path):
    root, results = gpt_parallel_run
    (checkpoint,) = (next((root / "lightning_logs").glob("version_*")) / "checkpoints").glob("*step=20*")
    common = ["--config", str(GPT_DEMO), "--ckpt_path", str(checkpoint), "--trainer.default_root_dir", str(tmp_path),
              "--trainer.enable_progress_bar", "false", "--model.init_args.sample_tokens", "0",
              "--data.init_args.max_bytes", "300000"]
    validated = pools.get(4).run(cli_eval_job, ["validate", *common, "--trainer.limit_val_batches", "2"])[0]
    # the same weights and batches as the fit's last validation
    assert validated["metrics"]["val_loss"] == pytest.approx(results[0]["summary"]["final_val_loss"], rel=1e-6)
    predicted = pools.get(4).run(cli_eval_job, ["predict", *common, "--trainer.limit_predict_batches", "2"])[0]
    per_rank_batch = 16 // _dp_of(GPT_DEMO, 4)
    assert predicted["predictions"] == [(per_rank_batch, 64, 256)] * 2  # next-token logits


def _degrees(config: Path) -> dict:
    import yaml

    return yaml.safe_load(config.read_text())["trainer"]["strategy"]["init_args"]


def _dp_of(config: Path, world: int) -> int:
    degrees = _degrees(config)
    return world // (degrees.get("tp", 1) * degrees.get("pp", 1))


@pytest.fixture(scope="module")
def moe_parallel_run(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_demo")
    return root, _fit_demo(pools, MOE_DEMO, root)


def test_moe_demo_trains_and_logs_balance(moe_parallel_run):
    root, results = moe_parallel_run
    summary = results[0]["summary"]
    assert summary["final_val_loss"] < summary["first_loss"]
    _, events = _events(root)
    scalars = set(events.Tags()["scalars"])
    for layer in ("blocks.1.mlp", "blocks.3.mlp"):  # moe_every=2: the second and fourth blocks
        for key in ("balance_loss", "load_imbalance", "global_load_imbalance", "dropped_fraction"):
            assert f"moe/{layer}/{key}" in scalars, (layer, key)
    assert "comm/ep/all_to_all_MB" in scalars
    assert events.Scalars("moe/blocks.1.mlp/global_load_imbalance")[-1].value >= 1.0


def _assert_logged_like_one_device(parallel: list[dict], single: dict, keys: tuple[str, ...]) -> None:
    """Issue 14: what every rank's loggers see (``train_loss``, MoE ``train_aux_loss``) is the global batch's
    value, the one-device run's, step by step (fp32 tolerance: reductions in another order)."""
    for key in keys:
        assert len(single[key]) == 20, key
        for r in parallel:
            assert r[key] == parallel[0][key], f"rank {r['rank']} logged another {key} than rank 0"
        assert_losses_close(parallel[0][key], single[key], rtol=FP32_RTOL)


def test_one_device_gives_the_same_losses(pools, gpt_parallel_run, tmp_path):
    """The acceptance: the demo with tp=1, pp=1 on one device has the parallel run's per-step losses,
    and the tp=2 x pp=2 run logs them as `train_loss` on every rank."""
    _, parallel = gpt_parallel_run
    single = _one_device(pools, GPT_DEMO, tmp_path, "tp", "pp")
    _assert_same_train_and_val_losses(parallel[0]["summary"], single["summary"])
    _assert_logged_like_one_device(parallel, single, ("logged_loss",))


def test_moe_demo_on_one_device_gives_the_same_losses(pools, moe_parallel_run, tmp_path):
    """Issue 6's recipe parity: dp=4 x ep=2 (ZeRO-1) against all experts on one device, for the LM
    loss and the routers' aux loss. Each rank's aux loss is the mean over its own sequences
    (``balance_scope="sequence"``), so the mean over the 4 equal dp ranks (what ``sync_dist`` logs)
    is the global batch's."""
    _, parallel = moe_parallel_run
    assert _degrees(MOE_DEMO).get("ep", 1) == 2
    single = _one_device(pools, MOE_DEMO, tmp_path, "ep")
    _assert_same_train_and_val_losses(parallel[0]["summary"], single["summary"])
    assert all(v > 0 for v in single["aux"])
    _assert_logged_like_one_device(parallel, single, ("logged_loss", "aux"))


def test_bad_configurations_fail_before_any_process_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-para"])  # pytest's own argv is not the CLI's
    from lightning_para.cli import ConfigurationError, ParaCLI, main

    # run=False: parse and instantiate only, so nothing could ever launch from inside pytest
    base = ["--config", str(GPT_DEMO), "--trainer.default_root_dir", str(tmp_path)]
    # degrees that do not fit the devices: the strategy's ValueError, raised in this process
    with pytest.raises(ConfigurationError, match=r"world size 3 is not divisible by pp=\d x tp=2"):
        ParaCLI(args=[*base, "--trainer.strategy.tp", "2", "--trainer.devices", "3"], run=False)
    assert not dist.is_initialized()
    with pytest.raises(ConfigurationError, match=r"`data.path='/no/such/corpus.txt'` does not exist"):
        ParaCLI(args=[*base, "--data.init_args.path", "/no/such/corpus.txt"], run=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigurationError, match="is an empty file"):
        ParaCLI(args=[*base, "--data.init_args.path", str(empty)], run=False)
    with pytest.raises(ConfigurationError, match="Vocabulary mismatch: the data's tokenizer has 257 tokens"):
        ParaCLI(args=[*base, "--data.init_args.special_tokens", "['<|endoftext|>']"], run=False)
    # the console script prints the message, not a traceback, and exits with status 2
    assert main(["fit", *base, "--trainer.strategy.tp", "2", "--trainer.devices", "3"]) == 2
    assert "lightning-para: configuration error:" in capsys.readouterr().err


def _install_wheel(tmp: Path) -> Path:
    """``pip install`` of this repository as users get it: a built wheel, not editable, into its own
    site directory (the dependencies come from this environment)."""
    dist_dir, site = tmp / "dist", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist_dir), str(REPO)], check=True, timeout=300)
    (wheel,) = dist_dir.glob("lightning_para-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True, timeout=300)
    return site


def test_installed_wheel_runs_the_demo_from_an_unrelated_directory(tmp_path):
    """Outside a pool, as a user would: the console script of a non-editable install, started in a
    folder that is not the repository, launches its own processes (Lightning's launcher), trains the
    README's demo config (tp=2 x pp=2) and exits 0. The recipes and configs come from the wheel."""
    site = _install_wheel(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_"))}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    where = subprocess.run(
        [sys.executable, "-c", "import lightning_para.recipes as r; print(r.__file__); print(r.config_path('gpt-cpu-demo'))"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the installed copy, shipped configs included
    cmd = [
        str(site / "bin" / "lightning-para"), "fit", "--config", str(GPT_DEMO),
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--data.init_args.max_bytes", "100000", "--trainer.default_root_dir", str(elsewhere),
    ]
    proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning-para: loss at step 0" in proc.stdout
    assert (next((elsewhere / "lightning_logs").glob("version_*")) / "para_summary.json").is_file()


def test_config_short_names(tmp_path):
    from lightning_para.cli import ConfigurationError, resolve_config_names
    from lightning_para.recipes import config_names, config_path

    assert {"gpt-cpu-demo", "moe-cpu-demo"} <= set(config_names())
    assert config_path("gpt-cpu-demo").read_text() == GPT_DEMO.read_text()  # recipes/ links the shipped file
    args = resolve_config_names(["fit", "--config", "gpt-cpu-demo", "-c", "moe-cpu-demo.yaml", f"--config={GPT_DEMO}"])
    assert args == ["fit", "--config", str(config_path("gpt-cpu-demo")), "-c", str(config_path("moe-cpu-demo")), f"--config={GPT_DEMO}"]
    with pytest.raises(ConfigurationError, match=r"`--config gpt-gpu-demo` is neither a file nor a shipped config.*gpt-cpu-demo"):
        resolve_config_names(["fit", "--config", "gpt-gpu-demo"])
