"""cp and dp_replicate x dp_shard without communication: configuration errors, mesh layout on
torch's fake process group, the batch split and positions a cp rank gets, the GPT recipe's positions."""

from __future__ import annotations

import pytest
import torch

from lightning_para.config import ParallelConfig
from lightning_para.parallel.context import ContextParallelShard, shard_sequence
from lightning_para.recipes.gpt import GPT, apply_rope


# ----------------------------------------------------------------------------- bad configuration
@pytest.mark.parametrize(
    "kwargs, world, message",
    [
        ({"cp_method": "flash"}, None, r"`cp_method='flash'` is unknown. Choose one of 'all_to_all', 'ring'"),
        ({"cp": 0}, None, r"`cp=0` must be a positive integer"),
        ({"cp": 2, "activation_checkpointing": "selective"}, None, r"'selective'` with `cp>1` is not supported.*'full'"),
        ({"dp": 4, "dp_replicate": 3, "dp_shard": 2, "zero": 1}, None,
         r"`dp_replicate=3` x `dp_shard=2` = 6 must equal `dp=4`"),
        ({"dp": 4, "dp_replicate": 3, "zero": 1}, None, r"`dp_replicate=3` must divide `dp=4`. Choose dp_replicate in \[1, 2, 4\]"),
        ({"dp_replicate": 2}, None, r"`dp_replicate=2` \(hybrid sharding\) needs `zero` in 1, 2 or 3"),
        ({"dp_replicate": 2, "dp_shard": 2, "ep": 4, "zero": 1}, 4,
         r"`ep=4` must divide `dp_shard=2`.* replicates whole replicas over dp_replicate=2.* Choose ep in \[1, 2\]"),
        ({"dp_shard": 3, "zero": 1}, 4, r"`dp_shard=3` must divide `dp=4`.* Choose dp_shard in \[1, 2, 4\]"),
        ({"cp": 2, "tp": 2}, 6, r"world size 6 is not divisible by pp=1 x cp=2 x tp=2 = 4.* Choose pp, cp and tp"),
        ({"dp": 2, "cp": 2}, 8, r"pp=1 x dp=2 x cp=2 x tp=1 = 4 do not match the world size 8"),
    ],
    ids=["cp-method", "cp-zero", "cp-selective", "replicate-times-shard", "replicate-divides", "replicate-needs-zero",
         "ep-inside-shard", "shard-divides", "auto-dp", "world-size"],
)
def test_bad_configuration_names_the_argument(kwargs, world, message):
    with pytest.raises(ValueError, match=message):
        config = ParallelConfig(**kwargs)
        if world is not None:
            config.resolve_dims(world)


def test_degrees_resolve():
    dims = ParallelConfig(dp_replicate=2, zero=1, tp=2).resolve_dims(8)  # dp auto = 4, dp_shard = 4 / 2
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.zero_shards) == (4, 2, 2, 2)
    dims = ParallelConfig(dp_shard=2, zero=3).resolve_dims(8)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (8, 4, 2)
    dims = ParallelConfig(cp=2, ep=2, zero=1).resolve_dims(8)  # ZeRO shards dense state over dp x cp = 8
    assert (dims.dp, dims.cp, dims.edp, dims.zero_shards, dims.expert_zero_shards) == (4, 2, 2, 8, 4)
    assert ParallelConfig().resolve_dims(4).shape == (1, 1, 4, 1, 1, 1)  # dp alone: today's flat layout


# ----------------------------------------------------------------------------- mesh layout (fake process group)
def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


@pytest.mark.parametrize("rank", [0, 5])
def test_hybrid_mesh_shards_inside_a_node_and_replicates_across(fake_world, rank):
    """8 ranks = 2 nodes of 4: dp_replicate=2 x dp_shard=2 x tp=2. tp and dp_shard stay in a node."""
    fake_world(8, rank)
    dims = ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, zero=1).resolve_dims(8)
    dims.build_mesh("cpu")
    node = rank // 4
    assert _ranks(dims.get_mesh("tp")) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(dims.get_mesh("dp_shard")) == [node * 4 + rank % 2, node * 4 + rank % 2 + 2]
    assert _ranks(dims.get_mesh("dp_replicate")) == [rank % 4, rank % 4 + 4]  # one rank in each node
    assert _ranks(dims.get_mesh("dp")) == [rank % 2 + 2 * i for i in range(4)]  # the sampler's dp
    assert dims.zero_mesh() is dims.get_mesh("dp_shard")
    assert dims.replicate_mesh().get_group() is dims.get_mesh("dp_replicate").get_group()
    assert dims.fsdp_mesh().mesh_dim_names == ("dp_replicate", "dp_shard") and dims.fsdp_mesh().mesh.shape == (2, 2)


