// pybind11 bindings for the KV block allocator (server._C.BlockAllocator): argument conversion
// only; the semantics live in block_allocator*.cpp. C++ std::invalid_argument surfaces as
// ValueError and std::runtime_error as RuntimeError (pybind11's standard translation).
#include "bindings.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_allocator.h"

namespace py = pybind11;

namespace pagewire {
namespace {

// The Python-facing allocator: adds a reusable token buffer so that converting token ids does
// not allocate on every call.
class PyBlockAllocator : public BlockAllocator {
 public:
  using BlockAllocator::BlockAllocator;

  // Converts the tokens at positions [begin, end) of a sequence into a view whose total_len is
  // total_len. `seq` is a Python sequence of ints holding positions [offset, offset + len(seq)).
  // Only the items a call will read are converted.
  TokenView read_tokens(const py::handle& seq, int64_t offset, int64_t begin, int64_t end, int64_t total_len) {
    scratch_.resize(static_cast<size_t>(end > begin ? end - begin : 0));
    py::object fast = py::reinterpret_steal<py::object>(
        PySequence_Fast(seq.ptr(), "token_ids must be a sequence of ints"));
    if (!fast) throw py::error_already_set();
    PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
    for (int64_t i = begin; i < end; ++i) {
      const long long v = PyLong_AsLongLong(items[i - offset]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (v < 0 || v > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument("token_ids[" + std::to_string(i - offset) + "] = " + std::to_string(v) +
                                    " is out of range [0, 2^31)");
      scratch_[static_cast<size_t>(i - begin)] = static_cast<int32_t>(v);
    }
    return TokenView{scratch_.data(), begin, end > begin ? end - begin : 0, total_len};
  }

 private:
  std::vector<int32_t> scratch_;
};

int64_t seq_len(const py::handle& seq) {
  const Py_ssize_t n = PyObject_Length(seq.ptr());
  if (n < 0) throw py::error_already_set();
  return static_cast<int64_t>(n);
}

}  // namespace

void bind_allocator(py::module_& m) {
  py::class_<PyBlockAllocator>(m, "BlockAllocator", R"doc(
Paged KV block allocator with refcounted sharing, copy-on-write and automatic prefix caching.

A block is free (no hash), cached (refcount 0 with a prefix hash, evictable in LRU order) or used
(refcount > 0). Full blocks are identified by a hash chained over their parent and token ids;
a prefix hit also compares parent identity and token ids, so a collision never serves wrong KV.

Args:
    num_blocks: physical KV blocks (>= 1).
    block_size: tokens per block (>= 1).
    enable_prefix_caching: register full blocks and reuse them across sequences.
    hash_bits: bits of the 64-bit hash kept (1..64); fewer bits force collisions in tests.
    group_windows: one entry per KV group: 0 for full attention, W > 0 for a sliding window of W
        tokens, whose blocks return to the pool once they leave it (block_allocator.h).
)doc")
      .def(py::init<int64_t, int64_t, bool, int, std::vector<int64_t>>(), py::arg("num_blocks"),
           py::arg("block_size"), py::arg("enable_prefix_caching") = true, py::arg("hash_bits") = 64,
           py::arg("group_windows") = std::vector<int64_t>{0})
      .def_property_readonly("num_groups", &BlockAllocator::num_groups)
      .def_property_readonly("group_windows", &BlockAllocator::group_windows)
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def_property_readonly("block_size", &BlockAllocator::block_size)
      .def_property_readonly("num_free_blocks", &BlockAllocator::num_free_blocks,
                             "Blocks allocatable now: truly free + evictable cached.")
      .def("has_sequence", &BlockAllocator::has_sequence, py::arg("seq_id"))
      .def(
          "match_prefix",
          [](PyBlockAllocator& self, int64_t seq_id, const py::handle& token_ids) {
            const int64_t n = seq_len(token_ids);
            const int64_t full = n / self.block_size() * self.block_size();
            return self.match_prefix(seq_id, self.read_tokens(token_ids, 0, 0, full, n));
          },
          py::arg("seq_id"), py::arg("token_ids"), R"doc(
Attach the longest cached chain of full blocks matching token_ids to a sequence with no blocks
(created if unknown; ValueError if it has blocks). Counts prefix hit/miss tokens.

Returns:
    Tokens covered, a multiple of block_size (0 with prefix caching disabled).
)doc")
      .def("allocate_slots", &BlockAllocator::allocate_slots, py::arg("seq_id"),
           py::arg("num_computed_tokens"), py::arg("num_new_tokens"), R"doc(
Grow the sequence's block table (created if unknown) to cover num_computed_tokens +
num_new_tokens tokens. Shared blocks in the write range are copied on write.

Returns:
    [(src, dst), ...] block copies the caller must run (copy_blocks) before writing, or None if
    too few blocks are available, in which case nothing changed.
)doc")
      .def("blocks_needed", &BlockAllocator::blocks_needed, py::arg("seq_id"),
           py::arg("num_computed_tokens"), py::arg("num_new_tokens"),
           "Fresh blocks allocate_slots would take right now (new blocks + copy-on-write copies).")
      .def(
          "cache_full_blocks",
          [](PyBlockAllocator& self, int64_t seq_id, const py::handle& token_ids, int64_t start) {
            if (start < 0) throw std::invalid_argument("cache_full_blocks: start must be >= 0, got " +
                                                       std::to_string(start));
            const int64_t n = start + seq_len(token_ids);
            if (!self.prefix_caching_enabled()) {
              self.cache_full_blocks(seq_id, TokenView{nullptr, 0, 0, n});  // validates only
              return;
            }
            // The registration point lives here, not with the caller: read only the tokens of
            // blocks not yet registered, so a call costs O(new blocks), not O(sequence).
            const int64_t registered = self.registered_tokens(seq_id);
            const int64_t full = n / self.block_size() * self.block_size();
            if (registered >= full) {
              self.cache_full_blocks(seq_id, TokenView{nullptr, 0, 0, n});  // validates only
              return;
            }
            if (start > registered)
              throw std::invalid_argument("cache_full_blocks: token_ids start at position " + std::to_string(start) +
                                          " but seq_id " + std::to_string(seq_id) + " has registered only " +
                                          std::to_string(registered) + " tokens; positions [" +
                                          std::to_string(registered) + ", " + std::to_string(start) +
                                          ") are missing");
            self.cache_full_blocks(seq_id, self.read_tokens(token_ids, start, registered, full, n));
          },
          py::arg("seq_id"), py::arg("token_ids"), py::arg("start") = 0, R"doc(
Register every newly full block of the sequence under its chained hash. token_ids are the
sequence's tokens at positions [start, start + len(token_ids)), whose KV is in its blocks (or is
being written this step); start may be anything up to the tokens already registered, so a caller
passes just the tokens of the step (from the first block they touch) and the call reads only the
blocks that became full: O(new blocks). Idempotent; an identical block registered elsewhere is
kept and not duplicated. No-op with caching disabled.
)doc")
      .def(
          "registered_tokens",
          [](const PyBlockAllocator& self, int64_t seq_id) {
            if (!self.has_sequence(seq_id))
              throw std::invalid_argument("registered_tokens: unknown seq_id " + std::to_string(seq_id));
            return self.registered_tokens(seq_id);
          },
          py::arg("seq_id"),
           "Tokens of the sequence whose full blocks are registered (a multiple of block_size).")
      .def("fork", &BlockAllocator::fork, py::arg("parent_id"), py::arg("child_id"),
           "Give child_id (unknown or without blocks) the parent's block table; every block refcount++.")
      .def("truncate", &BlockAllocator::truncate, py::arg("seq_id"), py::arg("num_tokens"),
           "Keep ceil(num_tokens / block_size) blocks; an unshared partial tail loses its hash.")
      .def("free", &BlockAllocator::free, py::arg("seq_id"),
           "Release the sequence's blocks tail first and forget it; unknown ids are a no-op.")
      .def("block_table", &BlockAllocator::block_table, py::arg("seq_id"), py::arg("group") = 0,
           "Group `group`'s block table; -1 where a sliding window released the block.")
      .def(
          "fill_block_tables",
          [](const PyBlockAllocator& self, const std::vector<int64_t>& seq_ids, const py::buffer& out) {
            py::buffer_info info = out.request(true);
            if (info.format != py::format_descriptor<int32_t>::format() || info.ndim != 3)
              throw std::invalid_argument("fill_block_tables: out must be a writable int32 array [groups, rows, "
                                          "width], got format '" + info.format + "' with " +
                                          std::to_string(info.ndim) + " dims");
            if (info.shape[0] < self.num_groups() || info.shape[1] < static_cast<py::ssize_t>(seq_ids.size()))
              throw std::invalid_argument("fill_block_tables: out has room for " + std::to_string(info.shape[0]) +
                                          " groups x " + std::to_string(info.shape[1]) + " rows, needs " +
                                          std::to_string(self.num_groups()) + " x " + std::to_string(seq_ids.size()));
            if (info.strides[2] != 4 || info.strides[0] % 4 != 0 || info.strides[1] % 4 != 0)
              throw std::invalid_argument("fill_block_tables: out must be contiguous in its last dim");
            return self.fill_block_tables(seq_ids, static_cast<int32_t*>(info.ptr), info.strides[0] / 4,
                                          info.strides[1] / 4, info.shape[2]);
          },
          py::arg("seq_ids"), py::arg("out"), R"doc(
Write every group's block tables of seq_ids into out[g, r, :] (row r = seq_ids[r]) in one call; columns
past a table's end (up to the longest) are 0, released entries -1. out: a writable int32 buffer
[>= num_groups, >= len(seq_ids), width], contiguous in its last dim (a numpy view of a persistent
torch tensor). Returns the longest table (ValueError if wider than out, before writing).
)doc")
      .def(
          "fill_decode_inputs",
          [](const PyBlockAllocator& self, const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& tokens,
             const std::vector<int64_t>& starts, const std::vector<int64_t>& prompt_lens, const py::buffer& i64,
             const py::buffer& i32, const py::buffer& tables) {
            const py::ssize_t n = static_cast<py::ssize_t>(seq_ids.size());
            py::buffer_info a = i64.request(true), b = i32.request(true), t = tables.request(true);
            // numpy names int64 'l' on LP64 platforms, pybind11 'q': either, at 8 bytes.
            const bool int64_format = a.itemsize == 8 && (a.format == "l" || a.format == "q");
            if (!int64_format || a.ndim != 2 || a.shape[0] < 3 ||
                a.shape[1] < n || a.strides[1] != 8)
              throw std::invalid_argument("fill_decode_inputs: i64 must be a writable int64 array [3, >= " +
                                          std::to_string(n) + "], contiguous in its last dim");
            if (b.format != py::format_descriptor<int32_t>::format() || b.ndim != 2 || b.shape[0] < 3 ||
                b.shape[1] < n + 1 || b.strides[1] != 4)
              throw std::invalid_argument("fill_decode_inputs: i32 must be a writable int32 array [3, >= " +
                                          std::to_string(n + 1) + "], contiguous in its last dim");
            if (t.format != py::format_descriptor<int32_t>::format() || t.ndim != 3 || t.shape[0] < 1 ||
                t.shape[1] < n || t.strides[2] != 4)
              throw std::invalid_argument("fill_decode_inputs: tables must be a writable int32 array [groups, >= " +
                                          std::to_string(n) + ", width], contiguous in its last dim");
            return self.fill_decode_inputs(seq_ids, tokens, starts, prompt_lens, static_cast<int64_t*>(a.ptr),
                                           a.strides[0] / 8, static_cast<int32_t*>(b.ptr), b.strides[0] / 4,
                                           static_cast<int32_t*>(t.ptr), t.strides[1] / 4, t.shape[2]);
          },
          py::arg("seq_ids"), py::arg("tokens"), py::arg("starts"), py::arg("prompt_lens"), py::arg("i64"),
          py::arg("i32"), py::arg("tables"), R"doc(
One decode step's inputs for a single-group pool, into persistent buffers: row r is seq_ids[r], its
new token tokens[r] at position starts[r]. Writes i64[0] tokens, i64[1] positions, i64[2] slots;
i32[0] seq_lens, i32[1] prompt_lens, i32[2][:n + 1] query_start_loc; tables[0, r, :longest] the
block tables (0 past their end). Returns (longest, max_seq_len); max_seq_len is -1, with nothing
written, when the longest table is wider than tables (grow them and call again).
)doc")
      .def("refcount", &BlockAllocator::refcount, py::arg("block_id"))
      .def("chain_link", &BlockAllocator::chain_link, py::arg("seq_id"), py::arg("index"),
           "Group 0's registered chain link `index`: (representative block, generation).")
      .def("link_valid", &BlockAllocator::link_valid, py::arg("block"), py::arg("gen"),
           "Whether `block` is still registered with generation `gen`.")
      .def("stats",
           [](const PyBlockAllocator& self) {
             const BlockAllocator::Stats s = self.stats();
             py::dict d;
             d["num_blocks"] = s.num_blocks;
             d["used_blocks"] = s.used_blocks;
             d["free_blocks"] = s.free_blocks;
             d["cached_blocks"] = s.cached_blocks;
             d["prefix_hit_tokens"] = s.prefix_hit_tokens;
             d["prefix_miss_tokens"] = s.prefix_miss_tokens;
             d["evictions"] = s.evictions;
             return d;
           })
      .def("reset_prefix_cache", &BlockAllocator::reset_prefix_cache,
           "Drop every prefix hash: cached blocks become free, held blocks stay held.")
      .def("check_invariants", &BlockAllocator::check_invariants,
           "Raise RuntimeError describing the first broken bookkeeping invariant.")
      .def("__repr__", [](const PyBlockAllocator& self) {
        const BlockAllocator::Stats s = self.stats();
        return "BlockAllocator(num_blocks=" + std::to_string(s.num_blocks) +
               ", block_size=" + std::to_string(self.block_size()) +
               ", used=" + std::to_string(s.used_blocks) + ", free=" + std::to_string(s.free_blocks) +
               ", cached=" + std::to_string(s.cached_blocks) + ")";
      });
}

}  // namespace pagewire
