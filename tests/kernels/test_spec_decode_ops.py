"""ngram_propose and rejection_sample (server._C) against float64 references, and the distribution test.

The distribution test is the exactness proof of rejection sampling: on a tiny vocabulary with
known target p and draft q, 20,000 seeded trials of the first speculative position must follow p
(chi-square p > 0.001), and a deliberately wrong acceptance rule must fail the same test.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from server.kernels import ops
from tests.kernels.spec_reference import chi_square_p_value, ref_ngram_propose, ref_rejection_sample


def _propose(seqs: list[list[int]], k: int, min_n: int, max_n: int, pad: int = 0) -> list[list[int]]:
    bufs = [torch.tensor(s + [7] * pad, dtype=torch.int64) for s in seqs]  # spare capacity is ignored
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return ops.ngram_propose(bufs, lens, k, min_n, max_n).tolist()


def test_ngram_propose_examples() -> None:
    # "1 2 3 4 ... 1 2": the 2-gram "1 2" occurred at 0, followed by 3 4 5.
    assert _propose([[1, 2, 3, 4, 5, 9, 1, 2]], 3, 1, 3) == [[3, 4, 5]]
    # The longest match wins over a later, shorter one: "5 1 2" at 4 beats "1 2" at 8.
    assert _propose([[0, 0, 0, 0, 5, 1, 2, 6, 1, 2, 8, 5, 1, 2]], 2, 1, 3) == [[6, 1]]
    # Periodic tail: the continuation overlaps the proposal itself (k beyond the sequence's end).
    assert _propose([[4, 8, 4, 8, 4]], 5, 1, 2) == [[8, 4, 8, 4, 8]]
    # No match of at least min_n tokens, or too short a sequence: nothing.
    assert _propose([[1, 2, 3, 4], [5]], 2, 2, 3) == [[-1, -1], [-1, -1]]
    # k = 0 is an empty proposal.
    assert _propose([[1, 1, 1]], 0, 1, 2) == [[]]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_ngram_propose_matches_reference(min_n: int, max_n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(100 * min_n + 10 * max_n + k)
    # Batches above the kernel's parallel threshold (16) and below it, tiny alphabets so matches
    # of every length occur, and lengths from 1 up.
    for batch, alphabet in ((5, 3), (40, 4), (70, 2)):
        seqs = [
            torch.randint(0, alphabet, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(batch)
        ]
        got = _propose(seqs, k, min_n, max_n, pad=3)
        assert got == [ref_ngram_propose(s, k, min_n, max_n) for s in seqs]


def test_ngram_propose_checks_arguments() -> None:
    t = torch.tensor([1, 2, 3], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"num_tokens\[0\] = 4 is out of range"):
        ops.ngram_propose([t], torch.tensor([4]), 2, 1, 2)
    with pytest.raises(RuntimeError, match="min_n <= max_n"):
        ops.ngram_propose([t], torch.tensor([3]), 2, 3, 2)
    with pytest.raises(RuntimeError, match=r"token_ids\[0\] must be a contiguous CPU int64"):
        ops.ngram_propose([t.int()], torch.tensor([3]), 2, 1, 2)


def _random_case(gen: torch.Generator, S: int, V: int, max_k: int, with_q: bool, greedy_share: float):
    ks = torch.randint(0, max_k + 1, (S,), generator=gen).tolist()
    greedy = (torch.rand(S, generator=gen) < greedy_share).tolist()
    # Peaked random distributions, some with zeros (as top-k / top-p leave them).
    def dist(rows: int) -> torch.Tensor:
        logits = torch.randn(rows, V, generator=gen) * 3
        logits[torch.rand(rows, V, generator=gen) < 0.3] = float("-inf")
        logits[:, 0] = torch.where(torch.isinf(logits[:, 0]), torch.zeros(rows), logits[:, 0])  # never all -inf
        return torch.softmax(logits, -1)
    target = [dist(k + 1) for k in ks]
    draft_q = [dist(k) for k in ks] if with_q else None
    drafts = []
    for i, k in enumerate(ks):
        if draft_q is not None:
            drafts.append([int(torch.multinomial(draft_q[i][j], 1, generator=gen)) for j in range(k)])
        elif k:
            # Half the time copy the target's argmax (so greedy runs accept some), else random.
            row = [int(target[i][j].argmax()) if float(torch.rand(1, generator=gen)) < 0.5
                   else int(torch.randint(0, V, (1,), generator=gen)) for j in range(k)]
            drafts.append(row)
        else:
            drafts.append([])
    argmax = [t.argmax(-1).tolist() for t in target]
    uniform = [torch.rand(k + 1, generator=gen, dtype=torch.float64).tolist() for k in ks]
    return ks, greedy, target, draft_q, drafts, argmax, uniform


def _run_op(ks, greedy, target, draft_q, drafts, argmax, uniform, device: str = "cpu"):
    cu = [0]
    for k in ks:
        cu.append(cu[-1] + k)
    dev = torch.device(device)
    out, ne = ops.rejection_sample(
        torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=dev),
        torch.tensor(cu, dtype=torch.int64, device=dev),
        torch.cat(draft_q).to(dev) if draft_q is not None else None,
        torch.cat(target).to(dev),
        torch.tensor([t for a in argmax for t in a], dtype=torch.int64, device=dev),
        torch.tensor(greedy, dtype=torch.bool, device=dev),
        torch.tensor([u for us in uniform for u in us], dtype=torch.float64, device=dev),
    )
    out_l, ne_l = out.cpu().tolist(), ne.cpu().tolist()
    return [row[:n] for row, n in zip(out_l, ne_l)], out_l


@pytest.mark.parametrize("with_q", [False, True], ids=["point_mass", "draft_probs"])
@pytest.mark.parametrize("S,V", [(7, 11), (33, 50), (20, 1000)])
def test_rejection_sample_matches_float64_reference(with_q: bool, S: int, V: int) -> None:
    gen = torch.Generator().manual_seed(S * 7 + V + with_q)
    case = _random_case(gen, S, V, 5, with_q, greedy_share=0.3)
    ks, greedy, target, draft_q, drafts, argmax, uniform = case
    got, padded = _run_op(*case)
    assert got == ref_rejection_sample(drafts, draft_q, target, argmax, greedy, uniform)
    for row, k, emitted in zip(padded, ks, got):
        assert 1 <= len(emitted) <= k + 1
        assert len(row) == max(ks) + 1 and all(t == -1 for t in row[len(emitted):])


def test_rejection_sample_all_greedy_needs_no_probs() -> None:
    out, ne = ops.rejection_sample(
        torch.tensor([5, 6, 7, 1]), torch.tensor([0, 3, 3, 4]), None, None,
        torch.tensor([5, 6, 9, 2, 4, 1, 3]), torch.ones(3, dtype=torch.bool), torch.zeros(7, dtype=torch.float64),
    )
    # seq 0: 5, 6 accepted, 7 != 9 -> emits 5 6 9; seq 1: no drafts -> its argmax 4;
    # seq 2: draft 1 accepted -> 1 then bonus 3.
    assert ne.tolist() == [3, 1, 2]
    assert out.tolist() == [[5, 6, 9, -1], [4, -1, -1, -1], [1, 3, -1, -1]]


def test_rejection_sample_checks_arguments() -> None:
    with pytest.raises(ValueError, match="target_probs"):
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 1]), None, None, torch.tensor([1, 2]),
                             torch.zeros(1, dtype=torch.bool), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="uniform must be"):
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 1]), None, torch.full((2, 4), 0.25),
                             torch.tensor([1, 2]), torch.zeros(1, dtype=torch.bool), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"draft_token_ids\[0\] = 9 is out of range"):
        ops.rejection_sample(torch.tensor([9]), torch.tensor([0, 1]), None, torch.full((2, 4), 0.25),
                             torch.tensor([1, 2]), torch.zeros(1, dtype=torch.bool), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="cu_num_draft"):
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 2]), None, torch.full((2, 4), 0.25),
                             torch.tensor([1, 2]), torch.zeros(1, dtype=torch.bool), torch.zeros(2, dtype=torch.float64))
    # The checks shared with the CUDA kernel (csrc/spec_decode_checks.h): draft_probs' shape, and
    # draft_probs without target_probs (all rows greedy, so only the C++ check can refuse it).
    with pytest.raises(RuntimeError, match=r"draft_probs must be a float32 tensor \[num_drafts, V\] = \[1, 4\]"):
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 1]), torch.full((1, 5), 0.2), torch.full((2, 4), 0.25),
                             torch.tensor([1, 2]), torch.zeros(1, dtype=torch.bool), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="draft_probs needs target_probs"):
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 1]), torch.full((1, 4), 0.25), None,
                             torch.tensor([1, 2]), torch.ones(1, dtype=torch.bool), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="is_greedy must be Bool, got Long"):  # wrong dtype names the argument
        ops.rejection_sample(torch.tensor([1]), torch.tensor([0, 1]), None, torch.full((2, 4), 0.25),
                             torch.tensor([1, 2]), torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.float64))


# -- the distribution test ----------------------------------------------------------------------
TARGET = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25])
DRAFT = torch.tensor([0.10, 0.40, 0.10, 0.20, 0.20, 0.0])
TRIALS = 20_000


def _first_position_draws(rule: str, draft: Optional[torch.Tensor], seed: int, k: int = 2) -> torch.Tensor:
    """TRIALS independent sequences with k drafts each; returns the first emitted token of each.

    draft: the draft distribution q (drafts ~ q), or None: a point-mass proposer always proposing
    token 1 (the n-gram case). rule "kernel" runs server._C; "wrong" is a deliberately wrong rule
    (on rejection, draw from the target p instead of the residual max(p - q, 0))."""
    gen = torch.Generator().manual_seed(seed)
    V = TARGET.numel()
    if draft is not None:
        drafts = torch.multinomial(draft.expand(TRIALS * k, V), 1, replacement=True, generator=gen).view(-1)
        draft_probs: Optional[torch.Tensor] = draft.expand(TRIALS * k, V).contiguous()
    else:
        drafts = torch.full((TRIALS * k,), 1, dtype=torch.int64)
        draft_probs = None
    uniform = torch.rand(TRIALS * (k + 1), generator=gen, dtype=torch.float64)
    target = TARGET.expand(TRIALS * (k + 1), V).contiguous()
    if rule == "kernel":
        out, _ = ops.rejection_sample(
            drafts, torch.arange(0, TRIALS * k + 1, k, dtype=torch.int64), draft_probs, target,
            target.argmax(-1), torch.zeros(TRIALS, dtype=torch.bool), uniform,
        )
        return out[:, 0]
    # The wrong rule, vectorised over trials, first position only.
    d0 = drafts.view(TRIALS, k)[:, 0]
    u = uniform.view(TRIALS, k + 1)
    q_d = draft[d0] if draft is not None else torch.ones(TRIALS)
    accept = u[:, 0] * q_d.double() < TARGET[d0].double()
    redraw = torch.multinomial(TARGET.expand(TRIALS, V), 1, replacement=True, generator=gen).view(-1)
    return torch.where(accept, d0, redraw)


@pytest.mark.parametrize("draft", [DRAFT, None], ids=["draft_model", "point_mass"])
@pytest.mark.parametrize("seed", [1, 2])
def test_first_speculative_position_follows_target(draft: Optional[torch.Tensor], seed: int) -> None:
    tokens = _first_position_draws("kernel", draft, seed)
    counts = torch.bincount(tokens, minlength=TARGET.numel())
    assert chi_square_p_value(counts, TARGET) > 1e-3, counts.tolist()


@pytest.mark.parametrize("draft", [DRAFT, None], ids=["draft_model", "point_mass"])
def test_wrong_acceptance_rule_fails_the_same_test(draft: Optional[torch.Tensor]) -> None:
    tokens = _first_position_draws("wrong", draft, seed=1)
    counts = torch.bincount(tokens, minlength=TARGET.numel())
    assert chi_square_p_value(counts, TARGET) < 1e-3, counts.tolist()


def test_bonus_token_follows_target_when_everything_is_accepted() -> None:
    # Drafts equal to a token the target always picks (p = 1) are always accepted, so every
    # emission at position k is the bonus draw: it must follow the last row's distribution.
    gen = torch.Generator().manual_seed(5)
    V, k = TARGET.numel(), 1
    first = torch.zeros(V)
    first[2] = 1.0
    target = torch.stack([first, TARGET]).repeat(TRIALS, 1).contiguous()
    uniform = torch.rand(TRIALS * (k + 1), generator=gen, dtype=torch.float64)
    out, ne = ops.rejection_sample(
        torch.full((TRIALS,), 2, dtype=torch.int64), torch.arange(TRIALS + 1, dtype=torch.int64), None, target,
        target.argmax(-1), torch.zeros(TRIALS, dtype=torch.bool), uniform,
    )
    assert bool((ne == 2).all())
    counts = torch.bincount(out[:, 1], minlength=V)
    assert chi_square_p_value(counts, TARGET) > 1e-3, counts.tolist()


# -- CUDA (compile-checked here; run by bench/gpu_check.sh on a GPU machine) ------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("with_q", [False, True], ids=["point_mass", "draft_probs"])
def test_rejection_sample_cuda_matches_cpu(with_q: bool) -> None:
    if not torch._C._dispatch_has_kernel_for_dispatch_key("pagewire::rejection_sample", "CUDA"):
        pytest.skip("server._C was built without CUDA kernels")
    gen = torch.Generator().manual_seed(11 + with_q)
    case = _random_case(gen, 64, 3000, 5, with_q, greedy_share=0.3)
    cpu, _ = _run_op(*case)
    cuda, _ = _run_op(*case, device="cuda")
    # Acceptance decisions are the same float64 arithmetic; only a residual draw whose threshold
    # lands within rounding of a bucket edge may differ (chunked vs sequential sums).
    assert [len(a) for a in cpu] == [len(b) for b in cuda]
    same = sum(a == b for a, b in zip(cpu, cuda))
    assert same >= len(cpu) - 1


@pytest.mark.cuda
def test_rejection_sample_cuda_distribution() -> None:
    if not torch._C._dispatch_has_kernel_for_dispatch_key("pagewire::rejection_sample", "CUDA"):
        pytest.skip("server._C was built without CUDA kernels")
    gen = torch.Generator().manual_seed(3)
    V, k = TARGET.numel(), 2
    drafts = torch.multinomial(DRAFT.expand(TRIALS * k, V), 1, replacement=True, generator=gen).view(-1)
    target = TARGET.expand(TRIALS * (k + 1), V).contiguous()
    dev = torch.device("cuda")
    out, _ = ops.rejection_sample(
        drafts.to(dev), torch.arange(0, TRIALS * k + 1, k, dtype=torch.int64, device=dev),
        DRAFT.expand(TRIALS * k, V).contiguous().to(dev), target.to(dev), target.argmax(-1).to(dev),
        torch.zeros(TRIALS, dtype=torch.bool, device=dev),
        torch.rand(TRIALS * (k + 1), generator=gen, dtype=torch.float64).to(dev),
    )
    counts = torch.bincount(out[:, 0].cpu(), minlength=V)
    assert chi_square_p_value(counts, TARGET) > 1e-3, counts.tolist()
