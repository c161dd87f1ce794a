"""transformers models without processes: automatic plans that see each module once, head counts from
the config, pipeline_spec against the model's own forward (five families), the experts interface and
its expert-parallel math (a one-rank dispatcher), the router loss formula, and the bad-input errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
)

from lightning_para._dtensor import tied_parameter_groups  # noqa: E402
from lightning_para.integrations.transformers import pipeline_spec, transformers_experts  # noqa: E402
from lightning_para.integrations.transformers.experts import (  # noqa: E402
    _expert_parallel_forward,
    balancing_loss,
    router_statistics,
    run_local_experts,
)
from lightning_para.integrations.transformers.pipeline import split_causal_lm_batch  # noqa: E402
from lightning_para.parallel.expert import check_expert_layout  # noqa: E402
from lightning_para.parallel.tensor.plan import auto_plan, plan_modules  # noqa: E402
from lightning_para.parallel.tensor.validate import check_plan  # noqa: E402
from tests.hf_models import HFCausalLM, llama_config, mixtral_config  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
# Sliding windows shorter than the 12-token batches, so a wrong mask would show.
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24),
}


def _model(config, attn: str = "sdpa"):
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


# ----------------------------------------------------------------------------- pipeline_spec
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pipeline_layers_compute_what_the_model_computes(family, attn):
    """The pipeline layers, called as x = layer(x), give the model's own logits and loss bit for bit:
    positions, rotary tables and (sliding-window) causal masks are rebuilt inside each layer's call."""
    model = _model(FAMILIES[family](), attn)
    spec = pipeline_spec(model)
    assert [id(m) for m in spec.layers] == [id(m) for m in (model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head)]
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = model(input_ids=ids, labels=ids)
    x, labels = spec.split_batch((ids, ids))
    for layer in spec.layers:
        x = layer(x)
    assert torch.equal(x, expected.logits)
    assert torch.equal(spec.loss_fn(x, labels), expected.loss)
    # A microbatch's loss is weighted so the mean over microbatches is the batch's token mean.
    halves = [spec.loss_fn(x[i : i + 1], labels[i : i + 1]) for i in range(2)]
    torch.testing.assert_close(sum(halves) / 2, expected.loss, rtol=1e-6, atol=0)


def test_right_padding_becomes_ignored_labels_and_left_padding_is_refused():
    model = _model(FAMILIES["llama"]())
    spec = pipeline_spec(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    x, labels = spec.split_batch({"input_ids": ids, "attention_mask": mask})
    assert (labels[1, 8:] == -100).all() and torch.equal(labels[0], ids[0])
    for layer in spec.layers:
        x = layer(x)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(spec.loss_fn(x, labels), expected, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="padding before real tokens .*padding_side='right'"):
        split_causal_lm_batch({"input_ids": ids, "attention_mask": mask.flip(1)})


def test_pipeline_spec_names_the_class_and_what_is_missing():
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96))
    with pytest.raises(ValueError, match=r"does not know the architecture `GPT2LMHeadModel`.*no model.embed_tokens, model.layers"):
        pipeline_spec(gpt2)
    with pytest.raises(ValueError, match=r"`Linear`.*no model.embed_tokens"):
        pipeline_spec(nn.Linear(2, 2))
    routed = _model(MixtralConfig(**COMMON, num_local_experts=4, output_router_logits=True))
    with pytest.raises(ValueError, match="output_router_logits=True.*Set config.output_router_logits=False for pp>1"):
        pipeline_spec(routed)


