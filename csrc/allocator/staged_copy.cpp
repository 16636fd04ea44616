#include "allocator/staged_copy.h"

#include <algorithm>

#include "allocator/host_memory.h"

namespace april::alloc {

void staged_device_to_host(AsyncCopyOps& ops, void* dst, std::uintptr_t src, std::size_t size) {
  const std::size_t chunks = (size + kChunkBytes - 1) / kChunkBytes;
  auto chunk_len = [&](std::size_t i) { return std::min(kChunkBytes, size - i * kChunkBytes); };
  auto* out = static_cast<char*>(dst);
  for (std::size_t i = 0; i < chunks && i < AsyncCopyOps::kSlots; ++i) {
    ops.device_to_host_async(ops.staging(static_cast<int>(i)), src + i * kChunkBytes, chunk_len(i), static_cast<int>(i));
  }
  for (std::size_t i = 0; i < chunks; ++i) {
    int slot = static_cast<int>(i % AsyncCopyOps::kSlots);
    ops.wait(slot);
    parallel_copy(out + i * kChunkBytes, ops.staging(slot), chunk_len(i));
    std::size_t next = i + AsyncCopyOps::kSlots;
    if (next < chunks) ops.device_to_host_async(ops.staging(slot), src + next * kChunkBytes, chunk_len(next), slot);
  }
}

void staged_host_to_device(AsyncCopyOps& ops, std::uintptr_t dst, const void* src, std::size_t size) {
  const std::size_t chunks = (size + kChunkBytes - 1) / kChunkBytes;
  const auto* in = static_cast<const char*>(src);
  for (std::size_t i = 0; i < chunks; ++i) {
    int slot = static_cast<int>(i % AsyncCopyOps::kSlots);
    std::size_t len = std::min(kChunkBytes, size - i * kChunkBytes);
    // The staging buffer is free again once its previous upload has finished.
    if (i >= AsyncCopyOps::kSlots) ops.wait(slot);
    parallel_copy(ops.staging(slot), in + i * kChunkBytes, len);
    ops.host_to_device_async(dst + i * kChunkBytes, ops.staging(slot), len, slot);
  }
  for (int slot = 0; slot < AsyncCopyOps::kSlots && static_cast<std::size_t>(slot) < chunks; ++slot) ops.wait(slot);
}

}  // namespace april::alloc
