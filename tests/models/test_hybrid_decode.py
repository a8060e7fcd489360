"""pagewire::gdn_decode_layer and pagewire::gated_attention_decode_layer, the Gated DeltaNet hybrids'
layers (Qwen3.5, Qwen3-Next) as one C++ call each for small CPU batches: they must give exactly the
Python layers' floats (logits, every KV cache byte, every conv and recurrent state byte) for bf16
and fp32 weights, Q8_0 and Q4_0 blocks, decodes of one and three sequences and prefill chunks of up
to 16 rows; layers with experts (Qwen3.5-MoE, Qwen3-Next's sparse layers) stay in Python."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import server.models.qwen3_next as qn
from server.kernels import batch_invariant
from server.models.attention import StateBatch
from server.models.loader import load_model
from server.models.state_specs import attention_layers, state_specs
from tests.models.paged_harness import VOCAB, PagedRun, random_tokens
from tests.tiny_models import make_tiny_model


class HybridRun(PagedRun):
    """PagedRun with KV caches for the attention layers only and a state pool per recurrent
    layer (garbage-filled; slot s for sequence s, zeroed before its first token, as the engine does)."""

    def __init__(self, model: qn.Qwen3NextForCausalLM, slots: int = 4, seed: int = 0) -> None:
        super().__init__(model, seed=seed)
        c = model.config
        self.kv_caches = [self.kv_caches[i] for i in attention_layers(c)]
        g = torch.Generator().manual_seed(seed + 1)
        self.pools: list[dict[str, torch.Tensor]] = [
            {s.name: torch.randn((slots, *s.shape), generator=g).to(model.dtype if s.dtype == "model" else torch.float32)
             for s in specs} for specs in state_specs(c)]
        self.real = model
        self.model = self  # type: ignore[assignment]  # step() calls us; we add the state batch
        self.config = c
        self._sids: list[int] = []

    def step(self, new_tokens: dict[int, list[int]], lora: object = None) -> dict[int, torch.Tensor]:
        for sid in new_tokens:
            if sid not in self.lens:
                for pool in self.pools:
                    for t in pool.values():
                        t[sid].zero_()
        self._sids = list(new_tokens)
        return super().step(new_tokens)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv: list, meta: object) -> torch.Tensor:
        meta.state = StateBatch(torch.tensor(self._sids, dtype=torch.int64), self.pools)  # type: ignore[attr-defined]
        return self.real(ids, positions, kv, meta)  # type: ignore[arg-type]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.real.compute_logits(hidden)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tests.tiny_models' Qwen3.5, Qwen3.5-MoE and Qwen3-Next (a dense layer among sparse ones)."""
    return {a: make_tiny_model(tmp_path_factory.mktemp(a) / a, a, vocab_size=VOCAB)
            for a in ("qwen3_5", "qwen3_5_moe", "qwen3_next")}


def _steps(batch: int) -> list[dict[int, list[int]]]:
    """A 12-token prefill chunk per sequence (sequences 1.. together: 24 rows with batch 3, past
    the fused layers' 16), then single-token decodes of every sequence."""
    toks = {s: random_tokens(40, VOCAB, seed=s) for s in range(batch)}
    steps = [{0: toks[0][:12]}]
    steps.append({s: toks[s][:12] for s in range(1, batch)} if batch > 1 else {0: toks[0][12:13]})
    for t in range(13, 26):
        steps.append({s: [toks[s][t]] for s in range(batch)})
    return steps


def _run(model: qn.Qwen3NextForCausalLM, fused: bool, steps: list[dict[int, list[int]]]) -> tuple[list, HybridRun]:
    model.fused_decode = fused
    run = HybridRun(model, seed=5)
    return [run.step(s) for s in steps], run


