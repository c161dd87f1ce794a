"""Lightning's own tests of Fabric's ``ModelParallelStrategy`` and ``FSDPStrategy`` (2.6.x,
``tests/tests_fabric/strategies/``), adapted to CPU and gloo and run against
``lightning_para.fabric.ParaStrategy`` (the jobs and the adaptation: ``fabric_jobs.py``).

Each test names the Lightning test it adapts. Where ParaStrategy differs by design, the test
asserts ParaStrategy's behaviour and the docstring gives the difference and its one-line fix
(the table in ``docs/fabric.md`` lists them all).
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning_compat import fabric_jobs as jobs

# ParaStrategy's atomic, checksummed save adds its completion marker (with every file's CRC-32) to the DCP files.
DCP_FILES_2 = {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}
DCP_FILES_4 = DCP_FILES_2 | {"__2_0.distcp", "__3_0.distcp"}


# ----------------------------------------------------------------------------- 2 processes
@pytest.mark.parametrize("compile", [False, True])
def test_tensor_parallel(pools, compile):
    """test_model_parallel_integration.py::test_tensor_parallel (compile: ParaStrategy(compile=...) compiles
    each block after TP instead of the user's `torch.compile(model)`; eager backend on CPU)."""
    out = pools.get(2).run(jobs.tensor_parallel_job, {"tp": 2, "tp_plan": jobs.FEED_FORWARD_PLAN}, compile)
    assert out[0]["w1_mesh_shape"] == (2,)  # the tensor-parallel mesh
    assert out[0]["compiled"] == (1 if compile else 0)


def test_train_save_load_dp2(pools, tmp_path):
    """test_train_save_load (on 2 processes: FSDP2 over dp=2; the 4-process dp2 x tp2 case is below).
    Difference: the folder also holds ParaStrategy's completion marker (atomic, checksummed saves)."""
    out = pools.get(2).run(jobs.train_save_load_job, str(tmp_path), jobs.FSDP)
    assert DCP_FILES_2 <= out[0]["files"]


def test_save_full_state_dict(pools, tmp_path):
    """test_save_full_state_dict, with FSDPStrategy's variant of it (test_fsdp_integration.py)."""
    pools.get(2).run(jobs.save_full_state_dict_job, str(tmp_path))


def test_load_full_state_dict_into_sharded_model(pools, tmp_path):
    pools.get(2).run(jobs.load_full_into_sharded_job, str(tmp_path))


@pytest.mark.parametrize(
    "precision,expected", [("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)]
)
def test_module_init_context(pools, precision, expected):
    """test_module_init_context: under the init context parameters are made in the precision's dtype
    (on CPU, or on meta with empty_init). Difference: after setup, ParaStrategy's ZeRO-3 shards are the fp32
    masters (FSDP2 gathers them in ``expected`` for compute); one-line fix for Lightning's behaviour:
    ``ParaStrategy(precision_plugin=FabricParaPrecision(precision, master_weights=False))``."""
    out = pools.get(2).run(jobs.module_init_context_job, precision)[0]
    assert out[False][0] == {("cpu", expected)}
    assert out[True][0] == {("meta", expected)}
    for empty_init in (False, True):
        assert out[empty_init][1] == {("cpu", torch.float32 if expected != torch.float32 else expected)}


def test_save_filter(pools, tmp_path):
    out = pools.get(2).run(jobs.save_filter_job, str(tmp_path))
    assert out[0]["keys"] == {"w1.bias", "w2.bias", "w3.bias"}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("clip_type", ["norm", "val"])
def test_clip_gradients(pools, clip_type, precision):
    """test_clip_gradients (model_parallel and fsdp): Lightning skips the norm case as "not correct" for
    ModelParallelStrategy; ParaStrategy clips to the global norm over every shard, and it passes."""
    pools.get(2).run(jobs.clip_gradients_job, clip_type, precision)


# ----------------------------------------------------------------------------- 4 processes (sorted last)
def test_z_setup_device_mesh(pools):
    """test_setup_device_mesh: the degrees give the mesh's "data_parallel" and "tensor_parallel" sizes.
    Difference: ParaStrategy's mesh holds every dimension ("pp", "dp_replicate", ..., "tp"); Lightning's
    names are aliases on it (one-line fix: index it by name, not ``mesh_dim_names == (...)``)."""
    out = pools.get(4).run(jobs.setup_device_mesh_job)[0]
    assert out == {(1, 4): (1, 4), (4, 1): (4, 1), (2, 2): (2, 2)}


@pytest.mark.parametrize("compile", [False, True])
def test_z_fsdp2_tensor_parallel(pools, compile):
    out = pools.get(4).run(jobs.tensor_parallel_job, jobs.TP_FSDP, compile)
    assert out[0]["w1_mesh_shape"] == (2, 2)  # Lightning's check: a 2-D (dp, tp) DTensor mesh
    assert out[0]["compiled"] == (1 if compile else 0)


def test_z_train_save_load_dp2_tp2(pools, tmp_path):
    out = pools.get(4).run(jobs.train_save_load_job, str(tmp_path), jobs.TP_FSDP)
    assert DCP_FILES_4 <= out[0]["files"]


def test_z_save_sharded_and_consolidate_and_load(pools, tmp_path):
    out = pools.get(4).run(jobs.save_sharded_consolidate_load_job, str(tmp_path))
    assert DCP_FILES_4 <= out[0]["files"]


@pytest.mark.parametrize("move_to_device", [True, False])
def test_setup_module_move_to_device(pools, move_to_device):
    out = pools.get(2).run(jobs.setup_module_move_to_device_job, move_to_device)
    assert [o["local_numel"] for o in out] == [50, 50]


@pytest.mark.parametrize("zero", [1, 3])
def test_setup_with_multiple_param_groups(pools, zero):
    """test_setup_with_orig_params_and_multiple_param_groups (fsdp): FSDP1's ``use_orig_params`` has no
    counterpart (FSDP2 keeps original parameters); each group steps with its own learning rate."""
    out = pools.get(2).run(jobs.multiple_param_groups_job, zero)[0]
    assert out["moved"][0] > 1e-3 > 1e-5 > out["moved"][1] > 0
    assert out["dtensor"] == (zero == 3)


def test_reapply_compile(pools):
    pools.get(2).run(jobs.reapply_compile_job)


def test_load_raw_module_state(pools, tmp_path):
    pools.get(2).run(jobs.load_raw_module_state_job, str(tmp_path))


def test_collectives(pools):
    out = pools.get(2).run(jobs.collectives_job)
    for result in out:
        assert result == {"mean": 1.5, "sum": 3.0, "gathered": [1.0, 2.0], "broadcast": {"from": 1}}
