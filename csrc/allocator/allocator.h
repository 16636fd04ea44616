// The pause/resume allocator core: per-allocation metadata and the allocate / pause / resume / free
// state machine over any Backend. Thread-safe: one mutex guards all state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "allocator/backup_cache.h"
#include "allocator/cpu_backend.h"
#include "allocator/resources.h"

namespace april::alloc {

enum class DeviceKind { Cpu, Cuda, Hip };

const char* device_kind_name(DeviceKind kind);
// "cpu", "cuda" or "hip"; Error(InvalidArgument) otherwise.
DeviceKind parse_device_kind(const std::string& name);

struct Device {
  DeviceKind kind = DeviceKind::Cpu;
  int index = 0;
};

struct AllocationInfo {
  std::uintptr_t addr = 0;
  std::size_t logical_bytes = 0;   // what the caller asked for
  std::size_t physical_bytes = 0;  // rounded up to the backend's granularity
  Device device;
  std::string tag;
  bool cpu_backup = false;
  bool paused = false;
};

// What pause and resume of a tag have done so far: kept per tag, reported in its TagStats.
struct PauseHistory {
  std::uint64_t pauses = 0;
  std::uint64_t resumes = 0;
  double last_pause_seconds = 0;
  double last_resume_seconds = 0;
  std::size_t last_pause_copied_bytes = 0;
  std::size_t last_resume_copied_bytes = 0;
  double last_pause_copy_seconds = 0;   // the backup copy alone, within last_pause_seconds
  double last_resume_copy_seconds = 0;  // the restore copy alone, within last_resume_seconds
};

struct TagStats {
  std::string tag;
  bool paused = false;
  std::size_t allocations = 0;
  std::size_t logical_bytes = 0;
  std::size_t physical_bytes = 0;
  std::size_t resident_bytes = 0;  // physical bytes mapped now
  std::size_t backup_bytes = 0;    // host bytes holding backups now
  PauseHistory history;
};

struct BackendStatus {
  std::string name;
  bool compiled = false;
  bool usable = false;
  std::string reason;  // why it is not usable; empty when it is
};

class Allocator {
 public:
  Allocator();
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns the address of size bytes (size > 0) on device, accounted to tag. Throws
  // Error(InvalidState) when tag is paused, Error(OutOfMemory) when the device is full.
  std::uintptr_t allocate(std::size_t size, Device device, const std::string& tag, bool cpu_backup);
  // Frees an allocation in any state; a live one after its device finished the work queued on it.
  // Error(UnknownId) for an address it did not hand out.
  void free(std::uintptr_t addr);

  // Pauses one tag, or every active tag when tag is empty. Error(InvalidState) when the named tag is
  // already paused, Error(UnknownId) when it was never used, Error(OutOfMemory) when the host has no
  // room for the backups (then nothing of that tag is paused).
  void pause(const std::optional<std::string>& tag);
  // Resumes one tag, or every paused tag when tag is empty. Error(InvalidState) when the named tag is
  // active. Error(OutOfMemory) when the device has no room: then the tag stays paused, unchanged, and
  // resume can be called again. The same holds for a range a pause freed (ROCm) and could not
  // reserve again: resume reserves it first, and fails (tag still paused) while it cannot.
  void resume(const std::optional<std::string>& tag);

  AllocationInfo info(std::uintptr_t addr) const;
  std::vector<TagStats> stats() const;
  std::vector<BackendStatus> backends();
  std::size_t granularity(Device device);
  void memory_info(Device device, std::size_t* free_bytes, std::size_t* total_bytes);
  CpuBackend& cpu_backend() { return cpu_; }
  BackupCache& backup_cache() { return backup_cache_; }

 private:
  struct Allocation {
    std::size_t logical = 0;
    std::size_t physical = 0;
    Device device;
    std::string tag;
    bool cpu_backup = false;
    Backend* backend = nullptr;
    // Declared in acquisition order, so destruction unmaps before it releases before it frees the range.
    VaRange va;
    PhysicalMemory memory;
    Mapping mapping;
    HostBuffer backup;
    bool paused() const { return !mapping.held(); }
  };
  struct TagRecord {
    bool paused = false;
    PauseHistory history;
  };

  Backend& backend_locked(DeviceKind kind);
  std::vector<Allocation*> allocations_of(const std::string& tag);
  // Synchronizes each device the allocations live on, once.
  void synchronize_devices(const std::vector<Allocation*>& allocations);
  void pause_tag(const std::string& tag, TagRecord& record);
  void resume_tag(const std::string& tag, TagRecord& record);

  mutable std::mutex mutex_;
  CpuBackend cpu_;
  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> hip_;
  std::string cuda_error_;
  std::string hip_error_;
  // Declared after the backends and before the allocations: allocations give their backups back to
  // it when they die, and it frees what it keeps through the backends.
  BackupCache backup_cache_;
  std::map<std::uintptr_t, std::unique_ptr<Allocation>> allocations_;
  std::map<std::string, TagRecord> tags_;
};

}  // namespace april::alloc
