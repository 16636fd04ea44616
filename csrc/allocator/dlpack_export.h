// Hands an allocation to a framework as a DLPack tensor (a flat uint8 array over its bytes) that
// owns it: when the framework drops the tensor, the allocation is freed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "allocator/allocator.h"

namespace april::alloc {

// The DLPack (v0.8, unversioned) managed-tensor layout, as the DLPack ABI defines it.
struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// A new managed tensor of nbytes uint8 over the allocation at addr; its deleter frees the allocation
// in the global allocator (errors there are dropped: a deleter cannot report).
DLManagedTensor* export_allocation(std::uintptr_t addr, std::size_t nbytes, Device device);

}  // namespace april::alloc
