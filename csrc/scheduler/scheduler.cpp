#include "scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/error.h"
#include "scheduler/state_io.h"

namespace april::sched {

namespace {

const char* state_name(SampleState s) {
  switch (s) {
    case SampleState::Queued: return "queued";
    case SampleState::Running: return "running";
    case SampleState::Aborting: return "aborting";
    case SampleState::Done: return "done";
  }
  return "?";
}

std::string id_str(int64_t id) { return std::to_string(id); }

void remove_id(std::deque<int64_t>& q, int64_t id) {
  auto it = std::find(q.begin(), q.end(), id);
  if (it != q.end()) q.erase(it);
}

}  // namespace

Scheduler::Scheduler(const Config& config) : config_(config) { config_.validate(); }

void Scheduler::set_data_size(int64_t size) {
  check(size >= -1, ErrorKind::InvalidArgument,
        "data size " + id_str(size) + " is not allowed: must be >= 0, or -1 for unknown");
  std::lock_guard<std::mutex> lock(mu_);
  s_.data_size = size;
}

int64_t Scheduler::prompts_consumed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.prompts_consumed;
}

int64_t Scheduler::policy_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.policy_version;
}

bool Scheduler::step_open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_.step_open;
}

Group& Scheduler::group_of(int64_t sample_id, int64_t* index) {
  return const_cast<Group&>(static_cast<const Scheduler*>(this)->group_of(sample_id, index));
}

const Group& Scheduler::group_of(int64_t sample_id, int64_t* index) const {
  const int64_t n = config_.n_samples_per_prompt;
  auto it = sample_id >= 0 ? s_.groups.find(sample_id / n) : s_.groups.end();
  if (it == s_.groups.end()) {
    throw Error(ErrorKind::UnknownId,
                "sample id " + id_str(sample_id) +
                    " is not known: it was never dispatched, or its group was trained, filtered or dropped");
  }
  *index = sample_id % n;
  return it->second;
}

// ---------------------------------------------------------------- step control

void Scheduler::begin_step(int64_t policy_version) {
  std::lock_guard<std::mutex> lock(mu_);
  check(!s_.step_open, ErrorKind::InvalidState,
        "begin_step: step " + id_str(s_.step_index) + " (policy version " + id_str(s_.policy_version) +
            ") is still open; take_batch() ends it");
  check(policy_version >= 0 && policy_version >= s_.policy_version &&
            policy_version <= std::numeric_limits<int32_t>::max(),
        ErrorKind::InvalidArgument,
        "begin_step: policy_version=" + id_str(policy_version) + " is not allowed: must be in [" +
            id_str(std::max<int64_t>(s_.policy_version, 0)) + ", 2**31 - 1] (never below the previous step's)");
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
    s_.stats.over_sampling_groups = config_.over_sampling_batch_size;
  }
  std::vector<int64_t> ids;
  for (auto& [gid, g] : s_.groups) {
    for (auto& smp : g.samples) smp.tokens_at_step_start = static_cast<int64_t>(smp.tokens.size());
    ids.push_back(gid);
  }
  // A version bump is the only thing that makes tokens staler, so this is where the policy is enforced.
  // Groups with samples still in flight (aborts of the last step not yet returned) wait for them.
  for (int64_t gid : ids) {
    Group& g = s_.groups.at(gid);
    if (g.n_in_flight > 0) {
      g.stale_check_pending = true;
    } else {
      apply_staleness(gid);
    }
  }
}