# ----------------------------------------------------------------------------- automatic plan
def test_auto_plan_of_a_wrapped_llama():
    plan = auto_plan(HFCausalLM(llama_config()))
    layer = "model.model.layers.0"
    assert plan["model.model.embed_tokens"] == "vocab_parallel" and plan["model.lm_head"] == "lm_head"
    assert plan[f"{layer}.self_attn"] == "attention" and plan[f"{layer}.mlp"] == "mlp"
    assert {plan[f"{layer}.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
    assert plan[f"{layer}.self_attn.o_proj"] == plan[f"{layer}.mlp.down_proj"] == "rowwise"
    assert plan["model.model.norm"] == plan[f"{layer}.input_layernorm"] == "norm"


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class _HeadWrapper(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head


class _UserPipelined(nn.Module):
    """A user's pipeline wrappers registered *before* the model: the first path of every module
    is under `_pp_layers` (a ModuleList), and the head is reachable as `_pp_layers.3.head` and
    `model.lm_head`."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        model = AutoModelForCausalLM.from_config(llama_config(tie_word_embeddings=tied))
        base = model.model
        self._pp_layers = nn.ModuleList(
            [_Wrapped(base.embed_tokens), *[_Wrapped(layer) for layer in base.layers], _HeadWrapper(base.norm, model.lm_head)]
        )
        self.blocks = nn.ModuleList(list(base.layers))  # a second list of references
        self.model = model


@pytest.mark.parametrize("tied", [False, True])
def test_each_module_is_planned_once_and_the_head_is_found_by_structure(tied):
    module = _UserPipelined(tied)
    resolved = plan_modules(module)
    ids = [id(m) for _, m, _ in resolved.entries]
    assert len(ids) == len(set(ids)), "a module planned twice"
    head = module.model.lm_head
    styles = {id(m): style for _, m, style in resolved.entries}
    assert styles[id(head)] == "lm_head" and styles[id(module.model.model.embed_tokens)] == "vocab_parallel"
    assert resolved.by_name["_pp_layers.3.head"] == "lm_head"  # planned by its first path
    # The plan of a part (a pipeline stage holding the head wrapper) by identity, in the part's names.
    part = resolved.for_part(module.model)
    assert part["lm_head"] == "lm_head" and part["model.layers.1.self_attn"] == "attention" and len(part) == len(ids)
    assert tied_parameter_groups(module) == ([[("_pp_layers.0.inner", "weight"), ("_pp_layers.3.head", "weight")]] if tied else [])
    check_plan(module, resolved.by_name, 2, sequence_parallel=True)


def test_qwen3_query_key_norms_run_on_each_ranks_heads():
    model = _model(FAMILIES["qwen3"]())
    plan = auto_plan(model)
    assert plan["model.layers.0.self_attn.q_norm"] == plan["model.layers.0.self_attn.k_norm"] == "head_norm"
    check_plan(model, plan, 2, sequence_parallel=True)


def test_tp_not_dividing_key_value_heads_names_the_config_field():
    module = HFCausalLM(llama_config())  # 4 heads, 2 key/value heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide[\s\S]*key/value heads `config.num_key_value_heads` of"
                                         r" 'model.model.layers.0.self_attn' \(and 1 more\) = 2[\s\S]*Choose tp in \[1, 2\]"):
        check_plan(module, auto_plan(module), 4, sequence_parallel=False)


# ----------------------------------------------------------------------------- experts
class _OneRank:
    """The dispatcher protocol on one rank: every expert is local (routing math only, no collective)."""

    size = 1

    def __call__(self, experts, routed, counts):
        return experts(routed, counts.tolist())


def _experts_of(config):
    return [m for _, m in transformers_experts(_model(config))]


def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))
    torch.manual_seed(3)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    return experts


@pytest.mark.parametrize("which", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_expert_parallel_forward_matches_the_models_experts(which):
    """Sorting rows by expert, running each expert with the model's own gate and combining with the
    routing weights gives the transformers forward (concatenated, biased and transposed layouts)."""
    experts = _gpt_oss_experts() if which == "gpt_oss" else _experts_of(FAMILIES[which]())[0]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(10, experts.gate_up_proj.shape[-1] if not experts.is_transposed else experts.gate_up_proj.shape[1], generator=g)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=g)
    expected = experts(hidden, index, weights)
    ours = _expert_parallel_forward(experts, _OneRank(), 1.0, hidden, index, weights)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # Each expert's rows alone, in the model's math.
    rows = hidden[:3]
    torch.testing.assert_close(run_local_experts(experts, rows, [3] + [0] * (experts.num_experts - 1)),
                               experts(rows, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)), rtol=1e-5, atol=1e-6)


def test_router_statistics_give_transformers_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(12, 4, generator=g) for _ in range(3))
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    for m in (None, mask):
        ours = balancing_loss(*router_statistics(logits, 4, 2, m), 4)
        torch.testing.assert_close(ours, load_balancing_loss_func(logits, 4, 2, m), rtol=1e-6, atol=0)


def test_bad_expert_layouts_name_the_field_and_the_class():
    mixtral = _model(mixtral_config(num_local_experts=3))
    with pytest.raises(ValueError, match=r"`ep=2` must divide config.num_local_experts=3 .*Choose ep in \[1\]"):
        check_expert_layout(mixtral, 2, 2)

    class SparseMoeBlock(nn.Module):  # the transformers 4 layout: a list of per-expert MLPs
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    old = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": SparseMoeBlock()})])})
    with pytest.raises(ValueError, match=r"`layers.0.mlp` \(SparseMoeBlock\): `experts` is an nn.ModuleList of"
                                         r" per-expert modules \(transformers 4 layout\)"):
        check_expert_layout(old, 2, 2)


def test_recipe_builds_a_random_config_model_and_names_an_unknown_type():
    from lightning_para.recipes import HFCausalLM

    module = HFCausalLM(model_type="qwen3", config={**COMMON, "head_dim": 8})
    assert type(module.model).__name__ == "Qwen3ForCausalLM" and module.config.vocab_size == 96
    with pytest.raises(ValueError, match="`model.model_type='nope'`"):
        HFCausalLM(model_type="nope")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_unnormalized", "deepseek_v3"])
def test_balance_experts_biases_the_selection_only(family):
    """``balance_experts`` on a transformers MoE block: a zero bias routes as the router does; a bias that forces
    expert 0 in changes the selection only (the weights stay the chosen experts' unbiased, renormalised or not
    probabilities); DeepSeek-V3's own ``e_score_correction_bias`` is the bias that the update moves."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

    from lightning_para.moe import moe_stats_paused, update_expert_bias
    from lightning_para.parallel.expert import balance_experts

    small = dict(hidden_size=16, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=8)
    block = {
        "mixtral": lambda: MixtralSparseMoeBlock(MixtralConfig(**small, num_local_experts=4)),
        "qwen3_moe_unnormalized": lambda: Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small, num_experts=4, norm_topk_prob=False)),
        "deepseek_v3": lambda: DeepseekV3MoE(DeepseekV3Config(**small, n_routed_experts=4, n_group=2, topk_group=1)),
    }[family]()
    torch.manual_seed(0)
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    expected = block(x)
    assert balance_experts(block, 0.01) == 1
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-6)
    router = block.gate
    with moe_stats_paused(block):  # e.g. a pipeline's shape inference: not a step's load
        block(x)
    assert router.expert_load.sum() == 20  # the one training forward before: 10 tokens x top-2
    if family == "deepseek_v3":  # its own bias, selecting as it always did; the update moves it
        assert not hasattr(router, "expert_bias")
        update_expert_bias([block])
        assert router.e_score_correction_bias.abs().sum() > 0 and router.expert_load.sum() == 0
        return
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
    router.expert_load.zero_()
    out = block(x)
    assert router.expert_load[0] == 10 and router.expert_load.sum() == 20
    probs = torch.softmax(router.unbiased_forward(x)[0], dim=-1)
    chosen = torch.cat([torch.zeros(10, 1, dtype=torch.long), probs[:, 1:].topk(1).indices + 1], 1)
    weights = probs.gather(1, chosen)
    if family == "mixtral":
        weights = weights / weights.sum(1, keepdim=True)
    torch.testing.assert_close(out.reshape(10, 16), block.experts(x.reshape(10, 16), chosen, weights), rtol=1e-5, atol=1e-6)


def test_balance_experts_refuses_routers_it_cannot_bias():
    """A router that is not softmax top-k (Phi-MoE's sparse mixer) and a correction bias the router does not own
    (MiniMax-M2 keeps it on the block) are refused, naming them."""
    from transformers import MiniMaxM2Config, PhimoeConfig
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock
    from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock

    from lightning_para.parallel.expert import balance_experts

    small = dict(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    phimoe = PhimoeSparseMoeBlock(PhimoeConfig(**small))
    nn.init.normal_(phimoe.router.weight, std=0.3)
    with pytest.raises(ValueError, match=r"router `router` \(PhimoeTopKRouter\) does not route as softmax top-k"):
        balance_experts(phimoe, 0.01)
    with pytest.raises(ValueError, match=r"`e_score_correction_bias` is a correction bias that is not a buffer of the block's router"):
        balance_experts(MiniMaxM2SparseMoeBlock(MiniMaxM2Config(**small)), 0.01)
