// Entry points of the binding files; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

namespace april::bindings {

void register_errors();
void bind_scheduler(pybind11::module_& m);
void bind_allocator(pybind11::module_& m);

}  // namespace april::bindings
