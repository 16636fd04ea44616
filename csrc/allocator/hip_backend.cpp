// ROCm backend on HIP's virtual-memory API. libamdhip64.so is dlopen'ed, so this compiles with the
// headers alone. Two ROCm quirks are handled here: before ROCm 7, hipMemCreate wants the size split
// into granularity-sized chunks; and physical memory only returns to the device once its address
// range is freed, which pause_frees_va() tells the core.
#include <hip/hip_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allocator/dynamic_library.h"
#include "allocator/gpu_backends.h"
#include "allocator/gpu_runtime.h"
#include "allocator/host_memory.h"
#include "allocator/staged_copy.h"
#include "common/error.h"

namespace april::alloc {

namespace {

// hipMemAllocationProp as ROCm 6 and later lay it out (the same shape as CUDA's); the headers this
// may be compiled against can be older, so the layout handed to the runtime is chosen at run time.
struct HipAllocationPropV6 {
  int type;
  int requested_handle_type;
  hipMemLocation location;
  void* win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
  } alloc_flags;
};

// The runtime entry points used, and what gpu_runtime.h needs to know of the runtime's types.
struct HipApi {
  using Result = hipError_t;
  using DevicePtr = hipDeviceptr_t;
  using Stream = hipStream_t;
  using Event = hipEvent_t;
  using AccessDesc = hipMemAccessDesc;
  static constexpr Result kSuccess = hipSuccess;
  static constexpr Result kOutOfMemory = hipErrorOutOfMemory;
  static constexpr const char* kErrorFallback = "HIP error";
  static constexpr unsigned kStreamNonBlocking = hipStreamNonBlocking;
  static constexpr unsigned kEventDisableTiming = hipEventDisableTiming;
  static constexpr hipMemLocationType kLocationDevice = hipMemLocationTypeDevice;
  static constexpr hipMemAccessFlags kAccessReadWrite = hipMemAccessFlagsProtReadWrite;
  static constexpr GpuCallNames kCalls = {
      "hipMemAddressReserve", "hipMemAddressFree", "hipMemSetAccess", "hipHostMalloc",
      "hipStreamCreateWithFlags", "hipEventCreateWithFlags", "hipEventRecord", "hipEventSynchronize",
      "hipMemcpyDtoHAsync", "hipMemcpyHtoDAsync"};

  hipError_t (*init)(unsigned int);
  const char* (*get_error_name)(hipError_t);
  const char* (*get_error_string)(hipError_t);
  hipError_t (*runtime_get_version)(int*);
  hipError_t (*get_device_count)(int*);
  hipError_t (*get_device)(int*);
  hipError_t (*set_device)(int);
  hipError_t (*device_synchronize)();
  hipError_t (*mem_get_info)(size_t*, size_t*);
  hipError_t (*get_granularity)(size_t*, const hipMemAllocationProp*, hipMemAllocationGranularity_flags);
  hipError_t (*address_reserve)(void**, size_t, size_t, void*, unsigned long long);
  hipError_t (*address_free)(void*, size_t);
  hipError_t (*create)(hipMemGenericAllocationHandle_t*, size_t, const hipMemAllocationProp*, unsigned long long);
  hipError_t (*release)(hipMemGenericAllocationHandle_t);
  hipError_t (*map)(void*, size_t, size_t, hipMemGenericAllocationHandle_t, unsigned long long);
  hipError_t (*set_access)(void*, size_t, const hipMemAccessDesc*, size_t);
  hipError_t (*unmap)(void*, size_t);
  hipError_t (*host_alloc)(void**, size_t, unsigned int);
  hipError_t (*free_host)(void*);
  hipError_t (*stream_create)(hipStream_t*, unsigned int);
  hipError_t (*stream_destroy)(hipStream_t);
  hipError_t (*event_create)(hipEvent_t*, unsigned);
  hipError_t (*event_destroy)(hipEvent_t);
  hipError_t (*event_record)(hipEvent_t, hipStream_t);
  hipError_t (*event_synchronize)(hipEvent_t);
  hipError_t (*memcpy_dtoh_async)(void*, hipDeviceptr_t, size_t, hipStream_t);
  hipError_t (*memcpy_htod_async)(hipDeviceptr_t, void*, size_t, hipStream_t);

