#include "allocator/allocator.h"

#include <chrono>
#include <cstdio>
#include <limits>
#include <set>
#include <utility>

#include "allocator/gpu_backends.h"
#include "common/error.h"

namespace april::alloc {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string hex(std::uintptr_t addr) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(addr));
  return buf;
}

// A GPU backend is created on first use; a failed creation is remembered, so later calls report
// the same reason without loading the driver again.
template <typename Make>
Backend& create_once(std::unique_ptr<Backend>& backend, std::string& error, Make make) {
  if (!backend) {
    if (!error.empty()) throw Error(ErrorKind::Driver, error);
    try {
      backend = make();
    } catch (const Error& e) {
      error = e.what();
      throw;
    }
  }
  return *backend;
}

}  // namespace

const char* device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::Cpu: return "cpu";
    case DeviceKind::Cuda: return "cuda";
    case DeviceKind::Hip: return "hip";
  }
  return "unknown";
}

DeviceKind parse_device_kind(const std::string& name) {
  if (name == "cpu") return DeviceKind::Cpu;
  if (name == "cuda") return DeviceKind::Cuda;
  if (name == "hip") return DeviceKind::Hip;
  throw Error(ErrorKind::InvalidArgument, "device kind '" + name + "' is not allowed: use 'cpu', 'cuda' or 'hip'");
}

Allocator::Allocator() = default;
Allocator::~Allocator() = default;

Backend& Allocator::backend_locked(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::Cpu: return cpu_;
    case DeviceKind::Cuda:
#ifdef APRIL_EXT_WITH_CUDA
      return create_once(cuda_, cuda_error_, make_cuda_backend);
#else
      throw Error(ErrorKind::InvalidArgument, "device kind 'cuda': april_ext was built without the CUDA backend");
#endif
    case DeviceKind::Hip:
#ifdef APRIL_EXT_WITH_HIP
      return create_once(hip_, hip_error_, make_hip_backend);
#else
      throw Error(ErrorKind::InvalidArgument, "device kind 'hip': april_ext was built without the ROCm backend");
#endif
  }
  throw Error(ErrorKind::InvalidArgument, "unknown device kind");
}

