// CPU backend: host memory with GPU virtual-memory semantics. A reservation is a PROT_NONE mapping;
// physical memory is a memfd mapped over it with MAP_FIXED; unmapping puts PROT_NONE anonymous memory
// back, so the pages return to the OS (RSS drops) while the address range stays reserved.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "allocator/backend.h"

namespace april::alloc {

class CpuBackend final : public Backend {
 public:
  CpuBackend();

  const char* name() const override { return "cpu"; }
  int device_count() override { return 1; }
  std::size_t granularity(int device) override;
  void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) override;

  std::uintptr_t reserve(std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) override;
  void free_va(std::uintptr_t addr, std::size_t size) override;
  PhysicalHandle create(std::size_t size, int device) override;
  void release(PhysicalHandle handle) override;
  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override;
  void set_access(std::uintptr_t addr, std::size_t size, int device) override;
  void unmap(std::uintptr_t addr, std::size_t size) override;
  // Host work is done when a call returns: nothing to wait for. Counted, so tests can see the core
  // synchronize where a GPU needs it.
  void synchronize(int device) override;
  bool release_while_mapped() const override { return true; }
  bool pause_frees_va() const override { return pause_frees_va_.load(); }

  void* alloc_host(std::size_t size) override;
  void free_host(void* ptr, std::size_t size) noexcept override;
  void copy_to_host(void* dst, std::uintptr_t src, std::size_t size, int device) override;
  void copy_from_host(std::uintptr_t dst, const void* src, std::size_t size, int device) override;

  // A simulated device size: physical memory beyond it fails with OutOfMemory, as a full GPU would.
  // 0 = no limit other than the host's.
  void set_capacity(std::size_t bytes);
  std::size_t capacity() const;
  std::size_t committed() const;
  std::size_t synchronize_calls() const { return synchronize_calls_.load(); }

  // Test support, so that the core's GPU-only paths run on the host. With pause_frees_va the
  // backend behaves as ROCm does: pause frees each range and reserves the same address again.
  void set_pause_frees_va(bool on) { pause_frees_va_.store(on); }
  // The operations a fault can be injected into.
  enum class Op { ReserveAt, Unmap };
  // Makes the next `count` calls of op fail: with Error(Driver), as a failing driver call would, or
  // with a std::runtime_error (foreign), as any other failure inside a call would.
  void inject_faults(Op op, int count, bool foreign);
  // "reserve_at" or "unmap"; Error(InvalidArgument) otherwise.
  static Op parse_op(const std::string& name);

 private:
  struct Fault {
    int count = 0;
    bool foreign = false;
  };
  // Throws the injected fault of op, if one is left.
  void maybe_fail(Op op, const char* what);

  struct Handle {
    std::size_t size;
    bool mapped;
  };
  std::size_t page_size_;
  mutable std::mutex mutex_;
  std::size_t capacity_ = 0;
  // Physical bytes that exist (created and not yet both released and unmapped).
  std::size_t committed_ = 0;
  // Open memfds by descriptor.
  std::unordered_map<int, Handle> handles_;
  // Mapped ranges: address -> bytes, uncommitted on unmap (the memfd may be released before).
  std::unordered_map<std::uintptr_t, std::size_t> mapped_ranges_;
  std::map<Op, Fault> faults_;
  std::atomic<std::size_t> synchronize_calls_{0};
  std::atomic<bool> pause_frees_va_{false};
};

}  // namespace april::alloc
