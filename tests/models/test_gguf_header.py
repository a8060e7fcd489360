"""gguf_header (pagewire's own pass over a GGUF header) against the `gguf` package's GGUFReader on
the same files: every metadata value type, every tensor type's shape and bytes, the real default
model's 49k-token vocabulary, and the layouts it hands back to the package's reader."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.models import gguf_header
from server.models.gguf_file import GGUFFile


def _reference(path: Path, data: bool) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    # The data views must agree in dtype, shape and bytes (callers read them as they are).
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist())), int(t.data_offset),
                        t.data.dtype.str, t.data.shape, t.data.tobytes() if data else t.data.nbytes)
               for t in reader.tensors}
    return meta, tensors


def _ours(path: Path, data: bool) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    meta, infos = gguf_header.read_header(path)
    return meta, {t.name: (t.qtype.name, t.shape, t.data_offset, t.data.dtype.str, t.data.shape,
                           t.data.tobytes() if data else t.data.nbytes) for t in infos}


def _same(path: Path, data: bool = True) -> None:
    """Equal metadata and tensor tables; `data` compares every tensor's bytes too (for the real
    model, equal offsets, sizes and shapes into the same file already mean equal bytes)."""
    want_meta, want_tensors = _reference(path, data)
    got_meta, got_tensors = _ours(path, data)
    assert got_meta == want_meta
    assert list(got_meta) == list(want_meta)  # in file order
    assert got_tensors == want_tensors


def _every_type_file(path: Path, endian: Any = None, alignment: int = 0) -> Path:
    import gguf

    kw = {} if endian is None else {"endianess": endian}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -32000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)  # not exact in float32: both must give the same float
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo 日本 😀")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "日本", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty_list", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 3, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    for qt in ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
               "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"):
        q = gguf.GGMLQuantizationType[qt]
        block, size = gguf.GGML_QUANT_SIZES[q]
        raw = rng.integers(0, 256, size=(4, 256 // block * size), dtype=np.uint8)
        w.add_tensor(qt.lower(), raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [0, 64])
def test_every_value_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path: Path, alignment: int) -> None:
    _same(_every_type_file(tmp_path / "all.gguf", alignment=alignment))


def test_the_real_default_model() -> None:
    from server.models.default_model import find_default_model, missing_default_model_message

    found = find_default_model()
    if found is None:  # make build installs it; a missing model is a broken set-up, not a reason to skip
        pytest.fail(missing_default_model_message())
    _same(found.path, data=False)
    meta, _ = gguf_header.read_header(found.path)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_family_files(arch: str, tmp_path: Path) -> None:
    from tests.gguf_files import write_gguf
    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch, vocab_size=512)
    for qtype in ("F32", "Q8_0"):
        _same(write_gguf(tmp_path / f"{arch}-{qtype}.gguf", folder, qtype))


def test_a_big_endian_file_falls_back_to_the_gguf_reader(tmp_path: Path) -> None:
    import gguf

    path = _every_type_file(tmp_path / "big.gguf", endian=gguf.GGUFEndian.BIG)
    with pytest.raises(gguf_header.Unsupported):
        gguf_header.read_header(path)
    little = GGUFFile._parse(_every_type_file(tmp_path / "little.gguf"))
    big = GGUFFile._parse(path)
    assert big.metadata == little.metadata
    assert {n: t.shape for n, t in big.tensors.items()} == {n: t.shape for n, t in little.tensors.items()}


@pytest.mark.parametrize("cut", [30, 200, 1000, -100])
def test_truncated_headers_and_data_are_corrupt_not_crashes(tmp_path: Path, cut: int) -> None:
    data = _every_type_file(tmp_path / "all.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(gguf_header.Corrupt):
        gguf_header.read_header(path)
