// The one error type of the C++ core. Bindings turn it into the matching april_ext.errors class.
#pragma once

#include <stdexcept>
#include <string>

namespace april {

enum class ErrorKind {
  Config,           // a configuration field has a value that is not allowed
  InvalidArgument,  // a caller passed a value that is not allowed
  InvalidState,     // the call is not allowed in the object's current state
  UnknownId,        // an id (sample, group, pointer, tag) that is not known
  OutOfMemory,      // allocation or resume could not get memory
  CorruptState,     // a saved state that is truncated, corrupted or of another format
  Driver,           // a GPU driver / runtime call failed
  Io,               // a file-system operation failed
  Internal,         // a broken invariant: a bug in april_ext
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message);
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// Throws Error(kind, message) when cond is false.
inline void check(bool cond, ErrorKind kind, const std::string& message) {
  if (!cond) throw Error(kind, message);
}

}  // namespace april
