// Factories of the GPU backends. Each loads its driver library with dlopen and throws
// Error(Driver) with the reason when the library or a device is missing.
#pragma once

#include <memory>

#include "allocator/backend.h"

namespace april::alloc {

#ifdef APRIL_EXT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif
#ifdef APRIL_EXT_WITH_HIP
std::unique_ptr<Backend> make_hip_backend();
#endif

}  // namespace april::alloc
