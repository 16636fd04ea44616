#include "bindings/bindings.h"

namespace april::bindings {

void bind_allocator(pybind11::module_& m) { (void)m; }

}  // namespace april::bindings