void Scheduler::retune_over_sampling() {
  // The groups in hand show how many of a group's samples are still live (queued or generating) as
  // completion thins them out; holding T samples live takes about T / (n x that share) groups. The share
  // is observed at every step start and dispatch (a running mean, so one sparse moment does not swing
  // it); the ceiling bounds the groups in hand, and with them the buffer and the staleness of partials.
  const int64_t n = config_.n_samples_per_prompt;
  const int64_t target = config_.target_inflight_samples;
  int64_t active = 0;
  for (const auto& [gid, g] : s_.groups) active += g.state == GroupState::Active ? 1 : 0;
  const int64_t live = s_.queued_samples + s_.running_samples + s_.aborting_samples;
  if (active > 0) {
    const double observed = static_cast<double>(live) / static_cast<double>(n * active);
    s_.live_fraction = 0.5 * s_.live_fraction + 0.5 * observed;
  }
  // Floor: N' and enough fresh groups for T; ceiling: T groups (an active group has a live sample).
  const int64_t floor_groups = std::max(config_.over_sampling_batch_size, (target + n - 1) / n);
  const int64_t ceiling_groups = std::max(floor_groups, target);
  const double wanted = std::ceil(static_cast<double>(target) / (static_cast<double>(n) * s_.live_fraction));
  s_.adaptive_groups =
      std::clamp(static_cast<int64_t>(std::min(wanted, static_cast<double>(ceiling_groups))), floor_groups,
                 ceiling_groups);
  s_.stats.over_sampling_groups = s_.adaptive_groups;
}

int64_t Scheduler::inflight_cap() const {
  int64_t cap = std::numeric_limits<int64_t>::max();
  if (config_.max_inflight_samples > 0) cap = config_.max_inflight_samples;
  if (config_.over_sampling == OverSampling::Adaptive) cap = std::min(cap, config_.target_inflight_samples);
  return cap;
}

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
    smp.tokens_at_step_start = 0;
  }
  if (g.state != GroupState::Active) {
    remove_id(s_.completed, group_id);
    remove_id(s_.accepted, group_id);
    g.state = GroupState::Active;
    g.rewards.clear();
    g.popped = false;
  }
}

void Scheduler::erase_group(int64_t group_id) {
  Group& g = s_.groups.at(group_id);
  for (const auto& smp : g.samples) {
    if (smp.state == SampleState::Queued) s_.queued_samples -= 1;
  }
  remove_id(s_.completed, group_id);
  remove_id(s_.accepted, group_id);
  s_.groups.erase(group_id);
}

void Scheduler::complete_if_done(int64_t group_id, Group& g) {
  if (g.state == GroupState::Active && g.n_done == config_.n_samples_per_prompt) {
    g.state = GroupState::Completed;
    s_.completed.push_back(group_id);
    s_.stats.groups_completed += 1;
  }
}

bool Scheduler::step_done_locked() const {
  if (!s_.step_open) return false;
  if (static_cast<int64_t>(s_.accepted.size()) >= config_.rollout_batch_size) return true;
  if (!s_.data_exhausted()) return false;
  // Out of prompts: done once nothing left could still be accepted.
  for (const auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Accepted) return false;
  }
  return true;
}

bool Scheduler::step_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return step_done_locked();
}

std::vector<int64_t> Scheduler::samples_to_abort() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  if (!step_done_locked()) return out;
  const int64_t n = config_.n_samples_per_prompt;
  for (auto& [gid, g] : s_.groups) {
    for (int64_t i = 0; i < n; ++i) {
      Sample& smp = g.samples[i];
      if (smp.state != SampleState::Running) continue;
      smp.state = SampleState::Aborting;
      s_.running_samples -= 1;
      s_.aborting_samples += 1;
      out.push_back(gid * n + i);
    }
  }
  s_.stats.abort_requests += static_cast<int64_t>(out.size());
  return out;
}

