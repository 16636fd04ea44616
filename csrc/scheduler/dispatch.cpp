// Dispatch and refill: how many new groups to launch, adding them, and picking the queued samples to send to
// the engine in dispatch_order (buffered partials first with resume_priority), each with its length budget
// (chunk_tokens) and predicted final length.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/error.h"
#include "scheduler/prediction.h"
#include "scheduler/scheduler.h"

namespace april::sched {

int64_t Scheduler::groups_to_launch_locked() const {
  if (!s_.step_open || step_done_locked()) return 0;
  // Only the round's groups count (all of them without tail batching); queued samples of the others cannot
  // be dispatched now, so they hold no slot.
  int64_t active = 0, pending = 0;
  int64_t queued = config_.tail_batching ? 0 : s_.queued_samples;
  for (const auto& [gid, g] : s_.groups) {
    if (!in_round(g)) continue;
    if (g.state == GroupState::Active) active += 1;
    if (g.state == GroupState::Completed) pending += 1;
    if (!config_.tail_batching || g.state != GroupState::Active) continue;
    for (const auto& smp : g.samples) queued += smp.state == SampleState::Queued ? 1 : 0;
  }
  const int64_t accepted = round_accepted();
  // Pending groups may still be accepted: launching for them would overshoot N.
  const int64_t needed = config_.rollout_batch_size - accepted - pending;
  if (needed <= 0) return 0;
  if (config_.refill == Refill::Batch && s_.wave_launched && active > 0) return 0;  // the wave still generates
  // A long round does not over-sample: it launches only to replace long-queue groups the filter rejected.
  const bool long_round = config_.tail_batching && s_.round != Round::Short;
  const int64_t n = launch_width();  // samples a new group brings
  const int64_t n_prime = *config_.over_sampling_batch_size;
  int64_t k = 0;
  if (long_round) {
    k = needed - active;
  } else if (config_.over_sampling == OverSampling::Adaptive) {
    // Enough new groups to bring the live samples up to the target, within the step's group ceiling.
    const int64_t deficit = *config_.target_inflight_samples - queued - s_.running_samples - s_.aborting_samples;
    k = std::min(deficit > 0 ? (deficit + n - 1) / n : 0, s_.adaptive_groups - active);
  } else if (config_.refill == Refill::Batch || n_prime == config_.rollout_batch_size) {
    // Groups in hand (generating, completed, accepted) up to N'. With N' = N (no over-sampling) continuous
    // refill is this too: only the groups still needed are launched, so nothing is left to abort.
    k = needed + (n_prime - config_.rollout_batch_size) - active;
  } else {
    k = n_prime - active;  // continuous: keep N' groups generating
  }
  if (s_.data_size >= 0) k = std::min(k, s_.data_size - s_.prompts_consumed);
  if (config_.max_inflight_samples.has_value()) {
    const int64_t free_slots = *config_.max_inflight_samples - s_.running_samples - s_.aborting_samples - queued;
    // Round up: a group that only partly fits still fills the free slots; the rest of it waits queued.
    k = std::min(k, free_slots > 0 ? (free_slots + n - 1) / n : 0);
  }
  return std::max<int64_t>(k, 0);
}

int64_t Scheduler::groups_to_launch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_to_launch_locked();
}

