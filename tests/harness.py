"""Real multi-process gloo groups for tests, spawned once and reused for many jobs.

A :class:`WorkerPool` starts ``world_size`` processes that each join one gloo process group,
then runs *jobs* on all of them: a module-level function (pickled by reference) with
arguments. Each rank returns a value; the pool collects them in rank order.

Why a pool: spawning a process and importing torch + Lightning costs ~3-5 s per rank on two
cores; a test module with twenty layouts would spend minutes just starting processes.

Why a fork server: even pooled, a module that switches between world sizes restarts its pool,
and the suite starts ~100 pools. Workers are therefore forked from one ``forkserver`` process
that imported torch, Lightning, lightning-para and transformers once per session
(``PRELOADED_MODULES``): a 4-rank pool starts in ~1 s instead of ~20-100 s (measured on two
busy cores). Each worker is still a fresh process with its own process group, and gets the test
process's environment as it is when the pool starts, as a spawned one would.

Hangs fail fast: every job has a deadline, the gloo group has a timeout, and a rank that
raises gives the others a short grace period before the pool is killed and restarted. The
environment each worker sees is the one ``torchrun`` gives (RANK, LOCAL_RANK, NODE_RANK,
WORLD_SIZE, MASTER_ADDR/PORT), so a ``Trainer`` inside a job joins the existing group
instead of launching processes.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import subprocess
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

# Imported once by the fork server; a missing optional one (transformers) is skipped by multiprocessing.
PRELOADED_MODULES = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.pipelining", "lightning", "lightning.pytorch", "lightning_para", "lightning_para.strategy",
    "transformers", "transformers.models.llama.modeling_llama", "tests.hf_models", "litgpt.model",
]
_CONTEXT = None


def _worker_context():
    """The ``forkserver`` context with :data:`PRELOADED_MODULES` (set before the server starts)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOADED_MODULES)
    return _CONTEXT


DEFAULT_JOB_TIMEOUT = float(os.environ.get("PARA_TEST_JOB_TIMEOUT", 300))
PROCESS_GROUP_TIMEOUT = float(os.environ.get("PARA_TEST_PG_TIMEOUT", 120))
ERROR_GRACE_SECONDS = float(os.environ.get("PARA_TEST_ERROR_GRACE", 15))


class WorkerError(RuntimeError):
    """One or more ranks raised; the message holds every rank's traceback."""

    def __init__(self, errors: dict[int, str], pending: tuple[int, ...] = ()) -> None:
        self.errors = errors
        self.pending = pending
        parts = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items())]
        if pending:
            parts.append(f"ranks {list(pending)} did not finish (hang or crash); the pool was restarted")
        super().__init__("\n".join(parts))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_environment(rank: int, world_size: int, port: int, nproc_per_node: int) -> dict[str, str]:
    """The torchrun-like variables Lightning's ``LightningEnvironment`` reads."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % nproc_per_node),
        "NODE_RANK": str(rank // nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "OMP_NUM_THREADS": "1",
    }


def slurm_environment(rank: int, world_size: int, nproc_per_node: int) -> dict[str, str]:
    """What ``srun --ntasks-per-node=P`` gives each task (read by Lightning's ``SLURMEnvironment``)."""
    return {
        "SLURM_NTASKS": str(world_size),
        "SLURM_NTASKS_PER_NODE": str(nproc_per_node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % nproc_per_node),
        "SLURM_NODEID": str(rank // nproc_per_node),
        "SLURM_JOB_NAME": "lightning-para-tests",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "127.0.0.1",
    }


def _worker_main(rank, world_size, port, nproc_per_node, job_queue, result_queue, extra_env, parent_env) -> None:
    # The fork server's environment is the session's at its start; a spawned worker would see the test's now.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(worker_environment(rank, world_size, port, nproc_per_node))
    os.environ.update(extra_env)
    if extra_env.get("PARA_TEST_SLURM") == "1":  # emulate srun instead of torchrun
        os.environ.update(slurm_environment(rank, world_size, nproc_per_node))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT)
    )
    while True:
        job = job_queue.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        try:
            result = fn(*args, **kwargs)
            result_queue.put((job_id, rank, True, result))
        except BaseException:  # noqa: BLE001 - every failure must reach the test
            result_queue.put((job_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _code_main(code: str, argv: list, result_queue: Any, parent_env: dict) -> None:
    import contextlib
    import io
    import sys

    os.environ.clear()
    os.environ.update(parent_env)
    sys.argv = ["-c", *argv]
    out, err, code_rc = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, "<test child>", "exec"), {"__name__": "__main__"})  # noqa: S102 - test code
        except SystemExit as stop:
            code_rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - every failure must reach the test
            traceback.print_exc()
            code_rc = 1
    result_queue.put((code_rc, out.getvalue(), err.getvalue()))


