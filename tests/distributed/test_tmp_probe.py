import pytest
from tests.parity import fit_job, fit_reference, assert_losses_close
from tests.tp_models import token_dataset
from lightning_para.recipes.gpt import GPT


def sharp():
    return GPT(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, sample_tokens=0, warmup_steps=2)


@pytest.mark.parametrize("kw", [{"cp": 2, "pp": 2, "cp_method": "all_to_all", "schedule": "zero_bubble"},
                                {"cp": 2, "pp": 2, "cp_method": "all_to_all"},
                                {"cp": 2, "pp": 2, "schedule": "zero_bubble"}], ids=["a2a-zb", "a2a-1f1b", "ring-zb"])
def test_probe(pools, kw):
    res = pools.get(4).run(fit_job, sharp, kw, token_dataset, 2, 4, None, ("losses",))
    ref = fit_reference(sharp, token_dataset, 2, 4)
    print(kw, res[0]["losses"], ref["losses"])
    assert_losses_close(res[0]["losses"], ref["losses"])