void Scheduler::add_groups(const PromptBatch& p) {
  std::lock_guard<std::mutex> lock(mu_);
  // Every prompt is checked before the first group is added: a bad one launches nothing.
  check(s_.step_open, ErrorKind::InvalidState, "add_groups: no step is open; call begin_step() first");
  const auto n_groups = static_cast<int64_t>(p.n_groups);
  check(p.first_index == s_.prompts_consumed, ErrorKind::InvalidArgument,
        "add_groups: first prompt index " + std::to_string(p.first_index) +
            " is not allowed: prompts are taken in order, next is " + std::to_string(s_.prompts_consumed));
  check(s_.data_size < 0 || n_groups <= s_.data_size - p.first_index, ErrorKind::InvalidArgument,
        "add_groups: prompts " + std::to_string(p.first_index) + " to " +
            std::to_string(p.first_index + n_groups - 1) + " go past the data source's size " +
            std::to_string(s_.data_size));
  const auto n_tokens = static_cast<int64_t>(p.n_tokens);
  check(p.offsets[0] == 0 && p.offsets[p.n_groups] == n_tokens, ErrorKind::InvalidArgument,
        "add_groups: offsets must run from 0 to the " + std::to_string(n_tokens) + " tokens given");
  for (size_t i = 0; i < p.n_groups; ++i) {
    const int64_t index = p.first_index + static_cast<int64_t>(i);
    check(p.offsets[i + 1] <= n_tokens, ErrorKind::InvalidArgument,
          "add_groups: offsets must not decrease and stay within the " + std::to_string(n_tokens) + " tokens given");
    check(p.offsets[i + 1] > p.offsets[i], ErrorKind::InvalidArgument,
          "add_groups: prompt " + std::to_string(index) +
              " has no tokens (its offsets do not increase); a prompt needs at least one token id");
    for (int64_t t = p.offsets[i]; t < p.offsets[i + 1]; ++t) {
      check(p.tokens[t] >= 0, ErrorKind::InvalidArgument,
            "add_groups: token id " + std::to_string(p.tokens[t]) + " of prompt " + std::to_string(index) +
                " is not allowed: token ids must be in [0, 2**31 - 1]");
    }
  }
  for (size_t i = 0; i < p.n_groups; ++i) {
    const int64_t gid = s_.next_group_id++;
    Group& g = s_.groups[gid];
    g.prompt_index = p.first_index + static_cast<int64_t>(i);
    g.prompt.assign(p.tokens + p.offsets[i], p.tokens + p.offsets[i + 1]);
    if (p.history_keys != nullptr) {
      g.has_history_key = true;
      g.history_key = p.history_keys[i];
    }
    g.samples.resize(config_.group_width());
    g.long_queue = config_.tail_batching && s_.round != Round::Short;  // a long round's replacements join it
    // Every group has all its slots (one id layout); a long round's replacements leave the extra ones unused.
    for (size_t i = static_cast<size_t>(launch_width()); i < g.samples.size(); ++i) {
      g.samples[i].state = SampleState::Cancelled;
    }
    index_.add(gid, g);
  }
  s_.queued_samples += n_groups * launch_width();
  s_.prompts_consumed += n_groups;
  s_.wave_launched = s_.wave_launched || n_groups > 0;
  s_.stats.groups_launched += n_groups;
}

Dispatch Scheduler::dispatch() {
  std::lock_guard<std::mutex> lock(mu_);
  check(s_.step_open, ErrorKind::InvalidState, "dispatch: no step is open; call begin_step() first");
  Dispatch d;
  if (config_.over_sampling == OverSampling::Adaptive && !step_done_locked()) retune_over_sampling();
  if (step_done_locked() || s_.queued_samples == 0) return d;
  const int64_t cap = inflight_cap();
  const int64_t slots =
      cap == std::numeric_limits<int64_t>::max() ? cap : cap - s_.running_samples - s_.aborting_samples;
  if (slots <= 0) return d;
  const std::vector<Pick> picks = queued_in_dispatch_order();
  const size_t count = static_cast<size_t>(std::min<int64_t>(slots, static_cast<int64_t>(picks.size())));
  for (size_t r = 0; r < count; ++r) launch(d, picks[r]);
  return d;
}

