// Host-memory helpers shared by the backends: page-aligned anonymous buffers for backups and a
// multi-threaded chunked memcpy, so a backup runs near the machine's copy bandwidth.
#pragma once

#include <cstddef>

namespace april::alloc {

// Anonymous private mapping with transparent huge pages requested; nullptr when the host has no room.
void* map_host_buffer(std::size_t size) noexcept;
void unmap_host_buffer(void* ptr, std::size_t size) noexcept;

// memcpy split across worker threads in contiguous slices; small copies stay on the calling thread.
void parallel_copy(void* dst, const void* src, std::size_t size);

// Threads parallel_copy uses for a copy of this many bytes.
unsigned copy_threads(std::size_t size);

}  // namespace april::alloc
