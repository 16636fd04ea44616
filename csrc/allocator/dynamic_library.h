// An owned dlopen handle, so a GPU runtime is loaded at run time and one build imports everywhere.
#pragma once

#include <initializer_list>
#include <string>

namespace april::alloc {

class DynamicLibrary {
 public:
  // Loads the first of names that loads (e.g. an unversioned name, then versioned ones). Throws
  // Error(Driver) naming them and the last dlerror() when none can be loaded.
  explicit DynamicLibrary(std::initializer_list<const char*> names);
  ~DynamicLibrary();
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;

  // Throws Error(Driver) when the symbol is missing.
  void* symbol(const char* name) const;

  template <typename Fn>
  void load(Fn*& out, const char* name) const {
    out = reinterpret_cast<Fn*>(symbol(name));
  }

 private:
  std::string name_;
  void* handle_ = nullptr;
};

}  // namespace april::alloc
