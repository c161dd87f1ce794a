"""Tensor-parallel plans without processes: discovery, patterns, precedence, validation errors,
and activation checkpointing on one process."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_para import ParallelConfig
from lightning_para.parallel.activation_checkpoint import apply_activation_checkpointing, find_blocks
from lightning_para.parallel.tensor.validate import check_plan
from lightning_para.parallel.tensor.plan import auto_plan, match, resolve_plan
from tests.tp_models import Block, LlamaLike, NanoGPT, NanoGPTThreeHeads, NanoGPTWithGate


def _without_layer_1(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if ".1." not in k}


def test_auto_plan_nanogpt_names():
    plan = auto_plan(NanoGPT())
    assert _without_layer_1(plan) == {
        "transformer.wte": "vocab_parallel",
        "transformer.wpe": "sequence_slice",
        "lm_head": "lm_head",
        "transformer.h.0.attn": "attention",
        "transformer.h.0.attn.c_attn": "fused_qkv",
        "transformer.h.0.attn.c_proj": "rowwise",
        "transformer.h.0.mlp": "mlp",
        "transformer.h.0.mlp.c_fc": "colwise",
        "transformer.h.0.mlp.c_proj": "rowwise",
        "transformer.h.0.ln_1": "norm",
        "transformer.h.0.ln_2": "norm",
        "transformer.ln_f": "norm",
    }
    assert len(plan) == 12 + 8  # layer 1 mirrors layer 0


def test_auto_plan_hf_names_with_vocab_equal_to_width():
    # vocab == hidden == 64: the q_proj (64 -> 64) must not be taken for the output head.
    plan = auto_plan(LlamaLike())
    assert _without_layer_1(plan) == {
        "model.embed_tokens": "vocab_parallel",
        "lm_head": "lm_head",
        "model.layers.0.self_attn": "attention",
        **{f"model.layers.0.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")},
        "model.layers.0.self_attn.o_proj": "rowwise",
        "model.layers.0.mlp": "mlp",
        "model.layers.0.mlp.gate_proj": "colwise",
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.0.mlp.down_proj": "rowwise",
        "model.layers.0.input_layernorm": "norm",
        "model.layers.0.post_attention_layernorm": "norm",
        "model.norm": "norm",
    }


class _UnknownNames(nn.Module):
    """Names no table knows: the MLP is classified by shape (h -> 4h colwise, 4h -> h rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.ffn = nn.ModuleDict({"expand": nn.Linear(16, 64), "shrink": nn.Linear(64, 16)})
        self.readout = nn.Linear(16, 32)


def test_auto_plan_by_shape():
    plan = auto_plan(_UnknownNames())
    assert plan == {"tok": "vocab_parallel", "readout": "lm_head", "ffn": "mlp", "ffn.expand": "colwise", "ffn.shrink": "rowwise"}


def test_auto_plan_of_a_last_pipeline_stage_without_embedding():
    stage = nn.ModuleDict({"h": nn.ModuleList([Block(64, 4, 16)]), "ln_f": nn.LayerNorm(64), "lm_head": nn.Linear(64, 80)})
    plan = auto_plan(stage)
    assert plan["lm_head"] == "lm_head" and plan["h.0.attn"] == "attention" and plan["ln_f"] == "norm"
    check_plan(stage, plan, 2, sequence_parallel=True)


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])


def test_auto_plan_keeps_moe_layers_whole():
    model = nn.ModuleDict({"emb": nn.Embedding(32, 16), "moe": _MoE(), "head": nn.Linear(16, 32)})
    plan = auto_plan(model)
    assert plan == {"emb": "vocab_parallel", "head": "lm_head", "moe": "gather_sequence"}
    check_plan(model, plan, 2, sequence_parallel=True)  # experts and router are covered


@pytest.mark.parametrize(
    "pattern, name, hit",
    [
        ("blocks.*.attn.q_proj", "blocks.3.attn.q_proj", True),
        ("blocks.*.attn.q_proj", "blocks.3.mlp.q_proj", False),
        ("blocks.*", "blocks.3.attn", False),  # `*` stays inside one name
        ("**.c_fc", "transformer.h.0.mlp.c_fc", True),
        ("**.c_fc", "c_fc", True),
        ("h.[0-1].mlp", "h.1.mlp", True),
        ("h.[0-1].mlp", "h.2.mlp", False),
    ],
)
def test_pattern_matching(pattern, name, hit):
    assert match(pattern, name) is hit