// Queued samples of dispatchable groups in dispatch order. resume_priority: buffered partials (continuations
// too), then fresh samples, each class sorted by dispatch_order, ties among partials by resume_order and among
// fresh samples by creation order; otherwise one list, ties by creation order.
std::vector<Scheduler::Pick> Scheduler::queued_in_dispatch_order() const {
  std::vector<Pick> partials, fresh;
  for (const auto& [gid, g] : s_.groups) {
    if (!dispatchable(g)) continue;
    double predicted = -1.0;  // the group's, computed once it has a queued sample
    for (int64_t i = 0; i < static_cast<int64_t>(g.samples.size()); ++i) {
      const Sample& smp = g.samples[i];
      if (smp.state != SampleState::Queued) continue;
      if (predicted < 0) predicted = group_length_prediction(s_, g, config_.max_response_len);
      const auto len = static_cast<int64_t>(smp.tokens.size());
      (len == 0 ? fresh : partials)
          .push_back({gid, i, len, sample_length_prediction(predicted, len)});
    }
  }
  switch (config_.resume_order) {
    case ResumeOrder::OldestFirst: break;  // map order is creation order
    case ResumeOrder::NewestFirst:
      std::stable_sort(partials.begin(), partials.end(), [](const Pick& a, const Pick& b) { return a.gid > b.gid; });
      break;
    case ResumeOrder::LongestFirst:
      std::stable_sort(partials.begin(), partials.end(), [](const Pick& a, const Pick& b) { return a.len > b.len; });
      break;
  }
  if (!config_.resume_priority) {
    partials.insert(partials.end(), fresh.begin(), fresh.end());
    fresh.clear();
    std::stable_sort(partials.begin(), partials.end(), older);  // one list: ties in creation order
  }
  sort_by_dispatch_order(partials);
  sort_by_dispatch_order(fresh);
  partials.insert(partials.end(), fresh.begin(), fresh.end());
  return partials;
}

// Stable: ties keep the order they come in (resume_order among partials, creation order otherwise).
void Scheduler::sort_by_dispatch_order(std::vector<Pick>& picks) const {
  switch (config_.dispatch_order) {
    case DispatchOrder::Fifo: break;  // partials in resume_order, fresh samples as launched; one list by age
    case DispatchOrder::OldestFirst:
      std::stable_sort(picks.begin(), picks.end(), older);
      break;
    case DispatchOrder::LongestPredictedFirst:
      std::stable_sort(picks.begin(), picks.end(),
                       [](const Pick& a, const Pick& b) { return a.predicted - a.len > b.predicted - b.len; });
      break;
    case DispatchOrder::ShortestFirst:
      std::stable_sort(picks.begin(), picks.end(),
                       [](const Pick& a, const Pick& b) { return a.predicted - a.len < b.predicted - b.len; });
      break;
  }
}

// Sends one queued sample: its request (prompt + partial response, the remaining budget or one chunk of it)
// goes into d. A partial that came back at a chunk boundary at this policy version is a continuation: the
// engine still holds its KV, so it is no re-prefill.
void Scheduler::launch(Dispatch& d, const Pick& pick) {
  Group& g = s_.groups.at(pick.gid);
  Sample& smp = g.samples[pick.index];
  const bool is_resume = pick.len > 0;
  const bool is_continuation = is_resume && smp.chunk_version >= 0 && smp.chunk_version == s_.policy_version;
  int64_t budget = config_.max_response_len - pick.len;
  if (config_.chunk_tokens.has_value()) budget = std::min(budget, *config_.chunk_tokens);
  d.sample_ids.push_back(ids_.id(pick.gid, pick.index));
  d.group_ids.push_back(pick.gid);
  d.prompt_indices.push_back(g.prompt_index);
  d.input_ids.insert(d.input_ids.end(), g.prompt.begin(), g.prompt.end());
  d.input_ids.insert(d.input_ids.end(), smp.tokens.begin(), smp.tokens.end());
  d.offsets.push_back(static_cast<int64_t>(d.input_ids.size()));
  d.prompt_lens.push_back(static_cast<int32_t>(g.prompt.size()));
  d.max_new_tokens.push_back(budget);
  d.is_resume.push_back(is_resume ? 1 : 0);
  d.is_continuation.push_back(is_continuation ? 1 : 0);
  d.predicted_lens.push_back(pick.predicted);
  smp.state = SampleState::Running;
  smp.dispatch_version = s_.policy_version;
  smp.resumed = is_resume && !is_continuation;
  smp.dispatch_len = static_cast<int32_t>(pick.len);
  smp.dispatch_budget = static_cast<int32_t>(budget);
  // The accuracy figure pairs a final length with the prediction made when the sample last started or resumed:
  // a chunk continuation's prediction is bounded below by its length, which would grade the predictor on
  // what it was told.
  if (!is_continuation || smp.predicted_len == 0) smp.predicted_len = static_cast<int32_t>(pick.predicted);
  smp.chunk_version = -1;
  g.n_in_flight += 1;
  s_.queued_samples -= 1;
  s_.running_samples += 1;
  const auto input_len = static_cast<int64_t>(g.prompt.size()) + pick.len;
  if (is_continuation) {
    s_.stats.continuation_requests += 1;
    s_.stats.continuation_tokens += input_len;
  } else if (is_resume) {
    smp.resumes += 1;
    s_.stats.resume_requests += 1;
    s_.stats.re_prefill_tokens += input_len;
  } else {
    s_.stats.new_requests += 1;
    s_.stats.prefill_tokens += static_cast<int64_t>(g.prompt.size());
  }
}

