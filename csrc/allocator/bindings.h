// pybind11 bindings for the KV block allocator; called from module.cpp.
#pragma once
#include <pybind11/pybind11.h>

namespace pagewire {
void bind_allocator(pybind11::module_& m);
}  // namespace pagewire
