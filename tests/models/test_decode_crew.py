"""A one-token DecodeStack step on a crew (csrc/cpu/crew.h): the whole stack in one OpenMP region,
the kernels' shares handed to the waiting threads, which read the next matrices ahead between
them. It must give the regions' floats bit for bit (logits and every KV byte), with the short
attention on the leader and a long one split over the crew, with the read-ahead on and off; run
only for stacks whose every kernel takes a crew (a sparse layer's quantised experts do, float ones
do not); leave no
thread behind when a layer raises; and, by default, run only while its threads' cores hand work
over quickly (a probe each crew step), falling back to regions for 64 steps when they do not.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server.kernels.quant import x8_here
from server.models.decoder import DecoderForCausalLM
from server.models.loader import load_model
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens
from tests.tiny_models import make_tiny_model

# Wide enough heads that a context of 600 tokens passes paged attention's serial line (2^17 query
# row x position x dim products: 8 heads x 32 dims x 512 positions), so its units go to the crew.
WIDE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
            num_hidden_layers=3, max_position_embeddings=1024)

pytestmark = pytest.mark.skipif(not x8_here(), reason="the crew's kernels are the x8 ones (AVX2 or better)")


@pytest.fixture(autouse=True)
def crew_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The crew forced on ($PAGEWIRE_DECODE_CREW=1; by default it follows its probe) for every test
    here, with a team of two (`make test`'s workers run one thread each: conftest.py), restored after."""
    monkeypatch.setenv("PAGEWIRE_DECODE_CREW", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", vocab_size=VOCAB, **WIDE)


def _decode(model: DecoderForCausalLM, prompt: int, steps: int) -> tuple[list[torch.Tensor], PagedRun]:
    run = PagedRun(model, num_blocks=(prompt + steps) // 16 + 2, seed=3)
    toks = random_tokens(prompt + steps, VOCAB, seed=11)
    logits = [run.step({0: toks[:prompt]})[0]]
    logits += [run.step({0: [toks[t]]})[0] for t in range(prompt, prompt + steps)]
    return logits, run


def _crew_runs(model: DecoderForCausalLM) -> int:
    return sum(entry[2].crew_runs() for entry in model._stacks.values() if entry[2] is not None)


def _same_floats(a: tuple[list[torch.Tensor], PagedRun], b: tuple[list[torch.Tensor], PagedRun]) -> None:
    """Two _decode runs gave the same logits at every step and the same bytes in every KV cache."""
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for (ka, va), (kb, vb) in zip(a[1].kv_caches, b[1].kv_caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def _regions_then_crew(model: DecoderForCausalLM, prompt: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six one-token steps with regions, then on a forced crew: every step on it, the same floats."""
    monkeypatch.setenv("PAGEWIRE_DECODE_CREW", "0")
    plain = _decode(model, prompt, 6)
    assert _crew_runs(model) == 0
    monkeypatch.setenv("PAGEWIRE_DECODE_CREW", "1")
    crew = _decode(model, prompt, 6)
    assert _crew_runs(model) == 6  # every one-token step, none of the prompt's
    _same_floats(plain, crew)


@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
@pytest.mark.parametrize("prompt", [40, 600])
@pytest.mark.parametrize("ahead", ["0", "1048576"])
def test_the_crew_gives_the_regions_floats(wide_model: Path, quantization: str, prompt: int, ahead: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(wide_model, dtype="bfloat16")
    if quantization != "none":
        model.quantize_weights(quantization)  # q4_0x8 / q8_0x8 kinds
    else:
        model.interleave_bf16()  # bf16x8 kinds, as the engine packs them
    monkeypatch.setenv("PAGEWIRE_CREW_AHEAD", ahead)
    _regions_then_crew(model, prompt, monkeypatch)


def _moe_model(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "moe", "qwen3moe", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, moe_intermediate_size=128,
                           num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)


@pytest.mark.parametrize("prompt", [40, 600])
def test_a_sparse_layer_on_the_crew_gives_the_regions_floats(tmp_path: Path, prompt: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # moe_decode's region becomes one crew job (its barriers bind to the crew's region), the router
    # runs on the bf16 kernels' team_for: the same floats and KV bytes as with regions.
    model, _ = load_model(_moe_model(tmp_path), dtype="bfloat16")
    model.quantize_weights("int4")
    _regions_then_crew(model, prompt, monkeypatch)


def test_float_experts_keep_the_stack_on_its_regions(tmp_path: Path) -> None:
    # Float experts take moe_experts_cpu's regions, which inside a crew would be teams of one.
    model, _ = load_model(_moe_model(tmp_path), dtype="bfloat16")
    _decode(model, 40, 3)
    assert _crew_runs(model) == 0 and any(entry[2] is not None for entry in model._stacks.values())


def test_the_crew_is_off_when_told(wide_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEWIRE_DECODE_CREW", "0")
    model, _ = load_model(wide_model, dtype="bfloat16")
    model.quantize_weights("int4")
    _decode(model, 40, 3)
    assert _crew_runs(model) == 0 and any(entry[2] is not None for entry in model._stacks.values())


def _stack(model: DecoderForCausalLM) -> object:
    return next(entry[2] for entry in model._stacks.values() if entry[2] is not None)


def test_by_default_the_crew_runs_while_its_cores_are_close(wide_model: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEWIRE_DECODE_CREW")
    monkeypatch.setenv("PAGEWIRE_CREW_FAR_NS", str(10**12))  # every probe counts as close
    model, _ = load_model(wide_model, dtype="bfloat16")
    model.quantize_weights("int4")
    _decode(model, 40, 5)
    assert _crew_runs(model) == 5
    assert 0 < _stack(model).crew_handoff_ns() < 10**12  # type: ignore[attr-defined]


def test_by_default_far_cores_send_the_next_64_steps_to_regions(wide_model: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEWIRE_DECODE_CREW", "0")
    model, _ = load_model(wide_model, dtype="bfloat16")
    model.quantize_weights("int4")
    plain = _decode(model, 40, 70)
    monkeypatch.delenv("PAGEWIRE_DECODE_CREW")
    monkeypatch.setenv("PAGEWIRE_CREW_FAR_NS", "0")  # every probe counts as far
    auto = _decode(model, 40, 70)
    # The first step probes on the crew and finds it far; 64 steps take regions; the 66th probes again.
    assert _crew_runs(model) == 2
    _same_floats(plain, auto)


def test_a_layer_that_raises_on_the_crew_leaves_it_and_the_stack_works_after(wide_model: Path) -> None:
    model, _ = load_model(wide_model, dtype="bfloat16")
    model.quantize_weights("int4")
    logits, run = _decode(model, 40, 2)
    stack = next(entry[2] for entry in model._stacks.values() if entry[2] is not None)
    before = stack.crew_runs()
    hidden = torch.zeros(1, model.config.hidden_size, dtype=model.dtype)
    pos = torch.tensor([42], dtype=torch.int64)
    slots = torch.tensor([run.tables[0][2] * run.block_size + 10], dtype=torch.int64)
    tables = torch.tensor([run.tables[0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    # A sequence longer than its block table holds: paged attention refuses it inside the region.
    too_long = torch.tensor([len(run.tables[0]) * run.block_size + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="needs more than the"):
        stack.run(hidden.clone(), None, [pos], [slots], [tables], too_long, qsl, 1, int(too_long[0]))
    assert stack.crew_runs() == before + 1
    # The crew's threads were released: the next steps run on a crew again, with the same floats
    # as a fresh run's.
    total = _crew_runs(model)
    again, _ = _decode(model, 40, 2)
    assert _crew_runs(model) == total + 2
    assert all(torch.equal(a, b) for a, b in zip(logits, again))


def test_the_benches_handoff_probe() -> None:
    import server._C

    assert server._C.core_handoff_ns(1) == -1  # nothing to hand over to
    probes = [server._C.core_handoff_ns(2, 3) for _ in range(3)]
    assert all(0 < p < 10**9 for p in probes)  # a handoff and back: some ns, never an hour
