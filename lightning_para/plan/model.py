"""``ModelDesc``: the shape of a decoder-only transformer, and its parameter counts.

The planner needs only a handful of numbers per model: layers ``L``, hidden size ``h``,
attention heads ``a`` (and key/value heads for GQA), FFN width ``f``, vocabulary ``V`` and,
for a Mixture-of-Experts model, the experts. Everything else (parameters per pipeline stage,
FLOPs per token, activation bytes) is derived from them.

Conventions (they match PyTorch's ``nn.Linear``/``nn.Embedding`` parameter shapes, so
``describe_module`` can check the count against a real module exactly):

* attention: ``q`` ``h x a d``, ``k``/``v`` ``h x kv d``, output ``a d x h`` (``d`` the head dim);
* MLP: two matrices (``h x f``, ``f x h``), three when gated (SwiGLU: gate, up, down);
* MoE layer: a router ``E x h``, ``E`` routed experts of width ``moe_ffn`` and optional
  always-on shared experts of total width ``shared_expert_ffn`` (DeepSeekMoE);
* norms: RMSNorm ``h``; LayerNorm ``2h`` with bias, ``h`` without; two per layer, one final.

The published models are in :mod:`.presets`, the Hugging Face ``config.json`` reader in :mod:`.hf_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

NORMS = ("rmsnorm", "layernorm")


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}={value!r}` must be an integer >= {minimum}.")


@dataclass(frozen=True)
class PipelineUnit:
    """One entry of a pipeline contract's layer list (``configure_pipeline()``): the smallest
    piece a pipeline split moves between stages.

    Args:
        layers: transformer layers (0-based indices) inside this entry.
        embedding: it holds the token embedding (and learned positions).
        final_norm: it holds the final norm.
        head: it holds the output projection.
    """

    layers: tuple[int, ...] = ()
    embedding: bool = False
    final_norm: bool = False
    head: bool = False


def default_pipeline_units(layers: int) -> tuple[PipelineUnit, ...]:
    """``[embedding, layer 0, ..., layer L-1, final norm + head]``: the recipes' contract
    (``GPT.configure_pipeline``) and nanoGPT's / torchtitan's split points."""
    return (
        PipelineUnit(embedding=True),
        *(PipelineUnit(layers=(i,)) for i in range(layers)),
        PipelineUnit(final_norm=True, head=True),
    )


@dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer, as the planner sees it.

    Args:
        layers, hidden, heads, ffn, vocab: ``L``, ``h``, ``a``, dense FFN width ``f``, ``V``.
        kv_heads: key/value heads (GQA); ``None``: ``heads`` (multi-head attention).
        head_dim: ``None``: ``hidden // heads``.
        num_experts, top_k: routed experts per MoE layer and experts per token (0: dense model).
        moe_ffn: width of one routed expert (``None``: ``ffn``).
        shared_expert_ffn: total width of the always-on shared experts of an MoE layer.
        moe_every, first_k_dense: layer ``i`` is an MoE layer when ``i >= first_k_dense`` and
            ``(i - first_k_dense) % moe_every == moe_every - 1`` (every layer: 1; GShard's
            every other layer: 2; DeepSeek-V3: the first 3 layers dense).
        moe_layers: the MoE layers by index, for a layout that rule cannot say (Qwen-MoE's ``mlp_only_layers``);
            ``None``: the rule.
        capacity_factor: MoE expert capacity (GShard/Switch); ``None``: dropless.
        tied_embeddings: the output head reuses the input embedding matrix.
        gated_mlp: SwiGLU-style MLP with three matrices instead of two.
        norm: ``"rmsnorm"`` or ``"layernorm"``.
        norm_upcast: the norm is eager code that keeps an fp32 copy of its input for backward
            (transformers' RMSNorm classes: ``hidden_states.to(torch.float32)``, then the normalized
            tensor in the input dtype): 4 bytes per element per norm more than torch's fused kernel
            (``nn.RMSNorm`` on CUDA keeps its input and the fp32 row ``rstd``). Measured with saved-tensor
            hooks on transformers' ``LlamaRMSNorm``: 6.03 bytes per element in bf16, 8.05 in fp32.
        loss_upcast: the loss casts the logits to fp32 before the cross-entropy (transformers'
            ``ForCausalLMLoss``, ``logits.float()``; torchtitan's ``cross_entropy(pred.float())``): its
            log-probabilities and their gradients are fp32, and the fp32 copy lives while the loss runs.
        bias: linear layers (and LayerNorms) have biases.
        learned_positions: rows of a learned position embedding (0: RoPE or none).
        dropout: the model trains with dropout (adds Megatron's dropout masks to activations).
        attention_params: parameters of one attention block, overriding the formula above
            (for attention variants such as DeepSeek's MLA, see :data:`PRESETS`).
        pipeline_units: the entries a pipeline split moves between stages, in order
            (``None``: :func:`default_pipeline_units`; ``describe_module`` reads them from
            ``configure_pipeline()``).
        name: a label for tables.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: Optional[int] = None
    shared_expert_ffn: int = 0
    moe_every: int = 1
    first_k_dense: int = 0
    moe_layers: Optional[tuple[int, ...]] = None
    capacity_factor: Optional[float] = None
    tied_embeddings: bool = False
    gated_mlp: bool = True
    norm: str = "rmsnorm"
    norm_upcast: bool = False
    loss_upcast: bool = False
    bias: bool = False
    learned_positions: int = 0
    dropout: bool = False
    attention_params: Optional[int] = None
    pipeline_units: Optional[tuple[PipelineUnit, ...]] = None
    name: str = "custom"
    # Fields that __post_init__ filled in from others, so `with_changes` derives them again.
    _derived: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = []
        for name in ("layers", "hidden", "heads", "ffn", "vocab"):
            _check_int(name, getattr(self, name))
        for name in ("num_experts", "top_k", "shared_expert_ffn", "first_k_dense", "learned_positions"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("moe_every", self.moe_every)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(
                    f"`hidden={self.hidden}` is not divisible by `heads={self.heads}`; pass `head_dim` explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
            derived.append("head_dim")
        _check_int("head_dim", self.head_dim)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
            derived.append("kv_heads")
        _check_int("kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"`kv_heads={self.kv_heads}` must divide `heads={self.heads}` (GQA groups).")
        if self.norm not in NORMS:
            raise ValueError(f"`norm={self.norm!r}` is unknown. Choose one of {', '.join(map(repr, NORMS))}.")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"`top_k={self.top_k}` must be in 1..num_experts={self.num_experts}.")
            if self.moe_ffn is None:
                object.__setattr__(self, "moe_ffn", self.ffn)
                derived.append("moe_ffn")
            _check_int("moe_ffn", self.moe_ffn)
            if self.first_k_dense >= self.layers:
                raise ValueError(f"`first_k_dense={self.first_k_dense}` leaves no MoE layer of {self.layers}.")
            if self.moe_layers is not None:
                object.__setattr__(self, "moe_layers", tuple(sorted(set(self.moe_layers))))
                if not self.moe_layers or not all(0 <= i < self.layers for i in self.moe_layers):
                    raise ValueError(f"`moe_layers={self.moe_layers}` must name at least one of layers"
                                     f" 0..{self.layers - 1}.")
        elif self.top_k or self.shared_expert_ffn:
            raise ValueError("`top_k` and `shared_expert_ffn` need `num_experts > 0` (a dense model has neither).")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"`capacity_factor={self.capacity_factor!r}` must be > 0, or None for dropless routing.")
        if self.attention_params is not None:
            _check_int("attention_params", self.attention_params)
        if self.pipeline_units is not None:
            self._check_pipeline_units()
        object.__setattr__(self, "_derived", tuple(derived))

    def _check_pipeline_units(self) -> None:
        units = tuple(self.pipeline_units or ())
        covered = [i for unit in units for i in unit.layers]
        if covered != list(range(self.layers)):
            raise ValueError(
                f"`pipeline_units` must list the layers 0..{self.layers - 1} once each, in order; they list {covered}."
            )
        for flag in ("embedding", "final_norm", "head"):
            if sum(getattr(unit, flag) for unit in units) != 1:
                raise ValueError(f"`pipeline_units` must place the {flag.replace('_', ' ')} in exactly one unit.")
        object.__setattr__(self, "pipeline_units", units)

    def units(self) -> tuple[PipelineUnit, ...]:
        """The pipeline contract's entries (:attr:`pipeline_units` or the default)."""
        return self.pipeline_units if self.pipeline_units is not None else default_pipeline_units(self.layers)

    # ------------------------------------------------------------------ shapes
    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output: ``heads * head_dim``."""
        return self.heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim  # type: ignore[operator]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has routed experts."""
        if not self.is_moe:
            return False
        if self.moe_layers is not None:
            return index in self.moe_layers
        if index < self.first_k_dense:
            return False
        return (index - self.first_k_dense) % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    # ------------------------------------------------------------------ parameters of the parts
    def norm_params(self) -> int:
        """One normalization layer."""
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    def attention_block_params(self) -> int:
        """One attention block: q, k, v and output projections (and biases)."""
        if self.attention_params is not None:
            return self.attention_params
        weights = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        return weights + (self.q_dim + 2 * self.kv_dim + self.hidden if self.bias else 0)

    def mlp_params(self, width: int) -> int:
        """One MLP (or one expert) of hidden width ``width``."""
        matrices = 3 if self.gated_mlp else 2
        biases = ((2 if self.gated_mlp else 1) * width + self.hidden) if self.bias else 0
        return matrices * self.hidden * width + biases

    def routed_expert_params_per_layer(self) -> int:
        """All routed experts of one MoE layer (0 for a dense model)."""
        return self.num_experts * self.mlp_params(self.moe_ffn) if self.is_moe else 0  # type: ignore[arg-type]

    def layer_params(self, index: int) -> int:
        """Every parameter of layer ``index``."""
        return self.layer_dense_params(index) + (self.routed_expert_params_per_layer() if self.is_moe_layer(index) else 0)

    def layer_dense_params(self, index: int) -> int:
        """Parameters of layer ``index`` that every token uses: all but its routed experts."""
        common = self.attention_block_params() + 2 * self.norm_params()
        if not self.is_moe_layer(index):
            return common + self.mlp_params(self.ffn)
        shared = self.mlp_params(self.shared_expert_ffn) if self.shared_expert_ffn else 0
        return common + shared + self.num_experts * self.hidden  # router: E x h

    def layer_active_params(self, index: int) -> int:
        """Parameters one token passes through in layer ``index`` (top_k of the routed experts)."""
        active = self.layer_dense_params(index)
        if self.is_moe_layer(index):
            active += self.top_k * self.mlp_params(self.moe_ffn)  # type: ignore[arg-type]
        return active

    def embedding_params(self) -> int:
        """The input token embedding (and learned positions)."""
        return (self.vocab + self.learned_positions) * self.hidden

    def head_params(self) -> int:
        """The final norm and the output projection (0 extra when tied to the embedding)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    # ------------------------------------------------------------------ totals
    def total_params(self) -> int:
        """Every parameter (a tied embedding counted once)."""
        return self.embedding_params() + self.head_params() + sum(self.layer_params(i) for i in range(self.layers))

    def expert_params(self) -> int:
        """Routed-expert parameters of the whole model (sharded by ``ep``)."""
        return self.num_moe_layers * self.routed_expert_params_per_layer()

    def active_params(self) -> int:
        """Parameters one token uses: the dense ones plus ``top_k`` routed experts per MoE layer."""
        return self.embedding_params() + self.head_params() + sum(self.layer_active_params(i) for i in range(self.layers))

    def flops_params(self) -> int:
        """Parameters in matrix multiplies per token: active layer parameters plus the output
        projection (``V h``, also when tied); the embedding lookup does no multiply."""
        return sum(self.layer_active_params(i) for i in range(self.layers)) + self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward and backward, without recomputation.

        ``6 N + 12 L (a d) s``: 6 FLOPs per matmul parameter and token (2 forward, 4 backward;
        Kaplan et al. 2020, Sec. 2.1; Chinchilla, Hoffmann et al. 2022) plus the attention scores
        ``Q K^T`` and ``softmax V`` (PaLM, Chowdhery et al. 2022, Appendix B, which also counts the
        causal mask's skipped half, as MFU does by convention).
        """
        _check_int("seq_len", seq_len)
        return 6.0 * self.flops_params() + 12.0 * self.layers * self.q_dim * seq_len

    def summary(self) -> str:
        """One line: name, size, shape."""
        moe = f", {self.num_experts} experts top-{self.top_k}" if self.is_moe else ""
        active = f" ({_count(self.active_params())} active)" if self.is_moe else ""
        return (
            f"{self.name}: {_count(self.total_params())} params{active}, L={self.layers} h={self.hidden}"
            f" heads={self.heads}/{self.kv_heads} ffn={self.ffn} vocab={self.vocab}{moe}"
        )

    def with_changes(self, **changes: Any) -> "ModelDesc":
        """A copy with some fields replaced (unknown field names raise ``ValueError``)."""
        known = {f.name for f in fields(self) if f.init}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"Unknown ModelDesc fields {unknown}; valid fields: {sorted(known)}.")
        return replace(self, **{**{name: None for name in self._derived}, **changes})


def _count(n: int) -> str:
    """``8.03B``, ``125M``, ``919K``: a parameter count at a readable scale."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 100 * scale else f"{n / scale:.0f}{suffix}"
    return str(n)


def mla_attention_params(
    hidden: int, heads: int, q_lora_rank: Optional[int], kv_lora_rank: int, qk_nope_dim: int, qk_rope_dim: int,
    v_dim: int,
) -> int:
    """Parameters of one Multi-head Latent Attention block (DeepSeek-V2 report, Sec. 2.1.2).

    Down-projections of queries and keys/values to low ranks (with their RMSNorms), the
    decoupled RoPE key, the up-projections, and the output projection. ``q_lora_rank`` ``None``
    (or 0): the queries are projected directly (DeepSeek-V2-Lite).
    """
    if q_lora_rank:
        q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * heads * (qk_nope_dim + qk_rope_dim)
    else:
        q = hidden * heads * (qk_nope_dim + qk_rope_dim)
    kv = hidden * (kv_lora_rank + qk_rope_dim) + kv_lora_rank + kv_lora_rank * heads * (qk_nope_dim + v_dim)
    return q + kv + heads * v_dim * hidden
