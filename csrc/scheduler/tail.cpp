// Tail batching (RollPacker's schedule, partial responses kept): short rounds train the first N groups and
// send the groups still generating to a long queue; a long round runs the long queue alone once it holds N
// groups (or the data is used up), with no over-sampling. Semantics: docs/scheduler.md, "Tail batching".
#include <algorithm>
#include <utility>
#include <vector>

#include "scheduler/scheduler.h"

namespace april::sched {

bool Scheduler::in_round(const Group& g) const {
  if (!config_.tail_batching) return true;
  switch (s_.round) {
    case Round::Short: return !g.long_queue;
    case Round::Long: return g.long_queue;
    case Round::Drain: return true;
  }
  return true;
}

bool Scheduler::dispatchable(const Group& g) const {
  return g.state == GroupState::Active && !g.stale_check_pending && in_round(g);
}

int64_t Scheduler::round_accepted() const {
  if (!config_.tail_batching) return static_cast<int64_t>(s_.accepted.size());
  return std::count_if(s_.accepted.begin(), s_.accepted.end(),
                       [&](int64_t gid) { return in_round(s_.groups.at(gid)); });
}

// The first N accepted groups of the round in acceptance order; a drain round takes long-queue groups first.
std::vector<int64_t> Scheduler::batch_group_ids() const {
  const auto n_groups = static_cast<size_t>(config_.rollout_batch_size);
  std::vector<int64_t> ids;
  const bool long_first = config_.tail_batching && s_.round != Round::Short;
  for (bool first_pass : {true, false}) {
    for (int64_t gid : s_.accepted) {
      const Group& g = s_.groups.at(gid);
      if (ids.size() < n_groups && in_round(g) && (g.long_queue == long_first) == first_pass) ids.push_back(gid);
    }
  }
  return ids;
}

// At begin_step, after the staleness policy: what the step is. A long round begins once the long queue holds N
// groups; with the data used up, any long-queue group left makes the step a drain round.
void Scheduler::begin_round() {
  s_.round = Round::Short;
  if (!config_.tail_batching) return;
  const auto long_groups = std::count_if(s_.groups.begin(), s_.groups.end(),
                                         [](const auto& kv) { return kv.second.long_queue; });
  if (long_groups == 0) return;
  if (s_.data_exhausted()) {
    s_.round = Round::Drain;
  } else if (long_groups >= config_.rollout_batch_size) {
    s_.round = Round::Long;
  } else {
    return;
  }
  s_.stats.long_round = 1;
  s_.stats.over_sampling_groups = config_.rollout_batch_size;  // no over-sampling
  if (!config_.tail_batching_restart) return;
  // Strict on-policy: every long-queue group starts again from its prompt. A group with samples in flight
  // (aborts on their way back, or carried samples, aborted now) restarts when the last one is back.
  for (auto& [gid, g] : s_.groups) {
    if (!g.long_queue) continue;
    if (g.n_in_flight == 0) {
      restart_long_group(gid);
      continue;
    }
    for (size_t i = 0; i < g.samples.size(); ++i) {
      Sample& smp = g.samples[i];
      if (smp.state == SampleState::Running) mark_aborting(smp, ids_.id(gid, static_cast<int64_t>(i)), pending_aborts_);
    }
    g.stale_check_pending = true;
    g.tail_restart = true;
  }
}

// At take_batch, once the batch is out: every group still generating goes to (or stays in) the long queue. A
// group none of whose samples produced anything or is in flight has not started: it stays where it is. A group
// joining the long queue keeps n samples (no over-provisioning in long rounds).
void Scheduler::end_round() {
  if (!config_.tail_batching) return;
  for (auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Active || g.long_queue) continue;
    g.long_queue = std::any_of(g.samples.begin(), g.samples.end(), [](const Sample& smp) {
      return (smp.in_flight() && !smp.surplus) || smp.state == SampleState::Done || !smp.tokens.empty();
    });
    if (g.long_queue) trim_long_group(gid, g);
  }
}

// The n samples kept: done ones, then the longest partials (ties: lower slot); the others are cancelled.
void Scheduler::trim_long_group(int64_t group_id, Group& g) {
  std::vector<int64_t> live;
  for (size_t i = 0; i < g.samples.size(); ++i) {
    const Sample& smp = g.samples[i];
    if (smp.state != SampleState::Cancelled && !smp.surplus) live.push_back(static_cast<int64_t>(i));
  }
  const auto n = static_cast<size_t>(config_.n_samples_per_prompt);
  if (live.size() <= n) return;
  auto rank = [&](int64_t i) {
    const Sample& smp = g.samples[i];
    return std::make_pair(smp.state == SampleState::Done, smp.tokens.size());
  };
  std::stable_sort(live.begin(), live.end(), [&](int64_t a, int64_t b) { return rank(a) > rank(b); });
  for (size_t k = n; k < live.size(); ++k) cancel_sample(group_id, live[k]);
}

// tail_batching_restart: nothing of the group is in flight; every sample that generated anything starts again.
void Scheduler::restart_long_group(int64_t group_id) {
  Group& g = s_.groups.at(group_id);
  g.tail_restart = false;
  for (auto& smp : g.samples) {
    if (smp.state != SampleState::Done && smp.tokens.empty()) continue;
    s_.stats.tail_restarted_samples += 1;
    s_.stats.tail_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
    restart_sample(g, smp);
  }
  reopen_group(group_id, g);
}

}  // namespace april::sched
