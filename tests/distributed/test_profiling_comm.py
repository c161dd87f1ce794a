"""ParaProfiler's communication numbers against the independent test counter, per layout.

On the step the profiler traces, a second dispatch mode (``tests/comm_counter.py``: its own
interception, group names and sums; only the op table, ``classify``, is the library's, pinned op
by op in ``tests/unit/test_profiling.py``) counts the same collectives; the bytes per collective
kind must agree exactly, and every op must be attributed to a mesh dimension of the layout.
"""

from __future__ import annotations

import pytest

from lightning_para.recipes.gpt import GPT

TRACED_BATCH = 1  # ParaProfiler(comm_every_n_steps=2) traces batch 1


class CountedGPT(GPT):
    """Counts the traced batch's collectives with CollectiveCounter, nested inside the profiler's tracer:
    entered after it (module hooks run after the callbacks') and left when the optimizer step
    (with ZeRO's post-step all-gather) has returned, before the profiler logs anything."""

    def __init__(self, **kwargs):
        super().__init__(n_layer=2, n_embd=32, n_head=4, block_size=16, sample_tokens=0, **kwargs)
        self.counter = None

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == TRACED_BATCH:
            from tests.comm_counter import CollectiveCounter

            self.counter = CollectiveCounter()
            self.counter.__enter__()

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        if self.counter is not None and self.trainer.fit_loop.epoch_loop.batch_idx == TRACED_BATCH:
            self.counter.__exit__(None, None, None)


def comm_job(strategy_kwargs: dict) -> dict:
    import lightning as L
    import torch.distributed as dist

    from lightning_para import ParaStrategy
    from lightning_para.instrument.collectives import CollectiveCounter
    from lightning_para.recipes.data import TextDataModule
    from lightning_para.observe.profiler import ParaProfiler

    captured = {}
    original_summary = CollectiveCounter.summary

    def keep(self):  # the profiler's own numbers, as it logs them
        captured.update(original_summary(self))
        return original_summary(self)

    CollectiveCounter.summary = keep
    try:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=dist.get_world_size(), strategy=ParaStrategy(**strategy_kwargs), max_steps=3,
            limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[ParaProfiler(comm_every_n_steps=2, memory_every_n_steps=0)],
        )
        model = CountedGPT()
        trainer.fit(model, datamodule=TextDataModule(max_bytes=40_000, seq_len=16, global_batch_size=8))
    finally:
        CollectiveCounter.summary = original_summary
    return {"tracer": captured, "counter": dict(model.counter.bytes_by_kind)}


LAYOUTS = [
    ({"zero": 0}, {"dp"}),
    ({"zero": 3}, {"dp"}),
    ({"pp": 2, "zero": 1}, {"dp", "pp"}),
    ({"tp": 2, "pp": 2}, {"tp", "pp", "dp"}),  # "dp": ZeRO's bucket calls on the size-1 dp group
]


@pytest.mark.parametrize("strategy_kwargs,dims", LAYOUTS, ids=[str(k) for k, _ in LAYOUTS])
def test_profiler_bytes_match_the_independent_counter(pools, strategy_kwargs, dims):
    for result in pools.get(4).run(comm_job, strategy_kwargs):
        tracer, counter = result["tracer"], result["counter"]
        by_kind: dict[str, float] = {}
        for key, entry in tracer.items():
            dim, kind = key.split("/")
            # "world": the `train_loss` logging's sync_dist (issue 14) on the default group.
            assert dim in dims | {"world"}, f"{key} attributed to {dim!r}, expected one of {dims}"
            by_kind[kind] = by_kind.get(kind, 0) + entry["bytes"]
            if kind not in ("send", "recv"):
                assert entry["seconds"] > 0
        assert counter and by_kind == {k: float(v) for k, v in counter.items()}