Batch Scheduler::take_batch() {
  std::lock_guard<std::mutex> lock(mu_);
  check(s_.step_open, ErrorKind::InvalidState, "take_batch: no step is open; call begin_step() first");
  check(step_done_locked(), ErrorKind::InvalidState,
        "take_batch: the step is not done: " + id_str(static_cast<int64_t>(s_.accepted.size())) + " of " +
            id_str(config_.rollout_batch_size) + " groups accepted and prompts remain");
  check(s_.running_samples == 0, ErrorKind::InvalidState,
        "take_batch: " + id_str(s_.running_samples) +
            " samples are still running; call samples_to_abort() and abort them in the engine first");
  const int64_t n = config_.n_samples_per_prompt;
  const int64_t v = s_.policy_version;
  const bool mask_stale = config_.staleness_policy == StalenessPolicy::Mask && config_.max_staleness >= 0;
  const int64_t n_groups = std::min<int64_t>(config_.rollout_batch_size, static_cast<int64_t>(s_.accepted.size()));
  Batch b;
  b.policy_version = v;
  StepStats& st = s_.stats;
  int64_t total = 0;
  for (int64_t j = 0; j < n_groups; ++j) {
    const Group& g = s_.groups.at(s_.accepted[j]);
    total += n * static_cast<int64_t>(g.prompt.size());
    for (const auto& smp : g.samples) total += static_cast<int64_t>(smp.tokens.size());
  }
  b.tokens.reserve(total);
  b.loss_mask.reserve(total);
  b.behavior_logprobs.reserve(total);
  b.versions.reserve(total);
  for (int64_t j = 0; j < n_groups; ++j) {
    const int64_t gid = s_.accepted[j];
    const Group& g = s_.groups.at(gid);
    b.group_ids.push_back(gid);
    b.prompt_indices.push_back(g.prompt_index);
    for (int64_t i = 0; i < n; ++i) {
      const Sample& smp = g.samples[i];
      const size_t plen = g.prompt.size();
      b.tokens.insert(b.tokens.end(), g.prompt.begin(), g.prompt.end());
      b.tokens.insert(b.tokens.end(), smp.tokens.begin(), smp.tokens.end());
      b.loss_mask.insert(b.loss_mask.end(), plen, 0);
      b.behavior_logprobs.insert(b.behavior_logprobs.end(), plen, 0.0f);
      b.behavior_logprobs.insert(b.behavior_logprobs.end(), smp.logprobs.begin(), smp.logprobs.end());
      b.versions.insert(b.versions.end(), plen, -1);
      for (size_t k = 0; k < smp.segments.size(); ++k) {
        const Segment& seg = smp.segments[k];
        const size_t len = smp.segment_end(k) - seg.start;
        const int64_t staleness = v - seg.version;
        const bool train = !(config_.mask_offpolicy && seg.version != v) &&
                           !(mask_stale && staleness > config_.max_staleness);
        b.versions.insert(b.versions.end(), len, seg.version);
        b.loss_mask.insert(b.loss_mask.end(), len, train ? 1 : 0);
        if (seg.version < v) st.batch_offpolicy_tokens += static_cast<int64_t>(len);
        if (!train) st.batch_masked_tokens += static_cast<int64_t>(len);
      }
      b.offsets.push_back(static_cast<int64_t>(b.tokens.size()));
      b.prompt_lens.push_back(static_cast<int32_t>(plen));
      b.rewards.push_back(g.rewards[i]);
      b.group_index.push_back(static_cast<int32_t>(j));
      b.sample_ids.push_back(gid * n + i);
      b.finish_reasons.push_back(static_cast<uint8_t>(smp.finish));
      const int64_t staleness = smp.segments.empty() ? 0 : v - smp.oldest_version();
      if (static_cast<int64_t>(st.staleness_histogram.size()) <= staleness) {
        st.staleness_histogram.resize(staleness + 1, 0);
      }
      st.staleness_histogram[staleness] += 1;
      st.batch_max_staleness = std::max(st.batch_max_staleness, staleness);
      st.batch_response_tokens += static_cast<int64_t>(smp.tokens.size());
      st.batch_carried_tokens += smp.tokens_at_step_start;
    }
  }
  for (int64_t gid : b.group_ids) erase_group(gid);
  st.batch_groups = n_groups;
  st.batch_samples = n_groups * n;
  if (!config_.keep_surplus) {
    std::vector<int64_t> surplus;
    for (const auto& [gid, g] : s_.groups) {
      if (g.state != GroupState::Active) surplus.push_back(gid);
    }
    for (int64_t gid : surplus) erase_group(gid);
    st.surplus_dropped += static_cast<int64_t>(surplus.size());
  }
  s_.step_open = false;
  return b;
}

