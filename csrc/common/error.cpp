#include "common/error.h"

namespace april {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Config: return "ConfigError";
    case ErrorKind::InvalidArgument: return "InvalidArgumentError";
    case ErrorKind::InvalidState: return "InvalidStateError";
    case ErrorKind::UnknownId: return "UnknownIdError";
    case ErrorKind::OutOfMemory: return "OutOfMemoryError";
    case ErrorKind::CorruptState: return "CorruptStateError";
    case ErrorKind::Driver: return "DriverError";
    case ErrorKind::Io: return "PersistenceError";
    case ErrorKind::Internal: return "InternalError";
  }
  return "AprilError";
}

Error::Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}

}  // namespace april
