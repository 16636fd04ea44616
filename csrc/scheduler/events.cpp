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

// Messages of rejected events, built only on failure (out of the hot loops).
[[noreturn]] void throw_negative_count(int64_t sid, int64_t cnt) {
  throw Error(ErrorKind::InvalidArgument, "token count " + str(cnt) + " of sample " + str(sid) + " is negative");
}

[[noreturn]] void throw_counts_over(size_t n_tokens) {
  throw Error(ErrorKind::InvalidArgument,
              "token counts add up to more than the " + std::to_string(n_tokens) + " tokens given");
}

[[noreturn]] void throw_counts_mismatch(size_t sum, size_t n_tokens) {
  throw Error(ErrorKind::InvalidArgument, "token counts add up to " + std::to_string(sum) + " but " +
                                              std::to_string(n_tokens) + " tokens were given");
}

[[noreturn]] void throw_bad_token(const int32_t* chunk, int64_t cnt, int64_t sid) {
  throw Error(ErrorKind::InvalidArgument, "token id " + str(*std::min_element(chunk, chunk + cnt)) + " of sample " +
                                              str(sid) + " is not allowed: token ids must be in [0, 2**31 - 1]");
}

[[noreturn]] void throw_not_running(const Sample& smp, int64_t sid) {
  throw Error(ErrorKind::InvalidState,
              smp.state == SampleState::Done
                  ? "sample " + str(sid) + " already finished; tokens and finish are accepted once, while it runs"
              : smp.state == SampleState::WaitingEnv
                  ? "sample " + str(sid) +
                        " is waiting for its environment (state waiting_env): it takes on_env_tokens, or a finish "
                        "with reason stop or length and no tokens; model tokens only once it is dispatched again"
                  : "sample " + str(sid) + " is not running (state " + name_of(smp.state) +
                        "): tokens and finish are accepted between dispatch and finish");
}

[[noreturn]] void throw_bad_version(int64_t sid, int64_t ver, int64_t floor, int64_t current) {
  throw Error(ErrorKind::InvalidArgument,
              "version " + str(ver) + " of sample " + str(sid) + " is not allowed: must be in [" + str(floor) + ", " +
                  str(current) + "] (not below its dispatch version or earlier tokens, not above the current policy)");
}

[[noreturn]] void throw_over_cap(int64_t sid, int64_t len, int64_t cap) {
  throw Error(ErrorKind::InvalidArgument, "sample " + str(sid) + " would have " + str(len) +
                                              " response tokens, over max_response_len=" + str(cap));
}

void check_logprob_count(const EventBatch& ev) {
  if (ev.n_tokens != ev.n_logprobs) {
    throw Error(ErrorKind::InvalidArgument, "logprobs has " + std::to_string(ev.n_logprobs) +
                                                " entries but tokens has " + std::to_string(ev.n_tokens) +
                                                ": one behavior logprob per token");
  }
}

// The per-event helpers below are inline: on_tokens runs them for every event, and a call each costs as much as
// their work.

// The tokens of event e, which starts `used` tokens into the call's array: a count that is not negative and fits
// in what is left, token ids in [0, 2**31 - 1].
inline const int32_t* event_chunk(const EventBatch& ev, size_t e, size_t used) {
  const int64_t cnt = ev.counts[e];
  if (cnt < 0) throw_negative_count(ev.sample_ids[e], cnt);
  if (static_cast<size_t>(cnt) > ev.n_tokens - used) throw_counts_over(ev.n_tokens);
  const int32_t* chunk = ev.tokens + used;
  int32_t bits = 0;  // a negative id sets the sign bit: one test per chunk, no branch per token
  for (int64_t k = 0; k < cnt; ++k) bits |= chunk[k];
  if (bits < 0) throw_bad_token(chunk, cnt, ev.sample_ids[e]);
  return chunk;
}

// The record of a sample in flight (dispatched, not finished).
inline Sample& running_sample(const SampleIndex& index, int64_t sid) {
  Sample* smp = index.find(sid);
  if (smp == nullptr) throw_unknown_sample(sid);
  if (!smp->in_flight()) throw_not_running(*smp, sid);
  return *smp;
}

// A chunk of cnt > 0 tokens of version ver, for a response of len tokens whose next tokens must be of version
// floor or newer: the version is within [floor, current], the response stays within the cap.
inline void check_chunk(int64_t sid, int64_t cnt, int64_t ver, int64_t floor, int64_t len, int64_t current,
                        int64_t cap) {
  if (ver < floor || ver > current) throw_bad_version(sid, ver, floor, current);
  if (len + cnt > cap) throw_over_cap(sid, len + cnt, cap);
}

