// Binary encoding of the scheduler state and the atomic state file.
// File layout: magic "APRILSCH" | u32 format version | u64 payload length | payload | u64 FNV-1a of payload.
#pragma once

#include <cstdint>
#include <string>

#include "scheduler/config.h"
#include "scheduler/state.h"

namespace april::sched {

// Version 2 adds the adaptive over-sampling state and the over_sampling_groups counter; version 1 still loads.
constexpr uint32_t kStateFormatVersion = 2;

// The framed bytes of a state (header, payload, checksum).
std::string encode_state(const Config& config, const State& state);
// Parses and checks framed bytes into a fresh State; throws CorruptStateError / InvalidArgumentError.
State decode_state(const Config& config, const std::string& bytes);

// Writes to a temporary file in the same folder, fsyncs it, renames it over path, fsyncs the folder.
void write_file_atomic(const std::string& path, const std::string& bytes);
std::string read_file(const std::string& path);

}  // namespace april::sched