// ---------------------------------------------------------------- dispatch

int64_t Scheduler::groups_to_launch_locked() const {
  if (!s_.step_open || step_done_locked()) return 0;
  int64_t active = 0, pending = 0;
  for (const auto& [gid, g] : s_.groups) {
    if (g.state == GroupState::Active) active += 1;
    if (g.state == GroupState::Completed) pending += 1;
  }
  const int64_t accepted = static_cast<int64_t>(s_.accepted.size());
  // Pending groups may still be accepted: launching for them would overshoot N.
  if (accepted + pending >= config_.rollout_batch_size) return 0;
  if (config_.refill == Refill::Batch && s_.wave_launched && active > 0) return 0;  // the wave still generates
  const int64_t n = config_.n_samples_per_prompt;
  int64_t k = 0;
  if (config_.over_sampling == OverSampling::Adaptive) {
    // Enough new groups to bring the live samples up to the target, within the step's group ceiling.
    const int64_t deficit = config_.target_inflight_samples - s_.queued_samples - s_.running_samples -
                            s_.aborting_samples;
    k = std::min(deficit > 0 ? (deficit + n - 1) / n : 0, s_.adaptive_groups - active);
  } else if (config_.refill == Refill::Batch) {
    k = config_.over_sampling_batch_size - active - accepted - pending;
  } else {
    k = config_.over_sampling_batch_size - active;
  }
  if (s_.data_size >= 0) k = std::min(k, s_.data_size - s_.prompts_consumed);
  if (config_.max_inflight_samples > 0) {
    const int64_t free_slots =
        config_.max_inflight_samples - s_.running_samples - s_.aborting_samples - s_.queued_samples;
    // Round up: a group that only partly fits still fills the free slots; the rest of it waits queued.
    k = std::min(k, free_slots > 0 ? (free_slots + n - 1) / n : 0);
  }
  return std::max<int64_t>(k, 0);
}

int64_t Scheduler::groups_to_launch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_to_launch_locked();
}

