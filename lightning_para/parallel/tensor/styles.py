"""The tensor-parallel styles behind the plan shorthands (``"colwise"``, ``"rowwise"``, ...).

Each shorthand becomes a :class:`~torch.distributed.tensor.parallel.ParallelStyle` that
depends on two switches: ``sequence_parallel`` and ``loss_parallel``. Layout contract
(Megatron-LM, Shoeybi et al. 2019; sequence parallel: Korthikanti et al. 2022):

* The residual stream between sublayers is ``[batch, seq, hidden]``: a plain tensor, the
  full one on every tp rank (TP); under TP+SP a DTensor ``Shard(1)`` holding this rank's
  ``seq / tp`` slice, whose ``.shape`` is still the *global* one, so model code that builds
  positions, rotary tables or causal masks from ``hidden.shape[1]`` (Hugging Face models do)
  sees the real sequence length. The vocab-parallel embedding starts that stream. A module
  handed this rank's slice as a *plain* tensor (a block called on its own) gives plain
  tensors back: every SP style returns the kind of tensor it was given.
* An attention/MLP *sublayer* gets its input as one replicated DTensor (an all-gather along
  the sequence under SP), so its column-parallel children share one collective: in backward,
  their partial input gradients add up first, then one all-reduce (TP) or one reduce-scatter
  (SP) -- Megatron's ``f`` operator.
* The row-parallel output projection ends the sublayer with an all-reduce (TP) or a
  reduce-scatter along the sequence (SP) -- Megatron's ``g`` operator.

:class:`SublayerInput` and :class:`HeadNorm` are new here; the vocabulary-parallel embedding lives in
:mod:`.embedding`, the column-parallel styles (``Colwise`` and the fused projections) in :mod:`.columns`,
the styles on the sequence-sharded stream outside the sublayers in :mod:`.sequence`; everything else is
a configured torch style.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from lightning_para.parallel.tensor.columns import (
    Colwise,
    FusedBlocksColwise,
    FusedColwiseParallel,
)
from lightning_para.parallel.tensor.embedding import VocabParallelEmbedding
from lightning_para.parallel.tensor.global_sizes import explain_first_call
from lightning_para.parallel.tensor.sequence import (
    SEQ_DIM,
    GatherSequence,
    SequenceShardedNorm,
    SequenceSlice,
    like_input,
    shard_stage_boundary,
)

# Names of the hidden-states argument when a sublayer is called with keywords (HF style).
HIDDEN_KWARGS = ("hidden_states", "x", "hidden", "input", "inputs", "query", "h")


class _Regathered:
    """What a saved gathered input is packed into: its sequence shard (Megatron-SP)."""

    __slots__ = ("packed_shard", "shape")

    def __init__(self, packed_shard: Any, shape: torch.Size) -> None:
        self.packed_shard, self.shape = packed_shard, shape


class _KeepShardSaveGathered:
    """Saved-tensor hooks for one sublayer call: keep the shard, all-gather again in backward.

    The column-parallel matmuls save their input for the weight gradient; under SP that is the
    all-gathered ``[b, s, h]`` tensor. Korthikanti et al. (2022, Sec. 4.2.2) store the
    ``[b, s/t, h]`` shard instead and repeat the all-gather in backward: that is what makes
    activations ``sbh(34/t + 5as/(ht))``. Other tensors go to the enclosing hooks, if any.
    """

    def __init__(self, shard: DTensor, gathered: DTensor) -> None:
        self.shard = shard.detach()
        local = gathered._local_tensor  # private: see docs/architecture.md
        # The storage's identity: its data pointer would do on a real device, but every meta storage's is 0, so the
        # dry run matched other saved tensors of the same size (an MLP's local activation when ffn/t == h).
        self.storage, self.numel = local.untyped_storage()._cdata, local.numel()  # private: a storage's identity
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # private: see docs/architecture.md
        self.outer_pack, self.outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
        self.full: Optional[DTensor] = None

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks to enter around the sublayer's forward. Not kept on ``self``: that would be a reference cycle
        (``self`` -> context -> bound ``self.unpack`` -> ``self``), so the all-gather ``unpack`` makes in backward
        (``self.full``, a whole ``[b, s, h]`` input) would stay allocated after the backward until Python's cyclic
        garbage collector ran (the dry run of 405B measured ~4 GiB per microbatch held after its backward). Without
        it, the saved tensors' hooks are the last references: released with them, right after the backward."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else None  # private: no autograd inside a pack hook
        if (
            local is not None and local.numel() == self.numel and local.storage_offset() == 0
            and local.is_contiguous() and local.untyped_storage()._cdata == self.storage  # private: as above
        ):
            return _Regathered(self.outer_pack(self.shard), t.shape)
        return self.outer_pack(t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Regathered):
            return self.outer_unpack(packed)
        if self.full is None:  # q, k and v share one all-gather
            with torch.no_grad():
                self.full = self.outer_unpack(packed.packed_shard).redistribute(placements=[Replicate()])
        return self.full.view(packed.shape)


class SublayerInput(ParallelStyle):
    """The hidden-states input of an attention/MLP sublayer becomes one replicated DTensor.

    Under SP the input arrives sequence-sharded (a DTensor from a sequence-parallel norm or
    this rank's slice as a plain tensor) and is all-gathered once here; with
    ``keep_shard=True`` backward re-gathers it instead of keeping the gathered copy
    (:class:`_KeepShardSaveGathered`). The input is found as the first positional argument
    or a keyword in :data:`HIDDEN_KWARGS`.

    ``head_attributes`` are integer attributes of the module (head counts, attention width)
    divided by tp when the style is applied: attention code reshapes with them, and each rank
    computes ``n_head / tp`` heads.
    """

    def __init__(
        self, sequence_parallel: bool, head_attributes: Optional[dict[str, int]] = None, keep_shard: bool = False,
        float8: Any = None, name: str = "",
    ) -> None:
        super().__init__()
        self.name = name  # the module's name in the model, for the first-call error
        self.sequence_parallel = sequence_parallel
        self.head_attributes = dict(head_attributes or {})
        self.keep_shard = keep_shard and sequence_parallel
        self.float8 = float8  # Float8ParallelStyles (fp8="tensorwise"): cast to float8 before the gather
        self._cast: Optional[Callable[[Any], Any]] = None
        self._active: list[torch.autograd.graph.saved_tensors_hooks] = []  # one per call in flight
        self._plain_inputs: list[bool] = []  # per call in flight: was the hidden input a plain tensor?

    def _to_replicated(self, x: Any, mesh: DeviceMesh) -> Any:
        self._plain_inputs.append(not isinstance(x, DTensor))
        if isinstance(x, DTensor):
            if all(p.is_replicate() for p in x.placements):
                return x
            shard = x
        elif isinstance(x, torch.Tensor):
            layout = Shard(SEQ_DIM) if self.sequence_parallel else Replicate()
            shard = DTensor.from_local(x, mesh, [layout], run_check=False)
            if not self.sequence_parallel:
                return shard
        else:
            return x
        if self._cast is not None:  # float8 children: gather 1-byte activations (the amax is global)
            shard = self._cast(shard)
        full = shard.redistribute(mesh, [Replicate()])
        if self.keep_shard and torch.is_grad_enabled():
            context = _KeepShardSaveGathered(shard, full).context()
            context.__enter__()
            self._active.append(context)
        return full

    def _prepare(self, mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (self._to_replicated(args[0], mesh), *args[1:]), kwargs
        for key in HIDDEN_KWARGS:
            if isinstance(kwargs.get(key), torch.Tensor):
                return args, {**kwargs, key: self._to_replicated(kwargs[key], mesh)}
        raise ValueError(
            f"Tensor parallel: cannot find the hidden-states input of {type(module).__name__} (no tensor as first"
            f" positional argument nor as one of the keywords {HIDDEN_KWARGS}). Plan this module with a"
            " PrepareModuleInput style instead of 'attention'/'mlp'."
        )

    def _finish(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._active:
            self._active.pop().__exit__(None, None, None)
        input_was_plain = self._plain_inputs.pop() if self._plain_inputs else False
        # The row-parallel output is a sequence-sharded DTensor (the SP stream); a caller that
        # passed this rank's slice as a plain tensor gets a plain tensor back.
        return like_input(output, input_was_plain) if self.sequence_parallel else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for attr, full in self.head_attributes.items():
            setattr(module, attr, full // tp)
        divided = {attr: (full, full // tp) for attr, full in self.head_attributes.items()}
        explain_first_call(module, self.name or type(module).__name__, tp, divided)
        if self.float8 is not None and self.sequence_parallel:
            self._cast = self.float8.gather_cast(module)
            # The float8 children save their float8 input (1 byte/element, a tensor subclass the shard
            # re-gather cannot recognise): Megatron-SP's keep-the-shard is off under fp8.
            self.keep_shard = False
        module.register_forward_pre_hook(partial(self._prepare, device_mesh), with_kwargs=True)
        # always_call only where a saved-tensor context must be left on an error: torch.compile guards on
        # the ids of always-called hooks, so every block would compile its own graph.
        module.register_forward_hook(self._finish, always_call=self.keep_shard)
        return module

    def __repr__(self) -> str:
        return f"SublayerInput(sequence_parallel={self.sequence_parallel}, head_attributes={self.head_attributes})"


class HeadNorm(ParallelStyle):
    """A norm over ``head_dim`` inside attention (Qwen3's ``q_norm``/``k_norm``, OLMo-2's, ...).

    It runs on this rank's heads (``[..., heads/tp, head_dim]``, a plain tensor), so its weight
    sees only those heads: the weight becomes a ``Replicate`` DTensor and the input a DTensor
    sharded along the heads dimension (-2), so the weight's gradient comes back ``Partial`` and is
    summed over tp by the same hook as sequence-parallel norms. The output is plain again.
    """

    def _prepare(self, mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            if x.dim() < 2:
                raise ValueError(f"'head_norm' expects [..., heads, head_dim] inputs in {type(module).__name__}, got {tuple(x.shape)}.")
            x = DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
        return (x, *args[1:])

    @staticmethod
    def _finish(module: nn.Module, args: tuple, out: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(self._prepare, device_mesh))
        module.register_forward_hook(self._finish)
        return module


class _NoOp(ParallelStyle):
    """Leave the module as it is (replicated on every tp rank)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


# shorthand -> what it is for (the documentation table in docs/tensor_parallel.md)
SHORTHANDS = {
    "colwise": "nn.Linear split by output features (q/k/v, up/gate, fc1)",
    "rowwise": "nn.Linear split by input features (o_proj, down, fc2); ends the sublayer",
    "fused_qkv": "nn.Linear producing [q | k | v] blocks side by side (c_attn, qkv_proj)",
    "fused_gate_up": "nn.Linear producing [gate | up] blocks side by side (gate_up_proj)",
    "attention": "the attention module: input gathered once; head-count/width attributes divided by tp",
    "mlp": "the MLP module: input gathered once",
    "vocab_parallel": "nn.Embedding split by vocabulary rows",
    "lm_head": "output nn.Linear split by vocabulary; logits stay sharded for loss parallel",
    "norm": "LayerNorm/RMSNorm on the residual stream: sequence-sharded under SP",
    "head_norm": "a norm over head_dim inside attention (q/k norms): runs on this rank's heads",
    "sequence_slice": "a full-sequence output added to the residual stream (position embedding)",
    "gather_sequence": "a module run replicated on the full sequence (MoE layer, unsupported attention)",
    "replicate": "leave the module replicated on every tp rank (e.g. a small router)",
}
# Shorthands that make every nn.Linear inside the module count as planned (replicated on purpose).
COVERS_DESCENDANTS = ("replicate", "gather_sequence")
LINEAR_STYLES = ("colwise", "rowwise", "fused_qkv", "fused_gate_up", "lm_head")


def _float8_colwise(base: type, float8_collectives: bool) -> ParallelStyle:
    """torchao's float8 column-parallel style that, like :class:`Colwise`, also takes a DTensor input in
    another layout (a sequence shard): it is cast to float8 first, then gathered (1 byte/element);
    without float8 collectives (gloo) gathered first, then cast (the same float8 values)."""

    class Float8Colwise(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            x = inputs[0]
            if isinstance(x, DTensor) and tuple(x.placements) != tuple(desired_input_layouts):
                if not float8_collectives:  # gloo: gather in high precision, torchao's style casts after
                    inputs = (x.redistribute(placements=desired_input_layouts), *inputs[1:])
                else:
                    input_layouts = tuple(x.placements)  # torchao's style redistributes from the declared layout
            return base._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    return Float8Colwise()


def make_style(
    shorthand: str,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    head_attributes: Optional[dict[str, int]] = None,
    keep_shard: bool = True,
    float8: Any = None,
    name: str = "",
) -> ParallelStyle:
    """The ParallelStyle for one shorthand under the given switches.

    ``keep_shard`` (SP only): sublayers save their input's sequence shard and all-gather it
    again in backward (Megatron-SP), instead of saving the gathered copy.
    ``name``: the module's name in the model (named by the first-call error of a sublayer that reshapes with
    global sizes, :mod:`.global_sizes`).
    ``float8``: torchao's float8 styles (``parallel/fp8.py``'s ``Float8ParallelStyles``) for a module
    converted to float8 training (``fp8="tensorwise"``); for a sublayer, its float8 children's input
    is cast before the sequence all-gather.
    """
    sp = sequence_parallel
    if float8 is not None and shorthand in ("colwise", "rowwise"):
        if shorthand == "colwise":
            return _float8_colwise(float8.colwise, float8.float8_collectives)
        return float8.rowwise(output_layouts=Shard(SEQ_DIM), use_local_output=False) if sp else float8.rowwise()
    if float8 is not None and shorthand in ("fused_qkv", "fused_gate_up", "lm_head"):
        raise ValueError(
            f"fp8='tensorwise' with tp: a float8 linear planned {shorthand!r} is not supported (torchao's float8"
            " styles are column-/row-wise only). Plan q/k/v (gate/up) as separate 'colwise' Linears, or use fp8=None."
        )
    if shorthand == "colwise":
        return Colwise()
    if shorthand == "rowwise":
        # SP: the reduce-scattered output stays a global-shaped DTensor (the stream); the sublayer
        # around it hands a plain slice back to a caller that passed one.
        return RowwiseParallel(output_layouts=Shard(SEQ_DIM), use_local_output=False) if sp else RowwiseParallel()
    if shorthand == "fused_qkv":
        return FusedColwiseParallel(parts=3)
    if shorthand == "fused_gate_up":
        return FusedColwiseParallel(parts=2)
    if shorthand in ("attention", "mlp"):
        return SublayerInput(
            sp, head_attributes if shorthand == "attention" else None, keep_shard=keep_shard, float8=float8,
            name=name,
        )
    if shorthand == "vocab_parallel":
        return VocabParallelEmbedding(sp)
    if shorthand == "lm_head":
        # Loss parallel: logits stay a DTensor sharded over the vocabulary (never gathered).
        return Colwise(
            input_layouts=Shard(SEQ_DIM) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if shorthand == "norm":
        return SequenceShardedNorm() if sp else _NoOp()
    if shorthand == "head_norm":
        return HeadNorm()
    if shorthand == "sequence_slice":
        return SequenceSlice() if sp else _NoOp()
    if shorthand == "gather_sequence":
        return GatherSequence() if sp else _NoOp()
    if shorthand == "replicate":
        return _NoOp()
    raise ValueError(
        f"Unknown tensor-parallel style {shorthand!r}. Use one of {', '.join(SHORTHANDS)}"
        " or a torch.distributed.tensor.parallel.ParallelStyle instance."
    )


__all__ = [
    "SHORTHANDS", "make_style", "FusedBlocksColwise", "FusedColwiseParallel", "VocabParallelEmbedding", "SublayerInput", "SequenceSlice", "GatherSequence",
    "HeadNorm", "SequenceShardedNorm", "shard_stage_boundary",
]
