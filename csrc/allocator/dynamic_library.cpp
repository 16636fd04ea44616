#include "allocator/dynamic_library.h"

#include <dlfcn.h>

#include "common/error.h"

namespace april::alloc {

DynamicLibrary::DynamicLibrary(std::initializer_list<const char*> names) {
  std::string tried;
  std::string why = "no name given";
  for (const char* name : names) {
    handle_ = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (handle_ != nullptr) {
      name_ = name;
      return;
    }
    const char* err = ::dlerror();
    why = err ? err : "unknown reason";
    tried += tried.empty() ? name : std::string(", ") + name;
  }
  throw Error(ErrorKind::Driver, "cannot load " + tried + ": " + why);
}

DynamicLibrary::~DynamicLibrary() {
  if (handle_ != nullptr) ::dlclose(handle_);
}

void* DynamicLibrary::symbol(const char* name) const {
  void* p = ::dlsym(handle_, name);
  if (p == nullptr) throw Error(ErrorKind::Driver, name_ + " has no symbol " + name + " (driver too old?)");
  return p;
}

}  // namespace april::alloc
