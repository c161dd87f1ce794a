"""The transformers recipes under the ``lightning-para`` CLI: a few steps of each demo config in real
gloo groups against the same config on one device (tp/pp/ep set to 1), and what reaches TensorBoard.

Both parallel runs come first (one pool of 4), then both one-device runs (one pool of 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.integration.test_recipes_cli import REPO, LoggedLosses, _events  # noqa: E402
from tests.parity import FP32_RTOL, assert_losses_close  # noqa: E402

LLAMA_DEMO = REPO / "recipes" / "hf-llama-cpu-demo.yaml"
MIXTRAL_DEMO = REPO / "recipes" / "hf-mixtral-cpu-demo.yaml"
STEPS = 8
FAST = [
    "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1", "--profiling.comm_every_n_steps", "4",
    "--profiling.timeline_every_n_steps", "4", "--profiling.memory_every_n_steps", "8",
    "--data.init_args.max_bytes", "300000",
]
_runs: dict[tuple[str, int], dict] = {}


def hf_cli_job(args: list[str]) -> dict:
    from lightning_para.cli import run_cli
    from lightning_para.observe.profiler import ParaProfiler

    cli = run_cli([*args, "--trainer.callbacks+=tests.integration.test_recipes_cli.LoggedLosses"])
    profiler = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ParaProfiler))
    logged = next(cb for cb in cli.trainer.callbacks if isinstance(cb, LoggedLosses))
    return {"summary": profiler.last_summary, "aux": logged.aux, "logged_loss": logged.loss}


def _run(pools, config: Path, root: Path, world: int, *degrees_to_one: str) -> dict:
    key = (config.name, world)
    if key not in _runs:
        overrides = []
        if world == 1:
            overrides = ["--trainer.devices", "1", "--trainer.strategy.dp", "auto", "--trainer.strategy.sequence_parallel", "false"]
            for degree in degrees_to_one:
                overrides += [f"--trainer.strategy.{degree}", "1"]
        args = ["fit", "--config", str(config), *FAST, "--trainer.default_root_dir", str(root), *overrides]
        _runs[key] = {"root": root, "result": pools.get(world).run(hf_cli_job, args)[0]}
    return _runs[key]


def test_demos_train_under_their_layouts(pools, tmp_path_factory):
    """tp=2 x pp=2 + SP (Llama) and tp=2 x ep=2 (Mixtral, router loss and selection bias on): losses fall,
    TensorBoard has them."""
    for config in (LLAMA_DEMO, MIXTRAL_DEMO):
        run = _run(pools, config, tmp_path_factory.mktemp(config.stem), 4)
        summary = run["result"]["summary"]
        assert summary["steps"] == STEPS and len(summary["val_losses"]) == 2
        assert summary["train_losses"][-1] < summary["train_losses"][0]
        scalars = set(_events(run["root"])[1].Tags()["scalars"])
        assert {"train_loss", "val_loss", "perf/tokens_per_s"} <= scalars
    assert {"pipeline/expected_idle_fraction", "comm/pp/send_MB"} <= set(_events(_runs[(LLAMA_DEMO.name, 4)]["root"])[1].Tags()["scalars"])
    mixtral = _runs[(MIXTRAL_DEMO.name, 4)]
    scalars = set(_events(mixtral["root"])[1].Tags()["scalars"])
    assert "comm/ep/all_to_all_MB" in scalars
    # the selection bias's global load per layer, through ParaProfiler (bias_update_rate in the demo)
    assert {f"moe/model.model.layers.{i}.mlp.gate/global_load_imbalance" for i in range(4)} <= scalars
    assert len(mixtral["result"]["aux"]) == STEPS and all(v > 0 for v in mixtral["result"]["aux"])


@pytest.mark.parametrize("config, degrees", [(LLAMA_DEMO, ("tp", "pp")), (MIXTRAL_DEMO, ("tp", "ep"))], ids=["llama", "mixtral"])
def test_one_device_gives_the_same_losses(pools, tmp_path, config, degrees):
    """The demo on one device has the parallel run's per-step train and val losses (the Mixtral loss
    includes the router loss, computed over the whole batch of both data-parallel ranks)."""
    parallel = _runs[(config.name, 4)]["result"]
    single = _run(pools, config, tmp_path, 1, *degrees)["result"]
    assert_losses_close(parallel["summary"]["train_losses"], single["summary"]["train_losses"], rtol=FP32_RTOL)
    assert_losses_close([v for _, v in parallel["summary"]["val_losses"]],
                        [v for _, v in single["summary"]["val_losses"]], rtol=FP32_RTOL)
    if parallel["aux"]:
        assert_losses_close(parallel["aux"], single["aux"], rtol=FP32_RTOL)
