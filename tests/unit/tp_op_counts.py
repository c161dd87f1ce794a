"""Counts of the operators the GPT recipe dispatches under tensor parallelism, DTensor and plain, per
part of the model (run in a process of its own: it starts torch's fake process group).

Used by ``tests/unit/test_plan_overhead.py`` to recount ``lightning_para.plan.overhead``'s TP constants.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_para.instrument.operators import DTensorOpCounter


def count_gpt_tensor_parallel(sequence_parallel: bool, tp: int = 2) -> dict[str, Any]:
    """``{part: (dtensor, plain)}`` for a layer's forward/backward/optimizer step and the embedding's and
    head's (with the loss), from 1- and 2-layer GPT(tiny) models under ``tp`` (fake process group)."""
    from lightning_para.config import ParallelConfig
    from lightning_para.parallel.tensor import loss_parallel_backward, loss_parallel_step
    from lightning_para.parallelize import parallelize
    from lightning_para.simulate import start_fake_world
    from lightning_para.recipes import GPT

    torch.set_num_threads(1)
    start_fake_world(tp, 0)
    totals = {}
    embedding: dict[str, tuple[int, int]] = {}
    for layers in (1, 2):
        config = ParallelConfig(tp=tp, sequence_parallel=sequence_parallel)
        dims = config.resolve_dims(tp)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = GPT(preset="tiny", sample_tokens=0)
        model.blocks = nn.ModuleList(list(model.blocks)[:layers])
        parallelize(model, dims, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, 256, (4, 64))

        def forward() -> torch.Tensor:
            with loss_parallel_step(True):
                return model.loss_fn(model(idx), idx)

        with loss_parallel_backward(True):
            forward().backward()
        optimizer.step()
        with DTensorOpCounter() as fwd:
            loss = forward()
        with DTensorOpCounter() as bwd, loss_parallel_backward(True):
            loss.backward()
        with DTensorOpCounter() as opt:
            optimizer.step()
        totals[layers] = (fwd.pair(), bwd.pair(), opt.pair())
        if layers == 1:
            out = model.embed(idx)
            with DTensorOpCounter() as efwd:
                out = model.embed(idx)
            grad = out.detach() * 0 + 1 if not isinstance(out, DTensor) else out.detach().clone()
            with DTensorOpCounter() as ebwd:
                out.backward(grad)
            embedding = {"forward": efwd.pair(), "backward": ebwd.pair()}
    one, two = totals[1], totals[2]
    layer = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(one, two)]
    rest = [(a[0] - l[0], a[1] - l[1]) for a, l in zip(one, layer)]
    return {
        "layer_forward": layer[0], "layer_backward": layer[1], "layer_optimizer": layer[2],
        "embedding_forward": embedding["forward"], "embedding_backward": embedding["backward"],
        "head_forward": (rest[0][0] - embedding["forward"][0], rest[0][1] - embedding["forward"][1]),
        "head_backward": (rest[1][0] - embedding["backward"][0], rest[1][1] - embedding["backward"][1]),
        "rest_optimizer": rest[2],
    }


if __name__ == "__main__":
    import sys

    print(count_gpt_tensor_parallel(sys.argv[1:] == ["sp"]))
