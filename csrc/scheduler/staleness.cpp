// The staleness policy: restart stale samples or drop their group (keep and mask act in the batch).
#include <algorithm>

#include "scheduler/scheduler.h"

namespace april::sched {

bool Scheduler::staleness_enforced() const {
  return config_.max_staleness.has_value() && (config_.staleness_policy == StalenessPolicy::Restart ||
                                               config_.staleness_policy == StalenessPolicy::Drop);
}

bool Scheduler::is_stale(const Sample& smp) const {
  const int64_t oldest = smp.oldest_possible_version();
  return config_.max_staleness.has_value() && oldest >= 0 && s_.policy_version - oldest > *config_.max_staleness;
}

void Scheduler::restart_sample(Group& g, Sample& smp) {
  if (smp.state == SampleState::Done || smp.state == SampleState::WaitingEnv) {
    // A trajectory waiting for its environment starts again too: its env runs go with it.
    (smp.state == SampleState::Done ? g.n_done : s_.waiting_env_samples) -= 1;
    smp.state = SampleState::Queued;
    s_.queued_samples += 1;
  }
  smp.finish = FinishReason::Stop;
  smp.tokens = {};
  smp.logprobs = {};
  smp.segments = {};
  smp.env_runs = {};
  smp.tail_version = -1;
  smp.tokens_at_step_start = 0;
}

void Scheduler::reopen_group(int64_t group_id, Group& g) {
  if (g.state == GroupState::Active) return;
  unlist(group_id);
  g.state = GroupState::Active;
  g.rewards.clear();
  g.popped = false;
}

// Restarts the stale samples that are not in flight, or drops the group (callers make sure none of its
// samples is in flight then). A tail-batching restart waits for the same moment and goes first: it discards
// every token, so nothing is stale after it.
void Scheduler::apply_staleness(int64_t group_id) {
  Group& g = s_.groups.at(group_id);
  if (g.tail_restart && g.n_in_flight == 0) {
    restart_long_group(group_id);
    return;
  }
  if (!staleness_enforced()) return;
  auto stale = [&](const Sample& smp) { return is_stale(smp); };
  if (std::none_of(g.samples.begin(), g.samples.end(), stale)) return;
  if (config_.staleness_policy == StalenessPolicy::Drop) {
    for (const auto& smp : g.samples) s_.stats.stale_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
    s_.stats.groups_dropped_stale += 1;
    drop_group(group_id);
    return;
  }
  for (auto& smp : g.samples) {
    if (smp.in_flight() || !is_stale(smp)) continue;
    s_.stats.samples_restarted_stale += 1;
    s_.stats.stale_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
    restart_sample(g, smp);
  }
  reopen_group(group_id, g);
}

// step_boundary=carry, at begin_step: a group's running samples keep generating unless the policy needs
// them back. Restart: the stale ones are aborted (restarted when their abort returns, in finish()), the
// others restarted now. Drop: every running sample of the group is aborted and the group waits for them,
// then goes. A sample that is not stale now cannot become stale before the next version bump: its next
// tokens are no older than its dispatch version or its last token.
void Scheduler::apply_staleness_carried(int64_t group_id) {
  if (!staleness_enforced()) return;
  Group& g = s_.groups.at(group_id);
  // Pending: only aborts are in flight; the check runs when they are back.
  if (g.stale_check_pending) return;
  auto stale = [&](const Sample& smp) { return is_stale(smp); };
  if (std::none_of(g.samples.begin(), g.samples.end(), stale)) return;
  const bool drop = config_.staleness_policy == StalenessPolicy::Drop;
  for (size_t i = 0; i < g.samples.size(); ++i) {
    Sample& smp = g.samples[i];
    if (smp.state == SampleState::Running && (drop || is_stale(smp))) {
      mark_aborting(smp, ids_.id(group_id, static_cast<int64_t>(i)), pending_aborts_);
    }
  }
  if (drop && g.n_in_flight > 0) {
    g.stale_check_pending = true;
    return;
  }
  apply_staleness(group_id);
}

}  // namespace april::sched
