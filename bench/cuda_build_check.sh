#!/usr/bin/env bash
# bench/cuda_build_check.sh: compile the CUDA build of server._C on a machine WITHOUT a GPU, so that
# compile and link errors in csrc/cuda/ (and in setup.py's CUDA path) show up before GPU time is spent.
#
#   bash bench/cuda_build_check.sh            # set up the venv if needed, copy, build, verify
#   bash bench/cuda_build_check.sh --probe    # also compile a probe .cu (torch CUDA headers, bf16,
#                                             # AT_DISPATCH) in the copy: checks the toolchain itself
#   bash bench/cuda_build_check.sh --setup-only   # only create the venv (long: ~5.5 GB of wheels)
#   bash bench/cuda_build_check.sh --ignore-cuda-version   # see "CUDA versions" below
#
# What it does (never touches the repo's .venv, build/ or server/_C*.so):
#   1. finds the CUDA toolkit root: $CUDA_HOME, else the nvcc on PATH followed through symlinks and
#      `exec .../bin/nvcc` wrapper scripts (here /usr/local/bin/nvcc is such a wrapper of
#      /usr/local/cuda-13.0/bin/nvcc; torch alone would guess CUDA_HOME=/usr/local, which is wrong);
#   2. makes $CUDA_VENV (default /work/cuda-venv, outside the repo) with $CUDA_TORCH (default
#      torch==2.14.1, a cu130 build) + pybind11 ninja setuptools wheel numpy, installed by a nohup'd
#      pip in the background that this script polls (a rerun while it is going only polls);
#   3. copies csrc/ setup.py server/ pyproject.toml README.md to $CUDA_BUILD_DIR (default
#      /tmp/pagewire-cuda-build; its build/ is kept, so reruns are incremental);
#   4. builds there: CUDA_HOME=<root> TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=1 setup.py build_ext --inplace;
#   5. verifies the .so: links libc10_cuda/cudart, holds sm_90 code when csrc/cuda has sources, loads
#      under the CUDA torch (no GPU needed to load), and lists the ops with a CUDA kernel registered;
#   6. on failure prints the compiler's error lines (and ninja's FAILED lines) and exits 1.
#
# CUDA versions: torch's cpp_extension compares nvcc's release with torch.version.cuda. A different
# minor version only warns; a different MAJOR version raises RuntimeError ("The detected CUDA
# version ... mismatches the version that was used to compile PyTorch") and no environment variable
# turns that off (TORCH_DONT_CHECK_COMPILER_ABI only skips the gcc-version check). The fix is a torch
# built for the toolkit's major version (torch 2.14.1 from the local wheel store is +cu130, matching
# nvcc 13.0 here); --ignore-cuda-version runs setup.py with that check patched out, for a compile-only
# check across majors (the .so then won't match the torch runtime: don't ship it).
# C++ standard: torch 2.14's headers use C++20 (std::strong_ordering, string_view::starts_with,
# `requires`). setup.py passes no -std flag, so cpp_extension picks torch's own default for both
# compilers (C++20 from torch 2.13 on).
# Headers: this toolkit (nvcc, cudart, cccl, crt) has no cuBLAS/cuSPARSE/cuSOLVER headers, which
# ATen/cuda/CUDAContext.h includes; torch's own nvidia-* wheels have them in
# site-packages/nvidia/cu13/include, which this script passes as CUDA_INC_PATH (cpp_extension adds
# it to the include path). On the GPU machine the image's full toolkit has them.
#
# Environment: CUDA_HOME, CUDA_VENV, CUDA_VENV_PYTHON (python3.11: the local torch wheel is cp311),
# CUDA_TORCH, CUDA_BUILD_DIR, CUDA_BUILD_LOGDIR (default $CUDA_BUILD_DIR.logs), MAX_JOBS (1),
# TORCH_CUDA_ARCH_LIST (9.0), CUDA_VENV_WAIT (s to wait for the venv install, default 1500).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_VENV="${CUDA_VENV:-/work/cuda-venv}"
CUDA_TORCH="${CUDA_TORCH:-torch==2.14.1}"
BUILD_DIR="${CUDA_BUILD_DIR:-/tmp/pagewire-cuda-build}"
LOGDIR="${CUDA_BUILD_LOGDIR:-$BUILD_DIR.logs}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-1}"
PROBE=0 SETUP_ONLY=0 IGNORE_CUDA_VERSION=0
for a in "$@"; do
  case "$a" in
    --probe) PROBE=1 ;;
    --setup-only) SETUP_ONLY=1 ;;
    --ignore-cuda-version) IGNORE_CUDA_VERSION=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $a (see --help)"; exit 2 ;;
  esac
