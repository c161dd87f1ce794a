"""Pretrained safetensors folders in one process: sharded export with the index, reading slices back,
and every bad folder as a clear error (no weights, missing or truncated shard, names and shapes that differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lightning_para.checkpoint import (  # noqa: E402
    PretrainedWeights,
    load_pretrained_into,
    stored_tensors,
)
from lightning_para.checkpoint.atomic import mark_checkpoint_complete  # noqa: E402
from lightning_para.checkpoint.format import save_sharded  # noqa: E402
from lightning_para.checkpoint.pretrained import materialize_for_loading, real_buffers  # noqa: E402
from lightning_para.integrations.transformers import export, transformers_models  # noqa: E402
from lightning_para.integrations.transformers.weights import empty_causal_lm  # noqa: E402
from tests.hf_models import llama_config  # noqa: E402


def _llama(**overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(**overrides))


def _checkpoint(model) -> dict:
    wrapper = torch.nn.Module()
    wrapper.model = model
    return {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "transformers_models": transformers_models(wrapper)}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _read_back(folder: Path):
    """What ParaStrategy does, in one process: meta build, empty storage, read the slices (here: whole)."""
    model = empty_causal_lm(folder)
    materialize_for_loading(model, torch.device("cpu"), real_buffers(model))
    load_pretrained_into(model, PretrainedWeights(folder))
    return model


@pytest.mark.parametrize("source", ["dict", "sharded_dir"])
def test_export_writes_sharded_safetensors_with_the_index(tmp_path, source):
    from transformers import AutoModelForCausalLM

    model = _llama()
    ckpt = _checkpoint(model)
    if source == "sharded_dir":  # a ParaStrategy checkpoint directory (DCP + meta.pt + completion marker)
        path = tmp_path / "ckpt"
        save_sharded(path, {"state_dict": ckpt["state_dict"]}, {"transformers_models": ckpt["transformers_models"]})
        mark_checkpoint_complete(path)
        ckpt = path
    out = export(ckpt, tmp_path / "hf", max_shard_size=40_000, workers=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((out / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(model.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    expected = _logits(model, ids)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out), ids), expected, rtol=0, atol=0)
    torch.testing.assert_close(_logits(_read_back(out), ids), expected, rtol=0, atol=0)


def test_bad_folders_are_clear_errors(tmp_path):
    model = _llama()
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / sorted(set(index["weight_map"].values()))[1]
    # truncated shard
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"`{shard}` is truncated or corrupt: its header describes {len(data)} bytes"):
        stored_tensors(folder)
    # missing shard
    shard.unlink()
    with pytest.raises(ValueError, match=rf"lists the shard `{shard.name}`, which is missing"):
        stored_tensors(folder)
    # no weights at all
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        stored_tensors(empty)
    from lightning_para.recipes import HFCausalLM

    with pytest.raises(ValueError, match="holds no safetensors weights"):
        HFCausalLM(pretrained=str(empty))
    with pytest.raises(ValueError, match="has no config.json"):
        HFCausalLM(pretrained=str(tmp_path / "nowhere"), sharded_load=True)


def test_weights_that_do_not_match_the_config_are_listed(tmp_path):
    folder = tmp_path / "hf"
    _llama().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(intermediate_size=80, num_hidden_layers=3)
    (folder / "config.json").write_text(json.dumps(config))
    model = empty_causal_lm(folder)
    materialize_for_loading(model, torch.device("cpu"), real_buffers(model))
    with pytest.raises(ValueError) as err:
        load_pretrained_into(model, PretrainedWeights(folder))
    message = str(err.value)
    assert "missing from the files (9): ['model.layers.2." in message
    assert "model.layers.0.mlp.down_proj.weight: [64, 96] in the files, [64, 80] in the model" in message


def test_hf_recipe_loads_sharded_inside_a_meta_context_and_whole_outside(tmp_path):
    from lightning_para.recipes import HFCausalLM

    model = _llama()
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    with torch.device("meta"):  # what trainer.init_module(empty_init=True) opens
        lazy = HFCausalLM(pretrained=str(folder))
    assert all(p.is_meta for p in lazy.parameters()) and lazy.pretrained_weights() is not None
    assert not any(b.is_meta for b in lazy.buffers())  # RoPE tables are built for real
    eager = HFCausalLM(pretrained=str(folder))
    assert eager.pretrained_weights() is None
    ids = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(_logits(eager.model, ids), _logits(model, ids), rtol=0, atol=0)


def test_bf16_files_load_as_from_pretrained_loads_them(tmp_path):
    """Hub checkpoints are bf16: the sharded path builds the model in the config's dtype, as from_pretrained does."""
    from transformers import AutoModelForCausalLM

    model = _llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    sharded = _read_back(tmp_path / "hf")
    for (name, a), b in zip(eager.state_dict().items(), sharded.state_dict().values()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
