"""From a ParaStrategy run to the planner's inputs, and back: layout, batch, hardware.

The planner (:func:`~lightning_para.plan.estimate`) prices a :class:`Layout` of a
:class:`ModelDesc` on a :class:`Cluster` for a :class:`Training`. A Lightning run states the same
things differently: a :class:`~lightning_para.config.ParallelConfig`, a batch per data-parallel
rank as the DataLoader yields it, a precision plugin, an optimizer, and the machine it runs on.
This module translates between the two, so that

* ``ParaStrategy(layout="auto")`` can turn the planner's choice into a config
  (:meth:`ParallelConfig.with_layout`, through :meth:`Layout.strategy_kwargs`: the one mapping);
* the profiler and ``lightning-para plan --validate`` can ask the planner about *this* run
  (:meth:`Layout.from_config`, :func:`run_training`) and compare;
* ``--layout`` strings are read the one way (:func:`parse_layout`).

The local machine's figures (a :class:`Cluster` of this machine) are measured, not modelled:
:func:`lightning_para.calibrate.local_cluster`.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Optional

from lightning_para.plan.cluster import Cluster, Training
from lightning_para.plan.cost import Estimate, estimate
from lightning_para.plan.layout import PLANNER_FIELDS, Layout
from lightning_para.plan.model import ModelDesc
from lightning_para.spec.options import OPTIONS, check_option

if TYPE_CHECKING:  # read by duck typing: the command line's `--layout` parser loads no runtime
    from lightning_para.config import ParallelConfig
    from lightning_para.mesh import ParallelDims

# Options whose declared default is a value but whose planner field takes None (bucket_size_mb: Megatron's rule).
PLANNER_NONE = {name for name, (_, default) in PLANNER_FIELDS.items() if default is None}

# Short names accepted by `--layout` beside every Layout field (= every ParaStrategy layout argument).
LAYOUT_ALIASES = {"sp": "sequence_parallel", "m": "microbatches", "v": "virtual_stages", "bucket_mb": "bucket_size_mb"}
# `--layout "tp=2,pp=2,zero=1"` keys -> the option (lightning_para.spec.options) they set: Layout's fields, which are
# ParaStrategy's argument names (tests/unit/test_layout_vocabulary.py), and the short aliases.
LAYOUT_KEYS: dict[str, str] = {
    **{f.name: f.name for f in fields(Layout)}, **LAYOUT_ALIASES,
}
# How a value is read, by the option's kind in the declaration ("any": pipeline_split, a list of integers).
_READ = {"degree": "integer", "zero": "integer", "flag": "bool", "compile": "bool", "number": "number", "any": "list"}


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=2,pp=2,zero=1"`` -> ParaStrategy arguments (``ValueError`` naming a bad entry).

    Keys: every :class:`Layout` field, which are ParaStrategy's layout arguments (``dp tp pp ep cp
    cp_method cp_load_balance dp_replicate dp_shard zero zero3_units sequence_parallel ... ``), and
    the aliases ``sp m v bucket_mb``. Booleans take ``1``/``0``/``true``/``false``; lists
    (``pipeline_split``) are written with ``:`` (``pipeline_split=0:3``); ``none`` is ``None`` where
    the argument may be ``None``. Each value is checked by its option's one check
    (:func:`lightning_para.spec.options.check_option`).
    """
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in LAYOUT_KEYS or not value:
            raise ValueError(
                f"`--layout` entry {item!r} is not KEY=VALUE with a key among {', '.join(LAYOUT_KEYS)}"
                f" (e.g. --layout \"tp=2,pp=2\")."
            )
        name = LAYOUT_KEYS[key]
        option = OPTIONS[name]
        read = _READ.get(option.kind, "text")
        if value.lower() in ("none", "null") and (None in option.also or None in option.choices or name in PLANNER_NONE):
            out[name] = None
            continue
        if read == "bool":
            if value.lower() not in ("1", "0", "true", "false"):
                raise ValueError(f"`--layout` entry {item!r}: {key} takes true or false.")
            out[name] = value.lower() in ("1", "true")
        elif read == "integer":
            if not value.lstrip("-").isdigit():
                raise ValueError(f"`--layout` entry {item!r}: {key} takes a positive integer.")
            out[name] = int(value)
        elif read == "number":
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"`--layout` entry {item!r}: {key} takes a number.") from None
        elif read == "list":
            parts = value.split(":")
            if not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"`--layout` entry {item!r}: {key} takes integers separated by ':' (e.g. 0:3).")
            out[name] = [int(p) for p in parts]
        else:
            out[name] = value
        try:
            check_option(name, out[name], ())  # the option's one check; "auto" is no layout value
        except ValueError as err:
            raise ValueError(f"`--layout` entry {item!r}: {err}") from None
    return out


def strategy_overrides(arguments: dict[str, Any]) -> list[str]:
    """``--trainer.strategy.KEY VALUE`` command-line overrides for LightningCLI."""
    out = []
    for key, value in arguments.items():
        if value is None:
            text = "null"
        elif isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (list, tuple)):
            text = json.dumps(list(value))
        else:
            text = str(value)
        out += [f"--trainer.strategy.{key}", text]
    return out


def optimizer_kind(optimizer: Any) -> Optional[str]:
    """The planner's optimizer name for a torch optimizer: ``"adam"`` (Adam family: two fp32
    moments), ``"sgd"`` (SGD with momentum), ``"muon"`` (``lightning_para.optim.Muon``), or ``None`` for
    anything it does not model."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
    if name in ("Adam", "AdamW") and not group.get("amsgrad", False):
        return "adam"
    if name == "SGD" and group.get("momentum", 0):
        return "sgd"
    if hasattr(optimizer, "set_shard_view"):  # lightning_para.optim.Muon
        return "muon"
    return None


def run_training(
    seq_len: int,
    batch_per_rank: int,
    dp: int,
    *,
    accumulation: int = 1,
    precision: str = "32-true",
    optimizer: str = "adam",
) -> Training:
    """The :class:`Training` of a run whose data-parallel ranks each load ``batch_per_rank``
    sequences of ``seq_len`` tokens per batch, ``accumulation`` batches per optimizer step."""
    return Training(
        seq_len=seq_len, global_batch=batch_per_rank * dp * accumulation, micro_batch=None,
        accumulation=accumulation, precision=precision, optimizer=optimizer,
    )


def predict_run(
    model: ModelDesc, config: ParallelConfig, dims: ParallelDims, training: Training, cluster: Cluster
) -> Estimate:
    """The planner's prediction for a ParaStrategy run (raises ``ValueError`` if it cannot price it)."""
    return estimate(model, cluster, training, Layout.from_config(config, dims))


__all__ = [
    "LAYOUT_ALIASES", "LAYOUT_KEYS", "optimizer_kind", "parse_layout", "predict_run", "run_training",
    "strategy_overrides",
]
