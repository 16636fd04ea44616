// CUDA backend on the driver's virtual-memory API. libcuda.so.1 is dlopen'ed, so this compiles with
// the headers alone and a build imports on machines without a driver.
#include <cuda.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "allocator/dynamic_library.h"
#include "allocator/gpu_backends.h"
#include "allocator/gpu_runtime.h"
#include "allocator/host_memory.h"
#include "allocator/staged_copy.h"
#include "common/error.h"

namespace april::alloc {

namespace {

// The driver entry points used, resolved by their versioned ABI names, and what gpu_runtime.h needs to
// know of the driver's types.
struct CudaApi {
  using Result = CUresult;
  using DevicePtr = CUdeviceptr;
  using Stream = CUstream;
  using Event = CUevent;
  using AccessDesc = CUmemAccessDesc;
  static constexpr Result kSuccess = CUDA_SUCCESS;
  static constexpr Result kOutOfMemory = CUDA_ERROR_OUT_OF_MEMORY;
  static constexpr const char* kErrorFallback = "CUDA error";
  static constexpr unsigned kStreamNonBlocking = CU_STREAM_NON_BLOCKING;
  static constexpr unsigned kEventDisableTiming = CU_EVENT_DISABLE_TIMING;
  static constexpr CUmemLocationType kLocationDevice = CU_MEM_LOCATION_TYPE_DEVICE;
  static constexpr CUmemAccess_flags kAccessReadWrite = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  static constexpr GpuCallNames kCalls = {
      "cuMemAddressReserve", "cuMemAddressFree", "cuMemSetAccess", "cuMemHostAlloc", "cuStreamCreate",
      "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync"};

  decltype(&::cuInit) init;
  decltype(&::cuGetErrorName) get_error_name;
  decltype(&::cuGetErrorString) get_error_string;
  decltype(&::cuDeviceGetCount) device_get_count;
  decltype(&::cuDeviceGet) device_get;
  decltype(&::cuDeviceGetAttribute) device_get_attribute;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain;
  decltype(&::cuDevicePrimaryCtxRelease) primary_ctx_release;
  decltype(&::cuCtxGetCurrent) ctx_get_current;
  decltype(&::cuCtxSetCurrent) ctx_set_current;
  decltype(&::cuCtxGetDevice) ctx_get_device;
  decltype(&::cuCtxSynchronize) ctx_synchronize;
  decltype(&::cuMemGetInfo) mem_get_info;
  decltype(&::cuMemGetAllocationGranularity) get_granularity;
  decltype(&::cuMemAddressReserve) address_reserve;
  decltype(&::cuMemAddressFree) address_free;
  decltype(&::cuMemCreate) create;
  decltype(&::cuMemRelease) release;
  decltype(&::cuMemMap) map;
  decltype(&::cuMemSetAccess) set_access;
  decltype(&::cuMemUnmap) unmap;
  decltype(&::cuMemHostAlloc) host_alloc;
  decltype(&::cuMemFreeHost) free_host;
  decltype(&::cuStreamCreate) stream_create;
  decltype(&::cuStreamDestroy) stream_destroy;
  decltype(&::cuEventCreate) event_create;
  decltype(&::cuEventDestroy) event_destroy;
  decltype(&::cuEventRecord) event_record;
  decltype(&::cuEventSynchronize) event_synchronize;
  decltype(&::cuMemcpyDtoHAsync) memcpy_dtoh_async;
  decltype(&::cuMemcpyHtoDAsync) memcpy_htod_async;