std::vector<BackendStatus> Allocator::backends() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BackendStatus> out;
  for (DeviceKind kind : {DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Hip}) {
    BackendStatus s;
    s.name = device_kind_name(kind);
    s.compiled = kind == DeviceKind::Cpu;
#ifdef APRIL_EXT_WITH_CUDA
    s.compiled = s.compiled || kind == DeviceKind::Cuda;
#endif
#ifdef APRIL_EXT_WITH_HIP
    s.compiled = s.compiled || kind == DeviceKind::Hip;
#endif
    if (!s.compiled) {
      s.reason = "not compiled in (its headers were not found at build time)";
    } else {
      try {
        Backend& b = backend_locked(kind);
        s.usable = b.device_count() > 0;
        if (!s.usable) s.reason = "no device";
      } catch (const Error& e) {
        s.reason = e.what();
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::size_t Allocator::granularity(Device device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return backend_locked(device.kind).granularity(device.index);
}

void Allocator::memory_info(Device device, std::size_t* free_bytes, std::size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  backend_locked(device.kind).memory_info(device.index, free_bytes, total_bytes);
}

std::uintptr_t Allocator::allocate(std::size_t size, Device device, const std::string& tag, bool cpu_backup) {
  check(size > 0, ErrorKind::InvalidArgument, "size must be > 0, got 0");
  check(!tag.empty(), ErrorKind::InvalidArgument, "tag must be a non-empty string");
  std::lock_guard<std::mutex> lock(mutex_);
  Backend& b = backend_locked(device.kind);
  int count = b.device_count();
  check(device.index >= 0 && device.index < count, ErrorKind::InvalidArgument,
        std::string("device index ") + std::to_string(device.index) + " is out of range for " +
            device_kind_name(device.kind) + " (" + std::to_string(count) + " device(s))");
  auto rec = tags_.find(tag);
  check(rec == tags_.end() || !rec->second.paused, ErrorKind::InvalidState,
        "tag '" + tag + "' is paused: resume it before allocating in it");

  auto a = std::make_unique<Allocation>();
  std::size_t gran = b.granularity(device.index);
  // Rounding up to the granularity must not wrap around to a tiny (or zero) physical size.
  const std::size_t largest = std::numeric_limits<std::size_t>::max() / gran * gran;
  check(size <= largest, ErrorKind::InvalidArgument,
        "size " + std::to_string(size) + " bytes is over the largest allocation of " + std::to_string(largest) +
            " bytes (the size_t range rounded down to the granularity " + std::to_string(gran) + ")");
  a->logical = size;
  a->physical = round_up(size, gran);
  a->device = device;
  a->tag = tag;
  a->cpu_backup = cpu_backup;
  a->backend = &b;
  a->va = VaRange(&b, a->physical, gran, 0);
  PhysicalMemory memory(&b, a->physical, device.index);
  a->mapping = Mapping(&b, a->va.addr(), a->physical, memory, device.index);
  if (b.release_while_mapped()) {
    memory.reset();
  } else {
    a->memory = std::move(memory);
  }
  std::uintptr_t addr = a->va.addr();
  tags_[tag];
  allocations_.emplace(addr, std::move(a));
  return addr;
}

void Allocator::free(std::uintptr_t addr) {
  std::unique_ptr<Allocation> victim;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = allocations_.find(addr);
    check(it != allocations_.end(), ErrorKind::UnknownId,
          "free of " + hex(addr) + ": not an address this allocator handed out (or freed twice)");
    // Before anything changes: a failed synchronize leaves the allocation as it was.
    if (!it->second->paused()) it->second->backend->synchronize(it->second->device.index);
    victim = std::move(it->second);
    allocations_.erase(it);
    // Released in order and with errors reported; the destructor would drop them.
    victim->backup.reset();
    victim->mapping.reset();
    victim->memory.reset();
    victim->va.reset();
  }
}

std::vector<Allocator::Allocation*> Allocator::allocations_of(const std::string& tag) {
  std::vector<Allocation*> out;
  for (auto& [addr, a] : allocations_) {
    if (a->tag == tag) out.push_back(a.get());
  }
  return out;
}

void Allocator::pause(const std::optional<std::string>& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tag) {
    auto it = tags_.find(*tag);
    check(it != tags_.end(), ErrorKind::UnknownId, "pause: unknown tag '" + *tag + "' (no allocation used it)");
    bool all_paused = true;
    for (Allocation* a : allocations_of(*tag)) all_paused = all_paused && a->paused();
    check(!(it->second.paused && all_paused), ErrorKind::InvalidState, "pause: tag '" + *tag + "' is already paused");
    pause_tag(*tag, it->second);
    return;
  }
  for (auto& [name, record] : tags_) pause_tag(name, record);
}

void Allocator::pause_tag(const std::string& tag, TagRecord& record) {
  std::vector<Allocation*> todo;
  for (Allocation* a : allocations_of(tag)) {
    if (!a->paused()) todo.push_back(a);
  }
  if (record.paused && todo.empty()) return;
  auto start = std::chrono::steady_clock::now();
  synchronize_devices(todo);
  // Backups first: when the host has no room, nothing has been paused yet.
  std::vector<HostBuffer> backups(todo.size());
  try {
    for (std::size_t i = 0; i < todo.size(); ++i) {
      if (todo[i]->cpu_backup) backups[i] = HostBuffer(&backup_cache_, todo[i]->backend, todo[i]->logical);
    }
  } catch (const Error& e) {
    throw Error(e.kind(), "pause of tag '" + tag + "': " + e.what() + "; the tag stays active");
  }
  record.paused = true;
  std::size_t copied = 0;
  double copy_seconds = 0;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    Allocation* a = todo[i];
    std::uintptr_t addr = a->va.addr();
    if (backups[i].held()) {
      auto copy_start = std::chrono::steady_clock::now();
      a->backend->copy_to_host(backups[i].data(), addr, a->logical, a->device.index);
      copy_seconds += seconds_since(copy_start);
      copied += a->logical;
    }
    // The backup belongs to the allocation before the unmap, so a failing unmap cannot lose it.
    a->backup = std::move(backups[i]);
    a->mapping.reset();
    a->memory.reset();
    if (a->backend->pause_frees_va()) {
      std::size_t gran = a->backend->granularity(a->device.index);
      a->va.reset();
      try {
        a->va = VaRange(a->backend, a->physical, gran, addr);
      } catch (const Error& e) {
        // The allocation is paused with no range: resume reserves it again before mapping there.
        throw Error(e.kind(), "pause of tag '" + tag + "': the range at " + hex(addr) +
                                  " was freed to return its memory and could not be reserved again: " + e.what() +
                                  "; the allocation stays paused and resume reserves the range again");
      }
    }
  }
  record.history.pauses += 1;
  record.history.last_pause_seconds = seconds_since(start);
  record.history.last_pause_copied_bytes = copied;
  record.history.last_pause_copy_seconds = copy_seconds;
}

