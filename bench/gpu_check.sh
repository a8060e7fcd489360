#!/usr/bin/env bash
# bench/gpu_check.sh: the one prepared script for a lent GPU machine (see docs/gpu.md).
#
#   bash bench/gpu_check.sh                 # ON THE GPU MACHINE: env, deps, CUDA build, tests, benches
#   bash bench/gpu_check.sh --fetch-wheels  # HERE (has PyPI): fill bench/out/wheels for the trip
#                                           # (--fetch-wheels --all: also the big ones the image has)
#   bash bench/gpu_check.sh --help
#
# The GPU machine has no package registry: pure-Python deps travel as wheels in bench/out/wheels
# (ignored by git, so name it in the device tool's carry list). Its own python3 holds torch (with
# CUDA), which the fresh venv reuses (--system-site-packages plus a .pth, see stage_venv).
#
# Stages (each with its own timeout, all inside GPU_CHECK_BUDGET seconds; one PASS/FAIL/SKIP line each):
#   env       nvidia-smi, python, torch/CUDA versions, nvcc, CUDA_HOME
#   venv      fresh venv reusing the machine's torch; pip install --no-index from the wheel folder
#   build     MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace (CUDA build)
#   ops       which torch.ops.pagewire ops have a CUDA kernel; a CUDA-vs-CPU smoke on each that does
#   cuda      pytest -m cuda tests --ignore=tests/kernels
#   kernels   pytest -m cuda tests/kernels (the kernel tests on the GPU)
#   bench     bench scripts that take --device (bench/offline_throughput.py, bench/kernels.py)
#             run with --device cuda; skipped with a message while none does
# Logs: one file per stage plus summary.txt (8 files: the device tool returns at most 8) in $OUT
# (the device tool's return folder) when set, else in bench/out/gpu_check/. The console shows the
# environment in brief, each stage's verdict, the tail of a failing stage's log, and the summary
# table last (the device tool keeps only the last 12,000 characters of the output).
#
# Environment knobs: GPU_CHECK_BUDGET (s, default 540), GPU_CHECK_WHEELS (default bench/out/wheels),
# GPU_CHECK_VENV (default /tmp/pagewire-gpu-venv), GPU_CHECK_PYTHON (default python3),
# GPU_CHECK_STAGES (space-separated subset, default all), GPU_CHECK_BENCH_ARGS (extra args for
# offline_throughput.py), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 16),
# GPU_CHECK_ALLOW_NO_GPU=1 (dry run on a machine without a GPU: env does not stop the run).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

WHEELS="${GPU_CHECK_WHEELS:-bench/out/wheels}"
BASE_PY="${GPU_CHECK_PYTHON:-python3}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

