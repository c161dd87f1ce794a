"""The layout's options declared once: name, type, default, documentation, check, and the rules between them.

:data:`LAYOUT_OPTIONS` is the one declaration. What comes from it:

* :class:`~lightning_para.config.ParallelConfig`'s fields (names, types, defaults) and its checks;
* the planner's :class:`~lightning_para.plan.layout.Layout`'s fields (the options it prices, under the same
  names; a few with a planner's own type or default, named in ``plan/layout.py``) and its checks, and the values
  the search tries (:class:`~lightning_para.plan.search.SearchSpace`, checked here);
* the ``--layout`` parser's keys and value checks (:func:`~lightning_para.run_plan.parse_layout`);
* the ``Args`` section of both front ends' ``ParaStrategy`` (:func:`arguments_doc`). Their ``__init__``
  (``core/front_end.py``) spells the same arguments out, because LightningCLI, ``help()`` and IDEs read an
  explicit signature; ``tests/unit/test_options_once.py`` holds it to this declaration.

The rules that involve several options (:data:`RULES`) are written once too: ``ParallelConfig`` raises
on them, ``Layout`` on the ones without which it is no layout, and the planner lists the others as the
reasons it excludes a layout (:func:`rule_problems`). The values each option takes are declared here, and the
dimensions that implement them read them from here (``parallel/``: recomputation modes, cp methods, ZeRO-3 units,
fp8 recipes, torch.compile's keys). Part of the spec layer: it imports nothing heavy.
"""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

from lightning_para.spec.dims import divisors
from lightning_para.spec.schedules import SCHEDULES, schedule_info

# Lightning's precision names that ParaPrecision implements (see precision.py for what each keeps).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
# ``activation_checkpointing`` (the planner's "recomputation"): per-op selective (save every matmul, attention and
# collective output), torchtitan's per-op selective (``"selective_op"``: every second matmul recomputed, see
# ``parallel/activation_checkpoint.py``), whole blocks; or None.
RECOMPUTE_MODES = ("selective", "selective_op", "full")
ACTIVATION_CHECKPOINTING = (None, *RECOMPUTE_MODES)
ZERO_STAGES = (0, 1, 2, 3)
# How ZeRO accumulates gradients over several microbatches: "no_sync" (whole gradients, one reduction
# per step), "reduce_each_step" (ZeRO-2/3: one reduce-scatter per Lightning micro-step), and
# "reduce_each_microbatch" (ZeRO-2: also one per pipeline microbatch and stage, so a pipeline rank never
# holds more than one stage's whole gradients: the Llama 3 paper's FSDP under pipelining).
ZERO_ACCUMULATION = ("no_sync", "reduce_each_step", "reduce_each_microbatch")
CP_METHODS = ("ring", "all_to_all")  # ring attention (parallel/context/ring.py), DeepSpeed-Ulysses (ulysses.py)
PIPELINE_BALANCE = ("params", "time")
TP_UNPLANNED = ("error", "replicate")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao float8 training (parallel/fp8.py); None: off
# ZeRO-3's FSDP2 units (parallel/data/fsdp.py; the option's doc says what each groups).
ZERO3_UNITS = ("auto", "blocks", "blocks_and_ends")
# torch.compile's keyword arguments that compile=<dict> may give.
COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")

Degree = Union[int, Literal["auto"]]
Kind = Literal["degree", "flag", "choice", "zero", "number", "compile", "any"]


@dataclass(frozen=True)
class Option:
    """One layout option.

    ``kind`` says how a value is checked (:func:`check_option`): ``"degree"`` a positive integer,
    ``"flag"`` a bool, ``"choice"`` one of ``choices``, ``"zero"`` a ZeRO stage, ``"number"`` a
    positive number of ``unit``, ``"compile"`` :func:`compile_options`'
    check, ``"any"`` unchecked here (checked where it is applied). ``also``: values taken besides
    (``"auto"``, ``None``). ``not_planned``: why the planner's ``Layout`` has no such field (empty: it has).
    """

    name: str
    annotation: Any
    default: Any
    doc: str
    kind: Kind
    choices: tuple[Any, ...] = ()
    also: tuple[Any, ...] = ()
    unit: str = ""
    not_planned: str = ""


