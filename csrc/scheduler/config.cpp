#include "scheduler/config.h"

#include <string>

#include "common/error.h"

namespace april::sched {

namespace {
void require(bool cond, const std::string& field, int64_t value, const std::string& allowed) {
  check(cond, ErrorKind::InvalidArgument,
        "SchedulerConfig." + field + "=" + std::to_string(value) + " is not allowed: " + allowed);
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
  require(static_cast<int32_t>(over_sampling) >= 0 && static_cast<int32_t>(over_sampling) <= 1, "over_sampling",
          static_cast<int32_t>(over_sampling), "0 (fixed) or 1 (adaptive)");
  if (over_sampling == OverSampling::Adaptive) {
    require(target_inflight_samples >= n_samples_per_prompt, "target_inflight_samples", target_inflight_samples,
            "must be >= n_samples_per_prompt with adaptive over-sampling");
  } else {
    require(target_inflight_samples == 0, "target_inflight_samples", target_inflight_samples,
            "must be 0 (unset) with fixed over-sampling");
  }
  require(static_cast<int32_t>(refill) >= 0 && static_cast<int32_t>(refill) <= 1, "refill",
          static_cast<int32_t>(refill), "0 (batch) or 1 (continuous)");
  require(static_cast<int32_t>(staleness_policy) >= 0 && static_cast<int32_t>(staleness_policy) <= 3,
          "staleness_policy", static_cast<int32_t>(staleness_policy), "0..3 (keep, mask, restart, drop)");
  require(static_cast<int32_t>(resume_order) >= 0 && static_cast<int32_t>(resume_order) <= 2, "resume_order",
          static_cast<int32_t>(resume_order), "0..2 (oldest_first, newest_first, longest_first)");
}

}  // namespace april::sched
