// The one piece of process-wide state: the allocator instance behind the torch pluggable-allocator
// C symbols (torch calls them with no context argument), and the calling thread's region stack that
// tells those symbols which tag an allocation belongs to.
#pragma once

#include <string>

#include "allocator/allocator.h"

namespace april::alloc {

Allocator& global_allocator();

struct RegionFrame {
  std::string tag;
  bool cpu_backup = false;
};

// Thread-local: regions entered on one thread never tag allocations made on another.
void push_region(const std::string& tag, bool cpu_backup);
// Error(InvalidState) when the thread has no open region.
void pop_region();
// nullptr when the calling thread is outside every region.
const RegionFrame* current_region();

// The GPU kind the torch hooks allocate on (CUDA or HIP), fixed once when the hooks are installed.
void set_hook_device_kind(DeviceKind kind);
DeviceKind hook_device_kind();
// The last error of a torch hook on this thread (the hooks cannot throw into torch); empty if none.
std::string take_hook_error();
// Never throws: the hooks call it from their catch handlers.
void set_hook_error(const char* message) noexcept;

// Names of the C symbols exported for torch.cuda.memory.CUDAPluggableAllocator.
const char* torch_malloc_symbol();
const char* torch_free_symbol();

}  // namespace april::alloc