# Order: the signature's (the first five positional, as in Lightning's ModelParallelStrategy's spirit).
LAYOUT_OPTIONS: tuple[Option, ...] = (
    Option("dp", Degree, "auto", "data-parallel degree; ``\"auto\"`` takes what is left of the world size.",
           "degree", also=("auto",)),
    Option("tp", Degree, 1, "tensor-parallel degree (innermost mesh dim: keep it within a node); ``\"auto\"`` as in"
           " Lightning's ``ModelParallelStrategy``: the devices of one node (what dp leaves if dp is set).",
           "degree", also=("auto",)),
    Option("pp", int, 1, "pipeline-parallel degree (outermost mesh dim).", "degree"),
    Option("ep", int, 1, "expert-parallel degree; must divide ``dp`` (experts are sharded inside dp).", "degree"),
    Option("zero", int, 0, "ZeRO stage 0, 1, 2 or 3 over ``dp`` (over ``dp_shard x cp`` in general).", "zero",
           ZERO_STAGES),
    Option("cp", int, 1, "context-parallel degree: each sequence is split over ``cp`` ranks (load-balanced"
           " head-tail chunks) and attention runs across them (``docs/context_parallel.md``).", "degree"),
    Option("cp_method", str, "ring", "``\"ring\"`` (K/V blocks passed peer-to-peer) or ``\"all_to_all\"``"
           " (DeepSpeed-Ulysses; heads must divide by ``cp x tp``).", "choice", CP_METHODS),
    Option("cp_load_balance", bool, True, "head-tail chunks (``2 * cp`` must divide the sequence); ``False``:"
           " contiguous slices (``cp`` must divide it; causal attention then costs more on late ranks).", "flag"),
    Option("cp_check", bool, True, "before the first cp step, run a short prefix of the batch on the whole sequence"
           " and under cp and raise if the attention inputs differ (positions built from the local chunk;"
           " ``docs/context_parallel.md``). ``False`` skips it.", "flag",
           not_planned="a first-step numerics check of the model under cp (parallel/context/check.py), not a layout"),
    Option("dp_replicate", Optional[int], None, "hybrid sharded data parallel, ``dp = dp_replicate x dp_shard``:"
           " ZeRO state replicated over ``dp_replicate`` (across nodes); needs ``zero >= 1``.", "degree",
           also=(None,)),
    Option("dp_shard", Optional[int], None, "the other factor of hybrid sharding: ZeRO state sharded over"
           " ``dp_shard`` (within a node). ``dp`` alone means ``dp_shard = dp``.", "degree", also=(None,)),
    Option("sequence_parallel", bool, False, "shard norms/dropout/residuals along the sequence over ``tp``.", "flag"),
    Option("sp_save_input_shard", bool, True, "under sequence parallel, save only the sequence shard of each"
           " sublayer input for backward and all-gather it again there (Megatron-SP; less memory, one more"
           " all-gather per sublayer). ``False`` keeps the gathered input instead.", "flag"),
    Option("tp_plan", Optional[Mapping[str, Any]], None, "module-name pattern -> parallel style; overrides the"
           " model's declared plan.", "any", not_planned="the model's tensor-parallel plan (describe_module reads"
           " the model)"),
    Option("tp_unplanned", str, "error", "``\"error\"`` (default) for an ``nn.Linear`` no plan covers, or"
           " ``\"replicate\"`` to keep such Linears whole on every tp rank.", "choice", TP_UNPLANNED,
           not_planned="how the model's unplanned layers are handled (the model, not the layout)"),
    Option("loss_parallel", Union[bool, Literal["auto"]], "auto", "vocab-parallel cross-entropy under ``tp`` (full"
           " logits never gathered). ``\"auto\"``: on under the Trainer (the strategy computes ``training_step``"
           " inside torch's ``loss_parallel`` context), off under Fabric (the loop computes the loss outside the"
           " strategy; with ``True`` do it inside ``with strategy.loss_parallel():``).", "flag", also=("auto",)),
    Option("activation_checkpointing", Optional[str], None, "``None``, ``\"full\"``, ``\"selective\"`` or"
           " ``\"selective_op\"`` (torchtitan's per-op policy: every second matmul recomputed) per block; see"
           " ``parallel/activation_checkpoint.py``.", "choice", ACTIVATION_CHECKPOINTING),
    Option("schedule", str, "1f1b", "pipeline schedule (``\"gpipe\"``, ``\"1f1b\"``, ``\"interleaved\"``,"
           " ``\"zero_bubble\"``, ...).", "choice", SCHEDULES),
    Option("microbatches", Optional[int], None, "microbatches per pipeline step (default: ``pp * virtual_stages``,"
           " one per stage).", "degree", also=(None,)),
    Option("virtual_stages", int, 1, "stages per pipeline rank for interleaved schedules.", "degree"),
    Option("pipeline_split", Optional[Sequence[int]], None, "explicit layer indices where stages start (instead of"
           " balancing).", "any"),
    Option("pipeline_balance", str, "params", "``\"params\"`` (default) or ``\"time\"`` (measured per layer).",
           "choice", PIPELINE_BALANCE),
    Option("bucket_size_mb", float, 25.0, "gradient bucket size for ZeRO 0-2.", "number", unit="MiB"),
    Option("zero_accumulation", str, "no_sync", "``\"no_sync\"`` (no communication until the last micro-step),"
           " ``\"reduce_each_step\"`` (ZeRO-2/3 keep gradients sharded while accumulating) or"
           " ``\"reduce_each_microbatch\"`` (ZeRO-2: also over a pipeline's microbatches, stage by stage; ``m`` times"
           " the gradient traffic, one stage's whole gradients at most).", "choice", ZERO_ACCUMULATION),
    Option("zero3_units", str, "auto", "ZeRO-3's FSDP2 units. ``\"blocks\"`` (the collectives of Lightning's FSDP2"
           " recipe): one unit per block, and the embedding, final norm and head as one grouped unit gathered once"
           " per step. ``\"blocks_and_ends\"`` (torchtitan's): the embedding and the head get a unit each, which"
           " holds less memory gathered and costs two more collectives per step. ``\"auto\"`` (default):"
           " ``\"blocks\"`` when the parameters outside the blocks are no more than the largest block's. The bytes"
           " moved are the same (``docs/data_parallel.md``).", "choice", ZERO3_UNITS),
    Option("compile", Union[bool, Mapping[str, Any]], False, "``torch.compile`` each transformer block after TP/SP,"
           " CP and activation checkpointing, before data parallelism (``True``: inductor; a dict:"
           " ``torch.compile``'s keyword arguments, e.g. ``{\"backend\": \"aot_eager\"}``). Blocks of one class share"
           " one graph; a recompile storm warns with dynamo's reasons (``docs/performance.md``).", "compile"),
    Option("fp8", Optional[str], None, "``\"tensorwise\"`` or ``\"rowwise\"``: torchao float8 training of the"
           " linears (not the head, not widths that are not multiples of 16; ``strategy.parallel_model.float8`` names"
           " them); ``pip install lightning-para[fp8]``. Emulated without float8 hardware. Under tp, torchao's float8"
           " tensor-parallel styles (``\"tensorwise\"`` only); under ZeRO-3 the weights are all-gathered in float8.",
           "choice", (None, *FP8_RECIPES)),
    Option("layout", Optional[str], None, "``\"auto\"``: at setup the planner (``lightning_para.plan``) picks every"
           " degree and option left at its default for this model, world size and device memory, logs the choice"
           " and the runner-up, and uses it; values you set are kept (``docs/planner.md``).", "choice", ("auto",),
           also=(None,), not_planned="layout='auto' itself"),
    Option("layout_memory_gb", Optional[float], None, "memory per process the planner may fill (default: the"
           " device's; on CPU the RAM divided among the node's processes).", "number", also=(None,), unit="GB",
           not_planned="layout='auto''s memory limit (the planner's Cluster)"),
)
OPTIONS: dict[str, Option] = {o.name: o for o in LAYOUT_OPTIONS}
# The first arguments of ParaStrategy that may be given by position (the degrees and the ZeRO stage).
POSITIONAL = ("dp", "tp", "pp", "ep", "zero")
# The degrees ``dp="auto"`` resolves from the world size (``dp_shard`` is ``dp / dp_replicate``).
WORLD_SIZED = ("dp", "dp_shard")



