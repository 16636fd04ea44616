#include "allocator/backup_cache.h"

#include <iterator>

namespace april::alloc {

BackupCache::~BackupCache() { trim_locked(0); }

void BackupCache::set_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
  trim_locked(bytes);
}

std::size_t BackupCache::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

std::size_t BackupCache::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}

void* BackupCache::take(Backend* backend, std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto range = buffers_.equal_range(size);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second.backend == backend) {
      void* ptr = it->second.ptr;
      buffers_.erase(it);
      held_ -= size;
      return ptr;
    }
  }
  return nullptr;
}

void BackupCache::give(Backend* backend, void* ptr, std::size_t size) noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + size <= limit_) {
      buffers_.emplace(size, Entry{backend, ptr});
      held_ += size;
      return;
    }
  }
  backend->free_host(ptr, size);
}

void BackupCache::trim_locked(std::size_t limit) noexcept {
  // Largest first: the fewest buffers freed for the bytes returned.
  while (held_ > limit && !buffers_.empty()) {
    auto it = std::prev(buffers_.end());
    it->second.backend->free_host(it->second.ptr, it->first);
    held_ -= it->first;
    buffers_.erase(it);
  }
}

}  // namespace april::alloc
