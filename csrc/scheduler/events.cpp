// Engine events: streamed tokens and finish / abort results, validated as a whole before any is applied.
#include <algorithm>
#include <string>

#include "common/error.h"
#include "scheduler/names.h"
#include "scheduler/prediction.h"
#include "scheduler/scheduler.h"

namespace april::sched {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

// Hot path: one pass validates every event (writing only the samples' scratch fields), a second applies
// them. Nothing is allocated once scratch_samples_ has grown to the call's size; messages are built only on
// failure.
Sample* const* Scheduler::validate_events(const EventBatch& ev, bool finishing) {
  if (ev.n_tokens != ev.n_logprobs) {
    throw Error(ErrorKind::InvalidArgument, "logprobs has " + std::to_string(ev.n_logprobs) +
                                                " entries but tokens has " + std::to_string(ev.n_tokens) +
                                                ": one behavior logprob per token");
  }
  epoch_ += 1;
  if (scratch_samples_.size() < ev.n_events) scratch_samples_.resize(ev.n_events);
  Sample** out = scratch_samples_.data();
  size_t sum = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    const int64_t sid = ev.sample_ids[e];
    const int64_t cnt = ev.counts[e];
    if (cnt < 0) {
      throw Error(ErrorKind::InvalidArgument, "token count " + str(cnt) + " of sample " + str(sid) + " is negative");
    }
    if (static_cast<size_t>(cnt) > ev.n_tokens - sum) {
      throw Error(ErrorKind::InvalidArgument,
                  "token counts add up to more than the " + std::to_string(ev.n_tokens) + " tokens given");
    }
    const int32_t* chunk = ev.tokens + sum;
    int32_t bits = 0;  // a negative id sets the sign bit: one test per chunk, no branch per token
    for (int64_t k = 0; k < cnt; ++k) bits |= chunk[k];
    if (bits < 0) {
      throw Error(ErrorKind::InvalidArgument, "token id " + str(*std::min_element(chunk, chunk + cnt)) +
                                                  " of sample " + str(sid) +
                                                  " is not allowed: token ids must be in [0, 2**31 - 1]");
    }
    sum += static_cast<size_t>(cnt);
    Sample* smp = index_.find(sid);
    if (smp == nullptr) {
      throw Error(ErrorKind::UnknownId,
                  "sample id " + str(sid) +
                      " is not known: it was never dispatched, or its group was trained, filtered or dropped");
    }
    check_event(*smp, ev, e, finishing);
    // The apply pass writes at the ends of the response arrays, one place per sample far from the others:
    // start their loads now, so the misses overlap instead of queueing behind each other's stores.
    __builtin_prefetch(smp->tokens.data() + smp->tokens.size(), 1);
    __builtin_prefetch(smp->logprobs.data() + smp->logprobs.size(), 1);
    out[e] = smp;
  }
  if (sum != ev.n_tokens) {
    throw Error(ErrorKind::InvalidArgument, "token counts add up to " + std::to_string(sum) + " but " +
                                                std::to_string(ev.n_tokens) + " tokens were given");
  }
  return out;
}

// Checks event e against its sample as the earlier events of this call left it (in the sample's scratch
// fields): running, finished at most once, versions in order, the length cap.
void Scheduler::check_event(Sample& smp, const EventBatch& ev, size_t e, bool finishing) {
  const int64_t sid = ev.sample_ids[e];
  const int64_t cnt = ev.counts[e];
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
}

int64_t Scheduler::append_tokens(Sample& smp, const int32_t* tokens, const float* logprobs, int64_t count,
                                 int64_t version) {
  if (count == 0) return 0;
  if (smp.tail_version != version) {
    smp.segments.push_back({static_cast<int32_t>(version), static_cast<int32_t>(smp.tokens.size())});
    smp.tail_version = static_cast<int32_t>(version);
  }
  if (count == 1) {  // one decode step: the common case
    smp.tokens.push_back(*tokens);
    smp.logprobs.push_back(*logprobs);
  } else {
    smp.tokens.insert(smp.tokens.end(), tokens, tokens + count);
    smp.logprobs.insert(smp.logprobs.end(), logprobs, logprobs + count);
  }
  return count;
}

