#!/usr/bin/env bash
# bench/cpu_isa_check.sh: the checks owed to a CPU with more than AVX2 (an AVX-512 VNNI, AVX512-BF16
# or AMX machine), in one run, when a session lands on one. The development machine so far was
# AVX2-only, so the avx512 / avx512bf16 / amx kernels were tested only through emulated intrinsics
# (tests/kernels/emu_build.py) and never timed.
#
#   bash bench/cpu_isa_check.sh            # after `make build`; logs in bench/out/cpu_isa_check/
#
# 1. the CPU, its flags and the kernel family pagewire detects;
# 2. the kernel tests natively: every family this CPU has, through the cpu_isa fixture (the AMX and
#    VNNI kernels run in the extension here, not emulated);
# 3. `bench.kernels linear` once per family (PAGEWIRE_CPU_ISA caps it): the bf16 and Q8_0 kernels
#    against torch, per shape and row count, in ms and GB/s of weight read;
# 4. `bench.decode_step` per family on llama-246m (bf16, int8, int4) and SmolLM2 (bf16, int8, gguf):
#    MBU, int8/4-bit over bf16, batch 8 over batch 1 (issue 12's targets).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/out/cpu_isa_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD

"$PY" - <<'PYEOF' | tee "$OUT/cpu.txt"
import server._C
f = server._C.cpu_features()
print("CPU:", f.get("vendor"), f.get("brand"))
print("flags:", " ".join(k for k, v in f.items() if v is True))
print("detected family:", server._C.detected_cpu_isa())
PYEOF
best=$("$PY" -c "import server._C; print(server._C.detected_cpu_isa())")
families=$("$PY" -c "
order = ['avx2', 'avx512', 'avx512bf16', 'amx']
best = '$best'
print(' '.join(order[: order.index(best) + 1]) if best in order else '')")
echo "families to time: ${families:-none}"

# Every kernel module with a cpu_isa grid (the x8 layouts, the K-quants, MoE experts, thread splits
# included: session 44 found the list had fallen behind the kernels), then the emulated ones.
"$PY" -m pytest -q tests/kernels/test_linear.py tests/kernels/test_quant.py tests/kernels/test_quant4.py \
    tests/kernels/test_kquants.py tests/kernels/test_interleaved.py tests/kernels/test_thread_invariance.py \
    tests/kernels/test_moe_experts.py tests/kernels/test_moe_decode.py tests/kernels/test_quant_embedding.py \
    tests/kernels/test_fast_calls.py tests/kernels/test_autotune.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_emulated_*.py 2>&1 | tail -5 | tee "$OUT/tests.txt"

for fam in $families; do
    echo "== $fam: bench.kernels linear" | tee -a "$OUT/kernels.txt"
    PAGEWIRE_CPU_ISA=$fam "$PY" -m bench.kernels linear --threads 0 2>&1 | tee -a "$OUT/kernels.txt"
done
for fam in $families; do
    echo "== $fam: bench.decode_step" | tee -a "$OUT/decode_step.txt"
    PAGEWIRE_CPU_ISA=$fam "$PY" -m bench.decode_step --shape llama-246m --batch 1 8 \
        --quantization none int8 int4 2>&1 | tee -a "$OUT/decode_step.txt"
    PAGEWIRE_CPU_ISA=$fam "$PY" -m bench.decode_step --model default --batch 1 8 \
        --quantization none int8 gguf 2>&1 | tee -a "$OUT/decode_step.txt"
done
echo "logs in $OUT"
