// Device <-> pageable host copies through pinned staging buffers, pipelined: while the device copies
// one chunk into (or out of) one staging buffer, the host threads move the previous chunk between
// the other staging buffer and the backup. Shared by the CUDA and HIP backends.
#pragma once

#include <cstddef>
#include <cstdint>

namespace april::alloc {

// The asynchronous operations a GPU runtime provides, on one stream with one event per slot.
class AsyncCopyOps {
 public:
  static constexpr int kSlots = 2;
  virtual ~AsyncCopyOps() = default;
  // Pinned host buffer of kChunkBytes for a slot (allocated once, freed by the implementation).
  virtual void* staging(int slot) = 0;
  virtual void device_to_host_async(void* dst, std::uintptr_t src, std::size_t size, int slot) = 0;
  virtual void host_to_device_async(std::uintptr_t dst, const void* src, std::size_t size, int slot) = 0;
  // Blocks until the last copy issued on slot has finished.
  virtual void wait(int slot) = 0;
};

constexpr std::size_t kChunkBytes = 64u << 20;

void staged_device_to_host(AsyncCopyOps& ops, void* dst, std::uintptr_t src, std::size_t size);
void staged_host_to_device(AsyncCopyOps& ops, std::uintptr_t dst, const void* src, std::size_t size);

}  // namespace april::alloc