int64_t Scheduler::add_group(int64_t prompt_index, const int32_t* prompt, size_t prompt_len) {
  std::lock_guard<std::mutex> lock(mu_);
  check(s_.step_open, ErrorKind::InvalidState, "add_group: no step is open; call begin_step() first");
  check(prompt_index == s_.prompts_consumed, ErrorKind::InvalidArgument,
        "add_group: prompt_index=" + id_str(prompt_index) + " is not allowed: prompts are taken in order, next is " +
            id_str(s_.prompts_consumed));
  check(s_.data_size < 0 || prompt_index < s_.data_size, ErrorKind::InvalidArgument,
        "add_group: prompt_index=" + id_str(prompt_index) + " is past the data source's size " + id_str(s_.data_size));
  check(prompt_len >= 1, ErrorKind::InvalidArgument,
        "add_group: prompt " + id_str(prompt_index) + " has no tokens; a prompt needs at least one token id");
  const int64_t gid = s_.next_group_id++;
  Group& g = s_.groups[gid];
  g.prompt_index = prompt_index;
  g.prompt.assign(prompt, prompt + prompt_len);
  g.samples.resize(config_.n_samples_per_prompt);
  s_.queued_samples += config_.n_samples_per_prompt;
  s_.prompts_consumed += 1;
  s_.wave_launched = true;
  s_.stats.groups_launched += 1;
  return gid;
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
  struct Pick {
    int64_t gid;
    int64_t index;
    int64_t len;
  };
  std::vector<Pick> resumes, fresh;
  for (const auto& [gid, g] : s_.groups) {
    if (g.state != GroupState::Active || g.stale_check_pending) continue;
    for (int64_t i = 0; i < config_.n_samples_per_prompt; ++i) {
      const Sample& smp = g.samples[i];
      if (smp.state != SampleState::Queued) continue;
      (smp.tokens.empty() ? fresh : resumes).push_back({gid, i, static_cast<int64_t>(smp.tokens.size())});
    }
  }
  switch (config_.resume_order) {
    case ResumeOrder::OldestFirst: break;  // map order is creation order
    case ResumeOrder::NewestFirst:
      std::stable_sort(resumes.begin(), resumes.end(), [](const Pick& a, const Pick& b) { return a.gid > b.gid; });
      break;
    case ResumeOrder::LongestFirst:
      std::stable_sort(resumes.begin(), resumes.end(), [](const Pick& a, const Pick& b) { return a.len > b.len; });
      break;
  }
  resumes.insert(resumes.end(), fresh.begin(), fresh.end());
  const int64_t n = config_.n_samples_per_prompt;
  const size_t count = static_cast<size_t>(std::min<int64_t>(slots, static_cast<int64_t>(resumes.size())));
  for (size_t r = 0; r < count; ++r) {
    const Pick& p = resumes[r];
    Group& g = s_.groups.at(p.gid);
    Sample& smp = g.samples[p.index];
    const bool is_resume = !smp.tokens.empty();
    d.sample_ids.push_back(p.gid * n + p.index);
    d.group_ids.push_back(p.gid);
    d.prompt_indices.push_back(g.prompt_index);
    d.input_ids.insert(d.input_ids.end(), g.prompt.begin(), g.prompt.end());
    d.input_ids.insert(d.input_ids.end(), smp.tokens.begin(), smp.tokens.end());
    d.offsets.push_back(static_cast<int64_t>(d.input_ids.size()));
    d.prompt_lens.push_back(static_cast<int32_t>(g.prompt.size()));
    d.max_new_tokens.push_back(config_.max_response_len - static_cast<int64_t>(smp.tokens.size()));
    d.is_resume.push_back(is_resume ? 1 : 0);
    smp.state = SampleState::Running;
    smp.dispatch_version = s_.policy_version;
    smp.resumed = is_resume;
    g.n_in_flight += 1;
    s_.queued_samples -= 1;
    s_.running_samples += 1;
    if (is_resume) {
      smp.resumes += 1;
      s_.stats.resume_requests += 1;
      s_.stats.re_prefill_tokens += static_cast<int64_t>(g.prompt.size() + smp.tokens.size());
    } else {
      s_.stats.new_requests += 1;
      s_.stats.prefill_tokens += static_cast<int64_t>(g.prompt.size());
    }
  }
  return d;
}

// ---------------------------------------------------------------- engine events

