// Factories of the GPU backends. Each loads its driver library with dlopen and throws
// Error(Driver) with the reason when the library or a device is missing.
#pragma once

#include <memory>

#include "allocator/backend.h"
#include "common/error.h"

namespace april::alloc {

#ifdef APRIL_EXT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif
#ifdef APRIL_EXT_WITH_HIP
std::unique_ptr<Backend> make_hip_backend();
#endif

// The error of a failed runtime call, as both backends report it:
// "<call> failed: <name> (<code>): <description>", of kind OutOfMemory or Driver. A null name or
// description (an unknown code) is replaced by fallback_name or "no description".
Error runtime_call_error(const char* call, int code, const char* name, const char* description,
                         const char* fallback_name, bool out_of_memory);

}  // namespace april::alloc
