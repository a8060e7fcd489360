"""tests/pairwise.py: the grids the kernel tests run cover every pair of values."""
from __future__ import annotations

import itertools

from tests.pairwise import covers_every_pair, pairwise


def test_pairwise_covers_every_pair_and_keeps_the_edges() -> None:
    axes = [["a", "b", "c"], [1, 2, 3, 5, 8, 16, 17, 40], [(8, 32), (37, 256)], [False, True], ["x", "y"]]
    rows = pairwise(axes, edges=[("c", 40, (37, 256), True, "y")])
    assert covers_every_pair(rows, axes)
    assert ("c", 40, (37, 256), True, "y") in rows
    # 24 rows (3 x 8, the fewest that hold every pair of the first two axes) stand for 192.
    assert len(rows) <= 30 < len(list(itertools.product(*axes)))
    assert pairwise(axes) == pairwise(axes)  # the same rows every run


def test_pairwise_with_a_constraint_still_covers_every_allowed_pair() -> None:
    axes = [["avx2", "portable"], [64, 80, 96, 128, 256], ["f32", "bf16", "f16"]]

    def allowed(r: tuple) -> bool:
        return r[0] != "portable" or r[1] in (64, 80, 256)

    rows = pairwise(axes, allowed=allowed)
    assert all(allowed(r) for r in rows) and covers_every_pair(rows, axes, allowed)
