"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_world():
    """A fake process group of any size, seen from any of its ranks: meshes build, nothing is sent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