std::vector<Sample*>& Scheduler::validate_events(const EventBatch& ev, bool finishing) {
  // Hot path: messages are built only on failure.
  if (ev.n_tokens != ev.n_logprobs) {
    throw Error(ErrorKind::InvalidArgument, "logprobs has " + id_str(static_cast<int64_t>(ev.n_logprobs)) +
                                                " entries but tokens has " + id_str(static_cast<int64_t>(ev.n_tokens)) +
                                                ": one behavior logprob per token");
  }
  epoch_ += 1;
  scratch_samples_.clear();
  scratch_samples_.reserve(ev.n_events);
  const int64_t n = config_.n_samples_per_prompt;
  int64_t cached_gid = -1;  // events of one group usually arrive together
  Group* cached = nullptr;
  size_t sum = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    const int64_t sid = ev.sample_ids[e];
    const int64_t cnt = ev.counts[e];
    if (cnt < 0) {
      throw Error(ErrorKind::InvalidArgument, "token count " + id_str(cnt) + " of sample " + id_str(sid) + " is negative");
    }
    sum += static_cast<size_t>(cnt);
    if (sum > ev.n_tokens) {
      throw Error(ErrorKind::InvalidArgument, "token counts add up to more than the " +
                                                  id_str(static_cast<int64_t>(ev.n_tokens)) + " tokens given");
    }
    int64_t idx = 0;
    if (sid >= 0 && sid / n == cached_gid) {
      idx = sid % n;
    } else {
      cached = &group_of(sid, &idx);
      cached_gid = sid / n;
    }
    Sample& smp = cached->samples[idx];
    if (!smp.in_flight()) {
      throw Error(ErrorKind::InvalidState,
                  smp.state == SampleState::Done
                      ? "sample " + id_str(sid) + " already finished; tokens and finish are accepted once, while it runs"
                      : "sample " + id_str(sid) + " is not running (state " + state_name(smp.state) +
                            "): tokens and finish are accepted between dispatch and finish");
    }
    if (smp.scratch_epoch != epoch_) {
      smp.scratch_epoch = epoch_;
      smp.scratch_len = static_cast<int64_t>(smp.tokens.size());
      smp.scratch_version = std::max(smp.last_version(), smp.dispatch_version);
      smp.scratch_finished = false;
    }
    if (smp.scratch_finished) {
      throw Error(ErrorKind::InvalidState, "sample " + id_str(sid) + " is finished twice in one call");
    }
    if (finishing) {
      if (ev.reasons[e] > static_cast<uint8_t>(FinishReason::Abort)) {
        throw Error(ErrorKind::InvalidArgument, "finish reason " + id_str(ev.reasons[e]) + " of sample " + id_str(sid) +
                                                    " is not allowed: 0 (stop), 1 (length) or 2 (abort)");
      }
      smp.scratch_finished = true;
    }
    if (cnt > 0) {
      const int64_t ver = ev.versions[e];
      if (ver < smp.scratch_version || ver > s_.policy_version) {
        throw Error(ErrorKind::InvalidArgument,
                    "version " + id_str(ver) + " of sample " + id_str(sid) + " is not allowed: must be in [" +
                        id_str(smp.scratch_version) + ", " + id_str(s_.policy_version) +
                        "] (not below its dispatch version or earlier tokens, not above the current policy)");
      }
      if (smp.scratch_len + cnt > config_.max_response_len) {
        throw Error(ErrorKind::InvalidArgument, "sample " + id_str(sid) + " would have " +
                                                    id_str(smp.scratch_len + cnt) + " response tokens, over max_response_len=" +
                                                    id_str(config_.max_response_len));
      }
      smp.scratch_len += cnt;
      smp.scratch_version = ver;
    }
    scratch_samples_.push_back(&smp);
  }
  if (sum != ev.n_tokens) {
    throw Error(ErrorKind::InvalidArgument, "token counts add up to " + id_str(static_cast<int64_t>(sum)) + " but " +
                                                id_str(static_cast<int64_t>(ev.n_tokens)) + " tokens were given");
  }
  return scratch_samples_;
}

void Scheduler::append_tokens(Sample& smp, const int32_t* tokens, const float* logprobs, int64_t count,
                              int64_t version) {
  if (count == 0) return;
  const auto start = static_cast<int32_t>(smp.tokens.size());
  if (smp.segments.empty() || smp.segments.back().version != version) {
    smp.segments.push_back({static_cast<int32_t>(version), start});
  }
  smp.tokens.insert(smp.tokens.end(), tokens, tokens + count);
  smp.logprobs.insert(smp.logprobs.end(), logprobs, logprobs + count);
  s_.stats.generated_tokens += count;
  if (smp.resumed) s_.stats.resumed_generated_tokens += count;
}

void Scheduler::on_tokens(const EventBatch& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Sample*>& samples = validate_events(ev, false);
  size_t pos = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    append_tokens(*samples[e], ev.tokens + pos, ev.logprobs + pos, ev.counts[e], ev.versions[e]);
    pos += static_cast<size_t>(ev.counts[e]);
  }
}

