// The state file: atomic writes that concurrent writers (threads or processes) cannot corrupt.
#pragma once

#include <string>

namespace april::sched {

// Writes to a temporary file of its own in the same folder (unique per process and call), fsyncs it,
// renames it over path and fsyncs the folder: path always holds one writer's complete bytes.
void write_file_atomic(const std::string& path, const std::string& bytes);
std::string read_file(const std::string& path);

}  // namespace april::sched