def _count(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Collects 'gdn' / 'attn' for every fused layer call from now on."""
    calls: list[str] = []
    for cls, name in ((qn.GdnLayer, "gdn"), (qn.GatedAttentionLayer, "attn")):
        real = cls.forward_decode

        def counting(self: object, *args: object, _real: object = real, _name: str = name) -> object:
            calls.append(_name)
            return _real(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(cls, "forward_decode", counting)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("invariant", [False, True])
def test_fused_hybrid_layers_give_the_python_layers_floats(hybrids: dict[str, Path], dtype: str, quantization: str,
                                                           batch: int, invariant: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """In batch-invariant mode too, whose linear paths linear_route.linear_kind follows."""
    model, _ = load_model(hybrids["qwen3_5"], dtype=dtype)
    assert isinstance(model, qn.Qwen3NextForCausalLM)
    if quantization != "none":
        model.quantize_weights(quantization)
    assert all(layer.fusable for layer in model._layers)
    steps = _steps(batch)
    calls = _count(monkeypatch)
    with batch_invariant.mode(invariant):
        fused, run_f = _run(model, True, steps)
        n_fused = len(calls)
        plain, run_p = _run(model, False, steps)
    assert len(calls) == n_fused  # the Python run made no fused call
    # Every layer of every step of at most 16 rows ran fused (batch 3's second step has 24).
    small = sum(sum(map(len, step.values())) <= 16 for step in steps)
    assert calls == ["gdn", "attn"] * 2 * small
    for a, b in zip(fused, plain):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
    for (kf, vf), (kp, vp) in zip(run_f.kv_caches, run_p.kv_caches):
        assert torch.equal(kf, kp) and torch.equal(vf, vp)
    for pf, pp in zip(run_f.pools, run_p.pools):
        for name in pf:
            assert torch.equal(pf[name], pp[name]), name


def test_layers_with_experts_stay_in_python(hybrids: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5-MoE's layers are all sparse: none runs fused; Qwen3-Next's one dense layer (2, a
    DeltaNet layer) does, with the same floats as the Python layers."""
    moe, _ = load_model(hybrids["qwen3_5_moe"], dtype="float32")
    assert not any(layer.fusable for layer in moe._layers)
    calls = _count(monkeypatch)
    _run(moe, True, _steps(1))
    assert calls == []
    nxt, _ = load_model(hybrids["qwen3_next"], dtype="bfloat16")
    assert [layer.fusable for layer in nxt._layers] == [False, False, True, False]
    steps = _steps(3)
    fused, run_f = _run(nxt, True, steps)
    assert calls == ["gdn"] * (len(steps) - 1)  # not the second step's 24 rows
    plain, run_p = _run(nxt, False, steps)
    for a, b in zip(fused, plain):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid
    for pf, pp in zip(run_f.pools, run_p.pools):
        for name in pf:
            assert torch.equal(pf[name], pp[name]), name


def test_seventeen_rows_run_the_python_layers(hybrids: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(hybrids["qwen3_5"], dtype="float32")
    calls = _count(monkeypatch)
    run = HybridRun(model)
    run.step({0: random_tokens(17, VOCAB, seed=1)})
    assert calls == []
    run.step({0: random_tokens(16, VOCAB, seed=2)})
    assert calls == ["gdn", "attn"] * 2


def test_k_quant_ssm_out_kept_in_the_files_column_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3.5 GGUF whose ssm_out is Q6_K with value heads of 128 (half a 256-value block, so its
    tiled columns cannot be regrouped by moving whole blocks): --quantization gguf keeps it in
    blocks in the file's column order, and the layer gathers its input to match. The kept matrix
    is the dequantised file's, columns permuted; the fused layers give the Python layers' floats;
    and the model's logits stay those of the dequantised file (up to the kernels' 8-bit activations)."""
    from server.kernels.quant import QuantizedWeight
    from tests.gguf_files import write_gguf

    hf_dir = make_tiny_model(tmp_path / "hf", "qwen3_5", vocab_size=VOCAB, linear_value_head_dim=128)
    path = write_gguf(tmp_path / "mixed.gguf", hf_dir, "Q8_0",
                      qtype_of=lambda n: "Q6_K" if n.endswith("ssm_out.weight") else "Q8_0")
    kept, config = load_model(path, dtype="float32", keep_gguf_blocks=True)
    plain, _ = load_model(path, dtype="float32")
    assert isinstance(kept, qn.Qwen3NextForCausalLM) and isinstance(plain, qn.Qwen3NextForCausalLM)
    for i in (0, 2):
        g, p = kept._layers[i].gdn, plain._layers[i].gdn  # type: ignore[union-attr]
        assert isinstance(g.out_proj, QuantizedWeight) and g.out_proj.qtype == "q6_k"
        assert g.out_columns is not None
        assert torch.equal(g.out_proj.dequantize()[:, torch.argsort(g.out_columns)], p.out_proj)
    steps = _steps(3)
    calls = _count(monkeypatch)
    fused, run_f = _run(kept, True, steps)
    assert len(calls) == 4 * (len(steps) - 1)
    python, run_p = _run(kept, False, steps)
    reference, _ = _run(plain, False, steps)
    for a, b in zip(fused, python):
        for sid in a:
            assert torch.equal(a[sid], b[sid]), sid

    def error(logits: list[dict[int, torch.Tensor]]) -> float:
        got = torch.cat([x for step in logits for x in step.values()])
        want = torch.cat([x for step in reference for x in step.values()])
        return float((got - want).norm() / want.norm())

    assert error(fused) < 0.05
    for layer in kept._layers[::2]:  # without the gather the columns meet the wrong inputs
        layer.gdn.out_columns = None  # type: ignore[union-attr]
    assert error(_run(kept, True, steps)[0]) > 0.2


def test_opcheck_both_fused_layers(hybrids: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas' aliasing (hidden, the state pools and the KV caches mutated, a fresh output) and
    the fakes' shapes, on one decode token's real arguments (captured from a forward_decode call)."""
    model, _ = load_model(hybrids["qwen3_5"], dtype="float32")
    captured: dict[str, tuple] = {}
    for cls, name in ((qn.GdnLayer, "gdn"), (qn.GatedAttentionLayer, "attn")):
        real = cls.forward_decode

        def capture(self: object, *args: object, _real: object = real, _name: str = name) -> object:
            captured[_name] = (self, args)  # the last: the one-token step
            return _real(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(cls, "forward_decode", capture)
    run = HybridRun(model)
    run.step({0: random_tokens(5, VOCAB, seed=2)})
    run.step({0: random_tokens(1, VOCAB, seed=3)})

    def cloned(args: tuple) -> tuple:
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)

    layer, args = captured["gdn"]
    op_args = cloned(layer.decode_args(torch.randn(1, 64), *args[1:]))
    torch.library.opcheck(torch.ops.pagewire.gdn_decode_layer.default, op_args)
    layer, args = captured["attn"]
    op_args = cloned(layer.decode_args(torch.randn(1, 64), *args[1:]))
    torch.library.opcheck(torch.ops.pagewire.gated_attention_decode_layer.default, op_args)
    with pytest.raises(RuntimeError, match="decode_layer: unknown linear kind 'fp8'"):
        torch.ops.pagewire.gated_attention_decode_layer(*op_args[:6], "fp8", *op_args[7:])
