// Group life cycle: completion, hand-out for reward, the filter's verdict, removal.
#include <algorithm>
#include <cmath>
#include <deque>
#include <string>

#include "common/error.h"
#include "scheduler/scheduler.h"

namespace april::sched {

namespace {

void remove_id(std::deque<int64_t>& q, int64_t id) {
  auto it = std::find(q.begin(), q.end(), id);
  if (it != q.end()) q.erase(it);
}

}  // namespace

// Over-provisioned groups (tail_extra_samples): the first n samples to finish are the group's; the others are
// cancelled, and the group waits for the aborts of those in flight so that no event can name a trained group.
void Scheduler::complete_if_done(int64_t group_id, Group& g) {
  if (g.state != GroupState::Active || g.n_done < config_.n_samples_per_prompt) return;
  for (size_t i = 0; i < g.samples.size(); ++i) {
    const SampleState st = g.samples[i].state;
    if (st != SampleState::Done && st != SampleState::Cancelled) cancel_sample(group_id, static_cast<int64_t>(i));
  }
  if (g.n_in_flight > 0) return;
  g.state = GroupState::Completed;
  s_.completed.push_back(group_id);
  s_.stats.groups_completed += 1;
}

void Scheduler::cancel_sample(int64_t group_id, int64_t slot) {
  Sample& smp = s_.groups.at(group_id).samples[slot];
  if (smp.surplus) return;  // already cancelled, its abort under way
  s_.stats.surplus_samples_cancelled += 1;
  if (smp.in_flight()) {
    smp.surplus = true;
    if (smp.state == SampleState::Running) mark_aborting(smp, ids_.id(group_id, slot), pending_aborts_);
    return;
  }
  if (smp.state == SampleState::Queued) s_.queued_samples -= 1;
  if (smp.state == SampleState::WaitingEnv) s_.waiting_env_samples -= 1;
  discard_cancelled(smp);
}

// The cancelled sample's response goes (counted): it is never dispatched again.
void Scheduler::discard_cancelled(Sample& smp) {
  s_.stats.surplus_tokens_discarded += static_cast<int64_t>(smp.tokens.size());
  smp.state = SampleState::Cancelled;
  smp.surplus = false;
  smp.tokens = {};
  smp.logprobs = {};
  smp.segments = {};
  smp.env_runs = {};
  smp.tail_version = -1;
  smp.tokens_at_step_start = 0;
  smp.chunk_version = -1;
}

void Scheduler::unlist(int64_t group_id) {
  remove_id(s_.completed, group_id);
  remove_id(s_.accepted, group_id);
}

void Scheduler::erase_group(int64_t group_id) {
  Group& g = s_.groups.at(group_id);
  for (const auto& smp : g.samples) {
    if (smp.state == SampleState::Queued) s_.queued_samples -= 1;
    if (smp.state == SampleState::WaitingEnv) s_.waiting_env_samples -= 1;
  }
  unlist(group_id);
  index_.remove(group_id);
  s_.groups.erase(group_id);
}

void Scheduler::drop_group(int64_t group_id) {
  const Group& g = s_.groups.at(group_id);
  if (g.state == GroupState::Completed && g.popped) dropped_unrewarded_.insert(group_id);
  erase_group(group_id);
}

std::vector<CompletedGroup> Scheduler::pop_completed_groups() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CompletedGroup> out;
  for (int64_t gid : s_.completed) {
    Group& g = s_.groups.at(gid);
    g.popped = true;
    CompletedGroup c{gid, g.prompt_index, {}, {}, {}, {}};
    // The group's n done samples in slot order (the others of a completed group are cancelled).
    for (size_t i = 0; i < g.samples.size(); ++i) {
      const Sample& smp = g.samples[i];
      if (smp.state != SampleState::Done) continue;
      c.sample_ids.push_back(ids_.id(gid, static_cast<int64_t>(i)));
      c.response_lens.push_back(static_cast<int64_t>(smp.tokens.size()));
      c.finish_reasons.push_back(static_cast<uint8_t>(smp.finish));
      c.tokens.insert(c.tokens.end(), smp.tokens.begin(), smp.tokens.end());
    }
    out.push_back(std::move(c));
  }
  s_.completed.clear();
  return out;
}

void Scheduler::report_rewards(int64_t group_id, const float* rewards, size_t count, bool accepted) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = s_.groups.find(group_id);
  // Its reward was on its way when the group was dropped (surplus, stale): nothing to record.
  if (it == s_.groups.end() && dropped_unrewarded_.erase(group_id) > 0) return;
  if (it == s_.groups.end()) {
    throw Error(ErrorKind::UnknownId, "report_rewards: group id " + std::to_string(group_id) + " is not known: " +
                                          (group_id < 0 ? "group ids are in [0, 2**63 - 1]"
                                                        : "never launched, or already trained, filtered or dropped "
                                                          "for staleness"));
  }
  Group& g = it->second;
  check(g.state == GroupState::Completed, ErrorKind::InvalidState,
        "report_rewards: group " + std::to_string(group_id) +
            (g.state == GroupState::Active ? " is not complete yet (samples still generating or buffered)"
                                           : " was already rewarded"));
  check(static_cast<int64_t>(count) == config_.n_samples_per_prompt, ErrorKind::InvalidArgument,
        "report_rewards: group " + std::to_string(group_id) + " got " + std::to_string(count) +
            " rewards; it has n_samples_per_prompt=" + std::to_string(config_.n_samples_per_prompt) + " samples");
  for (size_t i = 0; i < count; ++i) {
    check(std::isfinite(rewards[i]), ErrorKind::InvalidArgument,
          "report_rewards: reward " + std::to_string(rewards[i]) + " of sample " + std::to_string(i) +
              " in group " + std::to_string(group_id) + " is not a finite number");
  }
  unlist(group_id);
  if (!accepted) {
    s_.stats.groups_filtered += 1;
    erase_group(group_id);
    return;
  }
  g.state = GroupState::Accepted;
  g.popped = false;
  g.rewards.assign(rewards, rewards + count);
  s_.accepted.push_back(group_id);
  s_.stats.groups_accepted += 1;
}

}  // namespace april::sched