void Allocator::synchronize_devices(const std::vector<Allocation*>& allocations) {
  std::set<std::pair<Backend*, int>> devices;
  for (const Allocation* a : allocations) devices.emplace(a->backend, a->device.index);
  for (const auto& [backend, device] : devices) backend->synchronize(device);
}

void Allocator::resume(const std::optional<std::string>& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tag) {
    auto it = tags_.find(*tag);
    check(it != tags_.end(), ErrorKind::UnknownId, "resume: unknown tag '" + *tag + "' (no allocation used it)");
    check(it->second.paused, ErrorKind::InvalidState, "resume: tag '" + *tag + "' is not paused");
    resume_tag(*tag, it->second);
    return;
  }
  for (auto& [name, record] : tags_) {
    if (record.paused) resume_tag(name, record);
  }
}

void Allocator::resume_tag(const std::string& tag, TagRecord& record) {
  std::vector<Allocation*> todo;
  for (Allocation* a : allocations_of(tag)) {
    if (a->paused()) todo.push_back(a);
  }
  auto start = std::chrono::steady_clock::now();
  // A range a pause freed and could not reserve again (ROCm) is reserved first: memory is never
  // mapped at an address the allocator does not hold.
  for (Allocation* a : todo) {
    if (a->va.held()) continue;
    const std::uintptr_t addr = a->va.addr();
    try {
      a->va = VaRange(a->backend, a->physical, a->backend->granularity(a->device.index), addr);
    } catch (const Error& e) {
      throw Error(e.kind(), "resume of tag '" + tag + "': the range at " + hex(addr) +
                                " could not be reserved again: " + e.what() +
                                "; the tag stays paused: call resume again once the address is free");
    }
  }
  // All physical memory first: when the device is full, nothing has changed and resume can be retried.
  std::vector<PhysicalMemory> memory;
  memory.reserve(todo.size());
  std::size_t needed = 0;
  for (Allocation* a : todo) needed += a->physical;
  try {
    for (Allocation* a : todo) memory.emplace_back(a->backend, a->physical, a->device.index);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::OutOfMemory) throw;
    throw Error(ErrorKind::OutOfMemory, "resume of tag '" + tag + "' needs " + std::to_string(needed) +
                                            " bytes: " + e.what() +
                                            "; the tag stays paused: free memory and call resume again");
  }
  std::size_t copied = 0;
  double copy_seconds = 0;
  for (std::size_t i = 0; i < todo.size(); ++i) {
    Allocation* a = todo[i];
    Mapping mapping(a->backend, a->va.addr(), a->physical, memory[i], a->device.index);
    if (a->backup.held()) {
      auto copy_start = std::chrono::steady_clock::now();
      a->backend->copy_from_host(a->va.addr(), a->backup.data(), a->logical, a->device.index);
      copy_seconds += seconds_since(copy_start);
      copied += a->logical;
    }
    a->mapping = std::move(mapping);
    if (a->backend->release_while_mapped()) {
      memory[i].reset();
    } else {
      a->memory = std::move(memory[i]);
    }
    a->backup.reset();
  }
  record.paused = false;
  record.history.resumes += 1;
  record.history.last_resume_seconds = seconds_since(start);
  record.history.last_resume_copied_bytes = copied;
  record.history.last_resume_copy_seconds = copy_seconds;
}

AllocationInfo Allocator::info(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = allocations_.find(addr);
  check(it != allocations_.end(), ErrorKind::UnknownId, "no allocation at " + hex(addr));
  const Allocation& a = *it->second;
  AllocationInfo out;
  out.addr = addr;
  out.logical_bytes = a.logical;
  out.physical_bytes = a.physical;
  out.device = a.device;
  out.tag = a.tag;
  out.cpu_backup = a.cpu_backup;
  out.paused = a.paused();
  return out;
}

std::vector<TagStats> Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, TagStats> by_tag;
  for (const auto& [name, record] : tags_) {
    TagStats& s = by_tag[name];
    s.tag = name;
    s.paused = record.paused;
    s.history = record.history;
  }
  for (const auto& [addr, a] : allocations_) {
    TagStats& s = by_tag[a->tag];
    s.allocations += 1;
    s.logical_bytes += a->logical;
    s.physical_bytes += a->physical;
    if (!a->paused()) s.resident_bytes += a->physical;
    if (a->backup.held()) s.backup_bytes += a->backup.size();
  }
  std::vector<TagStats> out;
  for (auto& [name, s] : by_tag) out.push_back(std::move(s));
  return out;
}

}  // namespace april::alloc
