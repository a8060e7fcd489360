"""The batched sampler: greedy, filters, penalties, blocked tokens, seeds, distribution, logprobs."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from server.engine.sampler import Sampler, SamplingBatch, apply_penalties
from server.engine.sampling_params import SamplingParams as SP


def build(
    params: list[SP],
    v: int,
    generators: Optional[list[Optional[torch.Generator]]] = None,
    outputs: Optional[list[list[int]]] = None,
    prompts: Optional[list[list[int]]] = None,
    blocked: Optional[list[list[int]]] = None,
) -> SamplingBatch:
    s = len(params)
    return SamplingBatch.build(
        params=params,
        generators=generators or [None] * s,
        output_token_ids=outputs or [[] for _ in range(s)],
        prompt_token_ids=prompts or [[] for _ in range(s)],
        blocked_token_ids=blocked,
        vocab_size=v,
        device="cpu",
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These tensors are tiny; on a busy 2-core box, waking torch's intra-op thread pool costs
    # milliseconds per op, more than the work itself.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(8, 100, generator=gen(0)) * 3


def test_greedy_is_argmax_and_takes_the_fast_path(logits: torch.Tensor) -> None:
    batch = build([SP(temperature=0)] * 8, 100)
    assert batch.fast_greedy
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


@pytest.mark.parametrize("params", [SP(top_k=1), SP(top_p=1e-6), SP(min_p=1.0), SP(temperature=1e-7)])
def test_degenerate_filters_equal_greedy(logits: torch.Tensor, params: SP) -> None:
    sampler = Sampler(seed=5)
    for _ in range(5):
        out = sampler(logits, build([params] * 8, 100))
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows(logits: torch.Tensor) -> None:
    params = [SP(temperature=0) if i % 2 else SP(temperature=5.0) for i in range(8)]
    out = Sampler()(logits, build(params, 100))
    assert torch.equal(out.token_ids[1::2], logits.argmax(-1)[1::2])


def test_top_k_and_top_p_keep_only_the_allowed_set() -> None:
    v = 50
    row = torch.randn(v, generator=gen(1))
    x = row.repeat(4000, 1)
    order = row.argsort(descending=True)
    probs = row.softmax(-1)
    for params, allowed in [
        (SP(top_k=5), set(order[:5].tolist())),
        (SP(top_p=0.5), set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())),
        (SP(top_k=10, top_p=0.3), None),
    ]:
        got = set(Sampler(seed=2)(x, build([params] * 4000, v)).token_ids.tolist())
        if allowed is None:  # top-p applies to the renormalised top-k set
            top10 = probs[order[:10]] / probs[order[:10]].sum()
            allowed = set(order[: int((top10.cumsum(0) < 0.3).sum()) + 1].tolist())
        assert got == allowed, params


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    v = 30
    row = torch.linspace(0, 3, v)
    probs = row.softmax(-1)
    out = Sampler(seed=3)(row.repeat(5000, 1), build([SP(min_p=0.3)] * 5000, v)).token_ids
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(out.tolist()) == allowed


def reference_penalties(logits: torch.Tensor, p: SP, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_penalties_match_float64_reference() -> None:
    v = 20
    logits = torch.randn(4, v, generator=gen(4)) * 2
    params = [
        SP(temperature=0, repetition_penalty=1.5),
        SP(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        SP(temperature=0, repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=2.0),
        SP(temperature=0),
    ]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 7], [1, 2]]
    outputs = [[3, 9, 9], [5, 5, 5, 8], [7, 10, 10, 11], [1, 1]]
    batch = build(params, v, outputs=outputs, prompts=prompts)
    got = apply_penalties(logits, batch)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i].double(), reference_penalties(logits[i], p, prompts[i], outputs[i]))
    assert torch.equal(got[3], logits[3])  # no penalties on that row
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, got.argmax(-1))


def test_blocked_tokens_are_never_sampled_and_logits_are_not_modified(logits: torch.Tensor) -> None:
    before = logits.clone()
    top3 = logits.topk(3, dim=-1).indices.tolist()
    params = [SP(temperature=0)] * 4 + [SP(temperature=2.0, repetition_penalty=1.2)] * 4
    sampler = Sampler(seed=6)
    for _ in range(200):
        out = sampler(logits, build(params, 100, blocked=top3, outputs=[[1]] * 8)).token_ids.tolist()
        assert all(t not in top3[i] for i, t in enumerate(out))
    assert torch.equal(logits, before)


def _seeded_run(seed: int, steps: int, neighbours: int, position: int) -> list[int]:
    """Sample one seeded row for `steps` steps inside a batch of unseeded, differently-tempered rows."""
    v = 64
    target = torch.randn(v, generator=gen(7))
    row_gen = gen(seed)
    noise = gen(100 + neighbours)
    sampler = Sampler(seed=neighbours)
    tokens = []
    for _ in range(steps):
        others = [SP(temperature=0.5 + j, top_k=-1 if j % 2 else 7) for j in range(neighbours)]
        params = others[:position] + [SP(temperature=0.9, top_p=0.95, seed=seed)] + others[position:]
        gens: list[Optional[torch.Generator]] = [None] * neighbours
        gens.insert(position, row_gen)
        x = torch.randn(neighbours + 1, v, generator=noise) * 4
        x[position] = target
        tokens.append(int(sampler(x, build(params, v, generators=gens)).token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_whatever_the_batch() -> None:
    alone = _seeded_run(seed=42, steps=30, neighbours=0, position=0)
    assert _seeded_run(seed=42, steps=30, neighbours=5, position=3) == alone
    assert _seeded_run(seed=42, steps=30, neighbours=9, position=9) == alone
    assert _seeded_run(seed=43, steps=30, neighbours=0, position=0) != alone


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the probability is zero
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sample_frequencies_follow_the_tempered_softmax() -> None:
    # 6 tokens -> 5 degrees of freedom; chi-square > 25 has probability < 2e-4 under the null.
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    n = 20000
    for params, probs in [
        (SP(temperature=0.7), (row / 0.7).softmax(-1)),
        (SP(temperature=1.5, top_k=3), torch.where(row >= 0.5, (row / 1.5).softmax(-1), 0.0)),
    ]:
        probs = probs / probs.sum()
        tokens = Sampler(seed=11)(row.repeat(n, 1), build([params] * n, 6)).token_ids
        assert _chi_square(torch.bincount(tokens, minlength=6), probs) < 25, params


def test_seeded_row_frequencies_follow_the_softmax() -> None:
    row = torch.tensor([1.0, 0.0, -0.5, 0.8])
    g = gen(3)
    sampler = Sampler()
    batch = build([SP(temperature=1.0, seed=3)], 4, generators=[g])
    tokens = torch.tensor([int(sampler(row[None], batch).token_ids) for _ in range(3000)])
    assert _chi_square(torch.bincount(tokens, minlength=4), row.softmax(-1)) < 22  # 3 dof


def test_logprobs_are_raw_log_softmax_with_ordered_top_k(logits: torch.Tensor) -> None:
    params = [SP(temperature=0.8, logprobs=5, presence_penalty=2.0, top_k=3), SP(logprobs=0),
              SP(temperature=0, logprobs=2), SP()] + [SP(temperature=0)] * 4
    out = Sampler()(logits, build(params, 100, outputs=[[0, 1]] * 8, blocked=[[5]] + [[]] * 7))
    ref = torch.log_softmax(logits.double(), -1)
    assert out.top_ids is not None and out.top_logprobs is not None and out.logprobs is not None
    assert out.top_ids.shape == (8, 5)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    want_lp, want_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs.double(), want_lp, atol=1e-5, rtol=1e-5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])


def test_logprobs_zero_returns_only_the_sampled_token(logits: torch.Tensor) -> None:
    out = Sampler()(logits, build([SP(temperature=0, logprobs=0)] * 8, 100))
    assert out.top_ids is None and out.top_logprobs is None
    assert out.logprobs is not None and out.logprobs.shape == (8,)


def test_build_rejects_mismatched_rows_and_bad_blocked_ids() -> None:
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SP()], [], [[]], [[]], None, 10, "cpu")
    with pytest.raises(ValueError, match="blocked_token_ids"):
        build([SP()], 10, blocked=[[10]])
    with pytest.raises(ValueError, match=r"logits: expected shape \[2, V\]"):
        Sampler()(torch.zeros(3, 10), build([SP(), SP()], 10))


@pytest.mark.cuda
def test_cuda_sampling_with_cpu_and_cuda_row_generators() -> None:
    dev = torch.device("cuda")
    logits = (torch.randn(4, 1000, generator=gen(0)) * 3).to(dev)
    params = [SP(temperature=0), SP(seed=1), SP(seed=2, top_p=0.9), SP(top_k=5, logprobs=3)]

    def run() -> torch.Tensor:
        # A CPU generator for a CUDA batch draws on the CPU and copies; a CUDA one draws in place.
        gens = [None, torch.Generator().manual_seed(1), torch.Generator(device=dev).manual_seed(2), None]
        batch = SamplingBatch.build(params, gens, [[]] * 4, [[]] * 4, [[], [], [], [3]], 1000, dev)
        out = Sampler(seed=0)(logits, batch)
        assert out.top_ids is not None and out.top_ids.shape == (4, 3)
        return out.token_ids

    first = run()
    assert first.device.type == "cuda"
    assert int(first[0]) == int(logits[0].argmax())
    assert torch.equal(first, run())
