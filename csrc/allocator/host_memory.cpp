#include "allocator/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace april::alloc {

namespace {
// Below this a slice is not worth a thread start.
constexpr std::size_t kMinSlice = 8u << 20;
constexpr unsigned kMaxThreads = 8;
}  // namespace

void* map_host_buffer(std::size_t size) noexcept {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
#ifdef MADV_HUGEPAGE
  // Fewer page faults on the first write of a large backup; advisory, so failure is harmless.
  ::madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void unmap_host_buffer(void* ptr, std::size_t size) noexcept {
  if (ptr != nullptr) ::munmap(ptr, size);
}

unsigned copy_threads(std::size_t size) {
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  std::size_t by_size = std::max<std::size_t>(1, size / kMinSlice);
  return static_cast<unsigned>(std::min<std::size_t>({hw, kMaxThreads, by_size}));
}

void parallel_copy(void* dst, const void* src, std::size_t size) {
  unsigned n = copy_threads(size);
  if (n <= 1) {
    std::memcpy(dst, src, size);
    return;
  }
  // Slices are multiples of 4 KiB so that no two threads touch the same destination page.
  std::size_t slice = ((size / n + 4095) / 4096) * 4096;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  std::vector<std::thread> workers;
  workers.reserve(n - 1);
  for (unsigned i = 1; i < n; ++i) {
    std::size_t begin = i * slice;
    if (begin >= size) break;
    std::size_t len = std::min(slice, size - begin);
    try {
      workers.emplace_back([=] { std::memcpy(d + begin, s + begin, len); });
    } catch (const std::system_error&) {
      std::memcpy(d + begin, s + begin, len);  // no thread to be had: copy this slice here
    }
  }
  std::memcpy(d, s, std::min(slice, size));
  for (auto& w : workers) w.join();
}

}  // namespace april::alloc
