// server._C.fast: the CPU ops a decode step calls from Python, as plain pybind11 functions beside
// their torch.ops.pagewire registrations (ops_registration.cpp), and the DecodeStack's run.
//
// Why: a call through torch.ops goes through the dispatcher (the schema's argument parsing, boxing,
// dispatch keys), a lot of code; right after a decode step's weights had streamed through the
// caches it took 24-37 us, against 3 us hot, where a pybind11 call took 4 us (bench/RESULTS.md,
// session 34). A small model's step makes about seven such calls outside its DecodeStack (the
// embedding rows, the stack, the final norm, the lm_head, the logits' widening, the argmax).
//
// Each function is the op's CPU implementation itself, so the same code, checks and results;
// server/kernels/ops.py calls these for CPU tensors and torch.ops for any other device (and
// torch.library.opcheck, torch.compile and the fake kernels keep the registered ops). A c10::Error
// raised here reaches Python as the op's would: torch's exception translators are shared with
// this module (one pybind11 ABI), so IndexError stays IndexError.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "ops.h"

namespace pagewire {
// cpu/embedding_gguf.cpp (declared in ops_registration.cpp too: ops.h is every kernel file's)
at::Tensor embedding_gguf_cpu(const at::Tensor& ids, const at::Tensor& weight, c10::string_view qtype,
                              at::ScalarType dtype);

void bind_fast_calls(pybind11::module_& m) {
  namespace py = pybind11;
  py::module_ f = m.def_submodule(
      "fast", "The per-step CPU ops as plain pybind11 calls (csrc/fast_calls.cpp): the torch.ops.pagewire "
              "ops' CPU implementations without the dispatcher.");
  f.def("rms_norm", [](const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_cpu(x, weight, eps); });
  f.def("add_rms_norm", [](at::Tensor residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
    return add_rms_norm_cpu(residual, delta, weight, eps);
  });
  f.def("argmax_rows", [](const at::Tensor& x) { return argmax_rows_cpu(x); });
  // The greedy step's tokens as a list of ints: argmax_rows where it applies (no index tensor, no
  // tolist), torch.argmax over the last dim for anything else (another device, fp16, no columns:
  // its error then). The engine's checks and tolist around the op cost 20 us a step cold.
  f.def("argmax_list", [](const at::Tensor& x) {
    if (argmax_rows_applies(x)) {
      std::vector<int64_t> idx(static_cast<size_t>(x.size(0)));
      argmax_rows_into(x, idx.data());
      return py::cast(idx);
    }
    const at::Tensor idx = x.argmax(-1).to(at::kCPU).contiguous();
    const int64_t* ip = idx.data_ptr<int64_t>();
    return py::cast(std::vector<int64_t>(ip, ip + idx.numel()));
  });
  f.def("widen_rows", [](const at::Tensor& x) { return widen_rows_cpu(x); });
  f.def("embedding_gguf", [](const at::Tensor& ids, const at::Tensor& weight, const std::string& qtype,
                             py::object dtype) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "embedding_gguf: dtype must be a torch.dtype");
    return embedding_gguf_cpu(ids, weight, qtype, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
  });
  f.def("linear_q4", [](const at::Tensor& x, const at::Tensor& weight, const std::string& qtype,
                        const c10::optional<at::Tensor>& bias) { return linear_q4_cpu(x, weight, qtype, bias); });
  f.def("linear_q8_0", [](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          bool interleaved) { return linear_q8_0_cpu(x, weight, bias, interleaved); });
  // The integer kernel at every row count, in blocks of 16 rows into one output (ops.h): what the
  // Python loop of 16-row calls and its torch.cat did, without the copies, a call and a parallel
  // region per block (SmolLM2's 1024-token prefill 1.07-1.31x faster on a Zen 3, bench/RESULTS.md).
  f.def("linear_q4_rows", [](const at::Tensor& x, const at::Tensor& weight, const std::string& qtype,
                             const c10::optional<at::Tensor>& bias) { return linear_q4_rows_cpu(x, weight, qtype, bias); });
  f.def("linear_q8_0_rows", [](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               bool interleaved) { return linear_q8_0_rows_cpu(x, weight, bias, interleaved); });
  f.def("linear_bf16x8", [](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    return linear_bf16x8_cpu(x, weight, bias);
  });
  f.def("linear_bf16z", [](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    return linear_bf16z_cpu(x, weight, bias);
  });
}

}  // namespace pagewire
