"""Recurrent modules (``nn.LSTM``, ``nn.RNN``) under ZeRO-3 against one device (issue 24).

Lightning's parity test with its ``ParityModuleRNN``, run under ``ParaStrategy(zero=3)``, reported
1.18477 against plain PyTorch's 1.18423. The cause is not ZeRO-3 or FSDP2 (``nn.RNNBase`` keeps its
``_flat_weights`` in step with FSDP2's parameter swaps through its ``__setattr__``): Lightning's
``DDPStrategy`` gives the same number bit for bit (checked on one device: DDP, ``zero=0`` and
``zero=3`` all 0.19277896 after 2 epochs, plain PyTorch 0.18717818). Two things every Lightning
distributed strategy does change the data, not the arithmetic:

* ``use_distributed_sampler=True`` (the default) replaces the train loader's sequential sampler by a
  ``DistributedSampler`` with ``shuffle=True``: another batch order from step 0 on;
* the strategy's setup re-seeds the global RNG (``reset_seed()``, as DDP and ModelParallelStrategy do),
  so a dataset built in ``train_dataloader()`` from ``torch.randn`` (``ParityModuleRNN``'s) draws
  other numbers than a loop that builds it right after the model.

With the same samples in the same order (``use_distributed_sampler=False`` and the dataset drawn after
the re-seed), ``zero=3`` reproduces plain PyTorch bit for bit. Here: the same batches per global step,
dp=2, against one device on the global batch, within 1e-5 (``FP32_RTOL``).
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.lightning_compat.common import dp_mean_losses, fit_job, max_rel_diff
from tests.lightning_compat.rnn import RNNModule, sequence_dataset
from tests.parity import FP32_RTOL, assert_params_close, fit_reference, full_parameters

STEPS, GLOBAL_BATCH = 4, 16


def _full_params(trainer, module):
    return full_parameters(module)


@pytest.mark.parametrize(("cell", "zero"), [
    ("lstm", 3),
    pytest.param("rnn", 3, marks=pytest.mark.slow),
    pytest.param("lstm", 2, marks=pytest.mark.slow),
])
def test_recurrent_module_matches_one_device(pools, cell, zero):
    model = partial(RNNModule, cell=cell)
    results = pools.get(2).run(fit_job, "para", {"zero": zero}, model, STEPS, GLOBAL_BATCH, None, (), _full_params,
                               None, sequence_dataset)
    reference = fit_reference(model, sequence_dataset, GLOBAL_BATCH, STEPS)
    diff = max_rel_diff(dp_mean_losses(results), reference["losses"])
    print(f"{cell} zero={zero}: losses within {diff:.1e} of one device")
    assert diff <= FP32_RTOL
    for r in results:
        assert_params_close(r["extra"], reference["params"])
