#include "allocator/global_allocator.h"

#include <cstddef>

#include <atomic>
#include <utility>
#include <vector>

#include "common/error.h"

namespace april::alloc {

namespace {
thread_local std::vector<RegionFrame> t_regions;
thread_local std::string t_hook_error;
std::atomic<DeviceKind> g_hook_kind{DeviceKind::Cuda};
}  // namespace

Allocator& global_allocator() {
  // Deliberately never destroyed: torch frees its pool blocks through our hooks during its own static
  // teardown, which may run after ours; the OS takes the memory back at exit.
  static Allocator* instance = new Allocator();
  return *instance;
}

void push_region(const std::string& tag, bool cpu_backup) {
  check(!tag.empty(), ErrorKind::InvalidArgument, "tag must be a non-empty string");
  t_regions.push_back(RegionFrame{tag, cpu_backup});
}

void pop_region() {
  check(!t_regions.empty(), ErrorKind::InvalidState, "pop_region: this thread has no open region");
  t_regions.pop_back();
}

const RegionFrame* current_region() { return t_regions.empty() ? nullptr : &t_regions.back(); }

void set_hook_device_kind(DeviceKind kind) { g_hook_kind.store(kind); }
DeviceKind hook_device_kind() { return g_hook_kind.load(); }

std::string take_hook_error() { return std::exchange(t_hook_error, std::string()); }
void set_hook_error(const std::string& message) { t_hook_error = message; }

const char* torch_malloc_symbol() { return "april_ext_torch_malloc"; }
const char* torch_free_symbol() { return "april_ext_torch_free"; }

}  // namespace april::alloc

// The contract of torch.cuda.memory.CUDAPluggableAllocator: plain C functions, no exceptions.
// A failure returns nullptr (torch raises its OutOfMemoryError) and leaves the reason for
// april_ext.memory to report.
extern "C" {

__attribute__((visibility("default"))) void* april_ext_torch_malloc(size_t size, int device, void* stream) {
  (void)stream;  // the VMM calls are stream-less; torch orders uses of the block itself
  using namespace april::alloc;
  const RegionFrame* frame = current_region();
  if (frame == nullptr) {
    set_hook_error("an allocation reached the april_ext pool outside a region");
    return nullptr;
  }
  try {
    Device dev{hook_device_kind(), device};
    return reinterpret_cast<void*>(
        global_allocator().allocate(static_cast<std::size_t>(size), dev, frame->tag, frame->cpu_backup));
  } catch (const april::Error& e) {
    set_hook_error(e.what());
  } catch (const std::exception& e) {
    set_hook_error(e.what());
  }
  return nullptr;
}

__attribute__((visibility("default"))) void april_ext_torch_free(void* ptr, size_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  using namespace april::alloc;
  try {
    global_allocator().free(reinterpret_cast<std::uintptr_t>(ptr));
  } catch (const april::Error& e) {
    set_hook_error(e.what());
  }
}

}  // extern "C"
