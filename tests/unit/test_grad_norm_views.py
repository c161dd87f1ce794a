"""Gradient norms over views: views that tile one tensor are normed as that tensor, in one kernel."""

import torch

from lightning_para.parallel.data.grad_norm import coalesce_views, global_grad_norm


def _params_viewing(flat: torch.Tensor, sizes: list[int], shapes: list[tuple]) -> list[torch.nn.Parameter]:
    params = []
    for view, shape in zip(flat.split(sizes), shapes):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = view.view(shape)
        params.append(p)
    return params


def test_views_tiling_a_bucket_are_one_tensor():
    bucket = torch.randn(1, 20)
    views = [v.view(s) for v, s in zip(bucket[0].split([12, 8]), [(3, 4), (8,)])]
    assert [t is bucket for t in coalesce_views(views)] == [True]


def test_partial_overlapping_or_foreign_views_stay_as_they_are():
    bucket = torch.randn(20)
    assert len(coalesce_views([bucket[:12]])) == 1 and coalesce_views([bucket[:12]])[0] is not bucket  # a gap
    overlapping = [bucket[:12], bucket[8:], bucket[12:]]
    assert len(coalesce_views(overlapping)) == 3
    transposed = torch.randn(4, 5).t()
    assert coalesce_views([transposed[0], transposed[1]])[0] is not transposed._base


def test_the_norm_is_the_norm_of_the_views():
    torch.manual_seed(0)
    flat = torch.randn(1, 30) * 3
    params = _params_viewing(flat[0], [6, 20, 4], [(2, 3), (4, 5), (4,)])
    separate = [torch.nn.Parameter(torch.zeros(p.shape)) for p in params]
    for p, q in zip(params, separate):
        q.grad = p.grad.clone()
    for norm_type in (2.0, 1.0, float("inf")):
        assert torch.allclose(global_grad_norm(params, norm_type), global_grad_norm(separate, norm_type), rtol=1e-6)
    flat[0, 7] = float("nan")  # a non-finite value in any view shows in the norm of the whole
    assert not torch.isfinite(global_grad_norm(params))
