#include "allocator/gpu_backends.h"

#include <string>

namespace april::alloc {

Error runtime_call_error(const char* call, int code, const char* name, const char* description,
                         const char* fallback_name, bool out_of_memory) {
  std::string msg = std::string(call) + " failed: " + (name ? name : fallback_name) + " (" + std::to_string(code) +
                    "): " + (description ? description : "no description");
  return Error(out_of_memory ? ErrorKind::OutOfMemory : ErrorKind::Driver, msg);
}

}  // namespace april::alloc
