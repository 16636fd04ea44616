#include "allocator/dlpack_export.h"

#include "allocator/global_allocator.h"

namespace april::alloc {

namespace {

constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::int32_t kDLROCM = 10;
constexpr std::uint8_t kDLUInt = 1;

struct Export {
  DLManagedTensor managed;
  std::int64_t shape[1];
  std::int64_t strides[1];
  std::uintptr_t addr;
};

void delete_export(DLManagedTensor* self) {
  auto* e = static_cast<Export*>(self->manager_ctx);
  // A deleter is called from C (the framework's DLPack code): nothing may escape it.
  try {
    global_allocator().free(e->addr);
  } catch (...) {
  }
  delete e;
}

}  // namespace

DLManagedTensor* export_allocation(std::uintptr_t addr, std::size_t nbytes, Device device) {
  auto* e = new Export{};
  e->addr = addr;
  e->shape[0] = static_cast<std::int64_t>(nbytes);
  e->strides[0] = 1;
  DLTensor& t = e->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(addr);
  t.device.device_type = device.kind == DeviceKind::Cpu ? kDLCPU : device.kind == DeviceKind::Cuda ? kDLCUDA : kDLROCM;
  t.device.device_id = device.kind == DeviceKind::Cpu ? 0 : device.index;
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = e->shape;
  t.strides = e->strides;
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = delete_export;
  return &e->managed;
}

}  // namespace april::alloc