// Capacity for `more` elements past the end, grown geometrically (amortized O(1) appends).
template <typename T>
void make_room(std::vector<T>& v, size_t more) {
  if (v.capacity() - v.size() < more) v.reserve(std::max(v.size() + more, 2 * v.capacity()));
}

// Appends count > 0 tokens of one version to the response. Room is made in every array first, so a failed
// allocation changes nothing and the appends below it cannot fail half-way.
inline void append_chunk(Sample& smp, const int32_t* tokens, const float* logprobs, int64_t count, int64_t version) {
  const auto n = static_cast<size_t>(count);
  const bool new_segment = smp.tail_version != version;
  make_room(smp.tokens, n);
  make_room(smp.logprobs, n);
  if (new_segment) {
    make_room(smp.segments, 1);
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
}

// Undoes the first n token events of a rejected call, newest first. Each appended at the ends of its sample's
// arrays, so cutting them there restores the sample; a segment left empty was opened by the event (segments
// before the call all have tokens).
void drop_appended(const SampleIndex& index, const EventBatch& ev, size_t n) {
  while (n > 0) {
    n -= 1;
    const auto cnt = static_cast<size_t>(ev.counts[n]);
    if (cnt == 0) continue;
    Sample& smp = *index.find(ev.sample_ids[n]);
    smp.tokens.resize(smp.tokens.size() - cnt);
    smp.logprobs.resize(smp.logprobs.size() - cnt);
    if (static_cast<size_t>(smp.segments.back().start) == smp.tokens.size()) {
      smp.segments.pop_back();
      smp.tail_version = smp.segments.empty() ? -1 : smp.segments.back().version;
    }
  }
}

}  // namespace

// on_finish: one pass validates every event (writing only the samples' scratch fields), a second applies them,
// since a finish cannot be undone cheaply. Nothing is allocated once scratch_samples_ has grown to the call's
// size; messages are built only on failure.
Sample* const* Scheduler::validate_events(const EventBatch& ev, bool finishing) {
  check_logprob_count(ev);
  epoch_ += 1;
  if (scratch_samples_.size() < ev.n_events) scratch_samples_.resize(ev.n_events);
  Sample** out = scratch_samples_.data();
  size_t sum = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    event_chunk(ev, e, sum);
    sum += static_cast<size_t>(ev.counts[e]);
    Sample* smp = index_.find(ev.sample_ids[e]);
    if (smp == nullptr) throw_unknown_sample(ev.sample_ids[e]);
    check_event(*smp, ev, e, finishing);
    // The apply pass writes at the ends of the response arrays, one place per sample far from the others:
    // start their loads now, so the misses overlap instead of queueing behind each other's stores.
    __builtin_prefetch(smp->tokens.data() + smp->tokens.size(), 1);
    __builtin_prefetch(smp->logprobs.data() + smp->logprobs.size(), 1);
    out[e] = smp;
  }
  if (sum != ev.n_tokens) throw_counts_mismatch(sum, ev.n_tokens);
  return out;
}

// Checks event e against its sample as the earlier events of this call left it (in the sample's scratch
// fields): running, finished at most once, versions in order, the length cap.
void Scheduler::check_event(Sample& smp, const EventBatch& ev, size_t e, bool finishing) {
  const int64_t sid = ev.sample_ids[e];
  const int64_t cnt = ev.counts[e];
  // A sample waiting for its environment takes a finish (the environment ended the trajectory) without tokens.
  const bool waiting = smp.state == SampleState::WaitingEnv;
  const bool env_ends_it = waiting && finishing && cnt == 0 &&
                           ev.reasons[e] <= static_cast<uint8_t>(FinishReason::Length);
  if (!smp.in_flight() && !env_ends_it) throw_not_running(smp, sid);
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
    if (ev.reasons[e] > kEnvWaitReason) {
      throw Error(ErrorKind::InvalidArgument,
                  "finish reason " + str(ev.reasons[e]) + " of sample " + str(sid) +
                      " is not allowed: 0 (stop), 1 (length), 2 (abort) or 3 (env_wait: the turn ended, the "
                      "sample waits for its environment)");
    }
    // A turn handed to the environment ends with a model token: the response is not empty and does not end
    // with the environment's tokens.
    if (ev.reasons[e] == kEnvWaitReason && cnt == 0 && (smp.scratch_len == 0 || smp.ends_in_env())) {
      throw Error(ErrorKind::InvalidState,
                  "sample " + str(sid) + " cannot wait for its environment: " +
                      (smp.scratch_len == 0 ? std::string("its response is empty (no model turn ended)")
                                            : std::string("its response ends with environment tokens "
                                                          "(no model turn since the last observation)")));
    }
    smp.scratch_finished = true;
  }
  if (cnt > 0) {
    const int64_t ver = ev.versions[e];
    check_chunk(sid, cnt, ver, smp.scratch_version, smp.scratch_len, s_.policy_version, config_.max_response_len);
    smp.scratch_len += cnt;
    smp.scratch_version = ver;
  }
}