class _DeclaredBlock(Block):
    def tensor_parallel_plan(self):
        return {"attn": "attention", "attn.c_attn": "fused_qkv", "attn.c_proj": "rowwise",
                "mlp": "mlp", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise", "ln_*": "norm"}


class _DeclaredGPT(NanoGPT):
    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList([_DeclaredBlock(64, 4, 16) for _ in range(2)])

    def tensor_parallel_plan(self):
        return {"transformer.wte": "vocab_parallel", "lm_head": "lm_head", "transformer.wpe": "sequence_slice",
                "transformer.ln_f": "norm"}


def test_declared_plan_merges_submodule_plans_and_override_wins():
    model = _DeclaredGPT()
    plan, source = resolve_plan(model)
    assert source == "declared" and plan == auto_plan(NanoGPT())
    override = {"transformer.wte": "vocab_parallel", "lm_head": "lm_head", "**.c_fc": "replicate"}
    plan, source = resolve_plan(model, override)
    assert source == "override" and plan == {
        "transformer.wte": "vocab_parallel", "lm_head": "lm_head", "transformer.h.0.mlp.c_fc": "replicate",
        "transformer.h.1.mlp.c_fc": "replicate",
    }
    assert resolve_plan(model, "auto")[1] == "auto"


def test_plan_typos_and_conflicts_are_errors():
    with pytest.raises(ValueError, match=r"pattern 'transformer.h.\*.atn' matches no module"):
        resolve_plan(NanoGPT(), {"transformer.h.*.atn": "attention"})
    with pytest.raises(ValueError, match=r"two tensor-parallel styles"):
        resolve_plan(NanoGPT(), {"lm_head": "lm_head", "lm_*": "colwise"})
    with pytest.raises(ValueError, match=r"Unknown tensor-parallel style 'column'"):
        from lightning_para.parallel.tensor.styles import make_style

        make_style("column", sequence_parallel=False, loss_parallel=True)
    with pytest.raises(ValueError, match=r"'transformer.ln_f' is a LayerNorm, but 'colwise' applies to nn.Linear"):
        check_plan(NanoGPT(), {**auto_plan(NanoGPT()), "transformer.ln_f": "colwise"}, 2, sequence_parallel=False)


def test_unplanned_linear_lists_every_module_and_how_to_plan():
    model = NanoGPTWithGate()
    with pytest.raises(ValueError) as info:
        check_plan(model, auto_plan(model), 2, sequence_parallel=False)
    text = str(info.value)
    assert "transformer.h.0.gate (Linear 64 -> 64)" in text and "transformer.h.1.gate (Linear 64 -> 64)" in text
    assert "tp_plan=" in text and "tensor_parallel_plan()" in text and "'replicate'" in text
    # Kept whole on purpose (an override with a pattern), it is accepted.
    plan, _ = resolve_plan(model, {**auto_plan(model), "transformer.h.*.gate": "replicate"})
    assert plan["transformer.h.1.gate"] == "replicate"
    check_plan(model, plan, 2, sequence_parallel=False)


class _WithTorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.ModuleDict({"norm": nn.LayerNorm(16), "attn": nn.MultiheadAttention(16, 2)})])
        self.head = nn.Linear(16, 32)


def test_multihead_attention_is_not_split_but_can_be_kept_whole():
    model = _WithTorchAttention()
    with pytest.raises(ValueError, match=r"blocks.0.attn.out_proj[\s\S]*MultiheadAttention \(blocks.0.attn\) is not split"):
        check_plan(model, auto_plan(model), 2, sequence_parallel=True)
    plan, _ = resolve_plan(model, {**auto_plan(model), "blocks.*.attn": "gather_sequence"})
    check_plan(model, plan, 2, sequence_parallel=True)


def test_divisibility_names_the_dimensions_and_valid_tp():
    with pytest.raises(ValueError) as info:
        check_plan(NanoGPTThreeHeads(), auto_plan(NanoGPTThreeHeads()), 2, sequence_parallel=False)
    text = str(info.value)
    assert "attention heads `n_head` of 'transformer.h.0.attn' (and 1 more) = 3" in text
    assert "Choose tp in [1]" in text
    model = NanoGPT(n_head=6, n_embd=42)
    with pytest.raises(ValueError) as info:
        check_plan(model, auto_plan(model), 4, sequence_parallel=False)
    text = str(info.value)
    assert re.search(r"tp=4 does not divide[\s\S]*`n_head` of 'transformer.h.0.attn' \(and 1 more\) = 6", text)
    assert "width of each of the 3 fused blocks" in text and "Choose tp in [1, 2]" in text
    gqa = LlamaLike(num_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"key/value heads `num_key_value_heads`[\s\S]*= 1"):
        check_plan(gqa, auto_plan(gqa), 2, sequence_parallel=False)


def test_sequence_parallel_needs_every_parameter_planned():
    plan = {k: v for k, v in auto_plan(NanoGPT()).items() if not k.endswith("ln_f")}
    check_plan(NanoGPT(), plan, 2, sequence_parallel=False)  # replicated norm: fine without SP
    with pytest.raises(ValueError, match=r"Sequence parallel: these modules hold parameters[\s\S]*transformer.ln_f"):
        check_plan(NanoGPT(), plan, 2, sequence_parallel=True)
    no_sublayer = {k: v for k, v in auto_plan(NanoGPT()).items() if not k.endswith(".mlp")}
    with pytest.raises(ValueError, match=r"no 'attention'/'mlp' parent[\s\S]*transformer.h.0.mlp.c_fc"):
        check_plan(NanoGPT(), no_sublayer, 2, sequence_parallel=True)


