// Step boundary: opening a step, deciding it is done, the aborts, and packing the TrainingBatch.
#include <algorithm>
#include <limits>
#include <string>

#include "common/error.h"
#include "scheduler/scheduler.h"

namespace april::sched {

void Scheduler::begin_step(int64_t policy_version) {
  std::lock_guard<std::mutex> lock(mu_);
  check(!s_.step_open, ErrorKind::InvalidState,
        "begin_step: step " + std::to_string(s_.step_index) + " (policy version " +
            std::to_string(s_.policy_version) + ") is still open; take_batch() ends it");
  check(policy_version >= 0 && policy_version >= s_.policy_version &&
            policy_version <= std::numeric_limits<int32_t>::max(),
        ErrorKind::InvalidArgument,
        "begin_step: policy_version=" + std::to_string(policy_version) + " is not allowed: must be in [" +
            std::to_string(std::max<int64_t>(s_.policy_version, 0)) +
            ", 2**31 - 1] (never below the previous step's)");
  s_.policy_version = policy_version;
  s_.step_open = true;
  s_.wave_launched = false;
  s_.step_index += 1;
  s_.stats = StepStats{};
  s_.stats.step = s_.step_index;
  s_.stats.policy_version = policy_version;
  if (config_.over_sampling == OverSampling::Adaptive) {
    retune_over_sampling();
  } else {
    s_.stats.over_sampling_groups = *config_.over_sampling_batch_size;
  }
  std::vector<int64_t> ids;
  for (auto& [gid, g] : s_.groups) {
    for (auto& smp : g.samples) smp.tokens_at_step_start = static_cast<int64_t>(smp.tokens.size());
    ids.push_back(gid);
  }
  // A version bump is the only thing that makes tokens staler, so this is where the policy is enforced.
  // abort: groups with samples still in flight (aborts of the last step not yet returned) wait for them.
  // carry: running samples stay, unless the policy needs them back (apply_staleness_carried).
  const bool carry = config_.step_boundary == StepBoundary::Carry;
  for (int64_t gid : ids) {
    Group& g = s_.groups.at(gid);
    if (carry) {
      apply_staleness_carried(gid);
    } else if (g.n_in_flight > 0) {
      g.stale_check_pending = true;
    } else {
      apply_staleness(gid);
    }
  }
  begin_round();
  // Samples still running here were carried across the boundary with their KV (none with abort).
  for (const auto& [gid, g] : s_.groups) {
    for (const auto& smp : g.samples) {
      if (smp.state != SampleState::Running) continue;
      s_.stats.carried_samples += 1;
      s_.stats.carried_kv_tokens += static_cast<int64_t>(g.prompt.size() + smp.tokens.size());
    }
  }
}

bool Scheduler::step_open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.step_open;
}

bool Scheduler::step_done_locked() const {
  if (!s_.step_open) return false;
  if (round_accepted() >= config_.rollout_batch_size) return true;
  if (!s_.data_exhausted()) return false;
  // Out of prompts: done once nothing left in the round could still be accepted.
  for (const auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Accepted && in_round(g)) return false;
  }
  return true;
}

bool Scheduler::step_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return step_done_locked();
}

std::vector<int64_t> Scheduler::samples_to_abort() {
  std::lock_guard<std::mutex> lock(mu_);
  // The samples marked aborting since the last call (carried ones begin_step brought back, cancelled surplus
  // samples); their abort may have answered already.
  std::vector<int64_t> out;
  for (int64_t sid : pending_aborts_) {
    const Sample* smp = index_.find(sid);
    if (smp != nullptr && smp->state == SampleState::Aborting) out.push_back(sid);
  }
  pending_aborts_.clear();
  // A sample marked at two version bumps (restarted and carried again in between) is listed once.
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (config_.step_boundary == StepBoundary::Abort && step_done_locked()) {
    for (auto& [gid, g] : s_.groups) {
      for (size_t i = 0; i < g.samples.size(); ++i) {
        Sample& smp = g.samples[i];
        if (smp.state == SampleState::Running) mark_aborting(smp, ids_.id(gid, static_cast<int64_t>(i)), out);
      }
    }
  }
  s_.stats.abort_requests += static_cast<int64_t>(out.size());
  return out;
}

Batch Scheduler::take_batch() {
  std::lock_guard<std::mutex> lock(mu_);
  check(s_.step_open, ErrorKind::InvalidState, "take_batch: no step is open; call begin_step() first");
  check(step_done_locked(), ErrorKind::InvalidState,
        "take_batch: the step is not done: " + std::to_string(round_accepted()) + " of " +
            std::to_string(config_.rollout_batch_size) + " groups accepted and prompts remain");
  check(s_.running_samples == 0 || config_.step_boundary == StepBoundary::Carry, ErrorKind::InvalidState,
        "take_batch: " + std::to_string(s_.running_samples) +
            " samples are still running; call samples_to_abort() and abort them in the engine first "
            "(or carry them with step_boundary='carry')");
  const int64_t n = config_.n_samples_per_prompt;
  // The first N accepted groups, packed in group id (launch) order: which groups are in the batch follows
  // acceptance, but their order in it is a function of the groups alone, not of when each reward arrived.
  std::vector<int64_t> ids = batch_group_ids();
  std::sort(ids.begin(), ids.end());
  const auto n_groups = static_cast<int64_t>(ids.size());
  Batch b;
  b.policy_version = s_.policy_version;
  int64_t total = 0;
  for (int64_t gid : ids) {
    const Group& g = s_.groups.at(gid);
    total += n * static_cast<int64_t>(g.prompt.size());
    for (const auto& smp : g.samples) total += static_cast<int64_t>(smp.tokens.size());
  }
  b.tokens.reserve(total);
  b.loss_mask.reserve(total);
  b.behavior_logprobs.reserve(total);
  b.versions.reserve(total);
  for (int64_t j = 0; j < n_groups; ++j) pack_group(b, ids[j], static_cast<int32_t>(j));
  for (int64_t gid : ids) erase_group(gid);
  s_.stats.batch_groups = n_groups;
  s_.stats.batch_samples = n_groups * n;
  if (!config_.keep_surplus) drop_surplus();
  end_round();
  s_.step_open = false;
  return b;
}

