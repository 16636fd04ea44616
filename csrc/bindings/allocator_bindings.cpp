// april_ext._C.memory: the pause/resume allocator. Converts arguments and forwards to the global
// allocator; the Python face is april_ext/memory.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "allocator/dlpack_export.h"
#include "allocator/global_allocator.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace april::bindings {

namespace {

using alloc::Device;
using alloc::global_allocator;

Device to_device(const std::string& kind, int index) { return Device{alloc::parse_device_kind(kind), index}; }

py::dict stats_dict(const alloc::TagStats& s) {
  py::dict d;
  d["tag"] = s.tag;
  d["paused"] = s.paused;
  d["allocations"] = s.allocations;
  d["logical_bytes"] = s.logical_bytes;
  d["physical_bytes"] = s.physical_bytes;
  d["resident_bytes"] = s.resident_bytes;
  d["backup_bytes"] = s.backup_bytes;
  d["pauses"] = s.history.pauses;
  d["resumes"] = s.history.resumes;
  d["last_pause_seconds"] = s.history.last_pause_seconds;
  d["last_resume_seconds"] = s.history.last_resume_seconds;
  d["last_pause_copied_bytes"] = s.history.last_pause_copied_bytes;
  d["last_resume_copied_bytes"] = s.history.last_resume_copied_bytes;
  d["last_pause_copy_seconds"] = s.history.last_pause_copy_seconds;
  d["last_resume_copy_seconds"] = s.history.last_resume_copy_seconds;
  return d;
}

void destroy_capsule(PyObject* capsule) {
  // A consumer that took ownership renamed the capsule to "used_dltensor".
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<alloc::DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

}  // namespace

void bind_allocator(py::module_& parent) {
  py::module_ m = parent.def_submodule("memory", "virtual-memory pause/resume allocator");
  using Release = py::call_guard<py::gil_scoped_release>;

  m.def("allocate",
        [](std::size_t size, const std::string& kind, int index, const std::string& tag, bool cpu_backup) {
          return global_allocator().allocate(size, to_device(kind, index), tag, cpu_backup);
        },
        py::arg("size"), py::arg("kind"), py::arg("index"), py::arg("tag"), py::arg("cpu_backup"), Release());
  m.def("free", [](std::uintptr_t addr) { global_allocator().free(addr); }, py::arg("addr"), Release());
  m.def("pause", [](std::optional<std::string> tag) { global_allocator().pause(tag); }, py::arg("tag"), Release());
  m.def("resume", [](std::optional<std::string> tag) { global_allocator().resume(tag); }, py::arg("tag"), Release());
  m.def("stats", [] {
    py::list out;
    for (const auto& s : global_allocator().stats()) out.append(stats_dict(s));
    return out;
  });
  m.def("info", [](std::uintptr_t addr) {
    alloc::AllocationInfo i = global_allocator().info(addr);
    py::dict d;
    d["addr"] = i.addr;
    d["logical_bytes"] = i.logical_bytes;
    d["physical_bytes"] = i.physical_bytes;
    d["kind"] = alloc::device_kind_name(i.device.kind);
    d["index"] = i.device.index;
    d["tag"] = i.tag;
    d["cpu_backup"] = i.cpu_backup;
    d["paused"] = i.paused;
    return d;
  }, py::arg("addr"));
  m.def("backends", [] {
    py::list out;
    for (const auto& b : global_allocator().backends()) {
      py::dict d;
      d["name"] = b.name;
      d["compiled"] = b.compiled;
      d["usable"] = b.usable;
      d["reason"] = b.reason;
      out.append(d);
    }
    return out;
  });
  m.def("granularity", [](const std::string& kind, int index) {
    return global_allocator().granularity(to_device(kind, index));
  }, py::arg("kind"), py::arg("index"));
  m.def("memory_info", [](const std::string& kind, int index) {
    std::size_t free_bytes = 0, total_bytes = 0;
    global_allocator().memory_info(to_device(kind, index), &free_bytes, &total_bytes);
    return py::make_tuple(free_bytes, total_bytes);
  }, py::arg("kind"), py::arg("index"));
  m.def("set_cpu_capacity", [](std::size_t bytes) { global_allocator().cpu_backend().set_capacity(bytes); },
        py::arg("bytes"));
  m.def("cpu_capacity", [] { return global_allocator().cpu_backend().capacity(); });
  m.def("cpu_committed", [] { return global_allocator().cpu_backend().committed(); });
  m.def("cpu_synchronize_calls", [] { return global_allocator().cpu_backend().synchronize_calls(); });
  m.def("cpu_set_pause_frees_va", [](bool on) { global_allocator().cpu_backend().set_pause_frees_va(on); },
        py::arg("on"));
  m.def("cpu_inject_faults", [](const std::string& op, int count, bool foreign) {
    global_allocator().cpu_backend().inject_faults(alloc::CpuBackend::parse_op(op), count, foreign);
  }, py::arg("op"), py::arg("count"), py::arg("foreign"));
  m.def("set_backup_cache_limit", [](std::size_t bytes) { global_allocator().backup_cache().set_limit(bytes); },
        py::arg("bytes"), Release());
  m.def("backup_cache_limit", [] { return global_allocator().backup_cache().limit(); });
  m.def("backup_cache_held", [] { return global_allocator().backup_cache().held(); });

  m.def("push_region", &alloc::push_region, py::arg("tag"), py::arg("cpu_backup"));
  m.def("pop_region", &alloc::pop_region);
  m.def("current_region", []() -> std::optional<py::tuple> {
    const alloc::RegionFrame* f = alloc::current_region();
    if (f == nullptr) return std::nullopt;
    return py::make_tuple(f->tag, f->cpu_backup);
  });
  m.def("set_hook_device_kind", [](const std::string& kind) {
    alloc::set_hook_device_kind(alloc::parse_device_kind(kind));
  }, py::arg("kind"));
  m.def("take_hook_error", &alloc::take_hook_error);
  m.def("torch_symbols", [] { return py::make_tuple(alloc::torch_malloc_symbol(), alloc::torch_free_symbol()); });

  m.def("export_allocation", [](std::uintptr_t addr) {
    const alloc::AllocationInfo i = global_allocator().info(addr);
    alloc::DLManagedTensor* managed = alloc::export_allocation(addr, i.logical_bytes, i.device);
    return py::capsule(managed, "dltensor", &destroy_capsule);
  }, py::arg("addr"));
}

}  // namespace april::bindings
