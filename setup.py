"""Build the server._C extension: CPU kernels always, CUDA kernels when torch has CUDA.

Sources:
  csrc/*.cpp            op schemas (TORCH_LIBRARY) and the pybind11 module
  csrc/allocator/*.cpp  the KV block allocator (plain C++, no torch headers)
  csrc/cpu/*.cpp        CPU kernels (ATen only, never torch/extension.h: it costs ~50 s/file)
  csrc/cuda/*.cu        CUDA kernels, compiled only when torch.version.cuda is set
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


# No -std flag: torch picks its own standard (C++17 up to 2.12, C++20 from 2.13), and its
# headers need it.
cxx_flags = ["-O3", "-fopenmp", "-DNDEBUG", "-Wno-unused-parameter"]
sources = _sources("csrc/*.cpp") + _sources("csrc/allocator/*.cpp") + _sources("csrc/cpu/*.cpp")

# `import server._C` must work before (or without) `import torch`: the loader finds libc10 and
# libtorch_cpu through the RUNPATH, first next to an installed package (site-packages/torch/lib),
# then in the torch this was built against. torch/lib also ships the libgomp that libtorch uses,
# so both import orders load one OpenMP runtime.
torch_lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
link_flags = ["-fopenmp", "-Wl,-rpath,$ORIGIN/../torch/lib", f"-Wl,-rpath,{torch_lib}"]

with_cuda = torch.version.cuda is not None and os.environ.get("PAGEWIRE_NO_CUDA", "0") != "1"
if with_cuda:
    cuda_sources = _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp")
    ext = CUDAExtension(
        "server._C",
        sources + cuda_sources,
        define_macros=[("PAGEWIRE_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension(
        "server._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )

# `make` installs the package metadata with PAGEWIRE_SKIP_EXT=1 and then builds the extension
# in place (build_ext --inplace), so ninja's objects persist in build/ and rebuilds are incremental.
skip_ext = os.environ.get("PAGEWIRE_SKIP_EXT", "0") == "1"

setup(
    ext_modules=[] if skip_ext else [ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
