// Translates april::Error into the Python class named by its kind (april_ext.errors).
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "common/error.h"

namespace py = pybind11;

namespace april::bindings {

void register_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const april::Error& e) {
      // Imported lazily: april_ext.errors is pure Python and does not import _C.
      py::object cls = py::module_::import("april_ext.errors").attr(error_kind_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}

}  // namespace april::bindings