@pytest.mark.parametrize("rank", [0, 3])
def test_cp_sits_between_tp_and_dp(fake_world, rank):
    fake_world(8, rank)
    dims = ParallelConfig(cp=2, tp=2, dp=2).resolve_dims(8)
    dims.build_mesh("cpu")
    # rank = (dp_i * cp + cp_i) * tp + tp_i
    tp_i, cp_i, dp_i = rank % 2, (rank // 2) % 2, rank // 4
    assert _ranks(dims.get_mesh("cp")) == [dp_i * 4 + tp_i, dp_i * 4 + 2 + tp_i]
    assert _ranks(dims.get_mesh("dp")) == [cp_i * 2 + tp_i, 4 + cp_i * 2 + tp_i]
    # ZeRO shards over dp x cp: the four ranks of this tp slot.
    assert sorted(_ranks(dims.zero_mesh())) == sorted({d * 4 + c * 2 + tp_i for d in range(2) for c in range(2)})
    assert dims.replicate_mesh() is None


def test_flat_layout_keeps_one_dp_group(fake_world):
    """dp alone: ZeRO's mesh *is* the dp mesh (one process group, labelled "dp" as before)."""
    fake_world(4)
    dims = ParallelConfig(zero=2).resolve_dims(4)
    dims.build_mesh("cpu")
    assert dims.zero_mesh() is dims.get_mesh("dp") is dims.get_mesh("dp_shard")
    assert dims.zero_mesh(expert=True) is dims.get_mesh("edp_cp")


# ----------------------------------------------------------------------------- what a cp rank gets
def test_default_batch_split_and_positions():
    shard = ContextParallelShard(cp_rank=1, cp=2)
    ids = torch.arange(16).view(2, 8)
    batch = {"ids": ids, "weights": torch.ones(2), "pair": (ids, ids + 100)}
    local = shard.split_batch(batch)
    assert local["ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2 of 4 (head-tail)
    assert torch.equal(local["weights"], torch.ones(2))  # 1-D tensors are not sequences
    assert torch.equal(local["pair"][1], local["ids"] + 100)
    assert shard.position_ids(8).tolist() == [2, 3, 4, 5]
    assert shard.position_ids(8, batch_size=3).shape == (3, 4)
    assert torch.equal(shard.local_positions(4), shard.position_ids(8))
    assert ContextParallelShard(0, 2, load_balance=False).position_ids(8).tolist() == [0, 1, 2, 3]


def test_sequence_length_error_names_cp_and_choices():
    with pytest.raises(ValueError, match=r"cp=4\) splits every sequence .* into 2\*cp=8 equal chunks .* 12 tokens\."
                                         r" Choose cp in \[1, 2, 3, 6\].*cp_load_balance=False"):
        ContextParallelShard(0, 4).split(torch.zeros(1, 12))
    ContextParallelShard(0, 4, load_balance=False).split(torch.zeros(1, 12))  # cp alone divides 12


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_gpt_recipe_uses_global_positions_under_cp(pos):
    """A cp rank's embedding and RoPE equal the matching rows of the whole sequence's."""
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_embd=32, n_head=4, block_size=16, vocab_size=64, pos=pos)
    ids = torch.randint(0, 64, (2, 16))
    full = model.embed(ids)
    shard = ContextParallelShard(cp_rank=1, cp=2)
    model.embed.set_context_parallel(shard)
    torch.testing.assert_close(model.embed(shard.split(ids)), shard.split(full))
    x = torch.randn(2, 16, 4, 8)
    rotated = apply_rope(shard.split(x), 10000.0, shard.local_positions(8))
    torch.testing.assert_close(rotated, shard_sequence(apply_rope(x, 10000.0), 1, 2, dim=1))


# ----------------------------------------------------------------------------- the planner knows both
def test_planner_prices_cp_methods_and_checks_their_constraints():
    from lightning_para.plan import Cluster, Layout, Training, estimate, layout_problems, preset

    model, cluster = preset("llama3-8b"), Cluster.of("h100", nodes=1)
    training = Training(seq_len=8192, global_batch=8)
    with pytest.raises(ValueError, match="`cp_method='flash'` is unknown"):
        Layout(cp=2, cp_method="flash")
    ulysses = Layout(dp=1, tp=2, cp=4, cp_method="all_to_all")
    assert ulysses.label().split()[2] == "cp4(ulysses)"
    assert layout_problems(model, cluster, training, Layout(dp=1, tp=8, cp=1)) == []
    # llama3-8b has 8 kv heads: Ulysses over cp x tp = 16 cannot split them; ring can.
    two_nodes = Cluster.of("h100", nodes=2)
    problems = layout_problems(model, two_nodes, training, Layout(dp=1, tp=4, cp=4, cp_method="all_to_all"))
    assert problems == ["kv_heads 8 not divisible by cp x tp = 16 (Ulysses)"]
    assert layout_problems(model, two_nodes, training, Layout(dp=1, tp=4, cp=4)) == []
    bad = layout_problems(model, cluster, Training(seq_len=8190, global_batch=8), Layout(dp=4, cp=2))
    assert "seq_len 8190 not divisible by 2*cp=4 (load-balanced chunks)" in bad
    ring, a2a = (estimate(model, cluster, training, Layout(dp=2, tp=2, cp=2, cp_method=m, zero=1)) for m in
                 ("ring", "all_to_all"))
    assert {c.op for c in ring.collectives if c.dim == "cp"} == {"send_recv"}
    assert {c.op for c in a2a.collectives if c.dim == "cp"} == {"all_to_all"}
    # Ulysses' all-to-alls are not overlapped with attention: all of their time is exposed.
    assert all(c.exposed_seconds == pytest.approx(c.seconds) for c in a2a.collectives if c.dim == "cp")