// Appends a group's samples to the batch: prompt + response tokens, the loss mask from the staleness
// settings, versions per token, and the batch statistics.
void Scheduler::pack_group(Batch& b, int64_t group_id, int32_t index_in_batch) {
  const Group& g = s_.groups.at(group_id);
  const int64_t v = s_.policy_version;
  const bool mask_stale = config_.staleness_policy == StalenessPolicy::Mask && config_.max_staleness.has_value();
  const size_t plen = g.prompt.size();
  StepStats& st = s_.stats;
  b.group_ids.push_back(group_id);
  b.prompt_indices.push_back(g.prompt_index);
  size_t k = 0;  // the sample's place among the group's n done samples (in slot order, as pop_completed gave)
  for (size_t i = 0; i < g.samples.size(); ++i) {
    const Sample& smp = g.samples[i];
    if (smp.state != SampleState::Done) continue;  // a cancelled surplus slot
    b.tokens.insert(b.tokens.end(), g.prompt.begin(), g.prompt.end());
    b.tokens.insert(b.tokens.end(), smp.tokens.begin(), smp.tokens.end());
    b.loss_mask.insert(b.loss_mask.end(), plen, 0);
    b.behavior_logprobs.insert(b.behavior_logprobs.end(), plen, 0.0f);
    b.behavior_logprobs.insert(b.behavior_logprobs.end(), smp.logprobs.begin(), smp.logprobs.end());
    b.versions.insert(b.versions.end(), plen, -1);
    const size_t response_at = b.versions.size();
    for (size_t j = 0; j < smp.segments.size(); ++j) {
      const Segment& seg = smp.segments[j];
      const size_t end = smp.segment_end(j);
      const size_t len = end - seg.start;
      // Env tokens inside the segment's range are no model tokens: they count neither as off-policy nor masked.
      const auto model = static_cast<int64_t>(len) -
                         (smp.env_runs.empty() ? 0
                                               : smp.env_tokens_before(static_cast<int64_t>(end)) -
                                                     smp.env_tokens_before(seg.start));
      const bool train = !(config_.mask_offpolicy && seg.version != v) &&
                         !(mask_stale && v - seg.version > *config_.max_staleness);
      b.versions.insert(b.versions.end(), len, seg.version);
      b.loss_mask.insert(b.loss_mask.end(), len, train ? 1 : 0);
      if (seg.version < v) st.batch_offpolicy_tokens += model;
      if (!train) st.batch_masked_tokens += model;
    }
    // Env positions: never trained, no version (as on the prompt); their logprobs are stored as 0.0.
    for (const EnvRun& run : smp.env_runs) {
      const size_t at = response_at + static_cast<size_t>(run.start);
      std::fill_n(b.versions.begin() + static_cast<std::ptrdiff_t>(at), run.len, -1);
      std::fill_n(b.loss_mask.begin() + static_cast<std::ptrdiff_t>(at), run.len, uint8_t{0});
    }
    const int64_t env_tokens = smp.env_token_count();
    b.offsets.push_back(static_cast<int64_t>(b.tokens.size()));
    b.prompt_lens.push_back(static_cast<int32_t>(plen));
    b.rewards.push_back(g.rewards[k++]);
    b.group_index.push_back(index_in_batch);
    b.sample_ids.push_back(ids_.id(group_id, static_cast<int64_t>(i)));
    b.finish_reasons.push_back(static_cast<uint8_t>(smp.finish));
    const int64_t staleness = smp.segments.empty() ? 0 : v - smp.oldest_version();
    if (static_cast<int64_t>(st.staleness_histogram.size()) <= staleness) {
      st.staleness_histogram.resize(staleness + 1, 0);
    }
    st.staleness_histogram[staleness] += 1;
    st.batch_max_staleness = std::max(st.batch_max_staleness, staleness);
    st.batch_response_tokens += static_cast<int64_t>(smp.tokens.size());
    st.batch_env_tokens += env_tokens;
    st.batch_carried_tokens += smp.tokens_at_step_start - smp.env_tokens_before(smp.tokens_at_step_start);
  }
}

// keep_surplus=false: completed groups beyond the batch (accepted or awaiting reward) go; with tail batching
// those of the round, not the long queue's after a short round (nor the others' after a long round).
void Scheduler::drop_surplus() {
  std::vector<int64_t> surplus;
  for (const auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Active && in_round(g)) surplus.push_back(gid);
  }
  for (int64_t gid : surplus) drop_group(gid);
  s_.stats.surplus_dropped += static_cast<int64_t>(surplus.size());
}

}  // namespace april::sched
