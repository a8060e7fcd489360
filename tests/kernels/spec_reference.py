"""Plain-Python / float64 PyTorch references for the speculative-decoding ops, and a chi-square test.

Written from the definitions (prompt lookup; Leviathan et al. 2023 / Chen et al. 2023 rejection
sampling), not from the kernels: loops over sequences and positions, float64 throughout.
"""
from __future__ import annotations

from typing import Optional

import torch


def ref_ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram (min_n..max_n) that occurred earlier, at its latest occurrence;
    the k tokens after it, continuing into the proposal itself when they run past the end."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):  # occurrence tokens[i:i+n], ending before the suffix does
            if tokens[i:i + n] == suffix:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[L:]
    return [-1] * k


def ref_residual_draw(w: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from the unnormalised float64 weights w with u in [0, 1); -1 if all zero."""
    total = float(w.sum())
    if not total > 0.0:
        return -1
    cum = torch.cumsum(w, 0)
    hits = ((cum > u * total) & (w > 0)).nonzero()
    if hits.numel():
        return int(hits[0])
    return int((w > 0).nonzero()[-1])


def ref_rejection_sample(
    drafts: list[list[int]],
    draft_probs: Optional[list[torch.Tensor]],
    target_probs: list[torch.Tensor],
    target_argmax: list[list[int]],
    greedy: list[bool],
    uniform: list[list[float]],
) -> list[list[int]]:
    """Per sequence i: drafts[i] (k_i tokens), draft_probs[i] [k_i, V] or None (point masses),
    target_probs[i] [k_i + 1, V], target_argmax[i] (k_i + 1), uniform[i] (k_i + 1). Returns the
    emitted tokens of each sequence."""
    out: list[list[int]] = []
    for i, d in enumerate(drafts):
        k = len(d)
        emitted: list[int] = []
        if greedy[i]:
            for j in range(k):
                emitted.append(target_argmax[i][j])
                if d[j] != target_argmax[i][j]:
                    break
            else:
                emitted.append(target_argmax[i][k])
            out.append(emitted)
            continue
        p_all = target_probs[i].double()
        u_final = uniform[i][k]
        for j in range(k):
            p = p_all[j]
            if draft_probs is not None:
                q = draft_probs[i][j].double()
            else:
                q = torch.zeros_like(p)
                q[d[j]] = 1.0
            if uniform[i][j] < float(p[d[j]]) / float(q[d[j]]) if float(q[d[j]]) > 0 else float(p[d[j]]) > 0:
                emitted.append(d[j])
                continue
            t = ref_residual_draw((p - q).clamp(min=0.0), u_final)
            if t < 0:
                t = ref_residual_draw(p, u_final)
            emitted.append(t)
            break
        else:
            emitted.append(ref_residual_draw(p_all[k], u_final))
        out.append(emitted)
    return out


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of observed counts to probs (categories with
    probability 0 must have count 0, else the p-value is 0). P = Q(df / 2, chi2 / 2)."""
    counts = counts.double()
    probs = probs.double()
    n = float(counts.sum())
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))

