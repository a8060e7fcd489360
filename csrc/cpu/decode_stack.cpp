// DecodeStack (torch.classes.pagewire.DecodeStack): every decoder layer of a small CPU step in one
// call from Python. decode_layer (cpu/decode_layer.cpp) already runs a layer's ops in one call; what
// it still costs is the call itself: about 60 arguments parsed from Python through the dispatcher,
// plus the Python layer's own bytecode, 30 times a step on SmolLM2-135M, and meanwhile the second
// OpenMP thread waits (about 0.3-0.4 ms of a 3.4 ms step on an AMX Xeon; bench/RESULTS.md, session
// 21). A stack is built once per (row-count bucket, linear plan, KV cache list): each layer's
// static arguments (weights, norms, kinds, shapes, its KV cache pair, and a sparse layer's router
// and experts) are read from Python once, and run() takes only what changes per step (the residual
// stream, the RoPE rows, the step's attention metadata) and calls decode_layer_cpu and
// moe_decode_cpu in a C++ loop. The ops and their order are exactly the per-layer path's
// (DecoderLayer.forward_fused, SparseMoE._decode, DecoderLayer._leave), so the floats are the same
// bit for bit (tests/models/test_decode_stack.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "crew.h"
#include "quant4_kernel.h"

namespace pagewire {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// One layer's arguments to decode_layer_cpu that do not change between steps.
struct StackLayer {
  OptTensor attn_norm, attn_post_norm, mlp_norm, mlp_post_norm;
  double eps = 0, residual_multiplier = 1;
  at::Tensor qkv_weight;
  std::string qkv_kind;
  OptTensor qkv_bias, q_norm, k_norm;
  at::Tensor o_weight;
  std::string o_kind;
  OptTensor o_bias;
  at::Tensor gate_up_weight;
  std::string gate_up_kind;
  OptTensor gate_up_bias;
  at::Tensor down_weight;
  std::string down_kind;
  OptTensor down_bias;
  int64_t rope = -1;  // index into run()'s per-table RoPE rows; -1: a NoPE layer
  OptTensor cos, sin, qk_norm;
  at::Tensor key_cache, value_cache;
  double scale = 1;
  int64_t sliding_window = -1, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double softcap = 0;
  std::string activation;
  OptTensor v_norm;
  bool shares_kv = false, value_from_key = false;
  OptTensor layer_scalar, sinks;
  bool finishes = false;  // the layer adds its own output (layer scalar): no delta for the next
  // A sparse layer's MLP (moe_decode_cpu's arguments after x), present when moe is true.
  bool moe = false;
  at::Tensor router_weight;
  std::string router_kind;
  OptTensor router_bias;
  std::string router;
  int64_t top_k = 0;
  bool norm_topk_prob = false;
  at::Tensor experts_gate_up;
  std::string experts_gate_up_kind;
  at::Tensor experts_down;
  std::string experts_down_kind;
  OptTensor experts_gate_up_bias, experts_down_bias;
  std::string moe_activation;
  double alpha = 0, limit = 0;
  OptTensor shared_gate_up;
  std::string shared_gate_up_kind;
  OptTensor shared_down;
  std::string shared_down_kind;
  OptTensor shared_gate;
  std::string shared_gate_kind;
  OptTensor selection_bias;
  int64_t n_group = 1, topk_group = 1;
  double routed_scaling = 1;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  // Appends a layer; the arguments are decode_layer's static ones, in its order (ops.h), with the
  // RoPE table index (-1: none) in place of the per-step positions. Returns the layer's index.
  int64_t add_layer(OptTensor attn_norm, OptTensor attn_post_norm, OptTensor mlp_norm, OptTensor mlp_post_norm,
                    double eps, double residual_multiplier, at::Tensor qkv_weight, std::string qkv_kind,
                    OptTensor qkv_bias, OptTensor q_norm, OptTensor k_norm, at::Tensor o_weight, std::string o_kind,
                    OptTensor o_bias, at::Tensor gate_up_weight, std::string gate_up_kind, OptTensor gate_up_bias,
                    at::Tensor down_weight, std::string down_kind, OptTensor down_bias, int64_t rope, OptTensor cos,
                    OptTensor sin, OptTensor qk_norm, at::Tensor key_cache, at::Tensor value_cache, double scale,
                    int64_t sliding_window, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double softcap,
                    std::string activation, OptTensor v_norm, bool shares_kv, bool value_from_key,
                    OptTensor layer_scalar, OptTensor sinks) {
    TORCH_CHECK(rope >= -1, "DecodeStack.add_layer: rope must be a table index or -1, got ", rope);
    StackLayer l;
    l.attn_norm = std::move(attn_norm);
    l.attn_post_norm = std::move(attn_post_norm);
    l.mlp_norm = std::move(mlp_norm);
    l.mlp_post_norm = std::move(mlp_post_norm);
    l.eps = eps;
    l.residual_multiplier = residual_multiplier;
    l.qkv_weight = std::move(qkv_weight);
    l.qkv_kind = std::move(qkv_kind);
    l.qkv_bias = std::move(qkv_bias);
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.o_weight = std::move(o_weight);
    l.o_kind = std::move(o_kind);
    l.o_bias = std::move(o_bias);
    l.gate_up_weight = std::move(gate_up_weight);
    l.gate_up_kind = std::move(gate_up_kind);
    l.gate_up_bias = std::move(gate_up_bias);
    l.down_weight = std::move(down_weight);
    l.down_kind = std::move(down_kind);
    l.down_bias = std::move(down_bias);
    l.rope = rope;
    l.cos = std::move(cos);
    l.sin = std::move(sin);
    l.qk_norm = std::move(qk_norm);
    l.key_cache = std::move(key_cache);
    l.value_cache = std::move(value_cache);
    l.scale = scale;
    l.sliding_window = sliding_window;
    l.num_heads = num_heads;
    l.num_kv_heads = num_kv_heads;
    l.head_dim = head_dim;
    l.softcap = softcap;
    l.activation = std::move(activation);
    l.v_norm = std::move(v_norm);
    l.shares_kv = shares_kv;
    l.value_from_key = value_from_key;
    l.finishes = layer_scalar.has_value() && layer_scalar->defined();
    l.layer_scalar = std::move(layer_scalar);
    l.sinks = std::move(sinks);
    layers_.push_back(std::move(l));
    crew_ready_ = -1;
    plan_.clear();
    plan_off_.clear();
    return static_cast<int64_t>(layers_.size()) - 1;
  }

