// What the CUDA and HIP backends share. Where their virtual-memory and stream APIs differ only in names
// and types, the code is written once here over a runtime's API struct (CudaApi in cuda_backend.cpp,
// HipApi in hip_backend.cpp), so this header includes neither runtime's headers. An API struct has:
//   types         Result, DevicePtr, Stream, Event, AccessDesc
//   constants     kSuccess, kOutOfMemory (result codes); kErrorFallback (the name of an unknown error);
//                 kStreamNonBlocking, kEventDisableTiming, kLocationDevice, kAccessReadWrite (flags);
//                 kCalls, a GpuCallNames: the names that error messages give the calls below
//   entry points  address_reserve, address_free, set_access, host_alloc, free_host, stream_create,
//                 stream_destroy, event_create, event_destroy, event_record, event_synchronize,
//                 memcpy_dtoh_async, memcpy_htod_async: function pointers loaded from the runtime
//   describe(Result, const char** name, const char** text) const: the error's name and description,
//                 nullptr where the runtime has none
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "allocator/gpu_backends.h"
#include "allocator/staged_copy.h"
#include "common/error.h"

namespace april::alloc {

struct GpuCallNames {
  const char* address_reserve;
  const char* address_free;
  const char* set_access;
  const char* host_alloc;
  const char* stream_create;
  const char* event_create;
  const char* event_record;
  const char* event_synchronize;
  const char* memcpy_dtoh_async;
  const char* memcpy_htod_async;
};

// Throws the error of a failed call (see runtime_call_error); does nothing on success.
template <class Api>
void check_result(const Api& api, typename Api::Result r, const char* call) {
  if (r == Api::kSuccess) return;
  const char* name = nullptr;
  const char* text = nullptr;
  api.describe(r, &name, &text);
  throw runtime_call_error(call, static_cast<int>(r), name, text, Api::kErrorFallback, r == Api::kOutOfMemory);
}

// An address as the runtime's device pointer: an integer on CUDA, a pointer on HIP.
template <class Api>
typename Api::DevicePtr device_ptr(std::uintptr_t addr) {
  using DevicePtr = typename Api::DevicePtr;
  if constexpr (std::is_pointer_v<DevicePtr>) {
    return reinterpret_cast<DevicePtr>(addr);
  } else {
    return static_cast<DevicePtr>(addr);
  }
}

template <class DevicePtr>
std::uintptr_t address_of(DevicePtr ptr) {
  if constexpr (std::is_pointer_v<DevicePtr>) {
    return reinterpret_cast<std::uintptr_t>(ptr);
  } else {
    return static_cast<std::uintptr_t>(ptr);
  }
}

// Reserves size bytes of address space; with fixed_addr != 0 the range must start there (an error,
// with nothing left reserved, when the runtime places it elsewhere).
template <class Api>
std::uintptr_t reserve_range(const Api& api, std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) {
  typename Api::DevicePtr ptr{};
  check_result(api, api.address_reserve(&ptr, size, alignment, device_ptr<Api>(fixed_addr), 0),
               Api::kCalls.address_reserve);
  const std::uintptr_t addr = address_of(ptr);
  if (fixed_addr != 0 && addr != fixed_addr) {
    (void)api.address_free(ptr, size);
    throw Error(ErrorKind::Driver, std::string(Api::kCalls.address_reserve) + " did not return the requested address");
  }
  return addr;
}

template <class Api>
void free_range(const Api& api, std::uintptr_t addr, std::size_t size) {
  check_result(api, api.address_free(device_ptr<Api>(addr), size), Api::kCalls.address_free);
}

// Read-write access for device to a mapped range.
template <class Api>
void grant_access(const Api& api, std::uintptr_t addr, std::size_t size, int device) {
  typename Api::AccessDesc desc = {};
  desc.location.type = Api::kLocationDevice;
  desc.location.id = device;
  desc.flags = Api::kAccessReadWrite;
  check_result(api, api.set_access(device_ptr<Api>(addr), size, &desc, 1), Api::kCalls.set_access);
}

// One device's stream, an event per slot and pinned staging buffers for the pipelined backup copies
// (staged_copy.h). Made with the device's context current (CUDA) or the device set (HIP).
template <class Api>
class PinnedCopyOps final : public AsyncCopyOps {
 public:
  explicit PinnedCopyOps(const Api& api) : api_(api) {
    try {
      check(api_.stream_create(&stream_, Api::kStreamNonBlocking), Api::kCalls.stream_create);
      for (int i = 0; i < kSlots; ++i) {
        check(api_.event_create(&events_[i], Api::kEventDisableTiming), Api::kCalls.event_create);
        check(api_.host_alloc(&staging_[i], kChunkBytes, 0), Api::kCalls.host_alloc);  // 0: default flags
      }
    } catch (const Error&) {
      cleanup();
      throw;
    }
  }
  ~PinnedCopyOps() override { cleanup(); }
  PinnedCopyOps(const PinnedCopyOps&) = delete;
  PinnedCopyOps& operator=(const PinnedCopyOps&) = delete;

  void* staging(int slot) override { return staging_[slot]; }

  void device_to_host_async(void* dst, std::uintptr_t src, std::size_t size, int slot) override {
    check(api_.memcpy_dtoh_async(dst, device_ptr<Api>(src), size, stream_), Api::kCalls.memcpy_dtoh_async);
    check(api_.event_record(events_[slot], stream_), Api::kCalls.event_record);
  }

  void host_to_device_async(std::uintptr_t dst, const void* src, std::size_t size, int slot) override {
    // HIP declares the source non-const; neither runtime writes to it.
    check(api_.memcpy_htod_async(device_ptr<Api>(dst), const_cast<void*>(src), size, stream_),
          Api::kCalls.memcpy_htod_async);
    check(api_.event_record(events_[slot], stream_), Api::kCalls.event_record);
  }

  void wait(int slot) override { check(api_.event_synchronize(events_[slot]), Api::kCalls.event_synchronize); }

 private:
  void check(typename Api::Result r, const char* call) const { check_result(api_, r, call); }

  void cleanup() noexcept {
    for (int i = 0; i < kSlots; ++i) {
      if (staging_[i] != nullptr) (void)api_.free_host(staging_[i]);
      if (events_[i] != nullptr) (void)api_.event_destroy(events_[i]);
      staging_[i] = nullptr;
      events_[i] = nullptr;
    }
    if (stream_ != nullptr) (void)api_.stream_destroy(stream_);
    stream_ = nullptr;
  }

  const Api& api_;
  typename Api::Stream stream_ = nullptr;
  typename Api::Event events_[kSlots] = {};
  void* staging_[kSlots] = {};
};

// The PinnedCopyOps of each device, made on its first copy and kept until clear().
template <class Api>
class PinnedCopyOpsByDevice {
 public:
  explicit PinnedCopyOpsByDevice(const Api& api) : api_(api) {}

  AsyncCopyOps& get(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ops_.find(device);
    if (it == ops_.end()) it = ops_.emplace(device, std::make_unique<PinnedCopyOps<Api>>(api_)).first;
    return *it->second;
  }

  // Destroys them; a backend calls it before it gives up the contexts they were made in.
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.clear();
  }

 private:
  const Api& api_;
  std::mutex mutex_;
  std::map<int, std::unique_ptr<PinnedCopyOps<Api>>> ops_;
};

}  // namespace april::alloc
