"""Does torch's experimental ``context_parallel`` run on CPU/gloo? Prints one line per case.

    python scripts/probe_torch_context_parallel.py

Two gloo processes shard q, k, v (the buffers) with ``context_parallel``, call
``F.scaled_dot_product_attention`` inside it, and compare output and gradients with one-process
SDPA; ``CommDebugMode`` shows what DTensor communicated. Self-contained on purpose, so it can
be re-run on a new torch release. Results for torch 2.13 are in
docs/context_parallel_torch_probe.md.
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WORLD, SEQ = 2, 16


def head_tail_shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    """The default load balancer's layout: chunks rank and 2*WORLD-1-rank along dim 2."""
    chunks = t.chunk(2 * WORLD, dim=2)
    return torch.cat([chunks[rank], chunks[2 * WORLD - 1 - rank]], dim=2)


def attempt(rank: int, mesh, causal: bool, backend) -> str:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import context_parallel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, SEQ, 8, generator=g) for _ in range(3))
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=causal)
    ref.sum().backward()
    buffers = [t.clone() for t in (q, k, v)]
    stage, comm = "enter", CommDebugMode()
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            local = [t.detach().clone().requires_grad_() for t in buffers]  # a leaf cannot be resized
            stage = "forward"
            with (sdpa_kernel(backend) if backend is not None else torch.enable_grad()), comm:
                out = F.scaled_dot_product_attention(*local, is_causal=causal)
            out_err = float((out.detach() - head_tail_shard(ref.detach(), rank)).abs().max())
            stage = "backward"
            out.sum().backward()
            grad_err = max(
                float((x.grad - head_tail_shard(r.grad, rank)).abs().max()) for x, r in zip(local, ref_inputs)
            )
        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        return f"ran: max|out-ref|={out_err:.1e} max|grad-ref|={grad_err:.1e} forward comm={counts}"
    except Exception as err:  # noqa: BLE001 - the point is to report it
        return f"FAILED in {stage}: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def main(rank: int, port: int) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    for causal in (True, False):
        for backend in (None, SDPBackend.MATH):
            line = attempt(rank, mesh, causal, backend)
            if rank == 0:
                name = backend.name if backend is not None else "default"
                print(f"is_causal={causal} backend={name}: {line}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    print(f"torch {torch.__version__}, gloo, world size {WORLD}")
    mp.spawn(main, args=(free_port,), nprocs=WORLD)