  explicit HipApi(const DynamicLibrary& lib) {
    lib.load(init, "hipInit");
    lib.load(get_error_name, "hipGetErrorName");
    lib.load(get_error_string, "hipGetErrorString");
    lib.load(runtime_get_version, "hipRuntimeGetVersion");
    lib.load(get_device_count, "hipGetDeviceCount");
    lib.load(get_device, "hipGetDevice");
    lib.load(set_device, "hipSetDevice");
    lib.load(device_synchronize, "hipDeviceSynchronize");
    lib.load(mem_get_info, "hipMemGetInfo");
    lib.load(get_granularity, "hipMemGetAllocationGranularity");
    lib.load(address_reserve, "hipMemAddressReserve");
    lib.load(address_free, "hipMemAddressFree");
    lib.load(create, "hipMemCreate");
    lib.load(release, "hipMemRelease");
    lib.load(map, "hipMemMap");
    lib.load(set_access, "hipMemSetAccess");
    lib.load(unmap, "hipMemUnmap");
    lib.load(host_alloc, "hipHostMalloc");
    lib.load(free_host, "hipHostFree");
    lib.load(stream_create, "hipStreamCreateWithFlags");
    lib.load(stream_destroy, "hipStreamDestroy");
    lib.load(event_create, "hipEventCreateWithFlags");
    lib.load(event_destroy, "hipEventDestroy");
    lib.load(event_record, "hipEventRecord");
    lib.load(event_synchronize, "hipEventSynchronize");
    lib.load(memcpy_dtoh_async, "hipMemcpyDtoHAsync");
    lib.load(memcpy_htod_async, "hipMemcpyHtoDAsync");
  }

  void describe(hipError_t r, const char** name, const char** text) const {
    *name = get_error_name(r);
    *text = get_error_string(r);
  }
};

// hipMemCreate's handles of one physical allocation with their sizes: one handle, or one per
// granularity-sized chunk before ROCm 7.
using Chunks = std::vector<std::pair<hipMemGenericAllocationHandle_t, std::size_t>>;

// Sets the calling thread's device for the scope and puts the previous one back.
class DeviceScope {
 public:
  DeviceScope(const HipApi& api, int device);
  ~DeviceScope() {
    if (previous_ >= 0) (void)api_.set_device(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  const HipApi& api_;
  int previous_ = -1;
};

class HipBackend final : public Backend {
 public:
  HipBackend()
      : lib_({"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"}),
        api_(lib_),
        copy_ops_(api_) {
    check_call(api_.init(0), "hipInit");
    check_call(api_.get_device_count(&device_count_), "hipGetDeviceCount");
    int version = 0;
    check_call(api_.runtime_get_version(&version), "hipRuntimeGetVersion");
    // HIP_VERSION = major * 10000000 + minor * 100000 + patch.
    major_ = version / 10000000;
  }

  ~HipBackend() override {
    copy_ops_.clear();
    for (auto& [id, chunks] : handles_) {
      for (auto& chunk : chunks) (void)api_.release(chunk.first);
    }
  }

  const char* name() const override { return "hip"; }
  int device_count() override { return device_count_; }

  std::size_t granularity(int device) override {
    std::size_t g = 0;
    with_properties(device, [&](const hipMemAllocationProp* prop) {
      check_call(api_.get_granularity(&g, prop, hipMemAllocationGranularityMinimum), "hipMemGetAllocationGranularity");
    });
    return g;
  }

  void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) override {
    DeviceScope scope(api_, device);
    check_call(api_.mem_get_info(free_bytes, total_bytes), "hipMemGetInfo");
  }

  std::uintptr_t reserve(std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) override {
    return reserve_range(api_, size, alignment, fixed_addr);
  }

  void free_va(std::uintptr_t addr, std::size_t size) override { free_range(api_, addr, size); }

  PhysicalHandle create(std::size_t size, int device) override {
    std::size_t chunk = major_ < 7 ? granularity(device) : size;
    Chunks chunks;
    auto release_all = [&] {
      for (auto& c : chunks) (void)api_.release(c.first);
    };
    try {
      with_properties(device, [&](const hipMemAllocationProp* prop) {
        for (std::size_t offset = 0; offset < size; offset += chunk) {
          std::size_t len = std::min(chunk, size - offset);
          hipMemGenericAllocationHandle_t h = nullptr;
          check_call(api_.create(&h, len, prop, 0), "hipMemCreate");
          chunks.emplace_back(h, len);
        }
      });
    } catch (const Error&) {
      release_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    PhysicalHandle id = next_handle_++;
    handles_.emplace(id, std::move(chunks));
    return id;
  }

  void release(PhysicalHandle handle) override {
    Chunks chunks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = handles_.find(handle);
      if (it == handles_.end()) throw Error(ErrorKind::Internal, "hip backend: release of an unknown handle");
      chunks = std::move(it->second);
      handles_.erase(it);
    }
    for (auto& c : chunks) check_call(api_.release(c.first), "hipMemRelease");
  }

  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override {
    Chunks chunks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = handles_.find(handle);
      if (it == handles_.end()) throw Error(ErrorKind::Internal, "hip backend: map of an unknown handle");
      chunks = it->second;
    }
    std::size_t offset = 0;
    for (auto& c : chunks) {
      hipError_t r = api_.map(reinterpret_cast<void*>(addr + offset), c.second, 0, c.first, 0);
      if (r != hipSuccess) {
        for (std::size_t done = 0, k = 0; done < offset; done += chunks[k++].second) {
          (void)api_.unmap(reinterpret_cast<void*>(addr + done), chunks[k].second);
        }
        check_call(r, "hipMemMap");
      }
      offset += c.second;
    }
    (void)size;
    std::lock_guard<std::mutex> lock(mutex_);
    mapped_[addr] = std::move(chunks);
  }

