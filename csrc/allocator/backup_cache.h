// Host buffers of resumed backups kept for the next pause of the same size, up to a byte limit.
// An RL loop pauses the same tags every step: a kept buffer is already faulted in, so the next
// backup copies at memcpy speed instead of paying first-touch page zeroing. Off (limit 0) by default,
// since kept buffers hold host memory while their tags are active.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>

#include "allocator/backend.h"

namespace april::alloc {

class BackupCache {
 public:
  BackupCache() = default;
  ~BackupCache();
  BackupCache(const BackupCache&) = delete;
  BackupCache& operator=(const BackupCache&) = delete;

  // Lowering the limit frees kept buffers until the rest fits.
  void set_limit(std::size_t bytes);
  std::size_t limit() const;
  std::size_t held() const;

  // A kept buffer of exactly size bytes from backend, or nullptr.
  void* take(Backend* backend, std::size_t size);
  // Keeps the buffer when it fits under the limit, else frees it.
  void give(Backend* backend, void* ptr, std::size_t size) noexcept;

 private:
  struct Entry {
    Backend* backend;
    void* ptr;
  };
  void trim_locked(std::size_t limit) noexcept;

  mutable std::mutex mutex_;
  std::size_t limit_ = 0;
  std::size_t held_ = 0;
  std::multimap<std::size_t, Entry> buffers_;
};

}  // namespace april::alloc
