"""SIGTERM and SIGKILL while a checkpoint is being written in the background (``async_save=True``), under the
Trainer and Fabric: dp=2 ZeRO-1 (``tests/integration/async_train.py``), saves every 3 of 8 steps.

1. SIGTERM on rank 0 as step 4 starts, every write waiting 2 s before its shards: the step-3 save is still being
   written when every rank agrees to stop (after step 5; the agreement is read a step late). Every rank settles it,
   saves its preemption checkpoint (step 5) and exits with 143.
2. Resumed from the preemption checkpoint (bit for bit), rank 1 is SIGKILLed inside its background write of step 6
   (its shards written, no marker yet); rank 0 fails (the watchdog, or gloo's closed connection). Step 6 stays a
   hidden partial save;
   the Trainer's step 3, whose removal (``save_top_k=1``) waited for step 6 to complete, is still there.
3. ``ckpt_path="last"`` and ``"hpc"`` (Fabric: the newest complete checkpoint of the folder) resume the previous
   complete checkpoint (step 5) and log the uninterrupted run's losses bit for bit; the partial save is swept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker
from lightning_para.reliability.watchdog import WATCHDOG_EXIT_CODE
from tests.integration.async_train import train
from tests.integration.kill_helpers import launch

SCRIPT = Path(__file__).with_name("async_train.py")


def saved_step(path: Path) -> int:
    marker = read_marker(path)
    return marker["global_step"] if marker.get("global_step") is not None else torch.load(path / "meta.pt")["step"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("front_end", ("trainer", "fabric"))
def test_sigterm_and_sigkill_during_a_background_write(pools, tmp_path, front_end):
    pool = pools.get(2)
    trainer = front_end == "trainer"
    ckpt = tmp_path / "ckpt"
    base = {"front_end": front_end, "root": str(tmp_path), "ckpt": str(ckpt), "steps": 8, "every": 3}
    reference = pool.run(train, {**base, "root": str(tmp_path / "ref"), "every": 0})
    # 1. SIGTERM while the step-4 save is in flight.
    stopped = pool.run(train, {**base, "sigterm": 3, "slow_write": 2.0})
    assert [r["exit_code"] for r in stopped] == [143, 143], stopped
    assert [r["losses"] for r in stopped] == [{s: r["losses"][s] for s in range(1, 6)} for r in reference]
    preempted = tmp_path / "hpc_ckpt_1.ckpt" if trainer else ckpt / "preempted.ckpt"
    assert checkpoint_problems(preempted).complete and saved_step(preempted) == 5
    assert checkpoint_problems(ckpt / "step=3.ckpt").complete  # settled, not lost

    # 2. SIGKILL of rank 1 inside its background write of step 6.
    killed = launch(tmp_path / "killed", "external", json.dumps({**base, "resume": "hpc" if trainer else "newest",
                    "kill_write": [1, 1], "watchdog_timeout": 10.0}), script=SCRIPT, world=2)
    killed.wait_all(300)
    codes = killed.exit_codes()
    assert codes[1] == -9 and codes[0] in (WATCHDOG_EXIT_CODE, 1), (codes, killed.output()[-3000:])
    assert "[kill] rank 1 SIGKILLs itself in checkpoint write 1" in killed.output()
    assert killed.losses(0, so_far=True)[6] == reference[0]["losses"][6]  # resumed from the preemption checkpoint exactly
    assert not (ckpt / "step=6.ckpt").exists()
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".step=6.ckpt.partial-")], list(ckpt.iterdir())
    assert checkpoint_problems(ckpt / "step=3.ckpt").complete and checkpoint_problems(preempted).complete

    # 3. Every resume takes the previous complete checkpoint (step 5).
    for request in ("last", "hpc") if trainer else ("newest",):
        resumed = pool.run(train, {**base, "every": 100, "resume": request})  # a checkpoint callback, no saves
        assert [r["losses"] for r in resumed] == [{s: r["losses"][s] for s in (6, 7, 8)} for r in reference], request
        if trainer:  # swept when the fit began (Fabric's next save into the folder sweeps it)
            assert not [p for p in ckpt.iterdir() if ".partial-" in p.name]
