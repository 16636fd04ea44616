// Records of the scheduler: samples (one response each) inside groups (one prompt each).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "scheduler/config.h"
#include "scheduler/stats.h"

namespace april::sched {

enum class SampleState : uint8_t {
  Queued = 0,    // waiting for dispatch: fresh, or a buffered partial to resume
  Running = 1,   // dispatched to the engine
  Aborting = 2,  // dispatched, and the scheduler asked for its abort
  Done = 3,      // finished with stop or length
  // Tail batching over-provisioning: a slot the group no longer needs (its n samples are done or chosen) or
  // never uses (groups of long rounds). Never dispatched, holds no tokens, not queued, running or done.
  Cancelled = 4,
  // Multi-turn: the model's turn ended at a stop token and the environment (a tool) has not answered yet. Not
  // in the engine, not dispatchable, not done: on_env_tokens queues it again, a finish ends it.
  WaitingEnv = 5,
};

// A run of tokens produced under one policy version; versions are stored once per run, not per token.
struct Segment {
  int32_t version;
  int32_t start;  // index of the run's first token in the response
};

// A run of tokens the environment inserted (tool output) into the response: part of the sequence, never
// trained (loss mask 0, logprob 0.0, version -1 in the batch). Runs are in order, never adjacent, and each
// follows a model token: the response starts with a model token.
struct EnvRun {
  int32_t start;  // index of the run's first token in the response
  int32_t len;    // > 0
};

// alignas(64): the fields every token event reads and writes share one cache line (the first), so an event
// misses once per sample at most; the rest is read at dispatch, finish and step boundaries.
struct alignas(64) Sample {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  int32_t tail_version = -1;  // segments.back().version (-1: none), so events need not read segments
  SampleState state = SampleState::Queued;
  bool resumed = false;  // the last dispatch resumed an aborted partial (a re-prefill; not a continuation)
  FinishReason finish = FinishReason::Stop;
  int64_t dispatch_version = -1;  // policy version at the last dispatch
  // End of the first cache line.
  // Version runs of the response. Env tokens carry no version: they extend the range of the segment before
  // them (a segment always starts at a model token), and env_runs says which positions are env tokens.
  std::vector<Segment> segments;
  std::vector<EnvRun> env_runs;  // empty for a single-turn sample
  int64_t tokens_at_step_start = 0;  // response length when the current step began
  int64_t resumes = 0;
  // In flight and cancelled (Aborting): its abort result is dropped and it becomes Cancelled. Not persisted: a
  // saved state stores it as Cancelled.
  bool surplus = false;
  // Set at dispatch (not persisted: nothing is in flight after a load).
  int32_t dispatch_len = 0;     // response length when the last request was sent
  int32_t dispatch_budget = 0;  // that request's max_new_tokens
  int32_t predicted_len = 0;    // predicted final length at the last dispatch not a continuation; 0: none since a load
  // Policy version at which the sample came back at a chunk boundary: its next dispatch at that version is a
  // continuation (the engine still holds its KV). -1: none.
  int32_t chunk_version = -1;
  // Scratch of on_finish's validation pass (not persisted).
  uint64_t scratch_epoch = 0;
  int64_t scratch_len = 0;
  int64_t scratch_version = 0;
  bool scratch_finished = false;