void Scheduler::on_finish(const EventBatch& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Sample*>& samples = validate_events(ev, true);
  const int64_t n = config_.n_samples_per_prompt;
  size_t pos = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    Sample& smp = *samples[e];
    const int64_t cnt = ev.counts[e];
    append_tokens(smp, ev.tokens + pos, ev.logprobs + pos, cnt, cnt > 0 ? ev.versions[e] : 0);
    pos += static_cast<size_t>(cnt);
    const int64_t gid = ev.sample_ids[e] / n;
    Group& g = s_.groups.at(gid);
    (smp.state == SampleState::Running ? s_.running_samples : s_.aborting_samples) -= 1;
    g.n_in_flight -= 1;
    auto reason = static_cast<FinishReason>(ev.reasons[e]);
    const bool at_cap = static_cast<int64_t>(smp.tokens.size()) >= config_.max_response_len;
    if (reason == FinishReason::Abort && !at_cap) {
      // Recycled: every token, logprob and version segment stays for the resume.
      smp.state = SampleState::Queued;
      smp.tokens.shrink_to_fit();
      smp.logprobs.shrink_to_fit();
      smp.segments.shrink_to_fit();
      s_.queued_samples += 1;
      s_.stats.aborts += 1;
    } else {
      smp.state = SampleState::Done;
      smp.finish = reason == FinishReason::Abort ? FinishReason::Length : reason;
      g.n_done += 1;
      s_.stats.finished_samples += 1;
    }
    if (g.stale_check_pending && g.n_in_flight == 0) {
      g.stale_check_pending = false;
      apply_staleness(gid);
      if (s_.groups.find(gid) == s_.groups.end()) continue;
    }
    complete_if_done(gid, g);
  }
}

// ---------------------------------------------------------------- reward and filter

std::vector<CompletedGroup> Scheduler::pop_completed_groups() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CompletedGroup> out;
  const int64_t n = config_.n_samples_per_prompt;
  for (int64_t gid : s_.completed) {
    Group& g = s_.groups.at(gid);
    g.popped = true;
    CompletedGroup c{gid, g.prompt_index, {}, {}, {}, {}};
    for (int64_t i = 0; i < n; ++i) {
      c.sample_ids.push_back(gid * n + i);
      c.response_lens.push_back(static_cast<int64_t>(g.samples[i].tokens.size()));
      c.finish_reasons.push_back(static_cast<uint8_t>(g.samples[i].finish));
      c.tokens.insert(c.tokens.end(), g.samples[i].tokens.begin(), g.samples[i].tokens.end());
    }
    out.push_back(std::move(c));
  }
  s_.completed.clear();
  return out;
}

void Scheduler::report_rewards(int64_t group_id, const float* rewards, size_t count, bool accepted) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = s_.groups.find(group_id);
  check(it != s_.groups.end(), ErrorKind::UnknownId,
        "report_rewards: group id " + id_str(group_id) +
            " is not known: never launched, or already trained, filtered or dropped for staleness");
  Group& g = it->second;
  check(g.state == GroupState::Completed, ErrorKind::InvalidState,
        "report_rewards: group " + id_str(group_id) +
            (g.state == GroupState::Active ? " is not complete yet (samples still generating or buffered)"
                                           : " was already rewarded"));
  check(static_cast<int64_t>(count) == config_.n_samples_per_prompt, ErrorKind::InvalidArgument,
        "report_rewards: group " + id_str(group_id) + " got " + id_str(static_cast<int64_t>(count)) +
            " rewards; it has n_samples_per_prompt=" + id_str(config_.n_samples_per_prompt) + " samples");
  for (size_t i = 0; i < count; ++i) {
    check(std::isfinite(rewards[i]), ErrorKind::InvalidArgument,
          "report_rewards: reward " + std::to_string(rewards[i]) + " of sample " + id_str(static_cast<int64_t>(i)) +
              " in group " + id_str(group_id) + " is not a finite number");
  }
  remove_id(s_.completed, group_id);
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