def choices_text(values: Any) -> str:
    return ", ".join(repr(v) for v in values)


def compile_options(value: Union[bool, Mapping[str, Any], None]) -> Optional[dict[str, Any]]:
    """``compile=`` as ``torch.compile`` keyword arguments (``None``: no compile).

    ``True`` is torch's defaults (inductor); a mapping is passed to ``torch.compile``. Raises
    ``ValueError`` naming ``compile`` for another value or an unknown key.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(
                f"`compile={dict(value)!r}`: {unknown} are not torch.compile options. Use keys from {list(COMPILE_KEYS)}."
            )
        return dict(value)
    raise ValueError(f"`compile={value!r}` must be True, False or a dict of torch.compile options ({list(COMPILE_KEYS)}).")


def check_option(name: str, value: Any, also: Optional[tuple[Any, ...]] = None) -> None:
    """``ValueError`` naming ``name`` when ``value`` is not one it takes (its relations to other options are
    :data:`RULES`'). ``also``: the values taken besides its kind's (default: the declaration's ``also``, e.g.
    ``"auto"`` or ``None``; the planner passes its own)."""
    option = OPTIONS[name]
    if any(value is v or (isinstance(v, str) and value == v) for v in (option.also if also is None else also)):
        return
    kind = option.kind
    if kind == "choice":
        if value not in option.choices or isinstance(value, bool):
            shown = sorted(option.choices) if name == "cp_method" else option.choices
            choose = f"one of {choices_text(shown)}" if len(shown) > 1 else f"{shown[0]!r} or None"  # layout
            raise ValueError(f"`{name}={value!r}` is unknown. Choose {choose}.")
    elif kind == "degree":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer (1 disables this dimension).")
    elif kind == "flag":
        if not isinstance(value, bool):
            raise ValueError(f"`{name}={value!r}` must be True or False.")
    elif kind == "zero":
        if isinstance(value, bool) or value not in option.choices:
            raise ValueError(f"`zero={value!r}` is not a ZeRO stage. Choose one of {choices_text(option.choices)}.")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`{name}={value!r}` must be a positive number of {option.unit}.")
    elif kind == "compile":
        compile_options(value)  # ValueError naming `compile`


def arguments_doc(extra: Optional[Mapping[str, str]] = None, indent: int = 8) -> str:
    """The ``Args`` entries of every layout option (then ``extra``: a front end's own arguments), one per
    name, wrapped at 116 columns: the text both front ends' docstrings show."""
    lines = []
    for name, doc in [*((o.name, o.doc) for o in LAYOUT_OPTIONS), *(extra or {}).items()]:
        lines += textwrap.wrap(f"{name}: {doc}", 116 - indent, initial_indent=" " * indent,
                               subsequent_indent=" " * (indent + 4), break_on_hyphens=False)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- rules between options
# Each rule's parameters are the options it reads, by their names (:func:`rule_problems` passes them so); it
# returns ``(what is wrong, why and the fix)`` or ``None``. The planner shows the first part as the reason it
# excludes a layout; ParallelConfig raises with both.
Problem = Optional[tuple[str, str]]


def data_parallel_factors_problem(dp: Any, dp_replicate: Optional[int], dp_shard: Optional[int]) -> Problem:
    """``dp = dp_replicate x dp_shard``, each dividing ``dp``."""
    if not isinstance(dp, int):  # "auto": resolved from the world size (ParallelConfig.resolve_dims)
        return None
    r, s = dp_replicate, dp_shard
    if r is not None and s is not None and r * s != dp:
        return (f"`dp_replicate={r}` x `dp_shard={s}` = {r * s} must equal `dp={dp}`",
                f"Leave out dp (it is dp_replicate x dp_shard), or choose dp_replicate x dp_shard = {dp}.")
    for name, value in (("dp_replicate", r), ("dp_shard", s)):
        if value is not None and dp % value:
            choices = [d for d in range(1, dp + 1) if dp % d == 0]
            return f"`{name}={value}` must divide `dp={dp}`", f"Choose {name} in {choices}."
    return None


def expert_degree_problem(ep: int, dp: Any, dp_replicate: Optional[int] = None, dp_shard: Optional[int] = None) -> Problem:
    """``ep`` must divide the sharded part of ``dp``: expert parallelism splits the data-parallel ranks of one
    replica (``dp="auto"``: checked once the world size resolves it)."""
    if not isinstance(dp, int) or isinstance(dp, bool):
        return None
    replicas = dp_replicate if dp_replicate is not None else (dp // dp_shard if dp_shard else 1)
    shard = dp // max(1, replicas)
    if shard % ep == 0:
        return None
    if replicas == 1:
        return (f"`ep={ep}` must divide `dp={dp}`",
                f"expert parallelism splits the data-parallel ranks. Choose ep in {divisors(dp)} or a dp that is a"
                f" multiple of {ep}.")
    return (f"`ep={ep}` must divide `dp_shard={shard}`",
            f"expert parallelism splits the data-parallel ranks of one replica (hybrid sharding replicates whole"
            f" replicas over dp_replicate={replicas}). Choose ep in {divisors(shard)} or a dp_shard that is a multiple"
            f" of {ep}.")


def hybrid_sharding_problem(dp_replicate: Optional[int], zero: Any, layout: Optional[str] = None) -> Problem:
    if (dp_replicate or 1) > 1 and zero == 0 and layout != "auto":  # layout="auto" picks zero >= 1 for it
        return (f"`dp_replicate={dp_replicate}` (hybrid sharding) needs `zero` in 1, 2 or 3",
                "ZeRO-0 shards nothing, so there is nothing to replicate across groups. Use zero>=1, or leave"
                " dp_replicate out (plain data parallel).")
    return None


def zero_accumulation_problem(zero_accumulation: str, zero: Any) -> Problem:
    if zero_accumulation == "reduce_each_microbatch" and zero != 2:
        return (f"`zero_accumulation='reduce_each_microbatch'` needs `zero=2` (got zero={zero})",
                "it reduce-scatters each pipeline microbatch's gradients into ZeRO-2's shards. Set zero=2, or use"
                " zero_accumulation='reduce_each_step' (ZeRO-2/3, one reduction per Lightning micro-step).")
    return None


def context_recompute_problem(cp: int, activation_checkpointing: Optional[str]) -> Problem:
    if cp > 1 and activation_checkpointing in ("selective", "selective_op"):
        return (f"`activation_checkpointing={activation_checkpointing!r}` with `cp>1` is not supported",
                "selective recomputation caches the outputs of collectives, which would replay ring attention's"
                " point-to-point receives without their sends. Use activation_checkpointing='full' (recomputes"
                " attention across the cp group) or None.")
    return None


def fp8_tensor_parallel_problem(fp8: Optional[str], tp: Any) -> Problem:
    if fp8 == "rowwise" and tp != 1:
        return (f"`fp8='rowwise'` with `tp={tp}` is not supported",
                "torchao's float8 tensor-parallel styles assume tensorwise scales. Use fp8='tensorwise' with tp,"
                " or fp8='rowwise' with tp=1.")
    return None


def pipeline_zero3_problem(pp: int, zero: Any) -> Problem:
    if pp > 1 and zero == 3:
        return ("`zero=3` with `pp>1` is not supported",
                "FSDP2 would all-gather a stage's parameters for every microbatch's forward and backward (2m gathers"
                " per step instead of 2) and its reduce-scatter would fire once per microbatch, or it keeps them"
                " gathered and saves nothing over ZeRO-2. Use zero=1 (or zero=2); each rank already holds only 1/pp"
                " of the model.")
    return None


def pipeline_compile_problem(pp: int, compile: Any, schedule: str) -> Problem:
    if pp > 1 and compile and schedule in SCHEDULES and schedule_info(schedule).split_backward:
        return (f"`compile=True` with `schedule={schedule!r}` is not supported",
                "the schedule splits each backward into input- and weight-gradient passes over the stage's autograd"
                " graph, which a compiled block runs as one opaque node. Use schedule='1f1b' or 'interleaved' (or"
                " 'gpipe', 'looped_bfs') with compile, or compile=False with this schedule.")
    return None


def sequence_parallel_problem(sequence_parallel: bool, tp: Any) -> Problem:
    """ParallelConfig warns (nothing to split over); the planner cannot price a sequence shard of tp=1."""
    if sequence_parallel and tp == 1:
        return ("`sequence_parallel=True` has no effect with tp=1", "there is nothing to split the sequence over.")
    return None


def zero3_units_problem(zero3_units: str, zero: Any) -> Problem:
    if zero3_units != "auto" and zero != 3:
        return (f"`zero3_units={zero3_units!r}` has no effect with zero={zero}", "it chooses ZeRO-3's units.")
    return None


RuleFunction = Callable[..., Problem]
# The rules, by what they mean for a layout: without the ``LAYOUT_RULES`` the degrees are no layout;
# ``RUN_RULES`` are what ParaStrategy cannot run (the planner excludes such a layout, naming the rule);
# ``NOTE_RULES`` make an option idle (ParallelConfig warns).
LAYOUT_RULES: tuple[RuleFunction, ...] = (data_parallel_factors_problem, hybrid_sharding_problem, zero_accumulation_problem)
RUN_RULES: tuple[RuleFunction, ...] = (
    expert_degree_problem,  # the degrees' own rule (ParallelDims checks it again once "auto" is resolved)
    context_recompute_problem, fp8_tensor_parallel_problem, pipeline_zero3_problem, pipeline_compile_problem,
)
NOTE_RULES: tuple[RuleFunction, ...] = (sequence_parallel_problem, zero3_units_problem)
RULES = LAYOUT_RULES + RUN_RULES


def _arguments(rule: RuleFunction) -> tuple[str, ...]:
    return rule.__code__.co_varnames[: rule.__code__.co_argcount]


def rule_problems(values: Mapping[str, Any], rules: Sequence[RuleFunction] = RULES) -> list[tuple[str, str]]:
    """The ``(problem, why and fix)`` of every rule in ``rules`` that ``values`` break (an option missing from
    ``values`` takes its declared default)."""
    found = []
    for rule in rules:
        problem = rule(*(values[n] if n in values else OPTIONS[n].default for n in _arguments(rule)))
        if problem:
            found.append(problem)
    return found


def check_rules(values: Mapping[str, Any], rules: Sequence[RuleFunction] = RULES) -> None:
    """``ValueError`` naming the arguments and the fix for the first rule ``values`` break."""
    for problem, fix in rule_problems(values, rules):
        raise ValueError(f"{problem}: {fix}" if fix[0].islower() else f"{problem}. {fix}")


def warn_rules(values: Mapping[str, Any]) -> None:
    """A ``UserWarning`` for each option that ``values`` leave without effect (:data:`NOTE_RULES`)."""
    for problem, why in rule_problems(values, NOTE_RULES):
        warnings.warn(f"{problem} ({why.rstrip('.')}).")


__all__ = [
    "LAYOUT_OPTIONS", "LAYOUT_RULES", "NOTE_RULES", "OPTIONS", "Option", "POSITIONAL", "WORLD_SIZED",
    "RULES", "RUN_RULES", "arguments_doc", "check_option", "compile_options", "check_rules", "choices_text", "rule_problems",
    "warn_rules", "data_parallel_factors_problem", "expert_degree_problem", "hybrid_sharding_problem", "zero_accumulation_problem",
    "context_recompute_problem", "fp8_tensor_parallel_problem", "pipeline_zero3_problem", "pipeline_compile_problem",
    "sequence_parallel_problem", "zero3_units_problem",
    "ACTIVATION_CHECKPOINTING", "CP_METHODS", "FP8_RECIPES", "PIPELINE_BALANCE", "PRECISIONS",
    "RECOMPUTE_MODES", "SCHEDULES", "TP_UNPLANNED", "ZERO3_UNITS", "ZERO_ACCUMULATION", "ZERO_STAGES", "COMPILE_KEYS",
]
