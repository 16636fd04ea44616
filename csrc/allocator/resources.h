// RAII owners of the backend resources one allocation holds. Each releases what it owns when it
// dies, so every failure path of allocate / pause / resume unwinds without leaking device memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "allocator/backend.h"
#include "allocator/backup_cache.h"
#include "common/error.h"

namespace april::alloc {

// Where a range or mapping lies in the address space.
struct AddressSpan {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
};

// The backend call that gives each kind of resource back.
void free_va_span(Backend& backend, const AddressSpan& span);
void unmap_span(Backend& backend, const AddressSpan& span);
void release_handle(Backend& backend, const PhysicalHandle& handle);

// Owns one backend resource, described by a Value, and gives it back through Release when it dies
// or is reset. Moving transfers ownership; the moved-from owner holds nothing. The value stays
// readable after reset (pause re-reserves the same address it just freed).
template <class Value, void (*Release)(Backend&, const Value&)>
class BackendResource {
 public:
  BackendResource() = default;
  BackendResource(Backend* backend, Value value) : backend_(backend), value_(value) {}
  ~BackendResource();
  BackendResource(BackendResource&& other) noexcept;
  BackendResource& operator=(BackendResource&& other) noexcept;
  BackendResource(const BackendResource&) = delete;
  BackendResource& operator=(const BackendResource&) = delete;

  bool held() const { return backend_ != nullptr; }
  // Gives the resource back now, reporting a failure (the destructor swallows it).
  void reset();

 protected:
  const Value& value() const { return value_; }

 private:
  Backend* backend_ = nullptr;
  Value value_{};
};

// A reserved virtual address range.
class VaRange : public BackendResource<AddressSpan, free_va_span> {
 public:
  VaRange() = default;
  VaRange(Backend* backend, std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr);

  std::uintptr_t addr() const { return value().addr; }
  std::size_t size() const { return value().size; }
};

// Physical memory on a device, as long as the handle has not been released.
class PhysicalMemory : public BackendResource<PhysicalHandle, release_handle> {
 public:
  PhysicalMemory() = default;
  PhysicalMemory(Backend* backend, std::size_t size, int device);

  PhysicalHandle handle() const { return value(); }
};

// Physical memory mapped into a reserved range and made accessible.
class Mapping : public BackendResource<AddressSpan, unmap_span> {
 public:
  Mapping() = default;
  Mapping(Backend* backend, std::uintptr_t addr, std::size_t size, const PhysicalMemory& memory, int device);
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

// Destructors run on failure paths that already carry an error; a second failure while cleaning
// up cannot be reported better than the first, so it is dropped there (whatever its type: a
// destructor must not throw) and reported by reset().
template <class Value, void (*Release)(Backend&, const Value&)>
BackendResource<Value, Release>::~BackendResource() {
  try {
    reset();
  } catch (...) {
  }
}

template <class Value, void (*Release)(Backend&, const Value&)>
BackendResource<Value, Release>::BackendResource(BackendResource&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)), value_(other.value_) {}

template <class Value, void (*Release)(Backend&, const Value&)>
BackendResource<Value, Release>& BackendResource<Value, Release>::operator=(BackendResource&& other) noexcept {
  if (this != &other) {
    try {
      reset();
    } catch (...) {
    }
    backend_ = std::exchange(other.backend_, nullptr);
    value_ = other.value_;
  }
  return *this;
}

template <class Value, void (*Release)(Backend&, const Value&)>
void BackendResource<Value, Release>::reset() {
  if (backend_ == nullptr) return;
  Backend* b = std::exchange(backend_, nullptr);
  Release(*b, value_);
}

}  // namespace april::alloc