int64_t Scheduler::append_tokens(Sample& smp, const int32_t* tokens, const float* logprobs, int64_t count,
                                 int64_t version) {
  if (count == 0) return 0;
  append_chunk(smp, tokens, logprobs, count, version);
  return count;
}

// Hot path, one pass: each event is checked against its sample as the call's earlier events left it and applied
// at once, so an event touches its sample's record and the ends of its arrays once. A rejected event has the
// events before it undone, so a bad batch changes nothing. Nothing is allocated unless a response outgrows its
// arrays; messages are built only on failure.
void Scheduler::on_tokens(const EventBatch& ev) {
  // The records and array ends of the call's samples lie far apart and, between calls, other work evicts them:
  // each record is fetched kAhead events before its event, and the array ends half as far ahead (by then the
  // record that points to them is in), so the misses of several events overlap.
  constexpr size_t kAhead = 16;
  std::lock_guard<std::mutex> lock(mu_);
  check_logprob_count(ev);
  const int64_t current = s_.policy_version;
  const int64_t cap = config_.max_response_len;
  size_t used = 0;  // tokens of the events before e
  int64_t resumed = 0;
  size_t e = 0;
  try {
    for (; e < ev.n_events; ++e) {
      if (e + kAhead < ev.n_events) {
        if (const Sample* later = index_.find(ev.sample_ids[e + kAhead])) __builtin_prefetch(later, 1);
      }
      if (e + kAhead / 2 < ev.n_events) {
        if (const Sample* next = index_.find(ev.sample_ids[e + kAhead / 2])) {
          __builtin_prefetch(next->tokens.data() + next->tokens.size(), 1);
          __builtin_prefetch(next->logprobs.data() + next->logprobs.size(), 1);
        }
      }
      const int64_t sid = ev.sample_ids[e];
      const int32_t* chunk = event_chunk(ev, e, used);
      Sample& smp = running_sample(index_, sid);
      const int64_t cnt = ev.counts[e];
      if (cnt > 0) {
        const int64_t ver = ev.versions[e];
        check_chunk(sid, cnt, ver, std::max<int64_t>(smp.tail_version, smp.dispatch_version),
                    static_cast<int64_t>(smp.tokens.size()), current, cap);
        append_chunk(smp, chunk, ev.logprobs + used, cnt, ver);
        resumed += smp.resumed ? cnt : 0;
      }
      used += static_cast<size_t>(cnt);
    }
    if (used != ev.n_tokens) throw_counts_mismatch(used, ev.n_tokens);
  } catch (...) {
    drop_appended(index_, ev, e);
    throw;
  }
  s_.stats.generated_tokens += static_cast<int64_t>(used);
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

// Observations of the environment: each event appends count > 0 tokens to a sample waiting for its environment
// and queues it for dispatch (prompt + response, env tokens included). Validated as a whole first, then applied.
void Scheduler::on_env_tokens(const EventBatch& ev) {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_ += 1;
  if (scratch_samples_.size() < ev.n_events) scratch_samples_.resize(ev.n_events);
  Sample** samples = scratch_samples_.data();
  size_t used = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    const int64_t sid = ev.sample_ids[e];
    const int64_t cnt = ev.counts[e];
    event_chunk(ev, e, used);
    used += static_cast<size_t>(cnt);
    Sample* smp = index_.find(sid);
    if (smp == nullptr) throw_unknown_sample(sid);
    if (smp->scratch_epoch == epoch_) {
      throw Error(ErrorKind::InvalidState, "on_env_tokens: sample " + str(sid) +
                                               " is given environment tokens twice in one call");
    }
    smp->scratch_epoch = epoch_;
    if (smp->state != SampleState::WaitingEnv) {
      throw Error(ErrorKind::InvalidState,
                  "on_env_tokens: sample " + str(sid) + " is not waiting for its environment (state " +
                      name_of(smp->state) +
                      "): environment tokens are accepted after the sample's turn ended with env_wait, once");
    }
    if (cnt == 0) {
      throw Error(ErrorKind::InvalidArgument, "on_env_tokens: sample " + str(sid) +
                                                  " gets no tokens; an observation has at least one token (an "
                                                  "environment that is done finishes the sample instead)");
    }
    const auto len = static_cast<int64_t>(smp->tokens.size());
    if (len + cnt > config_.max_response_len) throw_over_cap(sid, len + cnt, config_.max_response_len);
    samples[e] = smp;
  }
  if (used != ev.n_tokens) throw_counts_mismatch(used, ev.n_tokens);
  size_t pos = 0;
  for (size_t e = 0; e < ev.n_events; ++e) {
    Sample& smp = *samples[e];
    const auto cnt = static_cast<size_t>(ev.counts[e]);
    // An earlier event of this call completed the sample's group (its n-th sample done at the cap), which
    // cancelled this surplus sample: its observation is dropped, as a cancelled sample's result is.
    if (smp.state != SampleState::WaitingEnv) {
      pos += cnt;
      continue;
    }
    make_room(smp.tokens, cnt);
    make_room(smp.logprobs, cnt);
    make_room(smp.env_runs, 1);
    smp.env_runs.push_back({static_cast<int32_t>(smp.tokens.size()), static_cast<int32_t>(cnt)});
    smp.tokens.insert(smp.tokens.end(), ev.tokens + pos, ev.tokens + pos + cnt);
    smp.logprobs.insert(smp.logprobs.end(), cnt, 0.0f);
    pos += cnt;
    s_.stats.env_tokens += static_cast<int64_t>(cnt);
    s_.waiting_env_samples -= 1;
    const int64_t sid = ev.sample_ids[e];
    Group& g = index_.group(sid);
    if (static_cast<int64_t>(smp.tokens.size()) >= config_.max_response_len) {
      // No room left for a model turn: a length finish, as a buffered partial at the cap after a load.
      smp.state = SampleState::Done;
      smp.finish = FinishReason::Length;
      g.n_done += 1;
      s_.stats.finished_samples += 1;
      record_final_length(s_, g, smp);
      complete_if_done(ids_.group(sid), g);
    } else {
      smp.state = SampleState::Queued;
      s_.queued_samples += 1;
    }
  }
}

