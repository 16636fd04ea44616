// The backend interface of the pause/resume allocator: the handful of virtual-memory operations that
// the core composes into allocate / pause / resume / free. One implementation per memory kind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace april::alloc {

// An opaque handle to physical memory (a CUmemGenericAllocationHandle, a hipMemGenericAllocationHandle_t
// or a memfd): only the backend that created it knows what it is.
using PhysicalHandle = std::uint64_t;

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const char* name() const = 0;
  virtual int device_count() = 0;
  // Physical allocations and mappings are made in multiples of this size.
  virtual std::size_t granularity(int device) = 0;
  // (free, total) bytes of the device as the driver sees them.
  virtual void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) = 0;

  // Reserves size bytes of address space; with fixed_addr != 0 the range must start there.
  virtual std::uintptr_t reserve(std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) = 0;
  virtual void free_va(std::uintptr_t addr, std::size_t size) = 0;
  // Throws Error(OutOfMemory) when the device has no room, Error(Driver) for any other failure.
  virtual PhysicalHandle create(std::size_t size, int device) = 0;
  virtual void release(PhysicalHandle handle) = 0;
  virtual void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) = 0;
  virtual void set_access(std::uintptr_t addr, std::size_t size, int device) = 0;
  virtual void unmap(std::uintptr_t addr, std::size_t size) = 0;
  // Waits for the work queued on device. The core calls it before it unmaps memory of a live
  // allocation (free) or copies / unmaps a tag's memory (pause): a kernel still queued on that
  // memory would otherwise read or write an unmapped address.
  virtual void synchronize(int device) = 0;

  // Whether a handle may be released right after map (the mapping keeps the memory alive), which
  // saves holding one handle (an fd on the CPU) per live allocation.
  virtual bool release_while_mapped() const = 0;
  // Whether physical memory only goes back to the device once its address range is freed (ROCm):
  // then pause frees the range and reserves the same address again.
  virtual bool pause_frees_va() const = 0;

  // Host memory for backups (pageable; GPU backends stage through pinned buffers of their own).
  // Returns nullptr when the host has no room.
  virtual void* alloc_host(std::size_t size) = 0;
  virtual void free_host(void* ptr, std::size_t size) noexcept = 0;
  virtual void copy_to_host(void* dst, std::uintptr_t src, std::size_t size, int device) = 0;
  virtual void copy_from_host(std::uintptr_t dst, const void* src, std::size_t size, int device) = 0;
};

// Rounds size up to a multiple of granularity (a power of two or any positive value).
std::size_t round_up(std::size_t size, std::size_t granularity);

}  // namespace april::alloc
