#include "scheduler/config.h"

#include <string>

#include "common/error.h"
#include "scheduler/names.h"

namespace april::sched {

namespace {

void require(bool cond, const std::string& field, int64_t value, const std::string& allowed) {
  check(cond, ErrorKind::Config,
        "SchedulerConfig." + field + "=" + std::to_string(value) + " is not allowed: " + allowed);
}

// A number cast into an enum by a C++ caller; Python passes names, parsed in names.cpp.
template <typename E>
void require_known(E value, const std::string& field) {
  require(name_of(value) != nullptr, field, static_cast<int64_t>(value), "not a value of the enum");
}

}  // namespace

void Config::validate() const {
  require(rollout_batch_size >= 1, "rollout_batch_size", rollout_batch_size, "must be >= 1");
  require(n_samples_per_prompt >= 1, "n_samples_per_prompt", n_samples_per_prompt, "must be >= 1");
  require(over_sampling_batch_size >= rollout_batch_size, "over_sampling_batch_size",
          over_sampling_batch_size, "must be >= rollout_batch_size");
  require(max_response_len >= 1 && max_response_len <= INT32_MAX, "max_response_len", max_response_len,
          "must be in [1, 2**31 - 1]");
  require(max_staleness >= -1, "max_staleness", max_staleness, "must be >= 0, or -1 for unlimited");
  require(max_inflight_samples == 0 || max_inflight_samples >= n_samples_per_prompt, "max_inflight_samples",
          max_inflight_samples, "must be 0 (no cap) or >= n_samples_per_prompt");
  require_known(refill, "refill");
  require_known(staleness_policy, "staleness_policy");
  require_known(resume_order, "resume_order");
  require_known(over_sampling, "over_sampling");
  require_known(step_boundary, "step_boundary");
  require_known(dispatch_order, "dispatch_order");
  require(chunk_tokens >= 0, "chunk_tokens", chunk_tokens, "must be >= 1, or 0 for no chunking");
  require(!tail_batching_restart || tail_batching, "tail_batching_restart", 1, "needs tail_batching");
  require(tail_extra_samples >= 0, "tail_extra_samples", tail_extra_samples, "must be >= 0");
  require(tail_extra_samples == 0 || tail_batching, "tail_extra_samples", tail_extra_samples,
          "must be 0 unless tail_batching is on");
  if (over_sampling == OverSampling::Adaptive) {
    require(target_inflight_samples >= n_samples_per_prompt, "target_inflight_samples", target_inflight_samples,
            "must be >= n_samples_per_prompt with adaptive over-sampling");
  } else {
    require(target_inflight_samples == 0, "target_inflight_samples", target_inflight_samples,
            "must be 0 (unset) with fixed over-sampling");
  }
}

}  // namespace april::sched
