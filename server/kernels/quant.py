"""Quantised linear weights kept quantised in memory: the QuantizedWeight container and its formats.

Every format but the four lattice types below is GGUF's block layout, byte for byte, so a tensor read
from a GGUF file (ggml shape [K, N], i.e. N rows of K values, each row a run of blocks) is wrapped
without conversion by `from_gguf_bytes`; the container holds the blocks as a uint8 tensor [N, K / block * block_bytes].

    qtype  values/block  bytes/block  value
    q8_0   32            34           d * q            (fp16 d, 32 int8 q)
    q4_0   32            18           d * (q - 8)      (fp16 d, 32 4-bit q)
    q4_1   32            20           d * q + m        (fp16 d, fp16 m, 32 4-bit q)
    q4_k   256           144          d*sc*q - dmin*mn (fp16 d, dmin, 8 x 6-bit sc/mn, 256 4-bit q)
    q5_k   256           176          d*sc*q - dmin*mn (as q4_k, 5-bit q: 32 bytes of fifth bits)
    q6_k   256           210          d*sc*(q - 32)    (6-bit q, 16 int8 sc per 16 values, fp16 d)
    mxfp4  32            17           E2M1(q) * 2^(e-127) (u8 exponent e, 32 4-bit q; experts)
    q5_0   32            22           d * (q - 16)     (fp16 d, 32 fifth bits, 32 4-bit q)
    q5_1   32            24           d * q + m        (fp16 d, fp16 m, 32 fifth bits, 32 4-bit q)
    iq4_nl 32            18           d * kvalues[q]   (fp16 d, 32 4-bit q indexing 16 int8 levels)
    q2_k   256           84           d*sc*q - dmin*mn (2-bit q, 4-bit sc/mn per 16 values, fp16 d, dmin)
    iq4_xs 256           136          d*(ls-32)*kvalues[q] (fp16 d, 8 x 6-bit ls, 256 4-bit q as iq4_nl's)
    q3_k   256           110          d*(sc-32)*(q-4)  (3-bit q: q2_k's 2 bits + a bit plane, 6-bit sc per 16 values, fp16 d)
    iq3_xxs, iq3_s, iq2_xxs, iq1_s
           256           136          d*(ls-32)*f*levels[q] (iq4_xs's bytes with the type's own 16 levels and
                                      power-of-two f: GGUF's lattice types, rewritten exactly at load by
                                      server.models.gguf_transcode, which also turns TQ1_0 / TQ2_0 into q2_k)
    iq2_xs, iq2_s, iq1_m
           256           138          d*(2l+1)/8*levels[q] (the same with a 4-bit l per 16 values: the "x16" layout)
    bf16   16            32           the bf16 value itself (from_bf16: a float matrix moved, x8 only)
    bf16z  (varies)      ~24          the bf16 value itself, packed losslessly at ~12.5 bits (pack_bf16:
                                      csrc/cpu/bf16z_layout.h; AVX2 / AVX512-BF16 decode reads 0.76x the bytes)

Float weights are quantised at load with `quantize` (q8_0 and q4_0, GGUF's rounding, in C++).

`for_kernels` gives the layout this CPU's kernel reads fastest: on x86 CPUs from AVX2 up every format
but MXFP4 is interleaved eight rows at a time (the same bytes rearranged, csrc/cpu/quant_kernel.h and
quant4_kernel.h), which the AVX2 kernels read 1.3-2.5x as fast as GGUF's rows. The model loaders
call it.
`server.kernels.ops.linear` runs a QuantizedWeight through pagewire::linear_q8_0 or
pagewire::linear_q4 (every 4-bit and K-quant format; activations quantised per row to 8 bits on the
fly, integer block dot products).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch

import server._C  # noqa: F401  (loads the op registrations)
from server._C import fast as _fast  # the ops' CPU code as plain calls (csrc/fast_calls.cpp)
from server.kernels.kinds import LinearKind, Qtype

__all__ = ["QuantizedWeight", "QuantizedExperts", "Qtype", "x8_here", "QUANTIZATIONS", "QTYPES", "GGUF_QTYPES", "INTERLEAVABLE",
           "Q8_0_BLOCK", "Q8_0_BLOCK_BYTES"]

Q8_0_BLOCK = 32  # values per block
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8


class BlockFormat(NamedTuple):
    values: int  # values per block
    nbytes: int  # bytes per block


# Every format a QuantizedWeight can hold, with a kernel in csrc/cpu.
QTYPES: dict[Qtype, BlockFormat] = {
    Qtype.Q8_0: BlockFormat(32, 34),
    Qtype.Q4_0: BlockFormat(32, 18),
    Qtype.Q4_1: BlockFormat(32, 20),
    Qtype.Q4_K: BlockFormat(256, 144),
    Qtype.Q5_K: BlockFormat(256, 176),
    Qtype.Q6_K: BlockFormat(256, 210),
    # GGML's MXFP4 (gpt-oss's experts): an E8M0 scale byte, then 16 bytes of E2M1 codes (value j in
    # the low nibble of byte j, value j + 16 in its high nibble); the 4-bit kernels read it (linear_q4
    # qtype "mxfp4", csrc/cpu/quant4_kernel.h). GGUF files ship it for experts only.
    Qtype.MXFP4: BlockFormat(32, 17),
    # Q5_0 / Q5_1 / IQ4_NL: the types llama.cpp's quantiser falls back to where a row is not whole
    # 256-value super-blocks (Q4_K / Q5_K / the low-bit types), and types of their own.
    Qtype.Q5_0: BlockFormat(32, 22),
    Qtype.Q5_1: BlockFormat(32, 24),
    Qtype.IQ4_NL: BlockFormat(32, 18),
    # IQ4_XS: IQ4_NL's levels under a 6-bit scale per 32 values and an fp16 d per 256 (4.25 bits a value).
    Qtype.IQ4_XS: BlockFormat(256, 136),
    # Q2_K: 2-bit codes under a 4-bit scale and min per 16 values and an fp16 d and dmin per 256.
    Qtype.Q2_K: BlockFormat(256, 84),
    # Q3_K: 3-bit codes (Q2_K's two-bit planes plus a plane of high bits) under a 6-bit scale per 16
    # values and an fp16 d per 256.
    Qtype.Q3_K: BlockFormat(256, 110),
    # IQ3_XXS / IQ3_S / IQ2_XXS / IQ1_S: IQ4_XS's 136 bytes per 256 values with the type's own levels
    # (csrc/cpu/quant4_kernel.h), rewritten from GGUF's lattice blocks at load (server.models.gguf_transcode).
    Qtype.IQ3_XXS: BlockFormat(256, 136),
    Qtype.IQ3_S: BlockFormat(256, 136),
    Qtype.IQ2_XXS: BlockFormat(256, 136),
    Qtype.IQ1_S: BlockFormat(256, 136),
    # IQ2_XS / IQ2_S / IQ1_M: that layout with a 4-bit scale per 16 values ("x16").
    Qtype.IQ2_XS: BlockFormat(256, 138),
    Qtype.IQ2_S: BlockFormat(256, 138),
    Qtype.IQ1_M: BlockFormat(256, 138),
    # bf16 in the x8 layout only (from_bf16): the same bytes as the bf16 matrix, moved.
    Qtype.BF16: BlockFormat(16, 32),
    # bf16 packed (pack_bf16): a buffer whose size depends on the values (a rare step of 256 values
    # stays 16-bit), so no fixed bytes per block (0).
    Qtype.BF16Z: BlockFormat(16, 0),
}

# The formats with an interleaved layout (QuantizedWeight.for_kernels).
INTERLEAVABLE: tuple[Qtype, ...] = (Qtype.Q8_0, Qtype.Q4_0, Qtype.Q4_1, Qtype.Q4_K, Qtype.Q5_K, Qtype.Q6_K, Qtype.Q5_0,
                                    Qtype.Q5_1, Qtype.IQ4_NL, Qtype.IQ4_XS, Qtype.Q2_K,
                                    Qtype.Q3_K, Qtype.IQ3_XXS, Qtype.IQ3_S, Qtype.IQ2_XXS, Qtype.IQ1_S,
                                    Qtype.IQ2_XS, Qtype.IQ2_S, Qtype.IQ1_M, Qtype.BF16, Qtype.BF16Z)

# GGUF tensor type names (gguf.GGMLQuantizationType) -> the qtype that keeps them as they are (the
# types rewritten into another qtype's blocks at load: server.models.gguf_transcode.TRANSCODED).
GGUF_QTYPES: dict[str, Qtype] = {"Q8_0": Qtype.Q8_0, "Q4_0": Qtype.Q4_0, "Q4_1": Qtype.Q4_1, "Q4_K": Qtype.Q4_K,
                                  "Q5_K": Qtype.Q5_K, "Q6_K": Qtype.Q6_K, "MXFP4": Qtype.MXFP4, "Q5_0": Qtype.Q5_0,
                                  "Q5_1": Qtype.Q5_1, "IQ4_NL": Qtype.IQ4_NL, "IQ4_XS": Qtype.IQ4_XS,
                                  "Q2_K": Qtype.Q2_K, "Q3_K": Qtype.Q3_K}

# --quantization values that quantise float weights at load, and the format each one stores.
# ("gguf", which keeps a GGUF file's own block types, is handled by the GGUF loader.)
QUANTIZATIONS: dict[str, Qtype] = {"int8": Qtype.Q8_0, "int4": Qtype.Q4_0}

# Rows the integer kernels take per call (kQ8KernelMaxRows / kQ4KernelMaxRows in csrc/ops.h);
# beyond it their ops dequantise and run ATen's GEMM, and linear_rows runs them in blocks of this size.
KERNEL_MAX_ROWS = 16
_QUANTIZERS = {Qtype.Q8_0: "quantize_q8_0", Qtype.Q4_0: "quantize_q4_0"}


def _qtype(value: Union[Qtype, str]) -> Qtype:
    try:
        return Qtype(value)
    except ValueError:
        raise ValueError(f"qtype: must be one of {', '.join(QTYPES)}, got {value!r}") from None


def x8_here() -> bool:
    """Whether this CPU's kernels read the interleaved x8 layouts (QuantizedWeight.for_kernels):
    every x86 family from AVX2 up; the portable family reads GGUF's rows."""
    return str(server._C.cpu_isa()) != "portable"


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight [N, K] (nn.Linear layout) kept in a block-quantised format.

    Attributes:
        qtype: a key of QTYPES (a plain string of one is accepted and stored as the Qtype).
        data: uint8 [N, K / block * block_bytes] on CPU, the blocks row by row (GGUF's layout), or
            with `interleaved` each group of eight rows rearranged within its own bytes.
        shape: the logical (N, K).
        interleaved: data is in the x8 layout (q8_0, q4_0, q4_1, q4_k and q6_k; see `for_kernels`).
    """

    qtype: Qtype
    data: torch.Tensor
    shape: tuple[int, int]
    interleaved: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", _qtype(self.qtype))
        fmt = QTYPES[self.qtype]
        n, k = self.shape
        if k <= 0 or k % fmt.values != 0:
            raise ValueError(f"shape: K = {k} must be a positive multiple of {fmt.values} for {self.qtype}")
        if self.qtype is Qtype.BF16Z:
            if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[0] != n or not self.interleaved:
                raise ValueError(f"data: a bf16z weight is an interleaved uint8 [{n}, W] buffer (pack_bf16), got "
                                 f"{self.data.dtype} {list(self.data.shape)}")
            return
        want = (n, k // fmt.values * fmt.nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"data: expected uint8 {list(want)} for {self.qtype} {list(self.shape)}, "
                             f"got {self.data.dtype} {list(self.data.shape)}")
        if self.interleaved and self.qtype not in INTERLEAVABLE:
            raise ValueError(f"interleaved: only {', '.join(INTERLEAVABLE)} have an interleaved layout, "
                             f"not {self.qtype}")
        if self.qtype is Qtype.BF16 and not self.interleaved:
            raise ValueError("interleaved: a bf16 QuantizedWeight exists only in the x8 layout (from_bf16); "
                             "a row-layout bf16 matrix stays a tensor")

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: Union[Qtype, str] = Qtype.Q8_0) -> "QuantizedWeight":
        """Quantise a float weight [N, K] (K a multiple of 32) with GGUF's rounding (q8_0 or q4_0)."""
        op = _QUANTIZERS.get(Qtype(qtype)) if qtype in QTYPES else None
        if op is None:
            raise ValueError(f"qtype: quantising at load supports {', '.join(_QUANTIZERS)}, got {qtype!r}")
        data = getattr(torch.ops.pagewire, op)(weight.detach().cpu())
        return cls(_qtype(qtype), data, (int(weight.shape[0]), int(weight.shape[1])))

    @classmethod
    def from_gguf_bytes(cls, qtype: Union[Qtype, str], raw: torch.Tensor, n: int, k: int) -> "QuantizedWeight":
        """Wrap GGUF tensor data of `qtype` (any uint8 tensor of the right byte count, e.g. a view of
        the mapped file) for a weight of N rows of K values; no copy when raw is contiguous."""
        q = _qtype(qtype)
        fmt = QTYPES[q]
        if k % fmt.values != 0:
            raise ValueError(f"shape: K = {k} must be a multiple of {fmt.values} for {q}")
        return cls(q, raw.reshape(n, k // fmt.values * fmt.nbytes), (n, k))

    @classmethod
    def from_bf16(cls, weight: torch.Tensor) -> "QuantizedWeight":
        """A bf16 matrix [N, K] (K a multiple of 16) moved into the x8 layout that the AVX2 and
        AVX512-BF16 bf16 kernels stream as one sequence (pagewire::linear_bf16x8; the same floats as
        pagewire::linear, bit for bit). Not a quantisation: the values are the matrix's own."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"weight: from_bf16 takes a bf16 [N, K] matrix, got {weight.dtype} {list(weight.shape)}")
        n, k = int(weight.shape[0]), int(weight.shape[1])
        if k <= 0 or k % 16:
            raise ValueError(f"shape: K = {k} must be a positive multiple of 16 for the x8 bf16 layout")
        return cls(Qtype.BF16, torch.ops.pagewire.interleave_bf16(weight.detach().cpu()), (n, k), interleaved=True)

    @classmethod
    def pack_bf16(cls, weight: torch.Tensor) -> "QuantizedWeight":
        """A bf16 matrix [N, K] (K a multiple of 16) packed losslessly (csrc/cpu/bf16z_layout.h): the
        x8 layout with each value's high byte (sign and upper exponent) as a 4-bit code into its row's
        16 most frequent, ~12.5 bits a value; a step of 256 values where some high byte is not in its
        row's table stays 16-bit. pagewire::linear_bf16z gives pagewire::linear's floats, bit for bit,
        on AVX512-BF16 and AVX2 CPUs, from 0.76x the bytes. Not a quantisation: unpacking gives the matrix back."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"weight: pack_bf16 takes a bf16 [N, K] matrix, got {weight.dtype} {list(weight.shape)}")
        n, k = int(weight.shape[0]), int(weight.shape[1])
        if n <= 0 or k <= 0 or k % 16:
            raise ValueError(f"shape: K = {k} must be a positive multiple of 16 (and N > 0) for the packed bf16 layout")
        return cls(Qtype.BF16Z, torch.ops.pagewire.pack_bf16z(weight.detach().cpu()), (n, k), interleaved=True)

    @classmethod
    def from_q8_0_bytes(cls, raw: torch.Tensor, n: int, k: int) -> "QuantizedWeight":
        """`from_gguf_bytes` for Q8_0."""
        return cls.from_gguf_bytes(Qtype.Q8_0, raw, n, k)

    def for_kernels(self) -> "QuantizedWeight":
        """This weight in the layout that this CPU's kernel reads fastest (itself when that is its own).

        On x86 CPUs with AVX2 or better, weights of every format but MXFP4, of at least eight rows,
        are interleaved: a copy of the same bytes, eight rows at a time, so one 32-bit lane of the x8
        kernel is one weight row (csrc/cpu/x8_body.h, x8_q5nl_body.h and, for the K-quants,
        x8k_body.h, each built for AVX2 and for AVX-512 VNNI). On AVX-512 CPUs too: measured on an AMX Xeon,
        the x8 kernels beat the AVX-512 row kernels at every row count up to the integer kernels'
        limit for 4-bit (1.1-1.9x), and from one row to four for Q8_0 (bench/RESULTS.md, session 20);
        from 4 rows on AMX CPUs Q8_0's x8 layout runs on AMX tiles (linear_q8_0x8_amx, session 21).
        The portable family reads GGUF's rows; so does MXFP4 everywhere."""
        if self.interleaved or self.qtype not in INTERLEAVABLE or self.shape[0] < 8 or not x8_here():
            return self
        return self.interleave()

    def interleave(self) -> "QuantizedWeight":
        """A copy in the interleaved x8 layout, whatever this CPU (for_kernels decides where it pays)."""
        if self.interleaved or self.qtype not in INTERLEAVABLE:
            raise ValueError(f"interleaved: {self.qtype} {'is already' if self.interleaved else 'has no'} "
                             "interleaved layout")
        if self.qtype is Qtype.BF16:  # (never reached: a bf16 weight is born interleaved)
            raise ValueError("interleaved: a bf16 weight is made in the x8 layout by from_bf16")
        if self.qtype is Qtype.Q8_0:
            data = torch.ops.pagewire.interleave_q8_0(self.data)
        else:
            data = torch.ops.pagewire.interleave_q4(self.data, self.qtype)
        return QuantizedWeight(self.qtype, data, self.shape, interleaved=True)

    @property
    def is_bf16(self) -> bool:
        """bf16 values (x8 or packed), not a quantisation: their op takes any row count itself."""
        return self.qtype is Qtype.BF16 or self.qtype is Qtype.BF16Z

    @functools.cached_property
    def op_qtype(self) -> LinearKind:
        """The format and layout as the C++ ops name them: the qtype, with "x8" when interleaved
        ("q4_0x8"; also pagewire::decode_layer's linear kind of this weight). Made once: the
        embedding rows and the lm_head ask for it every decode step, and built anew (an Enum's
        .value is a Python-level descriptor) it took 11 us with the caches cold after the step's
        weight stream. (A frozen dataclass still has the instance dict cached_property fills.)"""
        return LinearKind(self.qtype.value + "x8" if self.interleaved else self.qtype.value)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented weight [N, K] in `dtype` (exact in float32, as GGUF computes it)."""
        if self.qtype is Qtype.BF16:
            return torch.ops.pagewire.deinterleave_bf16(self.data).to(dtype)
        if self.qtype is Qtype.BF16Z:
            return torch.ops.pagewire.unpack_bf16z(self.data, self.shape[1]).to(dtype)
        if self.qtype is Qtype.Q8_0:
            return torch.ops.pagewire.dequantize_q8_0(self.data, self.interleaved).to(dtype)
        return torch.ops.pagewire.dequantize_q4(self.data, self.op_qtype).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ self^T (+ bias) in x's dtype, through the format's kernel."""
        if x.is_cpu:  # server._C.fast: the ops' CPU code without the dispatcher (csrc/fast_calls.cpp)
            if self.qtype is Qtype.BF16:
                return _fast.linear_bf16x8(x, self.data, bias)
            if self.qtype is Qtype.BF16Z:
                return _fast.linear_bf16z(x, self.data, bias)
            if self.qtype is Qtype.Q8_0:
                return _fast.linear_q8_0(x, self.data, bias, self.interleaved)
            return _fast.linear_q4(x, self.data, self.op_qtype, bias)
        if self.qtype is Qtype.BF16:
            return torch.ops.pagewire.linear_bf16x8(x, self.data, bias)
        if self.qtype is Qtype.BF16Z:
            return torch.ops.pagewire.linear_bf16z(x, self.data, bias)
        if self.qtype is Qtype.Q8_0:
            return torch.ops.pagewire.linear_q8_0(x, self.data, bias, self.interleaved)
        return torch.ops.pagewire.linear_q4(x, self.data, self.op_qtype, bias)

    def linear_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """As linear, but the integer kernel at every row count: above KERNEL_MAX_ROWS rows in blocks
        of that many (each row's floats those of a call with its block alone), where linear
        dequantises and runs ATen's GEMM. One call into one output on CPU; elsewhere a linear per block."""
        if x.is_cpu and not self.is_bf16:
            if self.qtype is Qtype.Q8_0:
                return _fast.linear_q8_0_rows(x, self.data, bias, self.interleaved)
            return _fast.linear_q4_rows(x, self.data, self.op_qtype, bias)
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.linear(x, bias)
        return torch.cat([self.linear(x[i : i + KERNEL_MAX_ROWS], bias) for i in range(0, x.shape[0], KERNEL_MAX_ROWS)])

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(frozen=True)
class QuantizedExperts:
    """A mixture-of-experts layer's stacked expert matrices [E, N, K] (gate_up: N = 2I, K = H;
    down: N = H, K = I) kept in a block format: each expert's matrix is a QuantizedWeight's bytes,
    one after another, so pagewire::moe_experts hands the format's row kernel one expert at a time.

    Attributes:
        qtype: a key of QTYPES.
        data: uint8 [E, N, K / block * block_bytes]; with `interleaved` each expert's rows in the x8
            layout (only when N is a multiple of 8, so no group spans two experts).
        shape: the logical (E, N, K).
    """

    qtype: Qtype
    data: torch.Tensor
    shape: tuple[int, int, int]
    interleaved: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", _qtype(self.qtype))
        fmt = QTYPES[self.qtype]
        e, n, k = self.shape
        if k <= 0 or k % fmt.values != 0:
            raise ValueError(f"shape: K = {k} must be a positive multiple of {fmt.values} for {self.qtype}")
        want = (e, n, k // fmt.values * fmt.nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"data: expected uint8 {list(want)} for {self.qtype} {list(self.shape)}, "
                             f"got {self.data.dtype} {list(self.data.shape)}")
        if self.interleaved and (self.qtype not in INTERLEAVABLE or n % 8):
            raise ValueError(f"interleaved: needs {', '.join(INTERLEAVABLE)} and rows per expert a multiple of 8")

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: Union[Qtype, str] = Qtype.Q8_0) -> "QuantizedExperts":
        """Quantise float experts [E, N, K] (K a multiple of 32) with GGUF's rounding (q8_0 or q4_0)."""
        e, n, k = (int(s) for s in weight.shape)
        flat = QuantizedWeight.quantize(weight.detach().reshape(e * n, k), qtype)
        return cls(flat.qtype, flat.data.reshape(e, n, -1), (e, n, k))

    @classmethod
    def from_gguf_bytes(cls, qtype: Union[Qtype, str], raw: torch.Tensor, e: int, n: int, k: int) -> "QuantizedExperts":
        """Wrap a GGUF `*_exps` tensor's data (E experts of N rows of K values)."""
        q = _qtype(qtype)
        fmt = QTYPES[q]
        if k % fmt.values != 0:
            raise ValueError(f"shape: K = {k} must be a multiple of {fmt.values} for {q}")
        return cls(q, raw.reshape(e, n, k // fmt.values * fmt.nbytes), (e, n, k))

    def for_kernels(self) -> "QuantizedExperts":
        """The layout this CPU's kernel reads fastest (QuantizedWeight.for_kernels per expert)."""
        e, n, k = self.shape
        if self.interleaved or n % 8 or self.qtype not in INTERLEAVABLE:
            return self
        flat = QuantizedWeight(self.qtype, self.data.reshape(e * n, -1), (e * n, k)).for_kernels()
        if not flat.interleaved:
            return self
        return QuantizedExperts(self.qtype, flat.data.reshape(self.data.shape), self.shape, interleaved=True)

    @functools.cached_property
    def op_qtype(self) -> LinearKind:
        """The kind pagewire::moe_experts takes for these experts ("q8_0", "q4_0x8", ...); made once,
        as QuantizedWeight.op_qtype."""
        return LinearKind(self.qtype.value + "x8" if self.interleaved else self.qtype.value)

    def expert(self, i: int) -> QuantizedWeight:
        """Expert i's matrix [N, K] (a view of the same bytes)."""
        return QuantizedWeight(self.qtype, self.data[i], (self.shape[1], self.shape[2]), self.interleaved)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented experts [E, N, K] in `dtype`."""
        e, n, k = self.shape
        flat = QuantizedWeight(self.qtype, self.data.reshape(e * n, -1), (e * n, k), self.interleaved)
        return flat.dequantize(dtype).reshape(e, n, k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()
