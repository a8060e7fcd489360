// The Python module server._C. Importing it also loads the TORCH_LIBRARY(pagewire, ...) op
// registrations compiled into the same shared object (see ops_registration.cpp).
#include <pybind11/pybind11.h>

#include "allocator/bindings.h"
#include "cpu/cpu_features.h"
#include "cpu/crew.h"
#include "cpu/dispatch_mode.h"
#include "cpu/small_blocks.h"

namespace py = pybind11;

namespace pagewire {
void bind_fast_calls(py::module_& m);   // fast_calls.cpp
void bind_decode_stack(py::module_& m);  // cpu/decode_stack.cpp
}  // namespace pagewire

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagewire native extension: paged-attention ops (torch.ops.pagewire.*) and the KV block allocator";
  pagewire::bind_allocator(m);
  pagewire::bind_fast_calls(m);
  pagewire::bind_decode_stack(m);
  m.def(
      "cpu_features",
      [] {
        const pagewire::cpu::CpuFeatures& f = pagewire::cpu::cpu_features();
        py::dict d;
        d["vendor"] = f.vendor;
        d["brand"] = f.brand;
        d["family"] = f.family;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512bf16"] = f.avx512bf16;
        d["avx512vnni"] = f.avx512vnni;
        d["avxvnni"] = f.avxvnni;
        d["amx_tile"] = f.amx_tile;
        d["amx_bf16"] = f.amx_bf16;
        d["amx_int8"] = f.amx_int8;
        d["os_avx"] = f.os_avx;
        d["os_avx512"] = f.os_avx512;
        d["os_amx"] = f.os_amx;
        return d;
      },
      "CPUID/XGETBV features of this CPU (instruction sets usable by this process).");
  m.def(
      "set_batch_invariant", [](bool on) { pagewire::cpu::batch_invariant_mode = on; },
      "Batch-invariant kernel choices on the calling thread (server.kernels.batch_invariant.mode).");
  m.def(
      "set_amx_allowed", [](bool on) { pagewire::cpu::amx_allowed = on; },
      "Whether the linear ops may use the AMX kernels on the calling thread (the autotune's choice).");
  m.def(
      "amx_allowed", [] { return pagewire::cpu::amx_allowed; },
      "Whether the linear ops may use the AMX kernels on the calling thread.");
  m.def(
      "batch_invariant", [] { return pagewire::cpu::batch_invariant_mode; },
      "Whether the C++ ops make batch-invariant kernel choices on the calling thread.");
  m.def(
      "cpu_isa", [] { return std::string(pagewire::cpu::isa_name(pagewire::cpu::active_isa())); },
      "Kernel family the CPU ops use now: the detected one, capped by $PAGEWIRE_CPU_ISA.");
  m.def(
      "core_handoff_ns", [](int threads, int tries) { return pagewire::cpu::team_handoff_ns(threads, tries); },
      py::arg("threads") = 0, py::arg("tries") = 5,
      "How far apart a team's cores sit: the shortest empty handoff to every other thread and back, in ns "
      "(cpu/crew.h team_handoff_ns; -1 with fewer than two threads).");
  m.def(
      "set_small_blocks", [](bool on) { pagewire::cpu::set_small_blocks(on); },
      "Install (True) or remove (False) the small-block cache as torch's CPU allocator (cpu/small_blocks.h).");
  m.def(
      "small_block_stats",
      [] {
        const pagewire::cpu::SmallBlockStats s = pagewire::cpu::small_block_stats();
        py::dict d;
        d["enabled"] = s.enabled;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["cached_bytes"] = s.cached_bytes;
        return d;
      },
      "The small-block cache: whether installed, hits and misses (all threads), bytes cached on this thread.");
  m.def(
      "release_small_blocks", [] { pagewire::cpu::release_small_blocks(); },
      "Return the calling thread's cached small blocks to the C library.");
  m.def(
      "detected_cpu_isa", [] { return std::string(pagewire::cpu::isa_name(pagewire::cpu::detected_isa())); },
      "Best kernel family this CPU supports: avx512bf16, avx2 or portable.");
}