  explicit CudaApi(const DynamicLibrary& lib) {
    lib.load(init, "cuInit");
    lib.load(get_error_name, "cuGetErrorName");
    lib.load(get_error_string, "cuGetErrorString");
    lib.load(device_get_count, "cuDeviceGetCount");
    lib.load(device_get, "cuDeviceGet");
    lib.load(device_get_attribute, "cuDeviceGetAttribute");
    lib.load(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    lib.load(primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
    lib.load(ctx_get_current, "cuCtxGetCurrent");
    lib.load(ctx_set_current, "cuCtxSetCurrent");
    lib.load(ctx_get_device, "cuCtxGetDevice");
    lib.load(ctx_synchronize, "cuCtxSynchronize");
    lib.load(mem_get_info, "cuMemGetInfo_v2");
    lib.load(get_granularity, "cuMemGetAllocationGranularity");
    lib.load(address_reserve, "cuMemAddressReserve");
    lib.load(address_free, "cuMemAddressFree");
    lib.load(create, "cuMemCreate");
    lib.load(release, "cuMemRelease");
    lib.load(map, "cuMemMap");
    lib.load(set_access, "cuMemSetAccess");
    lib.load(unmap, "cuMemUnmap");
    lib.load(host_alloc, "cuMemHostAlloc");
    lib.load(free_host, "cuMemFreeHost");
    lib.load(stream_create, "cuStreamCreate");
    lib.load(stream_destroy, "cuStreamDestroy_v2");
    lib.load(event_create, "cuEventCreate");
    lib.load(event_destroy, "cuEventDestroy_v2");
    lib.load(event_record, "cuEventRecord");
    lib.load(event_synchronize, "cuEventSynchronize");
    lib.load(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
    lib.load(memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
  }

  void describe(CUresult r, const char** name, const char** text) const {
    get_error_name(r, name);
    get_error_string(r, text);
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() : lib_({"libcuda.so.1", "libcuda.so"}), api_(lib_), copy_ops_(api_) {
    check_call(api_.init(0), "cuInit");
    check_call(api_.device_get_count(&device_count_), "cuDeviceGetCount");
  }

  ~CudaBackend() override {
    copy_ops_.clear();
    for (auto& [device, dev] : retained_) api_.primary_ctx_release(dev);
  }

  const char* name() const override { return "cuda"; }
  int device_count() override { return device_count_; }

  std::size_t granularity(int device) override {
    CUmemAllocationProp prop = properties(device);
    std::size_t g = 0;
    check_call(api_.get_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
    return g;
  }

  void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) override {
    ContextScope scope(*this, device);
    check_call(api_.mem_get_info(free_bytes, total_bytes), "cuMemGetInfo");
  }

  std::uintptr_t reserve(std::size_t size, std::size_t alignment, std::uintptr_t fixed_addr) override {
    ContextScope scope(*this, kAnyDevice);
    return reserve_range(api_, size, alignment, fixed_addr);
  }

  void free_va(std::uintptr_t addr, std::size_t size) override {
    ContextScope scope(*this, kAnyDevice);
    free_range(api_, addr, size);
  }

  PhysicalHandle create(std::size_t size, int device) override {
    ContextScope scope(*this, device);
    last_device_ = device;
    CUmemAllocationProp prop = properties(device);
    CUmemGenericAllocationHandle handle = 0;
    check_call(api_.create(&handle, size, &prop, 0), "cuMemCreate");
    return static_cast<PhysicalHandle>(handle);
  }

  void release(PhysicalHandle handle) override {
    ContextScope scope(*this, kAnyDevice);
    check_call(api_.release(static_cast<CUmemGenericAllocationHandle>(handle)), "cuMemRelease");
  }

  void map(std::uintptr_t addr, std::size_t size, PhysicalHandle handle) override {
    ContextScope scope(*this, kAnyDevice);
    check_call(api_.map(static_cast<CUdeviceptr>(addr), size, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0),
               "cuMemMap");
  }

  void set_access(std::uintptr_t addr, std::size_t size, int device) override {
    ContextScope scope(*this, device);
    grant_access(api_, addr, size, device);
  }

  void unmap(std::uintptr_t addr, std::size_t size) override {
    ContextScope scope(*this, kAnyDevice);
    check_call(api_.unmap(static_cast<CUdeviceptr>(addr), size), "cuMemUnmap");
  }

  // The primary context is the one torch queues its kernels in.
  void synchronize(int device) override {
    ContextScope scope(*this, device);
    check_call(api_.ctx_synchronize(), "cuCtxSynchronize");
  }

  bool release_while_mapped() const override { return true; }
  bool pause_frees_va() const override { return false; }

  void* alloc_host(std::size_t size) override { return map_host_buffer(size); }
  void free_host(void* ptr, std::size_t size) noexcept override { unmap_host_buffer(ptr, size); }

  // The copy stream of a device was made in its context and is only used with that context current.
  void copy_to_host(void* dst, std::uintptr_t src, std::size_t size, int device) override {
    ContextScope scope(*this, device);
    staged_device_to_host(copy_ops_.get(device), dst, src, size);
  }

  void copy_from_host(std::uintptr_t dst, const void* src, std::size_t size, int device) override {
    ContextScope scope(*this, device);
    staged_host_to_device(copy_ops_.get(device), dst, src, size);
  }

 private:
  void check_call(CUresult r, const char* call) const { check_result(api_, r, call); }

  // For calls on address ranges and handles, which any context of the process serves.
  static constexpr int kAnyDevice = -1;

  // Driver calls need a current context on the calling thread, which may be any thread (a tensor
  // deleter, torch's free hook) with any context current, possibly another device's. For the scope
  // of a call on `device` its primary context (the one torch uses) is made current unless the
  // current context is already that device's; the thread's previous context is put back after.
  // kAnyDevice keeps any current context and falls back to the device of the last creation.
  class ContextScope {
   public:
    ContextScope(CudaBackend& backend, int device) : api_(backend.api_) {
      CUcontext current = nullptr;
      backend.check_call(api_.ctx_get_current(&current), "cuCtxGetCurrent");
      if (current != nullptr) {
        if (device == kAnyDevice) return;
        CUdevice current_device = 0;
        backend.check_call(api_.ctx_get_device(&current_device), "cuCtxGetDevice");
        if (current_device == backend.device_handle(device)) return;
      }
      CUcontext target = backend.primary_context(device == kAnyDevice ? backend.last_device_.load() : device);
      backend.check_call(api_.ctx_set_current(target), "cuCtxSetCurrent");
      previous_ = current;
      restore_ = true;
    }
    ~ContextScope() {
      if (restore_) (void)api_.ctx_set_current(previous_);
    }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

   private:
    const CudaApi& api_;
    CUcontext previous_ = nullptr;
    bool restore_ = false;
  };

  CUdevice device_handle(int device) {
    CUdevice dev = 0;
    check_call(api_.device_get(&dev, device), "cuDeviceGet");
    return dev;
  }

  // The device's primary context, retained on first use and released with the backend.
  CUcontext primary_context(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = contexts_.find(device);
    if (it == contexts_.end()) {
      CUdevice dev = device_handle(device);
      CUcontext ctx = nullptr;
      check_call(api_.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      retained_[device] = dev;
      it = contexts_.emplace(device, ctx).first;
    }
    return it->second;
  }

  // GPUDirect RDMA capable memory where the device supports it with VMM, so NCCL / RDMA NICs can
  // register region memory; the granularity is queried with the same properties.
  CUmemAllocationProp properties(int device) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.allocFlags.gpuDirectRDMACapable = rdma_capable(device) ? 1 : 0;
    return prop;
  }

  bool rdma_capable(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = rdma_.find(device);
    if (it != rdma_.end()) return it->second;
    CUdevice dev = 0;
    int value = 0;
    check_call(api_.device_get(&dev, device), "cuDeviceGet");
    if (api_.device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev) !=
        CUDA_SUCCESS) {
      value = 0;
    }
    rdma_[device] = value != 0;
    return value != 0;
  }

  DynamicLibrary lib_;
  CudaApi api_;
  int device_count_ = 0;
  std::atomic<int> last_device_{0};
  std::mutex mutex_;
  std::map<int, bool> rdma_;
  std::map<int, CUcontext> contexts_;
  std::map<int, CUdevice> retained_;
  PinnedCopyOpsByDevice<CudaApi> copy_ops_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace april::alloc
