#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "april_ext compiled core: partial-rollout scheduler and pause/resume allocator";
  april::bindings::register_errors();
  april::bindings::bind_scheduler(m);
  april::bindings::bind_allocator(m);
}
