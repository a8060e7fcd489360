"""The names the C++ ops take, typed: block formats (`Qtype`) and the path of each matrix that
pagewire::decode_layer takes (`LinearKind`). Both are str-valued (server.strenum), so a plain
string of one of their values is accepted wherever they are, and the ops receive the same strings.
"""
from __future__ import annotations

from server.strenum import StrEnum


class Qtype(StrEnum):
    """A block-quantised weight format (GGUF's block layouts, lower-case)."""

    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    MXFP4 = "mxfp4"  # GGUF ships it for experts only (QuantizedExperts in moe_experts)
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    IQ4_NL = "iq4_nl"
    IQ4_XS = "iq4_xs"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    # llama.cpp's lattice types, held in IQ4_XS's layout with their own levels (rewritten at load:
    # server.models.gguf_transcode; csrc/cpu/quant4_kernel.h).
    IQ3_XXS = "iq3_xxs"
    IQ3_S = "iq3_s"
    IQ2_XXS = "iq2_xxs"
    IQ1_S = "iq1_s"
    # IQ2_XS, IQ2_S and IQ1_M: the same with a scale per 16 values (the "x16" layout).
    IQ2_XS = "iq2_xs"
    IQ2_S = "iq2_s"
    IQ1_M = "iq1_m"  # (IQ1_S's levels)
    # Not quantised: a bf16 matrix moved into the interleaved x8 layout (QuantizedWeight.from_bf16),
    # which the AVX2 bf16 kernel streams fastest; "blocks" of 16 values, 32 bytes.
    BF16 = "bf16"
    BF16Z = "bf16z"  # bf16 packed losslessly at 12.5 bits a value (pack_bf16z, csrc/cpu/bf16z_layout.h)


class LinearKind(StrEnum):
    """One matrix's path in pagewire::decode_layer (`linear_route.linear_kind`): pagewire::linear, F.linear,
    or a QuantizedWeight's format and layout (`QuantizedWeight.op_qtype`; "x8": interleaved)."""

    KERNEL = "kernel"
    TORCH = "torch"
    Q8_0 = "q8_0"
    Q8_0X8 = "q8_0x8"
    Q4_0 = "q4_0"
    Q4_0X8 = "q4_0x8"
    Q4_1 = "q4_1"
    Q4_1X8 = "q4_1x8"
    Q4_K = "q4_k"
    Q4_KX8 = "q4_kx8"
    Q5_K = "q5_k"
    Q5_KX8 = "q5_kx8"
    Q6_K = "q6_k"
    Q6_KX8 = "q6_kx8"
    MXFP4 = "mxfp4"  # moe_experts only
    Q5_0 = "q5_0"
    Q5_0X8 = "q5_0x8"
    Q5_1 = "q5_1"
    Q5_1X8 = "q5_1x8"
    IQ4_NL = "iq4_nl"
    IQ4_NLX8 = "iq4_nlx8"
    IQ4_XS = "iq4_xs"
    IQ4_XSX8 = "iq4_xsx8"
    Q2_K = "q2_k"
    Q2_KX8 = "q2_kx8"
    Q3_K = "q3_k"
    Q3_KX8 = "q3_kx8"
    IQ3_XXS = "iq3_xxs"
    IQ3_XXSX8 = "iq3_xxsx8"
    IQ3_S = "iq3_s"
    IQ3_SX8 = "iq3_sx8"
    IQ2_XXS = "iq2_xxs"
    IQ2_XXSX8 = "iq2_xxsx8"
    IQ1_S = "iq1_s"
    IQ1_SX8 = "iq1_sx8"
    IQ2_XS = "iq2_xs"
    IQ2_XSX8 = "iq2_xsx8"
    IQ2_S = "iq2_s"
    IQ2_SX8 = "iq2_sx8"
    IQ1_M = "iq1_m"
    IQ1_MX8 = "iq1_mx8"
    BF16X8 = "bf16x8"  # pagewire::linear_bf16x8
    BF16ZX8 = "bf16zx8"  # pagewire::linear_bf16z