// A sample's request ended: an abort below the length cap queues it for a resume, and so does a chunk
// boundary (divided rollout: a length finish below the cap after exactly the request's budget); anything else
// is done. A cancelled surplus sample's result, whatever it is, is dropped.
void Scheduler::finish(Sample& smp, Group& g, int64_t gid, FinishReason reason) {
  // Cancelled by an earlier event of this call: a sample waiting for its environment whose group that event
  // completed (tail_extra_samples). It passed the call's checks while waiting; its result is dropped.
  if (smp.state == SampleState::Cancelled) return;
  const bool was_aborting = smp.state == SampleState::Aborting;
  const bool was_waiting = smp.state == SampleState::WaitingEnv;  // the environment ended the trajectory
  const bool env_wait = static_cast<uint8_t>(reason) == kEnvWaitReason;
  if (was_waiting) {
    s_.waiting_env_samples -= 1;
  } else {
    (was_aborting ? s_.aborting_samples : s_.running_samples) -= 1;
    g.n_in_flight -= 1;
  }
  const auto len = static_cast<int64_t>(smp.tokens.size());
  const bool at_cap = len >= config_.max_response_len;
  const bool chunk_end = !was_waiting && config_.chunk_tokens.has_value() && reason == FinishReason::Length &&
                         !at_cap && len - smp.dispatch_len == smp.dispatch_budget;
  if (smp.surplus) {
    discard_cancelled(smp);
  } else if (env_wait && !at_cap) {
    // The turn ended at a stop token and the trajectory goes on: the environment answers with on_env_tokens
    // (queued again) or a finish. A turn at the length cap leaves no room for an answer: it finishes (below).
    smp.state = SampleState::WaitingEnv;
    smp.chunk_version = -1;
    s_.waiting_env_samples += 1;
    s_.stats.env_waits += 1;
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
      smp.env_runs.shrink_to_fit();
    }
    (chunk_end ? s_.stats.chunk_returns : s_.stats.aborts) += 1;
  } else {
    smp.state = SampleState::Done;
    smp.finish = reason == FinishReason::Abort || env_wait ? FinishReason::Length : reason;
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