  bool in_flight() const { return state == SampleState::Running || state == SampleState::Aborting; }
  int64_t oldest_version() const { return segments.empty() ? -1 : segments.front().version; }
  // The oldest version the response has or can still get: a sample in flight with no token yet gets tokens
  // of its dispatch version or newer. -1: none.
  int64_t oldest_possible_version() const {
    return !segments.empty() ? segments.front().version : in_flight() ? dispatch_version : -1;
  }
  int64_t last_version() const { return tail_version; }
  int64_t env_token_count() const {
    int64_t n = 0;
    for (const EnvRun& r : env_runs) n += r.len;
    return n;
  }
  // Env tokens among the first `pos` tokens of the response.
  int64_t env_tokens_before(int64_t pos) const {
    int64_t n = 0;
    for (const EnvRun& r : env_runs) n += std::clamp<int64_t>(pos - r.start, 0, r.len);
    return n;
  }
  bool ends_in_env() const {
    return !env_runs.empty() && static_cast<size_t>(env_runs.back().start + env_runs.back().len) == tokens.size();
  }
  // One past the last token of segment k: the next segment's start, or the response's end.
  size_t segment_end(size_t k) const { return k + 1 < segments.size() ? segments[k + 1].start : tokens.size(); }
};
static_assert(offsetof(Sample, dispatch_version) + sizeof(Sample::dispatch_version) <= 64,
              "the fields of a token event fit in the first cache line");

enum class GroupState : uint8_t {
  Active = 0,     // fewer than n samples done, or cancelled samples still in flight
  Completed = 1,  // n samples done, waiting for reward
  Accepted = 2,   // rewarded and accepted by the filter
};

struct Group {
  int64_t prompt_index = 0;
  bool has_history_key = false;  // the prompt's identity across epochs, for length prediction
  int64_t history_key = 0;
  std::vector<int32_t> prompt;
  std::vector<Sample> samples;
  std::vector<float> rewards;
  GroupState state = GroupState::Active;
  bool popped = false;               // handed out by pop_completed, reward not reported yet
  bool stale_check_pending = false;  // staleness to apply once no sample is in flight
  // Tail batching: the group is in the long queue (runs and counts only in long rounds), and with
  // tail_batching_restart its restart waits for its samples in flight (stale_check_pending is set with it).
  bool long_queue = false;
  bool tail_restart = false;
  int64_t n_done = 0;
  int64_t n_in_flight = 0;
};

// Tail batching: what the step is. Short: the configured step, over the groups outside the long queue. Long: only
// long-queue groups run and count, no over-sampling. Drain: a long round begun with the data exhausted, which
// takes every group left (long-queue groups first).
enum class Round : uint8_t { Short = 0, Long = 1, Drain = 2 };

// Final response lengths seen: their sum and count.
struct LengthStats {
  int64_t sum = 0;
  int64_t count = 0;

  void add(int64_t len) {
    sum += len;
    count += 1;
  }
  double mean() const { return static_cast<double>(sum) / static_cast<double>(count); }
};

// Everything that changes while the scheduler runs; persisted as a whole by state_io.
struct State {
  std::map<int64_t, Group> groups;  // by group id = creation order
  std::deque<int64_t> completed;    // completed groups not yet popped, in completion order
  std::deque<int64_t> accepted;     // accepted groups, in acceptance order
  int64_t next_group_id = 0;
  int64_t prompts_consumed = 0;  // data-source position
  int64_t data_size = -1;        // -1: unknown (endless)
  bool step_open = false;
  bool wave_launched = false;  // refill=batch: the step's first wave went out
  int64_t policy_version = -1;
  int64_t step_index = 0;  // steps begun so far
  int64_t queued_samples = 0;
  int64_t running_samples = 0;   // state Running
  int64_t aborting_samples = 0;  // state Aborting
  int64_t waiting_env_samples = 0;  // state WaitingEnv (persisted from format version 7 as sample states)
  // Adaptive over-sampling (persisted from format version 2).
  double live_fraction = 1.0;    // running mean of the live share of active groups' samples at step ends
  int64_t adaptive_groups = 0;   // N'_t: most groups generating at a time this step (0 before the first step)
  // Length prediction (persisted from format version 4): final lengths per prompt history key, and of all.
  std::map<int64_t, LengthStats> length_history;
  LengthStats final_lengths;
  Round round = Round::Short;    // tail batching (persisted from format version 5)
  StepStats stats;

  bool data_exhausted() const { return data_size >= 0 && prompts_consumed >= data_size; }
};

}  // namespace april::sched