void Scheduler::retune_over_sampling() {
  // The groups in hand show how many of a group's samples are still live (queued or generating) as
  // completion thins them out; holding T samples live takes about T / (n x that share) groups. The share
  // is observed at every step start and dispatch (a running mean, so one sparse moment does not swing
  // it); the ceiling bounds the groups in hand, and with them the buffer and the staleness of partials.
  // Tail batching: a long round does not over-sample; a short round observes its own groups, not the long
  // queue's (their queued samples are not live for it).
  if (config_.tail_batching && s_.round != Round::Short) return;
  const int64_t n = config_.group_width();
  const int64_t target = *config_.target_inflight_samples;
  int64_t active = 0;
  int64_t live = config_.tail_batching
                     ? 0
                     : s_.queued_samples + s_.running_samples + s_.aborting_samples + s_.waiting_env_samples;
  for (const auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Active || !in_round(g)) continue;
    active += 1;
    if (!config_.tail_batching) continue;
    for (const auto& smp : g.samples) {
      const bool settled = smp.state == SampleState::Done || smp.state == SampleState::Cancelled || smp.surplus;
      live += settled ? 0 : 1;
    }
  }
  if (active > 0) {
    const double observed = static_cast<double>(live) / static_cast<double>(n * active);
    s_.live_fraction = 0.5 * s_.live_fraction + 0.5 * observed;
  }
  // Floor: N' and enough fresh groups for T; ceiling: T groups (an active group has a live sample).
  const int64_t floor_groups = std::max(*config_.over_sampling_batch_size, (target + n - 1) / n);
  const int64_t ceiling_groups = std::max(floor_groups, target);
  const double wanted = std::ceil(static_cast<double>(target) / (static_cast<double>(n) * s_.live_fraction));
  s_.adaptive_groups =
      std::clamp(static_cast<int64_t>(std::min(wanted, static_cast<double>(ceiling_groups))), floor_groups,
                 ceiling_groups);
  s_.stats.over_sampling_groups = s_.adaptive_groups;
}

int64_t Scheduler::launch_width() const {
  return config_.tail_batching && s_.round != Round::Short ? config_.n_samples_per_prompt : config_.group_width();
}

int64_t Scheduler::inflight_cap() const {
  int64_t cap = std::numeric_limits<int64_t>::max();
  if (config_.max_inflight_samples.has_value()) cap = *config_.max_inflight_samples;
  if (config_.over_sampling == OverSampling::Adaptive) cap = std::min(cap, *config_.target_inflight_samples);
  return cap;
}

}  // namespace april::sched