  // Makes the last layer added sparse: its MLP is moe_decode_cpu with these arguments (those of
  // SparseMoE._decode, in ops.h's order), post-normed and scaled as DecoderLayer._leave does.
  void set_moe(at::Tensor router_weight, std::string router_kind, OptTensor router_bias, std::string router,
               int64_t top_k, bool norm_topk_prob, at::Tensor gate_up, std::string gate_up_kind, at::Tensor down,
               std::string down_kind, OptTensor gate_up_bias, OptTensor down_bias, std::string activation,
               double alpha, double limit, OptTensor shared_gate_up, std::string shared_gate_up_kind,
               OptTensor shared_down, std::string shared_down_kind, OptTensor shared_gate,
               std::string shared_gate_kind, OptTensor selection_bias, int64_t n_group, int64_t topk_group,
               double routed_scaling) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.set_moe: add the layer first");
    StackLayer& l = layers_.back();
    TORCH_CHECK(!l.finishes, "DecodeStack.set_moe: a layer with a layer scalar has no sparse MLP here");
    l.moe = true;
    crew_ready_ = -1;
    plan_.clear();
    plan_off_.clear();
    l.gate_up_kind = "none";  // decode_layer stops at the MLP's input (its sparse-layer contract)
    l.router_weight = std::move(router_weight);
    l.router_kind = std::move(router_kind);
    l.router_bias = std::move(router_bias);
    l.router = std::move(router);
    l.top_k = top_k;
    l.norm_topk_prob = norm_topk_prob;
    l.experts_gate_up = std::move(gate_up);
    l.experts_gate_up_kind = std::move(gate_up_kind);
    l.experts_down = std::move(down);
    l.experts_down_kind = std::move(down_kind);
    l.experts_gate_up_bias = std::move(gate_up_bias);
    l.experts_down_bias = std::move(down_bias);
    l.moe_activation = std::move(activation);
    l.alpha = alpha;
    l.limit = limit;
    l.shared_gate_up = std::move(shared_gate_up);
    l.shared_gate_up_kind = std::move(shared_gate_up_kind);
    l.shared_down = std::move(shared_down);
    l.shared_down_kind = std::move(shared_down_kind);
    l.shared_gate = std::move(shared_gate);
    l.shared_gate_kind = std::move(shared_gate_kind);
    l.selection_bias = std::move(selection_bias);
    l.n_group = n_group;
    l.topk_group = topk_group;
    l.routed_scaling = routed_scaling;
  }

