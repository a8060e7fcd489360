"""server.hugepages: the KV pool's tensors carved from one mapping on 2 MB pages where the kernel
allows them, zeroed and committed like torch.zeros, and plain torch.zeros elsewhere."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import pytest
import torch

from server import hugepages
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams


def _reports_eligibility() -> bool:
    try:
        with open("/proc/self/smaps") as f:
            return "THPeligible:" in f.read()
    except OSError:
        return False


# Huge pages on, and a kernel whose smaps says which mappings may use them (on_huge_pages reads it).
THP = hugepages.thp_mode() in ("always", "madvise") and _reports_eligibility()


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_are_separate_zeroed_tensors(dtype: torch.dtype) -> None:
    shapes = [(256, 2, 16, 64), (256, 2, 16, 64), (3, 5, 7)]  # over 2 MB in all: one mapping
    ts = hugepages.zeros(shapes, dtype)
    assert [tuple(t.shape) for t in ts] == shapes and all(t.dtype == dtype and t.is_contiguous() for t in ts)
    assert all(torch.count_nonzero(t) == 0 for t in ts)
    for i, t in enumerate(ts):  # no two share a byte
        t.fill_(i + 1)
    assert [int(t.float().mean()) for t in ts] == [1, 2, 3]
    del shapes
    gc.collect()
    assert float(ts[0].float().sum()) == ts[0].numel()  # the views keep their mapping alive


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_a_pool_sized_buffer_is_aligned_and_thp_eligible() -> None:
    (t,) = hugepages.zeros([(8, 1024, 1024)], torch.float32)  # 32 MB
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert hugepages.on_huge_pages(t)
    assert not hugepages.on_huge_pages(torch.zeros(4096))  # an ordinary allocation is not advised


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_pages_are_committed_once_not_per_tensor() -> None:
    """Zeroed now (committed, as torch.zeros), and one mapping for the lot: forty 1 MB tensors take
    about 40 MB of resident memory, not forty 2 MB huge pages."""
    before = _rss_kb()
    ts = hugepages.zeros([(256, 1024)] * 40, torch.float32)
    grown = _rss_kb() - before
    assert 38 * 1024 <= grown <= 46 * 1024, grown
    assert len({t.data_ptr() for t in ts}) == 40


def test_small_or_refused_buffers_are_plain_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    (small,) = hugepages.zeros([(16, 16)], torch.float32)
    assert not hugepages.on_huge_pages(small) and torch.count_nonzero(small) == 0
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    (big,) = hugepages.zeros([(8, 1024, 1024)], torch.float32)
    assert not hugepages.on_huge_pages(big) and torch.count_nonzero(big) == 0


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_the_engine_kv_pool_is_on_huge_pages(tiny_model: Callable[..., Path]) -> None:
    eng = LLMEngine(EngineConfig(str(tiny_model("llama")), kv_cache_tokens=16384, max_num_seqs=4))
    key, value = eng.runner.kv_caches[0]
    assert key.data_ptr() % hugepages.HUGE_PAGE == 0 and hugepages.on_huge_pages(key)
    assert hugepages.on_huge_pages(value)
    eng.add_request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert torch.count_nonzero(key) > 0  # the forward wrote its K through the views


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 512, bias=False)  # 512 KB
        self.lin.weight.requires_grad_(False)
        self.table = torch.randn(1024, 128)  # a plain attribute, 512 KB
        self.half = self.table[::2]  # a second view of the table's storage
        self.pair = (torch.randn(300, 300), [torch.randn(10)])  # inside containers; the small one stays


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_pack_moves_storages_in_place() -> None:
    from server.kernels.quant import QuantizedWeight

    m = _Holder()
    m.q = QuantizedWeight.quantize(torch.randn(512, 256), "q8_0")  # a dataclass's tensor (136 KB)
    outside = torch.randn(400, 400)
    # A detached slice: no `_base` leads to `outside`, a holder the walk cannot see, so it stays.
    m.shared = outside[:100].detach()
    before = {name: (t.clone(), t.data_ptr()) for name, t in
              [("lin", m.lin.weight), ("table", m.table), ("half", m.half), ("pair", m.pair[0]), ("q", m.q.data),
               ("shared", m.shared), ("small", m.pair[1][0])]}
    weight_obj = m.lin.weight
    moved, storages = hugepages.pack(m)
    assert storages == 4 and moved >= 4 * 128 * 1024
    now = {"lin": m.lin.weight, "table": m.table, "half": m.half, "pair": m.pair[0], "q": m.q.data,
           "shared": m.shared, "small": m.pair[1][0]}
    for name, t in now.items():
        assert torch.equal(t, before[name][0]), name
    for name in ("lin", "table", "pair", "q"):
        assert now[name].data_ptr() != before[name][1] and hugepages.on_huge_pages(now[name]), name
    assert m.half.untyped_storage().data_ptr() == m.table.untyped_storage().data_ptr()  # still one storage
    assert m.half.data_ptr() - m.table.data_ptr() == 0 and m.half.stride() == (256, 1)
    assert now["shared"].data_ptr() == before["shared"][1] and now["small"].data_ptr() == before["small"][1]
    assert m.lin.weight is weight_obj and isinstance(m.lin.weight, torch.nn.Parameter)
    x = torch.randn(3, 256)
    assert torch.equal(m.lin(x), x @ before["lin"][0].t())


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_pack_moves_a_view_with_the_tensor_it_was_taken_from() -> None:
    """QuantizedExperts.for_kernels reshapes a flat [E * N, bytes] matrix into [E, N, bytes]: the view
    keeps its flat base alive, which nothing else reaches, so the walk must move the base too (MoE
    experts had stayed on 4 KB pages, the bulk of such a model's bytes)."""
    from server.kernels.quant import QuantizedExperts

    m = torch.nn.Module()
    m.experts = QuantizedExperts.quantize(torch.randn(4, 64, 256), "q8_0")
    m.experts = QuantizedExperts(m.experts.qtype, m.experts.data.reshape(4 * 64, -1).clone().reshape(4, 64, -1),
                                 m.experts.shape)
    assert m.experts.data._base is not None  # the view holds its flat base, which only it reaches
    before = m.experts.data.clone()
    base = m.experts.data._base
    moved, storages = hugepages.pack(m)
    assert storages == 1 and moved == before.numel()
    assert hugepages.on_huge_pages(m.experts.data) and torch.equal(m.experts.data, before)
    # base and view moved together: one storage, so the old bytes are not kept alive by the base.
    assert base.untyped_storage().data_ptr() == m.experts.data.untyped_storage().data_ptr()


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_pack_leaves_a_mapped_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    torch.randn(256, 256).numpy().tofile(path)
    m = torch.nn.Module()
    m.mapped = torch.from_file(str(path), shared=False, size=256 * 256, dtype=torch.float32)
    assert hugepages.pack(m) == (0, 0)


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_the_engine_packs_its_weights_and_keeps_its_text(tiny_model: Callable[..., Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run() -> tuple[list[int], LLMEngine]:
        eng = LLMEngine(EngineConfig(str(path), kv_cache_tokens=2048, max_num_seqs=4))
        eng.add_request("r", list(range(10, 40)), params)
        out: list[int] = []
        while eng.has_unfinished_requests():
            for d in eng.step():
                out += d.samples[0].token_ids if d.samples else []
        return out, eng

    packed, eng = run()
    assert hugepages.on_huge_pages(eng.model.embed_tokens)  # the tiny model's largest tensor
    monkeypatch.setattr(hugepages, "pack", lambda root, min_bytes=0: (0, 0))
    plain, eng = run()
    assert not hugepages.on_huge_pages(eng.model.embed_tokens)
    assert packed == plain and len(packed) == 16


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here, or smaps does not report THPeligible")
def test_pack_peaks_at_the_weights_plus_the_largest() -> None:
    """Each old storage is freed as soon as its tensors have moved: packing 240 MB of twelve 20 MB
    tensors peaks near 260 MB, not 480 MB (a fresh process, so its peak RSS is this one's)."""
    import subprocess
    import sys

    code = (
        "import resource, torch\n"
        "from server import hugepages\n"
        "m = torch.nn.Module()\n"
        "m.ws = [torch.ones(5 * 2**20) * i for i in range(12)]\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "moved, n = hugepages.pack(m)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "assert n == 12 and all(float(w[7]) == i for i, w in enumerate(m.ws))\n"
        "print(moved, (peak - base) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == 12 * 20 * 2**20
    assert int(out[1]) < 60, f"packing grew the peak by {out[1]} MB"


def test_the_engine_says_when_huge_pages_are_off(tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    with caplog.at_level("INFO", logger="pagewire.engine"):
        eng = LLMEngine(EngineConfig(str(tiny_model("llama")), kv_cache_tokens=16384, max_num_seqs=4))
    assert "transparent huge pages are never on this machine" in caplog.text
    assert not hugepages.on_huge_pages(eng.runner.kv_caches[0][0])
