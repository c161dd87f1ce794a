"""The long-context recipe (``recipes/gpt-long-context-cpu.yaml``, cp=2 x tp=2 at 4x the demo's
sequence length) under the ``lightning-para`` CLI: it trains, generates, and TensorBoard shows
the context-parallel traffic under ``comm/cp``."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.integration.test_recipes_cli import GPT_DEMO, _events, _fit_demo

LONG_CONTEXT = Path(__file__).resolve().parents[2] / "recipes" / "gpt-long-context-cpu.yaml"


def test_long_context_recipe_trains_with_cp_and_tp_and_logs_comm_cp(pools, tmp_path):
    config, demo = (yaml.safe_load(p.read_text()) for p in (LONG_CONTEXT, GPT_DEMO))
    assert config["data"]["init_args"]["seq_len"] == 4 * demo["data"]["init_args"]["seq_len"] == 256
    assert {"cp": 2, "tp": 2}.items() <= config["trainer"]["strategy"]["init_args"].items()
    # FAST: 20 steps with validation twice; the comm tracer samples every 4th step.
    results = _fit_demo(pools, LONG_CONTEXT, tmp_path, "--model.init_args.sample_tokens", "4")
    summary = results[0]["summary"]
    assert summary["steps"] == 20 and len(summary["val_losses"]) == 2
    assert summary["final_val_loss"] < 0.8 * summary["first_loss"]
    # every rank generated the same text, each token from 256-byte windows split over cp
    assert len({r["sample"] for r in results}) == 1 and results[0]["sample"].startswith("def ")
    _, events = _events(tmp_path)
    scalars = set(events.Tags()["scalars"])
    ring = {"comm/cp/send_MB", "comm/cp/recv_MB", "comm/cp/total_MB"}  # K/V blocks around the ring
    assert ring <= scalars, sorted(t for t in scalars if t.startswith("comm/"))
    assert {"comm/tp/all_reduce_MB", "train_loss", "val_loss"} <= scalars
    # ring attention sends 2(c-1) = 2 K/V blocks per layer forward and again in backward, plus
    # the fp32 dK/dV hops: the traced step's cp bytes are far above zero and equal in and out.
    sent, received = events.Scalars("comm/cp/send_MB")[-1].value, events.Scalars("comm/cp/recv_MB")[-1].value
    assert sent > 0 and sent == received
