// The staleness policy: restart stale samples or drop their group (keep and mask act in the batch).
#include <algorithm>

#include "scheduler/scheduler.h"

namespace april::sched {

void Scheduler::apply_staleness(int64_t group_id) {
  const bool enforced = config_.max_staleness >= 0 && (config_.staleness_policy == StalenessPolicy::Restart ||
                                                       config_.staleness_policy == StalenessPolicy::Drop);
  if (!enforced) return;
  Group& g = s_.groups.at(group_id);
  auto is_stale = [&](const Sample& smp) {
    return !smp.segments.empty() && s_.policy_version - smp.oldest_version() > config_.max_staleness;
  };
  if (std::none_of(g.samples.begin(), g.samples.end(), is_stale)) return;
  if (config_.staleness_policy == StalenessPolicy::Drop) {
    for (const auto& smp : g.samples) s_.stats.stale_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
    s_.stats.groups_dropped_stale += 1;
    erase_group(group_id);
    return;
  }
  for (auto& smp : g.samples) {
    if (!is_stale(smp)) continue;
    s_.stats.samples_restarted_stale += 1;
    s_.stats.stale_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
    if (smp.state == SampleState::Done) {
      g.n_done -= 1;
      smp.state = SampleState::Queued;
      s_.queued_samples += 1;
    }
    smp.finish = FinishReason::Stop;
    smp.tokens = {};
    smp.logprobs = {};
    smp.segments = {};
    smp.tail_version = -1;
    smp.tokens_at_step_start = 0;
  }
  if (g.state != GroupState::Active) {
    unlist(group_id);
    g.state = GroupState::Active;
    g.rewards.clear();
    g.popped = false;
  }
}

}  // namespace april::sched
