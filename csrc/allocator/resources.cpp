#include "allocator/resources.h"

#include <string>
#include <utility>

#include "common/error.h"

namespace april::alloc {

std::size_t round_up(std::size_t size, std::size_t granularity) {
  return (size + granularity - 1) / granularity * granularity;
}

void free_va_span(Backend& backend, const AddressSpan& span) { backend.free_va(span.addr, span.size); }

void unmap_span(Backend& backend, const AddressSpan& span) { backend.unmap(span.addr, span.size); }

void release_handle(Backend& backend, const PhysicalHandle& handle) { backend.release(handle); }

VaRange::VaRange(Backend* backend, std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr)
    : BackendResource(backend, AddressSpan{backend->reserve(size, alignment, fixed_addr), size}) {}

PhysicalMemory::PhysicalMemory(Backend* backend, std::size_t size, int device)
    : BackendResource(backend, backend->create(size, device)) {}

namespace {

// Maps memory at addr and grants the device access, unmapping again when access cannot be granted.
AddressSpan map_accessible(Backend* backend, std::uintptr_t addr, std::size_t size, const PhysicalMemory& memory,
                           int device) {
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
  return AddressSpan{addr, size};
}

}  // namespace

Mapping::Mapping(Backend* backend, std::uintptr_t addr, std::size_t size, const PhysicalMemory& memory, int device)
    : BackendResource(backend, map_accessible(backend, addr, size, memory, device)) {}

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
