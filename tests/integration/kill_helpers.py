"""Start ``reliability_train.py`` as real processes, kill one rank, and read what the survivors did.

Shared by ``tests/integration/test_watchdog.py`` (a representative case) and
``scripts/kill_campaign.py`` (the full campaign). Two launchers: ``"external"`` starts every rank
itself (``RANK``/``WORLD_SIZE``/``MASTER_*``, as torchrun or a scheduler would), ``"lightning"``
starts one process with ``--devices 4`` and Lightning's launcher spawns the other three. Under
``"external"`` each rank is forked from the tests' fork server (``tests.harness.start_script``: torch and
Lightning imported once per session, not ~5 s per rank), still a process of its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_para.reliability.processes import process_alive
from tests.harness import ScriptProcess, start_script

SCRIPT = Path(__file__).with_name("reliability_train.py")
REPO = SCRIPT.parents[2]
WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "NODE_RANK", "SLURM_", "LIGHTNING_PARA_RUN_ID", "TORCHELASTIC_", "PBS_", "LSB_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


@dataclass
class Run:
    """One launch of the training script: its processes and where they write."""

    out: Path
    launcher: str
    world: int = WORLD
    procs: list[subprocess.Popen | ScriptProcess] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def rank_pids(self) -> dict[int, int]:
        pids = {}
        for r in range(self.world):
            f = self.out / f"rank{r}.pid"
            if f.is_file() and f.read_text().strip():
                pids[r] = int(f.read_text())
        return pids

    def wait_started(self, limit: float = 300.0) -> bool:
        """All ranks are training (each wrote its pid file), or some process already ended."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if len(self.rank_pids()) == self.world:
                return True
            if any(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.1)
        return False

    def kill_rank(self, rank: int) -> float:
        os.kill(self.rank_pids()[rank], signal.SIGKILL)
        return time.monotonic()

    def wait_all(self, limit: float) -> dict[int, Optional[float]]:
        """Wait until every process ended; seconds from now until each rank's ended (``None``: still
        running at ``limit``, then killed). Ranks are known by their pid files, and, for processes this
        harness started itself (all of them under ``"external"``, rank 0 under ``"lightning"``), by process."""
        start = time.monotonic()
        ended: dict[int, Optional[float]] = {}
        while time.monotonic() - start < limit:
            now = time.monotonic() - start
            for i, p in enumerate(self.procs):
                if p.poll() is not None:  # also reaps it, so a dead child is not a zombie
                    ended.setdefault(i, now)
            pids = self.rank_pids()
            for rank, pid in pids.items():
                if rank not in ended and not process_alive(pid):
                    ended[rank] = now
            if all(p.returncode is not None for p in self.procs) and all(r in ended for r in pids):
                break
            time.sleep(0.05)
        for rank, pid in self.rank_pids().items():
            if rank not in ended:
                ended[rank] = None
                try:
                    os.kill(pid, signal.SIGUSR1)  # its stacks, for the report
                    time.sleep(1)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                ended[i] = None
                p.kill()
            p.wait()
        return ended

    def output(self) -> str:
        return "".join((self.out / f"stdout{i}.txt").read_text(errors="replace") for i in range(len(self.procs)))

    def exit_codes(self) -> dict[int, Optional[int]]:
        """Each rank's exit code: from the process for ranks we started, from its own watchdog line otherwise."""
        codes: dict[int, Optional[int]] = {}
        if self.launcher == "external":
            return {r: p.returncode for r, p in enumerate(self.procs)}
        codes[0] = self.procs[0].returncode
        text = self.output()
        for r in range(1, self.world):
            m = re.search(rf"\[rank {r}\] .*exiting with code (\d+)", text)
            codes[r] = int(m.group(1)) if m else None
        return codes

    def verdicts(self) -> dict[int, str]:
        """The watchdog verdict line each rank printed (``[rank r] lightning-para watchdog: ...``)."""
        found = {}
        for line in self.output().splitlines():
            m = re.match(r"\[rank (\d+)\] lightning-para watchdog: (.*)", line)
            if m:
                found.setdefault(int(m.group(1)), m.group(2))
        return found

    def losses(self, rank: int = 0, so_far: bool = False) -> Optional[dict[int, float]]:
        """The losses rank ``rank`` logged by global step (``so_far``: also where it did not finish)."""
        f = self.out / (f"rank{rank}.steps.json" if so_far else f"rank{rank}.json")
        return {int(k): v for k, v in json.loads(f.read_text())["losses"].items()} if f.is_file() else None


def slurm_env(job_id: str, rank: int) -> dict[str, str]:
    """What ``srun`` gives rank ``rank`` of a one-node job of :data:`WORLD` tasks: Lightning then detects
    SLURM (``SLURMEnvironment``), and ``fit(ckpt_path=None)`` resumes with ``"hpc"``."""
    return dict(SLURM_JOB_ID=job_id, SLURM_JOB_NAME="train", SLURM_NTASKS=str(WORLD), SLURM_NTASKS_PER_NODE=str(WORLD),
                SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                SLURM_NODELIST="127.0.0.1")


def launch(
    out: Path, launcher: str, *args: str, env: Optional[dict[str, str]] = None, slurm: Optional[str] = None,
    script: Path = SCRIPT, world: int = WORLD,
) -> Run:
    """Start ``script`` (default: the training script) with ``args`` on ``world`` ranks under ``launcher`` (see the
    module docstring); ``env``: added to every process's environment (e.g. a scheduler's job id); ``slurm``: as
    ``srun`` would start job ``slurm``'s tasks (``"external"`` only)."""
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, launcher, world)
    command = [sys.executable, str(script), "--out", str(out), *args]
    if launcher == "lightning":
        process_env = {**base_env(), **(env or {})}
        with open(out / "stdout0.txt", "w") as log:
            run.procs.append(subprocess.Popen([*command, "--devices", str(world)], env=process_env, stdout=log, stderr=subprocess.STDOUT))
        return run
    port = free_port()
    for rank in range(world):
        process_env = {**base_env(), **(env or {})}
        process_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
        if slurm is not None:
            process_env.update(slurm_env(slurm, rank))
        # Forked from the tests' fork server (torch and Lightning imported once, not in every rank): each rank is
        # still a process of its own, with its own pid, signals and exit code.
        run.procs.append(start_script(str(script), [*command[2:], "--devices", str(world)], process_env,
                                      str(out / f"stdout{rank}.txt")))
    return run


def names_rank(verdict: Optional[str], rank: int) -> bool:
    return verdict is not None and re.search(rf"\brank {rank}\b", verdict) is not None
