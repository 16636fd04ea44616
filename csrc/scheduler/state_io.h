// Binary encoding of the scheduler state.
// Layout: magic "APRILSCH" | u32 format version | u64 payload length | payload | u64 FNV-1a of payload.
#pragma once

#include <cstdint>
#include <string>

#include "scheduler/config.h"
#include "scheduler/state.h"

namespace april::sched {

// Version 2 adds the adaptive over-sampling state and the over_sampling_groups counter, version 3 the
// carried_samples and carried_kv_tokens counters, version 4 the length prediction (history keys of groups,
// final lengths per key and of all, the step's prediction pairs) and the chunk, continuation and
// prediction_samples counters, version 5 tail batching (the round, the long queue, pending restarts, four
// counters), version 6 tail_extra_samples (in the header; each group's slots, cancelled ones included, and two
// counters), version 7 multi-turn samples (each sample's env runs after its segments, the waiting_env state,
// four counters); versions 1 to 6 still load (their samples have no env runs).
constexpr uint32_t kStateFormatVersion = 7;

// The framed bytes of a state (header, payload, checksum).
std::string encode_state(const Config& config, const State& state);
// Parses and checks framed bytes into a fresh State. Throws CorruptStateError for bytes that are not a
// consistent state, InvalidArgumentError for a state saved with another n_samples_per_prompt,
// max_response_len or tail_extra_samples.
State decode_state(const Config& config, const std::string& bytes);

}  // namespace april::sched