  void set_access(std::uintptr_t addr, std::size_t size, int device) override {
    grant_access(api_, addr, size, device);
  }

  // Chunked mappings are unmapped chunk by chunk, as they were mapped.
  void unmap(std::uintptr_t addr, std::size_t size) override {
    Chunks chunks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = mapped_.find(addr);
      if (it != mapped_.end()) {
        chunks = std::move(it->second);
        mapped_.erase(it);
      }
    }
    if (chunks.size() <= 1) {
      check_call(api_.unmap(reinterpret_cast<void*>(addr), size), "hipMemUnmap");
      return;
    }
    std::size_t offset = 0;
    for (auto& c : chunks) {
      check_call(api_.unmap(reinterpret_cast<void*>(addr + offset), c.second), "hipMemUnmap");
      offset += c.second;
    }
  }

  void synchronize(int device) override {
    DeviceScope scope(api_, device);
    check_call(api_.device_synchronize(), "hipDeviceSynchronize");
  }

  // Handles are kept until pause: releasing a mapped handle early is not reliable on every ROCm.
  bool release_while_mapped() const override { return false; }
  bool pause_frees_va() const override { return true; }

  void* alloc_host(std::size_t size) override { return map_host_buffer(size); }
  void free_host(void* ptr, std::size_t size) noexcept override { unmap_host_buffer(ptr, size); }

  void copy_to_host(void* dst, std::uintptr_t src, std::size_t size, int device) override {
    DeviceScope scope(api_, device);
    staged_device_to_host(copy_ops_.get(device), dst, src, size);
  }

  void copy_from_host(std::uintptr_t dst, const void* src, std::size_t size, int device) override {
    DeviceScope scope(api_, device);
    staged_host_to_device(copy_ops_.get(device), dst, src, size);
  }

 private:
  void check_call(hipError_t r, const char* call) const { check_result(api_, r, call); }

  // Calls fn with pinned device memory properties in the layout of the runtime's version.
  template <typename Fn>
  void with_properties(int device, Fn&& fn) {
    auto pinned_on_device = [device](auto& prop) {
      prop.type = hipMemAllocationTypePinned;
      prop.location.type = hipMemLocationTypeDevice;
      prop.location.id = device;
    };
    if (major_ >= 6) {
      HipAllocationPropV6 prop = {};
      pinned_on_device(prop);
      fn(reinterpret_cast<const hipMemAllocationProp*>(&prop));
    } else {
      hipMemAllocationProp prop = {};
      pinned_on_device(prop);
      fn(&prop);
    }
  }

  DynamicLibrary lib_;
  HipApi api_;
  int device_count_ = 0;
  int major_ = 0;
  std::mutex mutex_;
  PhysicalHandle next_handle_ = 1;
  std::map<PhysicalHandle, Chunks> handles_;
  // Mapped ranges by address, with the chunks mapped there.
  std::map<std::uintptr_t, Chunks> mapped_;
  PinnedCopyOpsByDevice<HipApi> copy_ops_;
};

DeviceScope::DeviceScope(const HipApi& api, int device) : api_(api) {
  int current = -1;
  if (api_.get_device(&current) == hipSuccess && current != device) {
    if (api_.set_device(device) != hipSuccess) {
      throw Error(ErrorKind::Driver, "hipSetDevice(" + std::to_string(device) + ") failed");
    }
    previous_ = current;
  }
}

}  // namespace

std::unique_ptr<Backend> make_hip_backend() { return std::make_unique<HipBackend>(); }

}  // namespace april::alloc
