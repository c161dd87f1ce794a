"""lightning_para.optim.Muon on one device: torch.optim.Muon's update plus AdamW's, the default split, overrides."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_para.optim import Muon, split_param_groups
from lightning_para.optim.routing import _owners


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 50, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.down(torch.relu(self.up(self.embed(x))))))


@pytest.mark.parametrize("nesterov, adjust", [(True, None), (False, "match_rms_adamw")])
def test_matches_torch_muon_and_adamw_per_step(nesterov, adjust):
    torch.manual_seed(0)
    ours, theirs = Tiny(), None
    theirs = copy.deepcopy(ours)
    opt = Muon(ours, lr=0.02, nesterov=nesterov, adjust_lr_fn=adjust, adamw_lr=3e-3, adamw_weight_decay=0.05)
    matrices = [theirs.up.weight, theirs.down.weight]
    rest = [p for p in theirs.parameters() if all(p is not m for m in matrices)]
    reference = [torch.optim.Muon(matrices, lr=0.02, nesterov=nesterov, adjust_lr_fn=adjust),
                 torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.05)]
    x = torch.randint(0, 50, (4, 9))
    for _ in range(4):
        for model, optimizers in ((ours, [opt]), (theirs, reference)):
            for o in optimizers:
                o.zero_grad()
            model(x).logsumexp(-1).mean().backward()
            for o in optimizers:
                o.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert set(opt.state[ours.up.weight]) == {"momentum_buffer"}
    assert set(opt.state[ours.embed.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_default_split_and_overrides():
    model = Tiny()
    muon, other = split_param_groups(model)
    assert [p.shape for p in muon["params"]] == [model.up.weight.shape, model.down.weight.shape]
    assert any(p is model.lm_head.weight for p in other["params"]) and any(p is model.embed.weight for p in other["params"])
    # Explicit groups win; a group without "use_muon" is split by shape.
    opt = Muon([{"params": [model.up.weight], "use_muon": False, "lr": 0.5}, {"params": [model.down.weight, model.down.bias]}])
    assert [(g["use_muon"], len(g["params"])) for g in opt.param_groups] == [(False, 1), (True, 1), (False, 1)]
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="momentum"):
        Muon(model, momentum=-1.0)
    bad = Muon([{"params": [nn.Parameter(torch.ones(2, 2, 2, 2))], "use_muon": True}])
    bad.param_groups[0]["params"][0].grad = torch.ones(2, 2, 2, 2)
    with pytest.raises(ValueError, match="use_muon=False"):
        bad.step()


def test_owners_balance_by_size():
    # Largest first, to the least-loaded rank: 2 x 2 ranks, coordinates per sharded dimension.
    owners = _owners([100, 10, 60, 50, 40], [2, 2])
    assert owners == [(0, 0), (1, 1), (0, 1), (1, 0), (1, 1)]


def test_planner_prices_one_state_for_matrices_and_the_routing():
    from lightning_para.plan import Cluster, Layout, Training, estimate, preset

    model, cluster = preset("gpt-125m"), Cluster.of("a100-80gb", nodes=1)
    layout = Layout(dp=4, tp=2, zero=1)
    adam, muon = (estimate(model, cluster, Training(seq_len=1024, global_batch=32, optimizer=kind), layout)
                  for kind in ("adam", "muon"))
    # Muon's matrices keep one 4-byte momentum where Adam keeps 8; embeddings and head keep AdamW's 8 under Muon
    # (gpt-125m: 85 M of its 124 M parameters are hidden matrices, the embeddings the rest).
    assert 0.6 < muon.memory.optimizer / adam.memory.optimizer < 0.75
    routes = [c for c in muon.collectives if c.what.startswith("Muon")]
    assert sorted(c.dim for c in routes) == ["dp", "tp"] and all(c.op == "all_to_all" and c.calls == 2 for c in routes)
    assert not [c for c in adam.collectives if c.what.startswith("Muon")]
    # Under tp the owners keep an int64 index per element they own, about as many as a rank sends: 8 bytes against
    # the route's 4 (bfloat16, there and back); without tp, none.
    assert muon.memory.buffers - adam.memory.buffers == pytest.approx(2 * routes[0].bytes, rel=1e-3)
    dp_only = [estimate(model, cluster, Training(seq_len=1024, global_batch=32, optimizer=kind), Layout(dp=8, zero=1))
               for kind in ("adam", "muon")]
    assert dp_only[0].memory.buffers == dp_only[1].memory.buffers


def test_ns_dtype_runs_torchs_iteration_in_another_dtype():
    """``ns_dtype``: torch's Newton-Schulz (bit-equal in bfloat16, tall and wide), in float32 close to float64."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from lightning_para.optim.muon import _newton_schulz

    torch.manual_seed(0)
    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
    for shape in ((24, 40), (40, 24)):
        g = torch.randn(shape)
        assert torch.equal(_newton_schulz(g, *args, torch.bfloat16), _zeropower_via_newtonschulz(g, *args))
        torch.testing.assert_close(_newton_schulz(g, *args, torch.float32),
                                   _newton_schulz(g.double(), *args, torch.float64).float(), rtol=0, atol=1e-5)
    models = [Tiny() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [Muon(m, lr=0.02, ns_dtype=d) for m, d in zip(models, (torch.float32, torch.float64))]
    x = torch.randint(0, 50, (4, 9))
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).logsumexp(-1).mean().backward()
            opt.step()
    torch.testing.assert_close(models[0].up.weight, models[1].up.weight, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(models[0], ns_dtype=torch.int32)