# ------------------------------------------------------------------------------------------------
# --fetch-wheels: run HERE (where PyPI answers). Downloads cp312 manylinux x86_64 wheels of the
# project's dependencies (pyproject.toml: dependencies + the test extra), minus torch and nvidia-*.
# ------------------------------------------------------------------------------------------------
fetch_wheels() {
  local py="${PYTHON:-python3}" limit_mib=40 keep_all=${1:-0}
  local -a reqs
  mapfile -t reqs < <("$py" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
names = list(p["dependencies"]) + [r for extra in p.get("optional-dependencies", {}).values() for r in extra]
for r in names:
    base = r.split(";")[0].strip()
    key = base.split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip().lower()
    if key == "torch" or key.startswith("nvidia-"):
        continue
    print(base)
EOF
  ) || { echo "fetch-wheels: could not read pyproject.toml with $py (needs Python >= 3.11)"; return 1; }
  echo "fetch-wheels: ${#reqs[@]} requirements from pyproject.toml: ${reqs[*]}"
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  local t0=$SECONDS
  # cp312 for the GPU machine's Python 3.12; manylinux up to 2_28 (its glibc is newer than that).
  "$py" -m pip download --disable-pip-version-check --no-cache-dir -q \
      --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$WHEELS" "${reqs[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
    || { echo "fetch-wheels: FAIL (pip download)"; return 1; }
  # Nothing should pull these in, but never carry them: the machine's torch stack is the one to use.
  rm -f "$WHEELS"/torch-*.whl "$WHEELS"/nvidia_*.whl "$WHEELS"/triton-*.whl
  echo "fetch-wheels: downloaded $(ls "$WHEELS"/*.whl | wc -l) wheels," \
       "$(du -cb "$WHEELS"/*.whl | tail -1 | awk '{ printf "%.1f", $1 / 1048576 }') MiB ($((SECONDS - t0)) s)"
  # The full set is ~55 MiB: too close to the device tool's 64 MiB. The GPU image already has these
  # big ones at versions that satisfy pyproject.toml (.library/device/KINDS.md: numpy 2.5.2,
  # transformers 5.17.0, tokenizers 0.23.2, hf-xet, uvloop), and pip keeps an installed version that
  # satisfies a requirement, so they stay home unless --all is given.
  if [[ $keep_all != 1 ]]; then
    local pruned=() name f
    for name in numpy transformers tokenizers hf_xet uvloop; do
      for f in "$WHEELS"/"$name"-[0-9]*.whl; do
        if [[ -e $f ]]; then pruned+=("$(basename "$f")"); rm -f "$f"; fi
      done
    done
    echo "fetch-wheels: left out (already on the GPU image; --all keeps them): ${pruned[*]:-none}"
  fi
  ls -1 "$WHEELS" | grep '\.whl$' > "$WHEELS/MANIFEST.txt"
  local n bytes mib
  n=$(grep -c . "$WHEELS/MANIFEST.txt")
  bytes=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
  mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
  echo "fetch-wheels: $n wheels, $mib MiB in $WHEELS (list: $WHEELS/MANIFEST.txt)"
  du -b "$WHEELS"/*.whl | sort -rn | head -5 | awk '{ printf "  %7.2f MiB  %s\n", $1 / 1048576, $2 }'
  local tree_kib
  tree_kib=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  echo "fetch-wheels: the working tree that travels besides: $((tree_kib / 1024)) MiB; device tool limit: 64 MiB for tree + carry"
  if awk -v b="$bytes" -v l="$limit_mib" 'BEGIN { exit !(b > l * 1048576) }'; then
    echo "fetch-wheels: FAIL: $mib MiB is over the $limit_mib MiB this script allows the wheels (64 MiB device-tool limit)"
    return 1
  fi
  echo "fetch-wheels: OK: on the GPU machine run 'bash bench/gpu_check.sh' with carry [\"$WHEELS\"]"
}

case "${1:-}" in
  --fetch-wheels)
    case "${2:-}" in --all) fetch_wheels 1 ;; "") fetch_wheels 0 ;; *) echo "unknown argument: $2"; exit 2 ;; esac
    exit $? ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "unknown argument: $1"; usage; exit 2 ;;
esac

# ------------------------------------------------------------------------------------------------
# The GPU run.
# ------------------------------------------------------------------------------------------------
START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET:-540}"
LOGDIR="${OUT:-$ROOT/bench/out/gpu_check}"
mkdir -p "$LOGDIR"
VENV="${GPU_CHECK_VENV:-/tmp/pagewire-gpu-venv}"
STAGES="${GPU_CHECK_STAGES:-env venv build ops cuda kernels bench}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
PY="$BASE_PY"           # becomes the venv's python after the venv stage

declare -a S_NAME S_RESULT S_SECS S_NOTE
SUMMARY="$LOGDIR/summary.txt"

want() { [[ " $STAGES " == *" $1 "* ]]; }

# Seconds a stage may take: its own cap, but never past the overall budget.
stage_timeout() {
  local cap=$1 left=$((BUDGET - (SECONDS - START)))
  ((left < cap)) && cap=$left
  ((cap < 5)) && cap=5
  echo "$cap"
}

record() {  # name result secs note
  S_NAME+=("$1"); S_RESULT+=("$2"); S_SECS+=("$3"); S_NOTE+=("$4")
  printf '%-4s %-8s %4ss  %s\n' "$2" "$1" "$3" "$4" | sed 's/^/[gpu_check] /'
}

# run_stage NAME CAP_SECONDS COMMAND...: runs COMMAND under timeout with its output in NAME.log.
# A stage's command may print 'GPU_CHECK_SKIP: why' to mean SKIP, and 'GPU_CHECK_NOTE: text' for
# the summary line; exit 0 is PASS, 124/137 is FAIL (timeout), anything else FAIL.
run_stage() {
  local name=$1 cap=$2; shift 2
  local log="$LOGDIR/$name.log" t0=$SECONDS to rc note result
  if ((SECONDS - START >= BUDGET)); then
    record "$name" SKIP 0 "overall budget of ${BUDGET}s spent"; return 0
  fi
  to=$(stage_timeout "$cap")
  echo "[gpu_check] ==== $name (timeout ${to}s) ===="
  timeout -k 10 "$to" "$@" >"$log" 2>&1
  rc=$?
  note=$(grep -a '^GPU_CHECK_NOTE:' "$log" | tail -1 | sed 's/^GPU_CHECK_NOTE: *//')
  if grep -aq '^GPU_CHECK_SKIP:' "$log" && ((rc == 0)); then
    result=SKIP; note=$(grep -a '^GPU_CHECK_SKIP:' "$log" | tail -1 | sed 's/^GPU_CHECK_SKIP: *//')
  elif ((rc == 0)); then
    result=PASS
  elif ((rc == 124 || rc == 137)); then
    result=FAIL; note="timeout after ${to}s; ${note}"
  else
    result=FAIL; note="exit $rc; ${note}"
  fi
  if [[ $result == FAIL ]]; then
    echo "[gpu_check] ---- last 25 lines of $name.log ----"
    tail -n 25 "$log" | cut -c1-200
  fi
  record "$name" "$result" $((SECONDS - t0)) "$note"
  [[ $result != FAIL ]]
}

# pytest's closing line ("3 passed, 1 skipped in 2.1s") as the stage note; exit 5 (none collected)
# becomes SKIP.
pytest_stage() {
  local what=$1; shift
  "$PY" -m pytest -q -p no:cacheprovider --timeout 120 -ra "$@"
  local rc=$?
  local last
  last=$(tail -n 1 "$LOGDIR/$what.log" 2>/dev/null | sed 's/^=* *//; s/ *=*$//')
  if ((rc == 5)); then
    echo "GPU_CHECK_SKIP: no tests collected ($*): ${last}"; return 0
  fi
  echo "GPU_CHECK_NOTE: ${last}"
  return $rc
}

# ---- env -----------------------------------------------------------------------------------------
stage_env() {
  echo "## date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $(nproc)"
  echo "## uname: $(uname -a)"
  echo "## nvidia-smi"
  nvidia-smi || echo "nvidia-smi failed (rc $?)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  echo "## python: $(command -v "$BASE_PY") $("$BASE_PY" --version 2>&1)"
  echo "## nvcc: $(command -v nvcc || echo 'not on PATH')"
  nvcc --version 2>&1 | tail -2 || true
  echo "## CUDA_HOME=${CUDA_HOME:-<unset>}; toolkits: $(ls -d /usr/local/cuda* 2>/dev/null | tr '\n' ' ')"
  echo "## toolkit root found from nvcc: $(PY=$BASE_PY find_cuda_home || echo none)"
  "$BASE_PY" - <<'EOF'
import sys
import torch
from torch.utils import cpp_extension
print("torch", torch.__version__, "cuda", torch.version.cuda, "file", torch.__file__)
print("torch.cuda.is_available()", torch.cuda.is_available())
print("cpp_extension.CUDA_HOME", cpp_extension.CUDA_HOME)
ok = torch.cuda.is_available()
if ok:
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    note = f"torch {torch.__version__} (CUDA {torch.version.cuda}), {p.name} cc {p.major}.{p.minor}"
else:
    note = f"torch {torch.__version__} (CUDA {torch.version.cuda}): NO GPU VISIBLE"
print("GPU_CHECK_NOTE:", note)
import os
if not ok and os.environ.get("GPU_CHECK_ALLOW_NO_GPU") == "1":
    print("GPU_CHECK_SKIP: no GPU visible; GPU_CHECK_ALLOW_NO_GPU=1 (dry run): going on")
    sys.exit(0)
sys.exit(0 if ok else 3)
EOF
}

# ---- venv ----------------------------------------------------------------------------------------
# A venv made from a python that is itself a venv (the GPU image's python3 is /opt/torch/.venv)
# sees only the *base* interpreter's site-packages with --system-site-packages, not the parent
# venv's torch. A .pth naming the parent's site-packages fixes that (appended after the venv's own,
# so what we install still wins).
stage_venv() {
  rm -rf "$VENV"
  "$BASE_PY" -m venv --system-site-packages "$VENV" 2>/dev/null \
    || "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
  local own parent
  own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  parent=$("$BASE_PY" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() if sys.prefix != sys.base_prefix))')
  if [[ -n $parent ]]; then
    printf '%s\n' "$parent" > "$own/_pagewire_parent_site.pth"
    echo "parent venv site-packages added via $own/_pagewire_parent_site.pth:"; echo "$parent"
  fi
  "$VENV/bin/python" -c 'import torch; print("venv sees torch", torch.__version__, torch.__file__)' || return 1
  if [[ ! -d $WHEELS ]] || ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "no wheels in $WHEELS: was bench/out/wheels carried? (bash bench/gpu_check.sh --fetch-wheels here first)"
    echo "trying with what the machine already has"
  fi
  local -a reqs
  mapfile -t reqs < <("$VENV/bin/python" - <<'EOF'
import tomllib  # Python >= 3.11
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in list(p["dependencies"]) + [r for e in p.get("optional-dependencies", {}).values() for r in e]:
    if not r.lower().startswith("torch"):
        print(r)
EOF
  )
  echo "installing (no index) from $WHEELS: ${reqs[*]}"
  # --no-deps is NOT used: pip resolves against the machine's packages and takes what is missing
  # (or too old) from the wheel folder.
  "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir --no-index --no-compile \
      --find-links "$WHEELS" "${reqs[@]}" || return 1
  "$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
    | grep -iE '^(torch|transformers|tokenizers|safetensors|pytest|pybind11|ninja|numpy|setuptools) ' || true
  local n
  n=$("$VENV/bin/python" -m pip list --disable-pip-version-check --path "$own" --format freeze 2>/dev/null | grep -vc '^pip==')
  echo "GPU_CHECK_NOTE: $n packages installed into the venv from $WHEELS; torch from the machine"
}

# The CUDA toolkit root: $CUDA_HOME, else the first real nvcc among PATH, /usr/local/cuda*,
# torch's nvidia wheels; links and `exec .../bin/nvcc` wrapper scripts are followed (torch alone
# takes dirname(dirname(which nvcc)), which is wrong for a wrapper in /usr/local/bin).
find_cuda_home() {
  if [[ -n ${CUDA_HOME:-} ]]; then echo "$CUDA_HOME"; return 0; fi
  local cand real i site
  site=$("$PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
  for cand in "$(command -v nvcc)" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc "$site"/nvidia/cu*/bin/nvcc \
              "$site"/nvidia/cuda_nvcc/bin/nvcc; do
    [[ -n $cand && -e $cand ]] || continue
    for i in 1 2 3 4; do
      real=$(readlink -f "$cand")
      if head -c 4 "$real" | grep -q $'\x7fELF'; then echo "${real%/bin/nvcc}"; return 0; fi
      cand=$(grep -aoE '/[^ "'"'"']*/bin/nvcc' "$real" | grep -v "^$real\$" | head -1)
      [[ -n $cand ]] || break
    done
  done
  return 1
}

# ---- build ---------------------------------------------------------------------------------------
stage_build() {
  local home
  home=$(find_cuda_home) && export CUDA_HOME="$home"
  echo "CUDA_HOME=${CUDA_HOME:-<not found: torch guesses>} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
  [[ -n ${CUDA_HOME:-} ]] && "$CUDA_HOME/bin/nvcc" --version | tail -2
  # ATen/cuda/CUDAContext.h includes cublas_v2.h & co.; a toolkit made of pip wheels may lack them,
  # torch's nvidia-* wheels have them (cpp_extension adds CUDA_INC_PATH to the include path).
  if [[ -n ${CUDA_HOME:-} && ! -e $CUDA_HOME/include/cublas_v2.h && -z ${CUDA_INC_PATH:-} ]]; then
    local site d
    site=$("$PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    for d in "$site"/nvidia/cu*/include "$site"/nvidia/cublas/include; do
      if [[ -e $d/cublas_v2.h ]]; then export CUDA_INC_PATH="$d"; echo "CUDA_INC_PATH=$d (toolkit has no cublas_v2.h)"; break; fi
    done
  fi
  export PATH="$VENV/bin:${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
  rm -f server/_C*.so
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else "torch has no CUDA: the build would be CPU-only")' || return 1
  "$PY" setup.py build_ext --inplace || return 1
  ls -la server/_C*.so
  local cu
  cu=$(find csrc/cuda -maxdepth 2 \( -name '*.cu' -o -name '*.cpp' \) 2>/dev/null | wc -l)
  echo "GPU_CHECK_NOTE: built $(basename server/_C*.so) with CUDA ($cu source files in csrc/cuda)"
}

# ---- ops: which ops have a CUDA kernel; compare each such op against its CPU kernel once --------
stage_ops() {
  "$PY" - <<'EOF'
import sys
import torch

import server._C  # noqa: F401
from server.kernels import ops

names = ["write_kv_cache", "paged_attention", "copy_blocks"]
has = {n: torch._C._dispatch_has_kernel_for_dispatch_key(f"pagewire::{n}", "CUDA") for n in names}
for n in names:
    print(f"pagewire::{n}: CUDA kernel {'registered' if has[n] else 'MISSING'}")
if not torch.cuda.is_available():
    print("GPU_CHECK_SKIP: no GPU visible (dry run): CUDA kernels registered for " + (", ".join(n for n in names if has[n]) or "no op"))
    sys.exit(0)
if not any(has.values()):
    print("GPU_CHECK_SKIP: no pagewire op has a CUDA kernel yet (csrc/cuda registers none)")
    sys.exit(0)

torch.manual_seed(0)
dev = torch.device("cuda")
failures = []
NB, KVH, BS, D, H = 16, 2, 16, 128, 8


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# GPU vs CPU kernel: about twice the tests' tolerances against float64 (tests/kernels/paged_reference.py).
for dtype, tol in [(torch.float32, 5e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)]:
    kc = torch.randn(NB, KVH, BS, D, dtype=dtype)
    vc = torch.randn(NB, KVH, BS, D, dtype=dtype)
    if has["write_kv_cache"]:
        T = 20
        k, v = torch.randn(T, KVH, D, dtype=dtype), torch.randn(T, KVH, D, dtype=dtype)
        slots = torch.randperm(NB * BS)[:T].to(torch.int64)
        slots[3] = -1
        kc_c, vc_c, kc_g, vc_g = kc.clone(), vc.clone(), kc.clone().to(dev), vc.clone().to(dev)
        ops.write_kv_cache(k, v, kc_c, vc_c, slots)
        ops.write_kv_cache(k.to(dev), v.to(dev), kc_g, vc_g, slots.to(dev))
        torch.cuda.synchronize()
        ok = torch.equal(kc_c, kc_g.cpu()) and torch.equal(vc_c, vc_g.cpu())
        print(f"write_kv_cache {dtype}: {'ok' if ok else 'MISMATCH'}")
        ok or failures.append(f"write_kv_cache {dtype}")
    if has["paged_attention"]:
        # Two sequences: a decode at context 37 and a 9-token prefill chunk on top of context 20.
        specs = [(37, 1), (20, 9)]
        seq_lens = torch.tensor([c + q for c, q in specs], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 10], dtype=torch.int32)
        max_blocks = (int(seq_lens.max()) + BS - 1) // BS
        bt = torch.randperm(NB)[: 2 * max_blocks].to(torch.int32).view(2, max_blocks)
        q = torch.randn(10, H, D, dtype=dtype)
        for window in (0, 8):
            out_c = torch.full_like(q, float("nan"))
            ops.paged_attention(out_c, q, kc, vc, bt, seq_lens, qsl, D ** -0.5, window, 9, int(seq_lens.max()))
            out_g = torch.full_like(q, float("nan")).to(dev)
            ops.paged_attention(out_g, q.to(dev), kc.to(dev), vc.to(dev), bt.to(dev), seq_lens.to(dev),
                                qsl.to(dev), D ** -0.5, window, 9, int(seq_lens.max()))
            torch.cuda.synchronize()
            err = rel(out_g, out_c)
            ok = err <= tol and not torch.isnan(out_g).any().item()
            print(f"paged_attention {dtype} window={window}: rel err vs CPU {err:.2e} (tol {tol}) {'ok' if ok else 'MISMATCH'}")
            ok or failures.append(f"paged_attention {dtype} w{window}")
    if has["copy_blocks"]:
        mapping = torch.tensor([[0, 5], [3, 9], [7, 1]], dtype=torch.int64)
        kcs_c, vcs_c = [kc.clone() for _ in range(2)], [vc.clone() for _ in range(2)]
        kcs_g, vcs_g = [t.to(dev) for t in kcs_c], [t.to(dev) for t in vcs_c]
        ops.copy_blocks(kcs_c, vcs_c, mapping)
        ops.copy_blocks(kcs_g, vcs_g, mapping.to(dev))
        torch.cuda.synchronize()
        ok = all(torch.equal(a, b.cpu()) for a, b in zip(kcs_c + vcs_c, kcs_g + vcs_g))
        print(f"copy_blocks {dtype}: {'ok' if ok else 'MISMATCH'}")
        ok or failures.append(f"copy_blocks {dtype}")

reg = ", ".join(n for n in names if has[n]) or "none"
print(f"GPU_CHECK_NOTE: CUDA kernels: {reg}; smoke vs CPU: {'FAILED ' + ', '.join(failures) if failures else 'all match'}")
sys.exit(1 if failures else 0)
EOF
}

# ---- bench: only scripts that take --device ------------------------------------------------------
stage_bench() {
  local ran=0 skipped=() rc=0
  if "$PY" bench/offline_throughput.py --help 2>/dev/null | grep -q -- '--device'; then
    echo "## bench/offline_throughput.py --device cuda"
    # shellcheck disable=SC2086
    "$PY" bench/offline_throughput.py --device cuda --shape llama-246m --dtype bfloat16 --num-seqs 64 \
        --json-out /tmp/pagewire-bench-offline.json ${GPU_CHECK_BENCH_ARGS:-} || rc=1
    # The device tool returns at most 8 files from $OUT: the JSON goes into bench.log, not a file.
    echo "## bench_offline.json"; cat /tmp/pagewire-bench-offline.json 2>/dev/null
    ran=$((ran + 1))
  else
    skipped+=("bench/offline_throughput.py has no --device flag")
  fi
  if "$PY" -m bench.kernels --help 2>/dev/null | grep -q -- '--device'; then
    for what in attention linear; do
      echo "## bench.kernels $what --device cuda"
      "$PY" -m bench.kernels "$what" --dtype bfloat16 --device cuda || rc=1
    done
    ran=$((ran + 1))
  else
    skipped+=("bench/kernels.py has no --device flag")
  fi
  if ((ran == 0)); then
    echo "GPU_CHECK_SKIP: no GPU benchmark yet ($(printf '%s; ' "${skipped[@]}" | sed 's/; $//'))"
    return 0
  fi
  echo "GPU_CHECK_NOTE: $ran GPU bench script(s) ran; results in bench.log${skipped:+; skipped: ${skipped[*]}}"
  return $rc
}

# Stages run as functions in a child bash so `timeout` can bound them.
export -f find_cuda_home stage_env stage_venv stage_build stage_ops stage_bench pytest_stage
export ROOT WHEELS BASE_PY VENV LOGDIR

echo "[gpu_check] pagewire GPU check: stages '$STAGES', budget ${BUDGET}s, logs in $LOGDIR"
echo "[gpu_check] git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed/untracked paths"

failed_env=0
if want env; then
  run_stage env 60 bash -c stage_env || failed_env=1
  grep -aE '^(## python|## nvcc|Cuda compilation tools|## toolkit root|torch |device 0|name, memory|NVIDIA|## CUDA_HOME)' \
    "$LOGDIR/env.log" | grep -v '^NVIDIA-SMI' | cut -c1-160 | sed 's/^/[gpu_check]   /'
fi
if ((failed_env)); then
  echo "[gpu_check] no usable GPU/torch: later stages would only fail"
else
  if want venv; then
    if run_stage venv 150 bash -c stage_venv; then PY="$VENV/bin/python"; else PY="$BASE_PY"; fi
  fi
  export PY
  build_ok=1
  if want build; then run_stage build 300 bash -c stage_build || build_ok=0; fi
  if ((build_ok)); then
    want ops && run_stage ops 90 bash -c stage_ops
    want cuda && run_stage cuda 150 bash -c 'pytest_stage cuda -m cuda tests --ignore=tests/kernels'
    want kernels && run_stage kernels 150 bash -c 'pytest_stage kernels -m cuda tests/kernels'
    want bench && run_stage bench 150 bash -c stage_bench
  else
    for s in ops cuda kernels bench; do want $s && record $s SKIP 0 "build failed"; done
  fi
fi

# ---- summary -------------------------------------------------------------------------------------
{
  echo "==================== pagewire gpu_check summary ($((SECONDS - START)) s) ===================="
  printf '%-8s %-5s %6s  %s\n' STAGE RESULT SECS NOTE
  for i in "${!S_NAME[@]}"; do
    printf '%-8s %-5s %6s  %s\n' "${S_NAME[$i]}" "${S_RESULT[$i]}" "${S_SECS[$i]}" "${S_NOTE[$i]}"
  done
  nfail=0
  for r in "${S_RESULT[@]}"; do [[ $r == FAIL ]] && nfail=$((nfail + 1)); done
  echo "overall: $([[ $nfail == 0 ]] && echo PASS || echo "FAIL ($nfail stage(s))"); logs: $LOGDIR"
} | tee "$SUMMARY"
grep -q '^overall: PASS' "$SUMMARY"
