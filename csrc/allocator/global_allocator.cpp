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
void set_hook_error(const char* message) noexcept {
  try {
    t_hook_error = message;
  } catch (...) {
    // Out of memory for the message itself: the hook's nullptr / silence still tells the caller.
  }
}

const char* torch_malloc_symbol() { return "april_ext_torch_malloc"; }
const char* torch_free_symbol() { return "april_ext_torch_free"; }

}  // namespace april::alloc

namespace {

// Runs the body of a torch hook. No exception may leave an extern "C" function into torch, so every
// one (a driver error, bad_alloc, anything) becomes the thread's hook error. Returns whether fn ran
// to the end.
template <class Fn>
bool run_hook(Fn&& fn) noexcept {
  try {
    fn();
    return true;
  } catch (const std::exception& e) {
    april::alloc::set_hook_error(e.what());
  } catch (...) {
    april::alloc::set_hook_error("an exception that is not a std::exception");
  }
  return false;
}

}  // namespace

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
  std::uintptr_t addr = 0;
  run_hook([&] {
    addr = global_allocator().allocate(static_cast<std::size_t>(size), Device{hook_device_kind(), device}, frame->tag,
                                       frame->cpu_backup);
  });
  return reinterpret_cast<void*>(addr);
}

// torch calls it where it would call cudaFree, which waits for the device: Allocator::free
// synchronizes the device before it unmaps.
__attribute__((visibility("default"))) void april_ext_torch_free(void* ptr, size_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  run_hook([&] { april::alloc::global_allocator().free(reinterpret_cast<std::uintptr_t>(ptr)); });
}

}  // extern "C"