void Scheduler::on_tokens(const EventBatch& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  Sample* const* samples = validate_events(ev, false);
  const int32_t* tokens = ev.tokens;
  const float* logprobs = ev.logprobs;
  int64_t added = 0;
  int64_t resumed = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    Sample& smp = *samples[e];
    const int64_t cnt = ev.counts[e];
    const int64_t n = append_tokens(smp, tokens, logprobs, cnt, ev.versions[e]);
    added += n;
    resumed += smp.resumed ? n : 0;
    tokens += cnt;
    logprobs += cnt;
  }
  s_.stats.generated_tokens += added;
  s_.stats.resumed_generated_tokens += resumed;
}

void Scheduler::on_finish(const EventBatch& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  Sample* const* samples = validate_events(ev, true);
  size_t pos = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    Sample& smp = *samples[e];
    const int64_t cnt = ev.counts[e];
    const int64_t added = append_tokens(smp, ev.tokens + pos, ev.logprobs + pos, cnt, cnt > 0 ? ev.versions[e] : 0);
    s_.stats.generated_tokens += added;
    if (smp.resumed) s_.stats.resumed_generated_tokens += added;
    pos += static_cast<size_t>(cnt);
    const int64_t sid = ev.sample_ids[e];
    finish(smp, index_.group(sid), ids_.group(sid), static_cast<FinishReason>(ev.reasons[e]));
  }
}

// A sample's request ended: an abort below the length cap queues it for a resume, and so does a chunk
// boundary (divided rollout: a length finish below the cap after exactly the request's budget); anything else
// is done. A cancelled surplus sample's result, whatever it is, is dropped.
void Scheduler::finish(Sample& smp, Group& g, int64_t gid, FinishReason reason) {
  const bool was_aborting = smp.state == SampleState::Aborting;
  (was_aborting ? s_.aborting_samples : s_.running_samples) -= 1;
  g.n_in_flight -= 1;
  const auto len = static_cast<int64_t>(smp.tokens.size());
  const bool at_cap = len >= config_.max_response_len;
  const bool chunk_end = config_.chunk_tokens > 0 && reason == FinishReason::Length && !at_cap &&
                         len - smp.dispatch_len == smp.dispatch_budget;
  if (smp.surplus) {
    discard_cancelled(smp);
  } else if ((reason == FinishReason::Abort || chunk_end) && !at_cap) {
    // Recycled: every token, logprob and version segment stays for the resume.
    smp.state = SampleState::Queued;
    s_.queued_samples += 1;
    // A chunk continues where the engine keeps its KV; one back once the batch is due (the step's aborts
    // asked for or under way) waits as any buffered partial.
    const bool continues = chunk_end && !was_aborting &&
                           !(config_.step_boundary == StepBoundary::Abort && step_done_locked());
    if (continues) {
      smp.chunk_version = static_cast<int32_t>(s_.policy_version);
    } else {
      smp.tokens.shrink_to_fit();
      smp.logprobs.shrink_to_fit();
      smp.segments.shrink_to_fit();
    }
    (chunk_end ? s_.stats.chunk_returns : s_.stats.aborts) += 1;
  } else {
    smp.state = SampleState::Done;
    smp.finish = reason == FinishReason::Abort ? FinishReason::Length : reason;
    g.n_done += 1;
    s_.stats.finished_samples += 1;
    record_final_length(s_, g, smp);
  }
  if (g.stale_check_pending && g.n_in_flight == 0) {
    g.stale_check_pending = false;
    apply_staleness(gid);
    if (s_.groups.find(gid) == s_.groups.end()) return;
  } else if (!g.stale_check_pending && config_.staleness_policy == StalenessPolicy::Restart &&
             staleness_enforced() && is_stale(smp)) {
    apply_staleness(gid);  // a stale carried sample back from its abort (or finished before it): restarted
  }
  complete_if_done(gid, g);
}

}  // namespace april::sched
