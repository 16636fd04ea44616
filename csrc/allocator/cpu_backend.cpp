#include "allocator/cpu_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "allocator/host_memory.h"
#include "common/error.h"

namespace april::alloc {

namespace {

std::string errno_text(const char* call) {
  int e = errno;
  return std::string(call) + " failed: " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
}

bool is_oom_errno(int e) { return e == ENOMEM || e == ENOSPC || e == EFBIG; }

}  // namespace

CpuBackend::CpuBackend() : page_size_(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))) {}

std::size_t CpuBackend::granularity(int) { return page_size_; }

void CpuBackend::memory_info(int, std::size_t* free_bytes, std::size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity_ != 0) {
    *total_bytes = capacity_;
    *free_bytes = capacity_ > committed_ ? capacity_ - committed_ : 0;
    return;
  }
  *total_bytes = static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * page_size_;
  *free_bytes = static_cast<std::size_t>(::sysconf(_SC_AVPHYS_PAGES)) * page_size_;
}

void CpuBackend::set_capacity(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = bytes;
}

std::size_t CpuBackend::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

std::size_t CpuBackend::committed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return committed_;
}

CpuBackend::Op CpuBackend::parse_op(const std::string& name) {
  if (name == "reserve_at") return Op::ReserveAt;
  if (name == "unmap") return Op::Unmap;
  throw Error(ErrorKind::InvalidArgument, "fault operation '" + name + "' is not allowed: use 'reserve_at' or 'unmap'");
}

void CpuBackend::inject_faults(Op op, int count, bool foreign) {
  check(count >= 0, ErrorKind::InvalidArgument, "count must be >= 0, got " + std::to_string(count));
  std::lock_guard<std::mutex> lock(mutex_);
  faults_[op] = Fault{count, foreign};
}

void CpuBackend::maybe_fail(Op op, const char* what) {
  bool foreign = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = faults_.find(op);
    if (it == faults_.end() || it->second.count == 0) return;
    it->second.count -= 1;
    foreign = it->second.foreign;
  }
  const std::string message = std::string("cpu backend: injected failure of ") + what;
  if (foreign) throw std::runtime_error(message);
  throw Error(ErrorKind::Driver, message);
}

void CpuBackend::synchronize(int) { synchronize_calls_.fetch_add(1); }

std::uintptr_t CpuBackend::reserve(std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) {
  if (fixed_addr != 0) maybe_fail(Op::ReserveAt, "reserving address space at a fixed address");
  // Alignment beyond a page is obtained by over-reserving and trimming the ends.
  std::size_t extra = alignment > page_size_ ? alignment : 0;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  void* hint = reinterpret_cast<void*>(fixed_addr);
  if (fixed_addr != 0) {
    extra = 0;
#ifdef MAP_FIXED_NOREPLACE
    flags |= MAP_FIXED_NOREPLACE;
#endif
  }
  void* p = ::mmap(hint, size + extra, PROT_NONE, flags, -1, 0);
  if (p == MAP_FAILED) {
    bool oom = errno == ENOMEM;
    throw Error(oom ? ErrorKind::OutOfMemory : ErrorKind::Driver, "reserving address space: " + errno_text("mmap"));
  }
  auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (fixed_addr != 0 && addr != fixed_addr) {
    ::munmap(p, size);
    throw Error(ErrorKind::Driver, "reserving address space at a fixed address: the kernel placed it elsewhere");
  }
  if (extra != 0) {
    std::uintptr_t aligned = (addr + alignment - 1) / alignment * alignment;
    if (aligned > addr) ::munmap(p, aligned - addr);
    std::uintptr_t end = addr + size + extra;
    if (end > aligned + size) ::munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
    addr = aligned;
  }
  return addr;
}

void CpuBackend::free_va(std::uintptr_t addr, std::size_t size) {
  if (::munmap(reinterpret_cast<void*>(addr), size) != 0) {
    throw Error(ErrorKind::Driver, "freeing address space: " + errno_text("munmap"));
  }
}

