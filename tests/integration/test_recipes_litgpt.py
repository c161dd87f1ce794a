"""The LitGPT recipe under the ``lightning-para`` CLI: a few steps of ``recipes/litgpt-cpu-demo.yaml``
(tp=2 x pp=2 + SP, 4 processes) against the same config on one device (tp = pp = 1)."""

from __future__ import annotations

import pytest

pytest.importorskip("litgpt")

from tests.integration.test_recipes_cli import REPO, _events  # noqa: E402
from tests.integration.test_recipes_hf import FAST, STEPS, hf_cli_job  # noqa: E402
from tests.parity import FP32_RTOL, assert_losses_close  # noqa: E402

pytestmark = pytest.mark.slow
DEMO = REPO / "recipes" / "litgpt-cpu-demo.yaml"


def test_litgpt_demo_matches_one_device(pools, tmp_path):
    """The demo trains under tp=2 x pp=2 + SP (losses fall, TensorBoard has them) with the one-device losses."""
    args = ["fit", "--config", str(DEMO), *FAST]
    parallel = pools.get(4).run(hf_cli_job, [*args, "--trainer.default_root_dir", str(tmp_path / "par")])[0]
    single = pools.get(1).run(hf_cli_job, [
        *args, "--trainer.default_root_dir", str(tmp_path / "one"), "--trainer.devices", "1",
        "--trainer.strategy.sequence_parallel", "false", "--trainer.strategy.tp", "1", "--trainer.strategy.pp", "1",
    ])[0]
    summary = parallel["summary"]
    assert summary["steps"] == STEPS and summary["train_losses"][-1] < summary["train_losses"][0]
    assert {"train_loss", "val_loss", "comm/pp/send_MB"} <= set(_events(tmp_path / "par")[1].Tags()["scalars"])
    assert_losses_close(summary["train_losses"], single["summary"]["train_losses"], rtol=FP32_RTOL)
    assert_losses_close([v for _, v in summary["val_losses"]], [v for _, v in single["summary"]["val_losses"]],
                        rtol=FP32_RTOL)