def test_tied_weights_need_one_layout():
    plan = {**auto_plan(NanoGPT()), "transformer.wte": "replicate"}
    with pytest.raises(ValueError, match=r"Tied parameters[\s\S]*different tensor-parallel layouts"):
        check_plan(NanoGPT(), plan, 2, sequence_parallel=False)


def test_head_attributes_found_for_the_attention_modules():
    heads = check_plan(LlamaLike(), auto_plan(LlamaLike()), 2, sequence_parallel=True)
    assert heads["model.layers.0.self_attn"] == {"num_heads": 4, "num_key_value_heads": 2}
    heads = check_plan(NanoGPT(), auto_plan(NanoGPT()), 2, sequence_parallel=False)
    assert heads["transformer.h.1.attn"] == {"n_head": 4, "n_embd": 64}


def test_sequence_parallel_with_tp1_warns():
    with pytest.warns(UserWarning, match=r"sequence_parallel=True` has no effect with tp=1"):
        ParallelConfig(sequence_parallel=True)


# ----------------------------------------------------------------------------- activation checkpointing
def _loss_and_grads(model: nn.Module, idx: torch.Tensor, y: torch.Tensor):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("mode", ["full", "selective", "selective_op"])
def test_activation_checkpointing_keeps_names_and_gradients(mode):
    torch.manual_seed(0)
    plain = NanoGPT()
    torch.manual_seed(0)
    recomputed = NanoGPT()
    names = list(recomputed.state_dict())
    blocks = apply_activation_checkpointing(recomputed, mode)
    assert blocks == list(recomputed.transformer.h) == find_blocks(recomputed)
    assert list(recomputed.state_dict()) == names  # checkpoints stay layout-independent
    idx = torch.randint(0, 64, (2, 16))
    loss_a, grads_a, saved_a = _loss_and_grads(plain, idx, idx)
    loss_b, grads_b, saved_b = _loss_and_grads(recomputed, idx, idx)
    assert loss_a == loss_b
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=0, atol=0)
    if mode == "full":
        assert saved_b < 0.3 * saved_a


def test_activation_checkpointing_needs_blocks():
    with pytest.raises(ValueError, match=r"has no blocks"):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")
    assert apply_activation_checkpointing(nn.Linear(2, 2), None) == []


def test_selective_op_keeps_what_the_planner_prices(monkeypatch):
    """``"selective_op"`` (torchtitan's per-op policy) on a Llama block: the matmuls run q, k, v, o,
    gate, up, down and every second one is recomputed, so the cache holds q, v, gate and down, the
    attention kernel's outputs (its output and fp32 log-sum-exp) and nothing else; with the block
    input that is exactly the planner's ``selective_op_layer_bytes``. Gradients match the plain run."""
    from lightning_para.parallel import activation_checkpoint as ac
    from lightning_para.plan.memory import selective_op_layer_bytes
    from lightning_para.plan.model import ModelDesc

    caches = []
    make = ac.create_selective_checkpoint_contexts

    def recording(policy):
        contexts = make(policy)
        caches.append(contexts[0].storage)
        return contexts

    monkeypatch.setattr(ac, "create_selective_checkpoint_contexts", recording)
    torch.manual_seed(0)
    plain = LlamaLike(num_layers=2)
    recomputed = LlamaLike(num_layers=2)
    recomputed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(recomputed.model, "selective_op")
    idx = torch.randint(0, 64, (2, 16))
    loss_a, grads_a, _ = _loss_and_grads(plain, idx, idx)

    def kept(storage) -> tuple[list[str], int]:
        names, nbytes = [], 0
        for key, outputs in storage.items():
            for value in outputs.values():
                if value is torch.utils.checkpoint._RECOMPUTE:
                    continue
                names.append(str(key))
                for leaf in torch.utils._pytree.tree_leaves(value):
                    tensor = getattr(leaf, "val", leaf)
                    if isinstance(tensor, torch.Tensor):
                        nbytes += tensor.numel() * tensor.element_size()
        return names, nbytes

    loss_b = F.cross_entropy(recomputed(idx).flatten(0, 1), idx.flatten())
    assert len(caches) == 2  # one per block forward (its recomputation reads the same cache)
    desc = ModelDesc(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=64)
    block_input = 2 * 16 * 64 * 4
    expected = selective_op_layer_bytes(desc, 16, 2, flash_attention=True, activation_bytes=4) - block_input
    for storage in caches:
        names, nbytes = kept(storage)
        assert sum("mm" in n for n in names) == 4, names  # q, v, gate, down of the 7 matmuls
        assert sum("scaled_dot_product" in n for n in names) == 1, names
        assert nbytes == expected
    loss_b.backward()
    assert loss_a == loss_b.item()
    for n, p in recomputed.named_parameters():
        torch.testing.assert_close(p.grad, grads_a[n], rtol=0, atol=0)