PhysicalHandle CpuBackend::create(std::size_t size, int) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (capacity_ != 0 && committed_ + size > capacity_) {
      throw Error(ErrorKind::OutOfMemory, "cpu backend: " + std::to_string(size) + " bytes requested, " +
                                              std::to_string(capacity_ - committed_) + " of the capacity of " +
                                              std::to_string(capacity_) + " bytes free");
    }
    committed_ += size;
  }
  auto uncommit = [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    committed_ -= size;
  };
  int fd = ::memfd_create("april_ext", MFD_CLOEXEC);
  if (fd < 0) {
    uncommit();
    throw Error(ErrorKind::Driver, "creating physical memory: " + errno_text("memfd_create"));
  }
  // fallocate takes the pages now, so that a full host fails here with an error instead of a SIGBUS
  // on first touch.
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 || ::fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0) {
    int e = errno;
    std::string msg = "creating " + std::to_string(size) + " bytes of physical memory: " + errno_text("fallocate");
    ::close(fd);
    uncommit();
    throw Error(is_oom_errno(e) ? ErrorKind::OutOfMemory : ErrorKind::Driver, msg);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  handles_[fd] = Handle{size, false};
  return static_cast<PhysicalHandle>(fd);
}

void CpuBackend::release(PhysicalHandle handle) {
  int fd = static_cast<int>(handle);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = handles_.find(fd);
    if (it == handles_.end()) throw Error(ErrorKind::Internal, "cpu backend: release of an unknown handle");
    // A mapped memfd lives on in its mapping; its bytes are uncommitted when the mapping goes.
    if (!it->second.mapped) committed_ -= it->second.size;
    handles_.erase(it);
  }
  ::close(fd);
}

void CpuBackend::map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) {
  int fd = static_cast<int>(handle);
  // Mapped accessible and populated: one kernel call fills the page tables, where first-touch
  // faults (one per 4 KiB page) would halve the bandwidth of a restore copy. set_access still
  // applies the protection the core asks for.
  void* p = ::mmap(reinterpret_cast<void*>(addr), size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE,
                   fd, 0);
  if (p == MAP_FAILED) throw Error(ErrorKind::Driver, "mapping physical memory: " + errno_text("mmap"));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = handles_.find(fd);
  if (it != handles_.end()) {
    it->second.mapped = true;
    mapped_ranges_[addr] = it->second.size;
  }
}

void CpuBackend::set_access(std::uintptr_t addr, std::size_t size, int) {
  if (::mprotect(reinterpret_cast<void*>(addr), size, PROT_READ | PROT_WRITE) != 0) {
    throw Error(ErrorKind::Driver, "setting access: " + errno_text("mprotect"));
  }
}

void CpuBackend::unmap(std::uintptr_t addr, std::size_t size) {
  maybe_fail(Op::Unmap, "unmapping physical memory");
  // Replacing the mapping (rather than munmap) keeps the range reserved for the resume.
  void* p = ::mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) throw Error(ErrorKind::Driver, "unmapping physical memory: " + errno_text("mmap"));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = mapped_ranges_.find(addr);
  if (it != mapped_ranges_.end()) {
    committed_ -= it->second;
    mapped_ranges_.erase(it);
  }
}

void* CpuBackend::alloc_host(std::size_t size) { return map_host_buffer(size); }

void CpuBackend::free_host(void* ptr, std::size_t size) noexcept { unmap_host_buffer(ptr, size); }

void CpuBackend::copy_to_host(void* dst, std::uintptr_t src, std::size_t size, int) {
  parallel_copy(dst, reinterpret_cast<const void*>(src), size);
}

void CpuBackend::copy_from_host(std::uintptr_t dst, const void* src, std::size_t size, int) {
  parallel_copy(reinterpret_cast<void*>(dst), src, size);
}

}  // namespace april::alloc
