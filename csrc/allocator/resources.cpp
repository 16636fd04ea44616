#include "allocator/resources.h"

#include <string>
#include <utility>

#include "common/error.h"

namespace april::alloc {

std::size_t round_up(std::size_t size, std::size_t granularity) {
  return (size + granularity - 1) / granularity * granularity;
}

// Destructors run on failure paths that already carry an error; a second failure while cleaning
// up cannot be reported better than the first, so it is dropped there and reported by reset().

VaRange::VaRange(Backend* backend, std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr)
    : backend_(backend), addr_(backend->reserve(size, alignment, fixed_addr)), size_(size) {}

VaRange::~VaRange() {
  try {
    reset();
  } catch (const Error&) {
  }
}

VaRange::VaRange(VaRange&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)), addr_(other.addr_), size_(other.size_) {}

VaRange& VaRange::operator=(VaRange&& other) noexcept {
  if (this != &other) {
    try {
      reset();
    } catch (const Error&) {
    }
    backend_ = std::exchange(other.backend_, nullptr);
    addr_ = other.addr_;
    size_ = other.size_;
  }
  return *this;
}

void VaRange::reset() {
  if (backend_ == nullptr) return;
  Backend* b = std::exchange(backend_, nullptr);
  b->free_va(addr_, size_);
}

PhysicalMemory::PhysicalMemory(Backend* backend, std::size_t size, int device)
    : backend_(backend), handle_(backend->create(size, device)) {}

PhysicalMemory::~PhysicalMemory() {
  try {
    reset();
  } catch (const Error&) {
  }
}

PhysicalMemory::PhysicalMemory(PhysicalMemory&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)), handle_(other.handle_) {}

PhysicalMemory& PhysicalMemory::operator=(PhysicalMemory&& other) noexcept {
  if (this != &other) {
    try {
      reset();
    } catch (const Error&) {
    }
    backend_ = std::exchange(other.backend_, nullptr);
    handle_ = other.handle_;
  }
  return *this;
}

void PhysicalMemory::reset() {
  if (backend_ == nullptr) return;
  Backend* b = std::exchange(backend_, nullptr);
  b->release(handle_);
}

Mapping::Mapping(Backend* backend, std::uintptr_t addr, std::size_t size, const PhysicalMemory& memory, int device) {
  backend->map(addr, size, memory.handle());
  try {
    backend->set_access(addr, size, device);
  } catch (const Error&) {
    try {
      backend->unmap(addr, size);
    } catch (const Error&) {
    }
    throw;
  }
  backend_ = backend;
  addr_ = addr;
  size_ = size;
}

Mapping::~Mapping() {
  try {
    reset();
  } catch (const Error&) {
  }
}

Mapping::Mapping(Mapping&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)), addr_(other.addr_), size_(other.size_) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    try {
      reset();
    } catch (const Error&) {
    }
    backend_ = std::exchange(other.backend_, nullptr);
    addr_ = other.addr_;
    size_ = other.size_;
  }
  return *this;
}

void Mapping::reset() {
  if (backend_ == nullptr) return;
  Backend* b = std::exchange(backend_, nullptr);
  b->unmap(addr_, size_);
}

HostBuffer::HostBuffer(BackupCache* cache, Backend* backend, std::size_t size)
    : cache_(cache), backend_(backend), size_(size) {
  data_ = cache->take(backend, size);
  if (data_ == nullptr) data_ = backend->alloc_host(size);
  if (data_ == nullptr) {
    backend_ = nullptr;
    throw Error(ErrorKind::OutOfMemory, "no host memory for a backup of " + std::to_string(size) + " bytes");
  }
}

HostBuffer::~HostBuffer() { reset(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : cache_(other.cache_),
      backend_(std::exchange(other.backend_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(other.size_) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    cache_ = other.cache_;
    backend_ = std::exchange(other.backend_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = other.size_;
  }
  return *this;
}

void HostBuffer::reset() noexcept {
  if (data_ == nullptr) return;
  cache_->give(backend_, data_, size_);
  backend_ = nullptr;
  data_ = nullptr;
}

}  // namespace april::alloc
