// The scheduler's records, introspection and persistence. The rest of the class lives beside it:
// step.cpp (step boundary, rewards, batch), dispatch.cpp (refill, dispatch), events.cpp (tokens,
// finishes), staleness.cpp.
#include "scheduler/scheduler.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "scheduler/prediction.h"
#include "scheduler/state_file.h"
#include "scheduler/state_io.h"

namespace april::sched {

Scheduler::Scheduler(const Config& config)
    : config_(config.validated()), ids_{config.group_width()}, index_(ids_) {}

void Scheduler::set_data_size(int64_t size) {
  check(size >= -1, ErrorKind::InvalidArgument,
        "data size " + std::to_string(size) + " is not allowed: must be >= 0, or -1 for unknown");
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

Group& Scheduler::group_of(int64_t sample_id, int64_t* index) {
  return const_cast<Group&>(static_cast<const Scheduler*>(this)->group_of(sample_id, index));
}

const Group& Scheduler::group_of(int64_t sample_id, int64_t* index) const {
  auto it = sample_id >= 0 ? s_.groups.find(ids_.group(sample_id)) : s_.groups.end();
  if (it == s_.groups.end()) throw_unknown_sample(sample_id);
  *index = ids_.slot(sample_id);
  return it->second;
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
    st.long_queue_groups += config_.tail_batching && g.long_queue ? 1 : 0;
    for (const auto& smp : g.samples) {
      if (smp.state == SampleState::Aborting || (smp.state == SampleState::Queued && !smp.tokens.empty())) {
        st.buffered_samples += 1;
        st.buffered_tokens += static_cast<int64_t>(smp.tokens.size());
      }
      st.waiting_env_samples += smp.state == SampleState::WaitingEnv ? 1 : 0;
    }
  }
  st.data_exhausted = s_.data_exhausted() ? 1 : 0;
  st.prompts_consumed = s_.prompts_consumed;
  st.prediction_rank_corr = rank_correlation(st.predicted_lens, st.final_lens);
  return st;
}

MemoryUsage Scheduler::buffered_memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryUsage m;
  for (const auto& [gid, g] : s_.groups) {
    for (const auto& smp : g.samples) {
      const bool held = smp.state == SampleState::Queued || smp.state == SampleState::WaitingEnv;
      if (!held || smp.tokens.empty()) continue;
      m.samples += 1;
      m.tokens += static_cast<int64_t>(smp.tokens.size());
      m.bytes += static_cast<int64_t>(smp.tokens.capacity() * sizeof(int32_t) +
                                      smp.logprobs.capacity() * sizeof(float) +
                                      smp.segments.capacity() * sizeof(Segment) +
                                      smp.env_runs.capacity() * sizeof(EnvRun));
    }
  }
  return m;
}

std::vector<int64_t> Scheduler::sample_ids(SampleState state) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const auto& [gid, g] : s_.groups) {
    for (size_t i = 0; i < g.samples.size(); ++i) {
      if (g.samples[i].state == state) out.push_back(ids_.id(gid, static_cast<int64_t>(i)));
    }
  }
  return out;
}

void Scheduler::sample_response(int64_t sample_id, std::vector<int32_t>& tokens, std::vector<float>& logprobs,
                                std::vector<int32_t>& versions, std::vector<uint8_t>& env_mask, SampleState& state,
                                int64_t& resumes) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t idx = 0;
  const Sample& smp = group_of(sample_id, &idx).samples[idx];
  tokens = smp.tokens;
  logprobs = smp.logprobs;
  versions.clear();
  for (size_t k = 0; k < smp.segments.size(); ++k) {
    versions.insert(versions.end(), smp.segment_end(k) - smp.segments[k].start, smp.segments[k].version);
  }
  env_mask.assign(smp.tokens.size(), 0);
  for (const EnvRun& run : smp.env_runs) {
    std::fill_n(versions.begin() + run.start, run.len, -1);
    std::fill_n(env_mask.begin() + run.start, run.len, uint8_t{1});
  }
  state = smp.state;
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
  pending_aborts_.clear();
  dropped_unrewarded_.clear();
  index_.rebuild(s_.groups);
  settle_after_load();
}

// Nothing is in flight after a load: what was running is queued again. A queued sample at the length cap
// could only be dispatched with no token budget, so it finishes as a length finish here; and the staleness
// policy runs now for what waited on samples in flight (returning aborts; with carry, stale carried samples
// whose abort had not returned).
void Scheduler::mark_aborting(Sample& smp, int64_t sample_id, std::vector<int64_t>& out) {
  smp.state = SampleState::Aborting;
  s_.running_samples -= 1;
  s_.aborting_samples += 1;
  out.push_back(sample_id);
}

void Scheduler::settle_after_load() {
  std::vector<int64_t> touched;
  for (auto& [gid, g] : s_.groups) {
    bool capped = false;
    for (auto& smp : g.samples) {
      // Past n done (over-provisioned groups), complete_if_done cancels the rest.
      if (g.n_done >= config_.n_samples_per_prompt) break;
      if (smp.state != SampleState::Queued || static_cast<int64_t>(smp.tokens.size()) < config_.max_response_len) {
        continue;
      }
      smp.state = SampleState::Done;
      smp.finish = FinishReason::Length;
      g.n_done += 1;
      s_.queued_samples -= 1;
      record_final_length(s_, g, smp);
      capped = true;
    }
    // A group saved with n samples done and cancelled ones in flight (stored cancelled) completes now.
    const bool complete = g.state == GroupState::Active && g.n_done >= config_.n_samples_per_prompt;
    if (capped || complete || g.stale_check_pending || staleness_enforced()) touched.push_back(gid);
  }
  // A state from format version 1, or saved with fixed over-sampling, has no group ceiling yet.
  if (config_.over_sampling == OverSampling::Adaptive && s_.adaptive_groups == 0) retune_over_sampling();
  for (int64_t gid : touched) {
    s_.groups.at(gid).stale_check_pending = false;
    apply_staleness(gid);
    auto it = s_.groups.find(gid);
    if (it != s_.groups.end()) complete_if_done(gid, it->second);
  }
}

void Scheduler::save(const std::string& path) const { write_file_atomic(path, serialize()); }

void Scheduler::load(const std::string& path) { deserialize(read_file(path)); }

}  // namespace april::sched