done
mkdir -p "$LOGDIR"
T_START=$SECONDS
declare -a STEP_NAMES STEP_SECS
step_done() { STEP_NAMES+=("$1"); STEP_SECS+=("$2"); echo "[cuda_build_check] $1: $2 s"; }
say() { echo "[cuda_build_check] $*"; }
timings() {
  local i
  for i in "${!STEP_NAMES[@]}"; do printf '  %-10s %5s s\n' "${STEP_NAMES[$i]}" "${STEP_SECS[$i]}"; done
  printf '  %-10s %5s s\n' total $((SECONDS - T_START))
}

# ---- 1. the toolkit root -------------------------------------------------------------------------
find_cuda_home() {
  local nvcc real i
  if [[ -n ${CUDA_HOME:-} ]]; then nvcc="$CUDA_HOME/bin/nvcc"; else nvcc=$(command -v nvcc || true); fi
  [[ -n $nvcc && -e $nvcc ]] || { say "no nvcc (set CUDA_HOME or put nvcc on PATH)"; return 1; }
  for i in 1 2 3 4; do
    real=$(readlink -f "$nvcc")
    if head -c 4 "$real" | grep -q $'\x7fELF'; then
      echo "${real%/bin/nvcc}"; return 0
    fi
    # A wrapper script: take the first absolute path to a bin/nvcc it names.
    nvcc=$(grep -aoE '/[^ "'"'"']*/bin/nvcc' "$real" | grep -v "^$real\$" | head -1)
    [[ -n $nvcc ]] || { say "$real is neither nvcc nor a wrapper naming one"; return 1; }
  done
  say "gave up following nvcc wrappers"; return 1
}
CUDA_ROOT=$(find_cuda_home) || exit 1
export CUDA_HOME="$CUDA_ROOT"
NVCC_RELEASE=$("$CUDA_HOME/bin/nvcc" --version | grep -oE 'release [0-9]+\.[0-9]+' | cut -d' ' -f2)
say "CUDA toolkit root: $CUDA_HOME (nvcc $NVCC_RELEASE); gcc $(gcc -dumpfullversion)"

