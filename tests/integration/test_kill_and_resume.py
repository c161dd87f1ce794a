"""A representative case of the kill campaign (``scripts/kill_campaign.py`` runs all of them).

``pp=2 x dp=2`` as four separately started processes, 8 steps, checkpoints every 3 steps with
``save_last=True``. During save 4 (``last.ckpt`` at step 6, replacing step 3's) rank 0 SIGKILLs
itself after marking the new checkpoint complete and before swapping it in. Then:

* every survivor exits with the watchdog's code within ``watchdog_timeout + 10`` s, naming rank 0;
* ``last.ckpt`` is still the complete step-3 checkpoint (the new one waits, hidden, and is swept when the
  resumed fit starts);
* ``fit(ckpt_path="last")`` with ``ParaModelCheckpoint`` resumes from the newest complete checkpoint,
  ``step=6.ckpt`` (Lightning's own lookup takes ``last.ckpt``, three steps older: issue 24), and logs the
  uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

from lightning_para.checkpoint.atomic import checkpoint_problems, read_marker
from lightning_para.reliability.watchdog import WATCHDOG_EXIT_CODE
from tests.distributed.test_reliability import gpt_fit_job
from tests.integration.kill_helpers import launch, names_rank

TIMEOUT = 10.0


def test_rank0_killed_during_the_last_save_then_resume_from_last(pools, tmp_path):
    run = launch(tmp_path / "killed", "external", "--layout", "pp2dp2", "--steps", "8", "--save-every", "3",
                 "--watchdog-timeout", str(TIMEOUT), "--kill", "marker-written:0:4")
    ended = run.wait_all(600)
    codes, verdicts = run.exit_codes(), run.verdicts()
    assert codes[0] == -9, run.output()[-3000:]
    killed_at = ended[0]
    for rank in (1, 2, 3):
        assert codes[rank] == WATCHDOG_EXIT_CODE, run.output()[-3000:]
        assert names_rank(verdicts.get(rank), 0), verdicts
        assert ended[rank] - killed_at <= TIMEOUT + 10, ended
    folder = tmp_path / "killed" / "ckpt"
    assert checkpoint_problems(folder / "last.ckpt").complete and read_marker(folder / "last.ckpt")["global_step"] == 3
    leftovers = [p for p in folder.iterdir() if p.name.startswith(".last.ckpt.partial-")]
    assert len(leftovers) == 1 and read_marker(leftovers[0])["global_step"] == 6  # complete, never swapped in

    pool = pools.get(4)
    reference = pool.run(gpt_fit_job, {"pp": 2, "dp": 2}, 8)[0]["logged"]
    assert checkpoint_problems(folder / "step=6.ckpt").complete
    resumed = pool.run(gpt_fit_job, {"pp": 2, "dp": 2}, 8, str(folder), "last", 2, 123, True)[0]["logged"]
    assert resumed == reference[6:]  # bit for bit: the same layout from the step-6 checkpoint
    # Never taken for a checkpoint; swept when the resumed fit started (it holds the folder from its start).
    assert [p.name for p in folder.iterdir() if p.name.startswith(".last")] == []