  // The model's final RMSNorm (weight [H]), which run() then applies after the last layer, on the
  // residual stream plus the last layer's output (add_rms_norm_cpu, or rms_norm_cpu when the last
  // layer left none), as the model's own norm / add_norm would: run() returns (the normed rows,
  // None). Inside the call the rows are still in this core's cache; as a call of its own after
  // the stack, that one-row norm took 20-23 us, with the caches cold after the layers' weights
  // (SmolLM2, bench/RESULTS.md session 35).
  void set_final_norm(at::Tensor weight, double eps) {
    final_norm_ = std::move(weight);
    final_eps_ = eps;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // How many run() calls went on a crew (tests, and what a profile of a step should show).
  int64_t crew_runs() const { return crew_runs_; }
  // The last crew step's empty-job handoff in ns (-1: none yet; Crew::handoff_ns).
  int64_t crew_handoff_ns() const { return last_handoff_ns_; }

  // Every layer in order over the residual stream `hidden` [T, H] (mutated) with the previous
  // sub-block's output `delta` (None at the first layer) -> (hidden, the last layer's output for
  // the final norm to add, or None). rows: per RoPE table the rows its layers read
  // (RopeBatch.positions); slot_mappings / block_tables: one pair for every layer, or one per layer
  // (several KV groups: AttentionMetadata.for_layer).
  std::tuple<at::Tensor, OptTensor> run(at::Tensor hidden, OptTensor delta, std::vector<at::Tensor> rows,
                                        std::vector<at::Tensor> slot_mappings, std::vector<at::Tensor> block_tables,
                                        at::Tensor seq_lens, at::Tensor query_start_loc, int64_t max_query_len,
                                        int64_t max_seq_len) {
    // One token (a lone decode) while the cores sit close, or when forced (crew_mode): the whole
    // stack in one region, its kernels on a crew (cpu/crew.h), where every layer's kernels hand
    // their shares to one (crew_ready).
    const CrewMode mode = crew_mode();
    bool crew_step = mode != CrewMode::kOff && hidden.dim() == 2 && hidden.size(0) == 1 &&
                     omp_get_max_threads() > 1 && !omp_in_parallel() && crew_ready();
    if (crew_step && mode == CrewMode::kAuto && regions_left_ > 0) {
      --regions_left_;  // the last probe found the cores far apart: regions until the next one
      crew_step = false;
    }
    if (crew_step) {
      std::tuple<at::Tensor, OptTensor> result;
      std::exception_ptr error;
      cpu::Crew crew(omp_get_max_threads());
      ahead_ = read_ahead_bytes();
      if (ahead_ > 0) {
        build_plan();
        crew.set_read_ahead(plan_.data(), plan_off_.data(), plan_.size(), ahead_);
      }
#pragma omp parallel num_threads(crew.size())
      {
        cpu::lead_or_serve(crew, [&] {
          // Where the members are now decides an auto stack's next steps (this one runs on the
          // crew anyway); a forced crew records it too (bench/decode_crew.py bins by it).
          last_handoff_ns_ = crew.handoff_ns();
          if (mode == CrewMode::kAuto && last_handoff_ns_ > far_handoff_ns()) regions_left_ = kRegionsBeforeProbe;
          try {
            result = finish(run_layers(hidden, delta, rows, slot_mappings, block_tables, seq_lens, query_start_loc,
                                       max_query_len, max_seq_len));
          } catch (...) {
            error = std::current_exception();  // raised after the region: exceptions must not leave it
          }
        });
      }
      ++crew_runs_;
      if (error) std::rethrow_exception(error);
      return result;
    }
    return finish(run_layers(hidden, delta, rows, slot_mappings, block_tables, seq_lens, query_start_loc,
                             max_query_len, max_seq_len));
  }

  // run()'s result after the final norm, when set_final_norm gave one.
  std::tuple<at::Tensor, OptTensor> finish(std::tuple<at::Tensor, OptTensor> out) const {
    if (!final_norm_.defined()) return out;
    at::Tensor& h = std::get<0>(out);
    const OptTensor& d = std::get<1>(out);
    at::Tensor normed = d.has_value() && d->defined() ? add_rms_norm_cpu(h, *d, final_norm_, final_eps_)
                                                      : rms_norm_cpu(h, final_norm_, final_eps_);
    return {normed, c10::nullopt};
  }

 private:
  // Whether every layer's kernels split over a crew (team_for, team_region): the x8 kinds,
  // quantised and bf16, and no sparse layer (moe_decode opens a region of its own, which would run
  // on the leader alone). Any other kind would run whole on the leader: those stacks keep their
  // regions. Q8_0 too since session 33: session 32 left it out after a 4-7 % loss on Llama-1B,
  // which the probe now explains (cores far apart); close, its steps took 0.96-1.00x the regions'.
  bool crew_ready() const {
    if (crew_ready_ < 0) {
      const auto one = [](const std::string& k) {
        cpu::Q4Type t;
        bool x8 = false;
        return k == "q8_0x8" || k == "bf16x8" || k == "bf16zx8" || (cpu::parse_q4_name(k, &t, &x8) && x8);
      };
      // "parts:KIND*ROWS+...": linear_parts_region's shares are a team_region; each part one of the above.
      const auto x8 = [&](const std::string& k) {
        if (k.rfind("parts:", 0) != 0) return one(k);
        for (size_t pos = 6; pos < k.size();) {
          const size_t end = std::min(k.find('+', pos), k.size());
          const size_t star = k.find('*', pos);
          if (star == std::string::npos || star > end || !one(k.substr(pos, star - pos))) return false;
          pos = end + 1;
        }
        return true;
      };
      // A sparse layer: moe_decode's quantised path (one region, a crew job on a crew), its router
      // and shared expert by kinds that split over the crew too ("kernel": the bf16 row kernels'
      // team_for).
      const auto split = [&](const std::string& k) { return k.empty() || k == "kernel" || x8(k); };
      const auto sparse_ok = [&](const StackLayer& l) {
        return l.experts_gate_up_kind != "float" && l.experts_down_kind != "float" && l.moe_activation == "silu" &&
               split(l.router_kind) && split(l.shared_gate_up_kind) && split(l.shared_down_kind) &&
               split(l.shared_gate_kind);
      };
      bool ok = !layers_.empty();
      for (const StackLayer& l : layers_) {
        ok = ok && x8(l.qkv_kind) && x8(l.o_kind) && (l.moe ? sparse_ok(l) : x8(l.gate_up_kind) && x8(l.down_kind));
      }
      crew_ready_ = ok ? 1 : 0;
    }
    return crew_ready_ == 1;
  }

  // The crew's read-ahead plan: every layer's four weight matrices (a sparse layer's qkv and o) in
  // the order the kernels read them (run_linear moves the window on, crew.h), and each one's first byte in the matrices laid
  // end to end, then their total. Built once (the weights do not move; add_layer clears it).
  void build_plan() {
    if (!plan_.empty()) return;
    int64_t off = 0;
    const auto add = [&](const at::Tensor& w) {
      plan_.push_back({static_cast<const char*>(w.data_ptr()), static_cast<int64_t>(w.nbytes())});
      plan_off_.push_back(off);
      off += static_cast<int64_t>(w.nbytes());
    };
    for (const StackLayer& l : layers_) {
      add(l.qkv_weight);
      add(l.o_weight);
      if (l.moe) continue;  // a sparse layer's experts are known only once routed: not read ahead
      add(l.gate_up_weight);
      add(l.down_weight);
    }
    plan_off_.push_back(off);
  }

  static int64_t read_ahead_bytes() {
    const char* e = std::getenv("PAGEWIRE_CREW_AHEAD");
    return e == nullptr ? int64_t{1} << 20 : std::atoll(e);
  }

  // $PAGEWIRE_DECODE_CREW (read at each call, so that a bench can alternate it step by step in
  // one process): "1" always a crew, "0" never, anything else (the default) a crew while the
  // threads' cores sit close. On the Zen 4 guest the two vCPUs move between one core complex (a
  // cache line's round trip 51-80 ns) and two (316-755 ns), minutes apart. Close, the crew's steps
  // took 0.90-0.93x the regions' on SmolLM2's 4-bit files (the member's read-ahead lands where the
  // leader reads it cheaply); far apart, 1.02-1.10x (a line the other core holds costs more than
  // memory), which is what made session 32's verdict flip between runs (bench/RESULTS.md, sessions
  // 32-33). So an auto step on the crew times a few empty handoffs first (Crew::handoff_ns: 150-240
  // ns close, 580-1,040 ns far there), and if they are far, the next kRegionsBeforeProbe steps open
  // regions.
  enum class CrewMode { kOff, kOn, kAuto };
  static CrewMode crew_mode() {
    const char* e = std::getenv("PAGEWIRE_DECODE_CREW");
    if (e != nullptr && std::strcmp(e, "1") == 0) return CrewMode::kOn;
    if (e != nullptr && std::strcmp(e, "0") == 0) return CrewMode::kOff;
    return CrewMode::kAuto;
  }
  static constexpr int64_t kRegionsBeforeProbe = 64;
  // The handoff above which the cores count as far apart: 400 ns, or $PAGEWIRE_CREW_FAR_NS (tests
  // force either verdict with 0 and a large value).
  static int64_t far_handoff_ns() {
    const char* e = std::getenv("PAGEWIRE_CREW_FAR_NS");
    return e != nullptr && *e != '\0' ? std::atoll(e) : 400;
  }

  std::tuple<at::Tensor, OptTensor> run_layers(at::Tensor& hidden, OptTensor delta, const std::vector<at::Tensor>& rows,
                                               const std::vector<at::Tensor>& slot_mappings,
                                               const std::vector<at::Tensor>& block_tables, const at::Tensor& seq_lens,
                                               const at::Tensor& query_start_loc, int64_t max_query_len,
                                               int64_t max_seq_len) {
    const size_t n = layers_.size();
    TORCH_CHECK(slot_mappings.size() == block_tables.size() && (slot_mappings.size() == 1 || slot_mappings.size() == n),
                "DecodeStack.run: ", slot_mappings.size(), " slot mappings and ", block_tables.size(),
                " block tables for ", n, " layers (one pair, or one per layer)");
    for (const StackLayer& l : layers_) {
      TORCH_CHECK(l.rope < 0 || static_cast<size_t>(l.rope) < rows.size(), "DecodeStack.run: a layer reads RoPE table ",
                  l.rope, " of ", rows.size());
    }
    // A NoPE layer's positions argument is never read (no tables); any rows tensor stands in.
    const at::Tensor no_rows = rows.empty() ? seq_lens : rows[0];
    for (size_t i = 0; i < n; ++i) {
      StackLayer& l = layers_[i];
      const size_t g = slot_mappings.size() == 1 ? 0 : i;
      at::Tensor out = decode_layer_cpu(
          hidden, delta, l.attn_norm, l.attn_post_norm, l.mlp_norm, l.mlp_post_norm, l.eps, l.residual_multiplier,
          l.qkv_weight, l.qkv_kind, l.qkv_bias, l.q_norm, l.k_norm, l.o_weight, l.o_kind, l.o_bias, l.gate_up_weight,
          l.gate_up_kind, l.gate_up_bias, l.down_weight, l.moe ? "none" : l.down_kind, l.down_bias,
          l.rope >= 0 ? rows[l.rope] : no_rows, l.cos, l.sin, l.qk_norm, l.key_cache, l.value_cache, slot_mappings[g],
          block_tables[g], seq_lens, query_start_loc, l.scale, l.sliding_window, max_query_len, max_seq_len,
          l.num_heads, l.num_kv_heads, l.head_dim, l.softcap, l.activation, l.v_norm, l.shares_kv, l.value_from_key,
          c10::nullopt, c10::nullopt, "torch", c10::nullopt, "torch", c10::nullopt, l.layer_scalar, l.sinks,
          c10::nullopt, c10::nullopt);
      if (l.moe) {
        at::Tensor mlp = moe_decode_cpu(
            out, l.router_weight, l.router_kind, l.router_bias, l.router, l.top_k, l.norm_topk_prob, l.experts_gate_up,
            l.experts_gate_up_kind, l.experts_down, l.experts_down_kind, l.experts_gate_up_bias, l.experts_down_bias,
            l.moe_activation, l.alpha, l.limit, l.shared_gate_up, l.shared_gate_up_kind, l.shared_down,
            l.shared_down_kind, l.shared_gate, l.shared_gate_kind, l.selection_bias, l.n_group, l.topk_group,
            l.routed_scaling);
        // DecoderLayer._leave: the post norm, then the residual multiplier (Python's `out * m`).
        if (l.mlp_post_norm.has_value() && l.mlp_post_norm->defined()) mlp = rms_norm_cpu(mlp, *l.mlp_post_norm, l.eps);
        if (l.residual_multiplier != 1.0) mlp = at::mul(mlp, l.residual_multiplier);
        delta = mlp;
      } else {
        delta = l.finishes ? OptTensor() : OptTensor(out);
      }
    }
    return {hidden, delta};
  }

  std::vector<StackLayer> layers_;
  std::vector<cpu::Crew::Range> plan_;
  std::vector<int64_t> plan_off_;
  int64_t ahead_ = 0;
  int64_t crew_runs_ = 0;
  at::Tensor final_norm_;  // set_final_norm's weight (undefined: run() leaves the norm to the caller)
  double final_eps_ = 0.0;
  int64_t regions_left_ = 0;     // auto mode: steps to run on regions before probing again
  int64_t last_handoff_ns_ = -1;  // the last crew step's probe (crew_handoff_ns)
  mutable int crew_ready_ = -1;  // crew_ready(), once the layers are in (-1: not yet known)
};

}  // namespace

// server._C.DecodeStack: a pybind11 class, not a TorchScript one (torch.classes), so that a step's
// run() is a plain call: a TorchScript method call took 30 us right after a step's weights had gone
// through the caches, against 2.5 us hot (csrc/fast_calls.cpp says why; bench/RESULTS.md, session 34).
void bind_decode_stack(pybind11::module_& m) {
  pybind11::class_<DecodeStack, c10::intrusive_ptr<DecodeStack>>(m, "DecodeStack")
      .def(pybind11::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_final_norm", &DecodeStack::set_final_norm)
      .def("size", &DecodeStack::size)
      .def("crew_runs", &DecodeStack::crew_runs)
      .def("crew_handoff_ns", &DecodeStack::crew_handoff_ns)
      .def("run", &DecodeStack::run);
}

}  // namespace pagewire