def run_code(code: str, *argv: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code argv...`` would, in a new process forked from the fork server (torch,
    Lightning and lightning-para already imported): a process of its own, so process-wide state (torch's fake
    process group of the dry run, a disabled garbage collector) stays there, started in ~1 s instead of a new
    interpreter's ~10 s on two cores. Returns its exit code and what Python code printed to stdout and stderr."""
    ctx = _worker_context()
    results = ctx.Queue()
    process = ctx.Process(target=_code_main, args=(code, list(argv), results, dict(os.environ)), daemon=True)
    process.start()
    try:
        returncode, stdout, stderr = results.get(timeout=timeout)
    except queue.Empty:
        process.kill()
        process.join(10)
        return subprocess.CompletedProcess(["-c", *argv], -9, "", f"timed out after {timeout} s")
    process.join(30)
    return subprocess.CompletedProcess(["-c", *argv], returncode, stdout, stderr)


def run_codes(jobs: list[tuple[str, ...]], timeout: float = 600.0) -> list[subprocess.CompletedProcess]:
    """:func:`run_code` of each ``(code, *argv)`` job, as many at once as there are cores, in job order: the suite runs
    one test at a time, so a test's sequence of one-process dry runs leaves the other cores idle."""
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: run_code(*job, timeout=timeout), jobs))


def _script_main(script: str, argv: list, env: dict, log: str) -> None:
    import runpy
    import sys
    import threading

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter does: print it, exit 1
        traceback.print_exc()
        code = 1
    # What the interpreter does at its end: wait for non-daemon threads, then run atexit callbacks.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ScriptProcess:
    """What :func:`start_script` started, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> Optional[int]:
        """The exit code, or ``-N`` when signal ``N`` ended it (as ``Popen``); ``None`` while it runs."""
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["<script>"], timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def start_script(script: str, argv: list[str], env: dict[str, str], log: str) -> ScriptProcess:
    """Start ``python script argv...`` with environment ``env``, stdout and stderr into the file ``log``,
    as a new process forked from the fork server (torch, Lightning and lightning-para already imported):
    a process of its own (its pid, signals and exit code, ``-9`` after SIGKILL), started in ~1 s instead of
    a new interpreter's ~10 s on two cores. It ends as the interpreter would: non-daemon threads joined,
    ``atexit`` callbacks run, exit code from ``SystemExit`` (1 and the traceback after an exception)."""
    # Not a daemon, so it may start processes of its own, as a script can; killed if the tests end first.
    process = _worker_context().Process(target=_script_main, args=(str(script), list(argv), dict(env), str(log)))
    process.start()
    if not _STARTED_SCRIPTS:
        atexit.register(_kill_scripts)
    _STARTED_SCRIPTS.append(process)
    return ScriptProcess(process)


_STARTED_SCRIPTS: list = []


def _kill_scripts() -> None:
    for process in _STARTED_SCRIPTS:
        if process.is_alive():
            process.kill()
            process.join(5)


class WorkerPool:
    """``world_size`` processes in one gloo group that run jobs until closed."""

    def __init__(self, world_size: int, nproc_per_node: Optional[int] = None, env: Optional[dict] = None) -> None:
        self.world_size = world_size
        self.nproc_per_node = nproc_per_node or world_size
        self.env = dict(env or {})
        self._ctx = _worker_context()
        self._procs: list = []
        self._job_queues: list = []
        self._result_queue = None
        self._job_id = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        port = _free_port()
        self._result_queue = self._ctx.Queue()
        self._job_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for rank in range(self.world_size):
            p = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.nproc_per_node, self._job_queues[rank], self._result_queue, self.env,
                      dict(os.environ)),
                daemon=True,
            )
            p.start()
            self._procs.append(p)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: Optional[float] = None,
        keep_alive_on_error: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises :class:`WorkerError` if any rank raises or does not finish in ``timeout`` seconds.
        After an error the pool restarts (a half-finished collective could poison later jobs),
        unless ``keep_alive_on_error`` says the job fails before any collective.
        """
        self.start()
        self._job_id += 1
        job_id = self._job_id
        for q in self._job_queues:
            q.put((job_id, fn, args, kwargs))
        deadline = time.monotonic() + (timeout or DEFAULT_JOB_TIMEOUT)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        error_deadline = None
        while pending:
            now = time.monotonic()
            limit = deadline if error_deadline is None else min(deadline, error_deadline)
            if now >= limit:
                break
            try:
                got_id, rank, ok, payload = self._result_queue.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead:
                    for r in dead:
                        errors.setdefault(r, f"process exited with code {self._procs[r].exitcode}")
                    break
                continue
            if got_id != job_id:
                continue  # a straggler from a job that already failed
            pending.discard(rank)
            if ok:
                results[rank] = payload
            else:
                errors[rank] = payload
                error_deadline = error_deadline or time.monotonic() + ERROR_GRACE_SECONDS
        if pending:
            if not errors:
                errors = {r: "no result before the deadline" for r in pending}
            self.close()
            raise WorkerError(errors, tuple(sorted(pending)))
        if errors:
            if not keep_alive_on_error:
                self.close()
            raise WorkerError(errors)
        return results

    def close(self) -> None:
        for q in self._job_queues:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._job_queues = []


class PoolManager:
    """One live pool at a time (two cores cannot host several), restarted on size changes."""

    def __init__(self) -> None:
        self._pool: Optional[WorkerPool] = None

    def get(self, world_size: int, nproc_per_node: Optional[int] = None, env: Optional[dict] = None) -> WorkerPool:
        key = (world_size, nproc_per_node or world_size, tuple(sorted((env or {}).items())))
        if self._pool is not None:
            current = (self._pool.world_size, self._pool.nproc_per_node, tuple(sorted(self._pool.env.items())))
            if current != key:
                self._pool.close()
                self._pool = None
        if self._pool is None:
            self._pool = WorkerPool(world_size, nproc_per_node, env)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

