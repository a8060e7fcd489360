// Placeholder until the allocator lands (owned by the allocator work item).
#include "bindings.h"
namespace pagewire {
void bind_allocator(pybind11::module_& m) {}
}  // namespace pagewire
