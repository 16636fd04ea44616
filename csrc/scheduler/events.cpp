// Engine events: streamed tokens and finish / abort results, validated as a whole before any is applied.
#include <algorithm>
#include <string>

#include "common/error.h"
#include "scheduler/names.h"
#include "scheduler/scheduler.h"

namespace april::sched {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::vector<Sample*>& Scheduler::validate_events(const EventBatch& ev, bool finishing) {
  // Hot path: messages are built only on failure.
  if (ev.n_tokens != ev.n_logprobs) {
    throw Error(ErrorKind::InvalidArgument, "logprobs has " + std::to_string(ev.n_logprobs) +
                                                " entries but tokens has " + std::to_string(ev.n_tokens) +
                                                ": one behavior logprob per token");
  }
  epoch_ += 1;
  scratch_samples_.clear();
  scratch_samples_.reserve(ev.n_events);
  int64_t cached_gid = -1;  // events of one group usually arrive together
  Group* cached = nullptr;
  size_t sum = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    const int64_t sid = ev.sample_ids[e];
    const int64_t cnt = ev.counts[e];
    if (cnt < 0) {
      throw Error(ErrorKind::InvalidArgument, "token count " + str(cnt) + " of sample " + str(sid) + " is negative");
    }
    sum += static_cast<size_t>(cnt);
    if (sum > ev.n_tokens) {
      throw Error(ErrorKind::InvalidArgument,
                  "token counts add up to more than the " + std::to_string(ev.n_tokens) + " tokens given");
    }
    if (cnt > 0) {
      const int32_t* chunk = ev.tokens + (sum - static_cast<size_t>(cnt));
      const int32_t lowest = *std::min_element(chunk, chunk + cnt);
      if (lowest < 0) {
        throw Error(ErrorKind::InvalidArgument, "token id " + str(lowest) + " of sample " + str(sid) +
                                                    " is not allowed: token ids must be in [0, 2**31 - 1]");
      }
    }
    scratch_samples_.push_back(&check_event(ev, e, finishing, cached_gid, cached));
  }
  if (sum != ev.n_tokens) {
    throw Error(ErrorKind::InvalidArgument, "token counts add up to " + std::to_string(sum) + " but " +
                                                std::to_string(ev.n_tokens) + " tokens were given");
  }
  return scratch_samples_;
}

// Checks event e against its sample as the earlier events of this call left it (in the sample's scratch
// fields): running, finished at most once, versions in order, the length cap.
Sample& Scheduler::check_event(const EventBatch& ev, size_t e, bool finishing, int64_t& cached_gid,
                               Group*& cached) {
  const int64_t n = config_.n_samples_per_prompt;
  const int64_t sid = ev.sample_ids[e];
  const int64_t cnt = ev.counts[e];
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
                    ? "sample " + str(sid) + " already finished; tokens and finish are accepted once, while it runs"
                    : "sample " + str(sid) + " is not running (state " + name_of(smp.state) +
                          "): tokens and finish are accepted between dispatch and finish");
  }
  if (smp.scratch_epoch != epoch_) {
    smp.scratch_epoch = epoch_;
    smp.scratch_len = static_cast<int64_t>(smp.tokens.size());
    smp.scratch_version = std::max(smp.last_version(), smp.dispatch_version);
    smp.scratch_finished = false;
  }
  if (smp.scratch_finished) {
    throw Error(ErrorKind::InvalidState, "sample " + str(sid) + " is finished twice in one call");
  }
  if (finishing) {
    if (ev.reasons[e] > static_cast<uint8_t>(FinishReason::Abort)) {
      throw Error(ErrorKind::InvalidArgument, "finish reason " + str(ev.reasons[e]) + " of sample " + str(sid) +
                                                  " is not allowed: 0 (stop), 1 (length) or 2 (abort)");
    }
    smp.scratch_finished = true;
  }
  if (cnt > 0) {
    const int64_t ver = ev.versions[e];
    if (ver < smp.scratch_version || ver > s_.policy_version) {
      throw Error(ErrorKind::InvalidArgument,
                  "version " + str(ver) + " of sample " + str(sid) + " is not allowed: must be in [" +
                      str(smp.scratch_version) + ", " + str(s_.policy_version) +
                      "] (not below its dispatch version or earlier tokens, not above the current policy)");
    }
    if (smp.scratch_len + cnt > config_.max_response_len) {
      throw Error(ErrorKind::InvalidArgument, "sample " + str(sid) + " would have " + str(smp.scratch_len + cnt) +
                                                  " response tokens, over max_response_len=" +
                                                  str(config_.max_response_len));
    }
    smp.scratch_len += cnt;
    smp.scratch_version = ver;
  }
  return smp;
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
  size_t pos = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    const int64_t cnt = ev.counts[e];
    append_tokens(*samples[e], ev.tokens + pos, ev.logprobs + pos, cnt, cnt > 0 ? ev.versions[e] : 0);
    pos += static_cast<size_t>(cnt);
    finish(*samples[e], ev.sample_ids[e] / config_.n_samples_per_prompt, static_cast<FinishReason>(ev.reasons[e]));
  }
}

// A sample's request ended: an abort below the length cap queues it for a resume, anything else is done.
void Scheduler::finish(Sample& smp, int64_t gid, FinishReason reason) {
  Group& g = s_.groups.at(gid);
  (smp.state == SampleState::Running ? s_.running_samples : s_.aborting_samples) -= 1;
  g.n_in_flight -= 1;
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
    if (s_.groups.find(gid) == s_.groups.end()) return;
  }
  complete_if_done(gid, g);
}

}  // namespace april::sched
