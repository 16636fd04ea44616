// Per-step counters, reset by begin_step. Names are the keys of Scheduler.stats() in Python.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace april::sched {

#define APRIL_STEP_COUNTERS(X)                                                                  \
  X(step) X(policy_version) X(generated_tokens) X(resumed_generated_tokens) X(new_requests)      \
  X(resume_requests) X(prefill_tokens) X(re_prefill_tokens) X(abort_requests) X(aborts)        \
  X(finished_samples) X(groups_launched) X(groups_completed) X(groups_accepted)                  \
  X(groups_filtered) X(groups_dropped_stale) X(samples_restarted_stale) X(stale_tokens_discarded) \
  X(surplus_dropped) X(batch_groups) X(batch_samples) X(batch_response_tokens)                   \
  X(batch_carried_tokens) X(batch_offpolicy_tokens) X(batch_masked_tokens)                       \
  X(batch_max_staleness) X(buffered_groups) X(buffered_samples) X(buffered_tokens)               \
  X(surplus_groups) X(data_exhausted) X(prompts_consumed) X(over_sampling_groups) X(carried_samples)         \
  X(carried_kv_tokens) X(chunk_returns) X(continuation_requests) X(continuation_tokens) X(prediction_samples) \
  X(long_round) X(long_queue_groups) X(tail_restarted_samples) X(tail_tokens_discarded)                     \
  X(surplus_samples_cancelled) X(surplus_tokens_discarded) X(env_waits) X(env_tokens) X(batch_env_tokens)  \
  X(waiting_env_samples)

// Format version 1 files hold every counter before over_sampling_groups, version 2 those before
// carried_samples, version 3 those before chunk_returns, version 4 those before long_round, version 5 those
// before surplus_samples_cancelled, version 6 those before env_waits.
constexpr size_t kV1CounterCount = 32;
constexpr size_t kV2CounterCount = 33;
constexpr size_t kV3CounterCount = 35;
constexpr size_t kV4CounterCount = 39;
constexpr size_t kV5CounterCount = 43;
constexpr size_t kV6CounterCount = 45;

struct StepStats {
#define APRIL_DECLARE(name) int64_t name = 0;
  APRIL_STEP_COUNTERS(APRIL_DECLARE)
#undef APRIL_DECLARE
  // staleness_histogram[s] = batch samples whose oldest token is s versions behind the batch.
  std::vector<int64_t> staleness_histogram;
  // The samples that finished this step: predicted final length at their last dispatch, and final length.
  std::vector<int64_t> predicted_lens;
  std::vector<int64_t> final_lens;
  // Spearman rank correlation of the two (computed by Scheduler::stats(); not persisted).
  double prediction_rank_corr = 0.0;

  std::vector<std::pair<std::string, int64_t>> counters() const {
    std::vector<std::pair<std::string, int64_t>> out;
#define APRIL_LIST(name) out.emplace_back(#name, name);
    APRIL_STEP_COUNTERS(APRIL_LIST)
#undef APRIL_LIST
    return out;
  }
};

}  // namespace april::sched
