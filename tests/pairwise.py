"""Pairwise grids for parametrised tests: every pair of values of any two axes appears in some
row (a covering array from `allpairspy`), plus named edge cases in full.

A full product of five axes is mostly redundant: a kernel bug that depends on one value shows in
every row with that value, and one that depends on two (a head size on one CPU family, a tail
of K with a bias) shows in any row that holds that pair. Pairwise keeps every such pair; the
edge cases list the rows that matter whole (the smallest and largest shapes, a row count on a
block boundary with every other axis at its hardest value).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional, Sequence

from allpairspy import AllPairs

Row = tuple[Any, ...]


def _pairs(row: Row) -> set[tuple[int, Any, int, Any]]:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def pairwise(axes: Sequence[Sequence[Any]], edges: Iterable[Sequence[Any]] = (),
             allowed: Optional[Callable[[Row], bool]] = None) -> list[Row]:
    """Rows of one value per axis that cover every pair of values some allowed row has, then the
    `edges` not already among them. Deterministic: the same axes give the same rows.

    allpairspy builds the covering array; its own filter loses pairs, so rows `allowed` refuses
    are dropped afterwards and each pair left uncovered gets the allowed row that covers the most
    such pairs (greedy, in product order)."""
    ok = allowed or (lambda _: True)
    rows = [r for r in (tuple(r) for r in AllPairs([list(a) for a in axes])) if ok(r)]
    candidates = [r for r in itertools.product(*axes) if ok(r)]
    missing = set().union(*map(_pairs, candidates)) - set().union(set(), *map(_pairs, rows))
    while missing:
        best = max(candidates, key=lambda r: len(_pairs(r) & missing))
        rows.append(best)
        missing -= _pairs(best)
    for e in edges:
        if tuple(e) not in rows:
            rows.append(tuple(e))
    return rows


def covers_every_pair(rows: Sequence[Row], axes: Sequence[Sequence[Any]],
                      allowed: Optional[Callable[[Row], bool]] = None) -> bool:
    """Whether `rows` hold every pair of values that some allowed row of the full product holds."""
    ok = allowed or (lambda _: True)
    need = set().union(set(), *(_pairs(r) for r in itertools.product(*axes) if ok(r)))
    return need <= set().union(set(), *map(_pairs, rows))