# ---- 2. the CUDA torch venv ----------------------------------------------------------------------
venv_ok() {
  [[ -x $CUDA_VENV/bin/python ]] && "$CUDA_VENV/bin/python" - "$CUDA_TORCH" <<'EOF' 2>/dev/null
import sys
import torch, pybind11, ninja, setuptools  # noqa: F401
want = sys.argv[1].split("==")[-1]
sys.exit(0 if torch.__version__.split("+")[0] == want and torch.version.cuda else 1)
EOF
}
setup_venv() {
  local t0=$SECONDS pidfile="$LOGDIR/venv-install.pid" log="$LOGDIR/venv-install.log" pid
  if venv_ok; then say "venv $CUDA_VENV ready"; step_done venv $((SECONDS - t0)); return 0; fi
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    say "venv install already running (pid $pid, log $log): polling"
  else
    local vpy="${CUDA_VENV_PYTHON:-$(command -v python3.11 || command -v python3)}"
    say "creating $CUDA_VENV with $vpy and pip install $CUDA_TORCH (several minutes; log $log)"
    rm -rf "$CUDA_VENV"
    nohup bash -c "'$vpy' -m venv '$CUDA_VENV' && '$CUDA_VENV/bin/pip' install --no-cache-dir --disable-pip-version-check \
        '$CUDA_TORCH' pybind11 ninja setuptools wheel numpy; echo \"INSTALL_EXIT=\$?\"" >"$log" 2>&1 &
    echo $! >"$pidfile"
    pid=$!
  fi
  local waited=0 limit="${CUDA_VENV_WAIT:-1500}"
  while kill -0 "$pid" 2>/dev/null; do
    sleep 20; waited=$((waited + 20))
    if ((waited % 60 == 0)); then say "  ... ${waited}s: $(tail -n 1 "$log" | cut -c1-150)"; fi
    if ((waited >= limit)); then say "venv install still running after ${limit}s (pid $pid); rerun later"; return 1; fi
  done
  rm -f "$pidfile"
  if ! venv_ok; then
    say "venv install FAILED; last lines of $log:"; tail -n 20 "$log"; return 1
  fi
  step_done venv $((SECONDS - t0))
}
setup_venv || exit 1
PY="$CUDA_VENV/bin/python"
read -r TORCH_VER TORCH_CUDA TORCH_SITE < <("$PY" -c 'import torch, os; print(torch.__version__, torch.version.cuda, os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
say "torch $TORCH_VER (built with CUDA $TORCH_CUDA) in $CUDA_VENV"
if [[ ${NVCC_RELEASE%%.*} != "${TORCH_CUDA%%.*}" ]]; then
  if ((IGNORE_CUDA_VERSION)); then
    say "WARNING: nvcc $NVCC_RELEASE vs torch CUDA $TORCH_CUDA: major versions differ; --ignore-cuda-version patches the check out"
  else
    say "FAIL: nvcc $NVCC_RELEASE vs torch CUDA $TORCH_CUDA: torch's cpp_extension refuses a different major version"
    say "      (no env var overrides it). Use a torch built for CUDA ${NVCC_RELEASE%%.*}, or --ignore-cuda-version (compile-only check)."
    exit 1
  fi
elif [[ $NVCC_RELEASE != "$TORCH_CUDA" ]]; then
  say "note: nvcc $NVCC_RELEASE vs torch CUDA $TORCH_CUDA: minor versions differ (cpp_extension only warns)"
fi
# cuBLAS & co. headers (ATen/cuda/CUDAContext.h needs them) from torch's nvidia wheels, if the toolkit lacks them.
if [[ ! -e $CUDA_HOME/include/cublas_v2.h ]]; then
  for d in "$TORCH_SITE"/nvidia/cu"${TORCH_CUDA%%.*}"/include "$TORCH_SITE"/nvidia/cublas/include; do
    if [[ -e $d/cublas_v2.h ]]; then export CUDA_INC_PATH="$d"; break; fi
  done
  say "toolkit has no cublas_v2.h: CUDA_INC_PATH=${CUDA_INC_PATH:-<none found: CUDAContext.h will not compile>}"
fi
((SETUP_ONLY)) && { timings; exit 0; }

# ---- 3. the copy ---------------------------------------------------------------------------------
exec 9>/tmp/pagewire-cuda-build.lock
flock 9   # one build of the copy at a time
t0=$SECONDS
mkdir -p "$BUILD_DIR"
for p in csrc server; do
  rm -rf "${BUILD_DIR:?}/$p"
  (cd "$ROOT" && tar -cf - --exclude='__pycache__' --exclude='*.so' --exclude='*.pyc' "$p") | (cd "$BUILD_DIR" && tar -xf -)
done
cp "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/README.md" "$BUILD_DIR/"
n_cu=$(find "$BUILD_DIR/csrc/cuda" -maxdepth 3 -type f \( -name '*.cu' -o -name '*.cpp' \) 2>/dev/null | wc -l)
say "copied csrc/ setup.py server/ to $BUILD_DIR; csrc/cuda has $n_cu source file(s):"
find "$BUILD_DIR/csrc/cuda" -maxdepth 3 -type f 2>/dev/null | sed "s|$BUILD_DIR/|    |"
if ((PROBE)); then
  mkdir -p "$BUILD_DIR/csrc/cuda"
  cat >"$BUILD_DIR/csrc/cuda/zz_build_probe.cu" <<'EOF'
// Written by bench/cuda_build_check.sh --probe into the temporary copy only (never the repo):
// compiles the headers and idioms a kernel file uses, so a toolchain problem shows without them.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace pagewire_probe {
template <typename T>
__global__ void scale_kernel(T* __restrict__ x, float s, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<T>(static_cast<float>(x[i]) * s);
}
void scale_(at::Tensor& x, double s) {
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "probe", [&] {
    scale_kernel<scalar_t><<<(n + 255) / 256, 256, 0, stream>>>(x.data_ptr<scalar_t>(), static_cast<float>(s), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace pagewire_probe
EOF
  say "probe: added csrc/cuda/zz_build_probe.cu to the copy"
  n_cu=$((n_cu + 1))
fi
rm -f "$BUILD_DIR"/server/_C*.so
step_done copy $((SECONDS - t0))

# ---- 4. build ------------------------------------------------------------------------------------
t0=$SECONDS
log="$LOGDIR/build.log"
say "building: CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS (log $log)"
if ((IGNORE_CUDA_VERSION)); then
  build_cmd=("$PY" -c 'import runpy, sys
import torch.utils.cpp_extension as ce
ce._check_cuda_version = lambda *a, **k: None  # --ignore-cuda-version
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")')
else
  build_cmd=("$PY" setup.py build_ext --inplace)
fi
(cd "$BUILD_DIR" && PATH="$CUDA_VENV/bin:$CUDA_HOME/bin:$PATH" nice -n 10 "${build_cmd[@]}") >"$log" 2>&1
rc=$?
step_done build $((SECONDS - t0))
if ((rc != 0)); then
  say "BUILD FAILED (exit $rc). ninja's failed commands:"
  grep -a '^FAILED:' "$log" | cut -c1-240 | head -20
  say "error lines (first 40, deduplicated):"
  grep -aE '(error|fatal)( [A-Z]*[0-9]+)?:|error: |undefined reference|nvcc fatal|RuntimeError|Error:' "$log" \
    | awk '!seen[$0]++' | head -40
  say "last 25 lines of $log:"; tail -n 25 "$log"
  say "timings:"; timings
  exit 1
fi

# ---- 5. verify -----------------------------------------------------------------------------------
t0=$SECONDS
so=$(ls "$BUILD_DIR"/server/_C*.so 2>/dev/null | head -1)
[[ -n $so ]] || { say "FAIL: build said ok but no server/_C*.so"; exit 1; }
say "built $so ($(du -h "$so" | cut -f1))"
needed=$(readelf -d "$so" | grep -oE 'lib(c10_cuda|torch_cuda|cudart)[^]]*' | sort -u | tr '\n' ' ')
say "links: ${needed:-none of c10_cuda/torch_cuda/cudart}"
verify_rc=0
[[ $needed == *c10_cuda* ]] || { say "FAIL: not linked to libc10_cuda: setup.py built the CPU-only extension"; verify_rc=1; }
if ((n_cu > 0)); then
  if readelf -S "$so" | grep -q '\.nv_fatbin'; then
    # cuobjdump is not in this toolkit: read the ELF arch of the embedded cubins instead.
    archs=$(objcopy -O binary --only-section=.nv_fatbin "$so" /dev/stdout 2>/dev/null | strings -a \
      | grep -oE '\bsm_[0-9]+a?\b' | sort -u | tr '\n' ' ')
    say "device code: .nv_fatbin present (arch strings: ${archs:-?})"
  else
    say "FAIL: csrc/cuda has sources but the .so has no .nv_fatbin section"; verify_rc=1
  fi
fi
(cd "$BUILD_DIR" && "$PY" - <<'EOF') 2>&1 | grep -v 'No CUDA runtime is found'
import torch
import server._C  # noqa: F401
names = ["write_kv_cache", "paged_attention", "copy_blocks"]
print("[cuda_build_check] loads under torch", torch.__version__, "(no GPU needed); CUDA kernels registered:",
      ", ".join(n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(f"pagewire::{n}", "CUDA")) or "none")
EOF
((${PIPESTATUS[0]} == 0)) || { say "FAIL: the built .so does not load"; verify_rc=1; }
step_done verify $((SECONDS - t0))
grep -aiE 'warning' "$log" | grep -v 'No CUDA runtime' | awk '!seen[$0]++' | head -10 | sed 's/^/  warning: /'
say "timings:"; timings
if ((verify_rc)); then say "RESULT: FAIL"; exit 1; fi
say "RESULT: PASS (CUDA build of server._C compiles, links and loads; $n_cu CUDA source file(s))"
