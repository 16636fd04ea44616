// RAII owners of the backend resources one allocation holds. Each releases what it owns when it
// dies, so every failure path of allocate / pause / resume unwinds without leaking device memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "allocator/backend.h"
#include "allocator/backup_cache.h"

namespace april::alloc {

// A reserved virtual address range.
class VaRange {
 public:
  VaRange() = default;
  VaRange(Backend* backend, std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr);
  ~VaRange();
  VaRange(VaRange&& other) noexcept;
  VaRange& operator=(VaRange&& other) noexcept;
  VaRange(const VaRange&) = delete;
  VaRange& operator=(const VaRange&) = delete;

  std::uintptr_t addr() const { return addr_; }
  std::size_t size() const { return size_; }
  // Frees the range now, reporting a failure (the destructor swallows it).
  void reset();

 private:
  Backend* backend_ = nullptr;
  std::uintptr_t addr_ = 0;
  std::size_t size_ = 0;
};

// Physical memory on a device, as long as the handle has not been released.
class PhysicalMemory {
 public:
  PhysicalMemory() = default;
  PhysicalMemory(Backend* backend, std::size_t size, int device);
  ~PhysicalMemory();
  PhysicalMemory(PhysicalMemory&& other) noexcept;
  PhysicalMemory& operator=(PhysicalMemory&& other) noexcept;
  PhysicalMemory(const PhysicalMemory&) = delete;
  PhysicalMemory& operator=(const PhysicalMemory&) = delete;

  bool held() const { return backend_ != nullptr; }
  PhysicalHandle handle() const { return handle_; }
  void reset();

 private:
  Backend* backend_ = nullptr;
  PhysicalHandle handle_ = 0;
};

// Physical memory mapped into a reserved range and made accessible.
class Mapping {
 public:
  Mapping() = default;
  Mapping(Backend* backend, std::uintptr_t addr, std::size_t size, const PhysicalMemory& memory, int device);
  ~Mapping();
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  bool active() const { return backend_ != nullptr; }
  void reset();

 private:
  Backend* backend_ = nullptr;
  std::uintptr_t addr_ = 0;
  std::size_t size_ = 0;
};

// A host buffer holding the backup of a paused allocation, taken from and given back to the cache.
class HostBuffer {
 public:
  HostBuffer() = default;
  // Throws Error(OutOfMemory) when the host has no room.
  HostBuffer(BackupCache* cache, Backend* backend, std::size_t size);
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool held() const { return data_ != nullptr; }
  void reset() noexcept;

 private:
  BackupCache* cache_ = nullptr;
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace april::alloc
