// The Python module server._C. Importing it also loads the TORCH_LIBRARY(pagewire, ...) op
// registrations compiled into the same shared object (see ops_registration.cpp).
#include <pybind11/pybind11.h>

#include "allocator/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagewire native extension: paged-attention ops (torch.ops.pagewire.*) and the KV block allocator";
  pagewire::bind_allocator(m);
}
