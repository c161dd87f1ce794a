"""``benchmarks.common.Interleaved``: the sides of a step-time comparison take turns, ``block`` steps each."""

import pytest

from benchmarks.common import Interleaved


def _loops(interleaved: Interleaved, steps: int, order: list, fail_at: dict | None = None) -> dict:
    def loop(side: str):
        def run() -> None:
            for step in range(1, steps + 1):
                if fail_at and fail_at.get(side) == step:
                    raise RuntimeError(f"{side} failed")
                order.append((side, step))
                interleaved.step_end(side)
        return run

    return {side: loop(side) for side in interleaved.sides}


def test_sides_take_turns_block_by_block():
    order: list = []
    interleaved = Interleaved(["a", "b", "c"], block=3, warmup=0)
    blocks = interleaved.run(_loops(interleaved, 6, order))
    expected = [(side, step) for first in (1, 4) for side in "abc" for step in range(first, first + 3)]
    assert order == expected
    # One figure per block: the mean of its steps after the first.
    assert {side: len(times) for side, times in blocks.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(t >= 0 for times in blocks.values() for t in times)


def test_warmup_steps_are_not_timed():
    interleaved = Interleaved(["a", "b"], block=2, warmup=4)
    blocks = interleaved.run(_loops(interleaved, 8, []))
    assert {side: len(times) for side, times in blocks.items()} == {"a": 2, "b": 2}


def test_a_failing_side_raises_and_the_others_finish():
    order: list = []
    interleaved = Interleaved(["a", "b"], block=2, warmup=0)
    with pytest.raises(RuntimeError, match="b failed"):
        interleaved.run(_loops(interleaved, 6, order, fail_at={"b": 3}))
    assert [step for side, step in order if side == "a"] == list(range(1, 7))


def test_block_of_one_step_is_refused():
    with pytest.raises(ValueError, match="block=1"):
        Interleaved(["a", "b"], block=1, warmup=0)