// ---------------------------------------------------------------- introspection

StepStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StepStats st = s_.stats;
  for (const auto& [gid, g] : s_.groups) {
    if (g.state == GroupState::Active) {
      st.buffered_groups += 1;
    } else {
      st.surplus_groups += 1;
    }
    for (const auto& smp : g.samples) {
      if (smp.state == SampleState::Aborting || (smp.state == SampleState::Queued && !smp.tokens.empty())) {
        st.buffered_samples += 1;
        st.buffered_tokens += static_cast<int64_t>(smp.tokens.size());
      }
    }
  }
  st.data_exhausted = s_.data_exhausted() ? 1 : 0;
  st.prompts_consumed = s_.prompts_consumed;
  return st;
}

MemoryUsage Scheduler::buffered_memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryUsage m;
  for (const auto& [gid, g] : s_.groups) {
    for (const auto& smp : g.samples) {
      if (smp.state != SampleState::Queued || smp.tokens.empty()) continue;
      m.samples += 1;
      m.tokens += static_cast<int64_t>(smp.tokens.size());
      m.bytes += static_cast<int64_t>(smp.tokens.capacity() * sizeof(int32_t) +
                                      smp.logprobs.capacity() * sizeof(float) +
                                      smp.segments.capacity() * sizeof(Segment));
    }
  }
  return m;
}

std::vector<int64_t> Scheduler::sample_ids(SampleState state) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  const int64_t n = config_.n_samples_per_prompt;
  for (const auto& [gid, g] : s_.groups) {
    for (int64_t i = 0; i < n; ++i) {
      if (g.samples[i].state == state) out.push_back(gid * n + i);
    }
  }
  return out;
}

void Scheduler::sample_response(int64_t sample_id, std::vector<int32_t>& tokens, std::vector<float>& logprobs,
                                std::vector<int32_t>& versions, uint8_t& state, int64_t& resumes) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t idx = 0;
  const Sample& smp = group_of(sample_id, &idx).samples[idx];
  tokens = smp.tokens;
  logprobs = smp.logprobs;
  versions.clear();
  for (size_t k = 0; k < smp.segments.size(); ++k) {
    versions.insert(versions.end(), smp.segment_end(k) - smp.segments[k].start, smp.segments[k].version);
  }
  state = static_cast<uint8_t>(smp.state);
  resumes = smp.resumes;
}

// ---------------------------------------------------------------- persistence

std::string Scheduler::serialize() const {
  std::lock_guard<std::mutex> lock(mu_);
  return encode_state(config_, s_);
}

void Scheduler::deserialize(const std::string& bytes) {
  State fresh = decode_state(config_, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  fresh.data_size = s_.data_size;  // the size belongs to the data source attached now
  s_ = std::move(fresh);
  // A state from format version 1, or saved with fixed over-sampling, has no group ceiling yet.
  if (config_.over_sampling == OverSampling::Adaptive && s_.adaptive_groups == 0) retune_over_sampling();
  std::vector<int64_t> pending;
  for (const auto& [gid, g] : s_.groups) {
    if (g.stale_check_pending) pending.push_back(gid);
  }
  // Nothing is in flight after a load, so checks that waited for returning aborts run now.
  for (int64_t gid : pending) {
    s_.groups.at(gid).stale_check_pending = false;
    apply_staleness(gid);
    auto it = s_.groups.find(gid);
    if (it != s_.groups.end()) complete_if_done(gid, it->second);
  }
}

void Scheduler::save(const std::string& path) const { write_file_atomic(path, serialize()); }

void Scheduler::load(const std::string& path) { deserialize(read_file(path)); }

}  // namespace april::sched
