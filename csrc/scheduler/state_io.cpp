#include "scheduler/state_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <type_traits>
#include <vector>

#include "common/error.h"

namespace april::sched {

namespace {

constexpr char kMagic[8] = {'A', 'P', 'R', 'I', 'L', 'S', 'C', 'H'};
constexpr size_t kHeader = sizeof(kMagic) + sizeof(uint32_t) + sizeof(uint64_t);

uint64_t fnv1a64(const char* data, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<uint64_t>(v.size());
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const char* data, size_t n) : data_(data), n_(n) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  template <typename T>
  std::vector<T> get_vec(uint64_t max_len) {
    const auto len = get<uint64_t>();
    check(len <= max_len, ErrorKind::CorruptState,
          "scheduler state is corrupted: an array of " + std::to_string(len) + " entries (at most " +
              std::to_string(max_len) + " allowed)");
    need(len * sizeof(T));
    std::vector<T> v(len);
    if (len > 0) std::memcpy(v.data(), data_ + pos_, len * sizeof(T));
    pos_ += len * sizeof(T);
    return v;
  }
  size_t size() const { return n_; }
  bool at_end() const { return pos_ == n_; }

 private:
  void need(size_t k) const {
    check(k <= n_ - pos_, ErrorKind::CorruptState,
          "scheduler state is truncated: needs " + std::to_string(k) + " more bytes at offset " +
              std::to_string(pos_) + " of " + std::to_string(n_));
  }
  const char* data_;
  size_t n_;
  size_t pos_ = 0;
};

void corrupt_unless(bool cond, const std::string& what) {
  check(cond, ErrorKind::CorruptState, "scheduler state is corrupted: " + what);
}

bool token_ids_valid(const std::vector<int32_t>& tokens) {
  return std::all_of(tokens.begin(), tokens.end(), [](int32_t t) { return t >= 0; });
}

// ---------------------------------------------------------------- encoding

void encode_sample(Writer& w, const Sample& smp) {
  // The engine's requests do not survive a restart: in-flight samples come back as buffered partials, and
  // cancelled ones whose abort was under way as cancelled.
  if (smp.surplus) {
    w.put<uint8_t>(static_cast<uint8_t>(SampleState::Cancelled));
    w.put<uint8_t>(static_cast<uint8_t>(FinishReason::Stop));
    w.put<int64_t>(smp.dispatch_version);
    w.put<int64_t>(0);
    w.put<int64_t>(smp.resumes);
    for (int k = 0; k < 4; ++k) w.put<uint64_t>(0);  // no tokens, logprobs, segments or env runs
    return;
  }
  const SampleState st = smp.in_flight() ? SampleState::Queued : smp.state;
  w.put<uint8_t>(static_cast<uint8_t>(st));
  w.put<uint8_t>(static_cast<uint8_t>(smp.finish));
  w.put<int64_t>(smp.dispatch_version);
  w.put<int64_t>(smp.tokens_at_step_start);
  w.put<int64_t>(smp.resumes);
  w.put_vec(smp.tokens);
  w.put_vec(smp.logprobs);
  w.put_vec(smp.segments);
  w.put_vec(smp.env_runs);  // from format version 7
}

std::string frame(const std::string& payload) {
  std::string out(kMagic, sizeof(kMagic));
  const uint32_t version = kStateFormatVersion;
  const uint64_t len = payload.size();
  out.append(reinterpret_cast<const char*>(&version), sizeof(version));
  out.append(reinterpret_cast<const char*>(&len), sizeof(len));
  out += payload;
  const uint64_t sum = fnv1a64(payload.data(), payload.size());
  out.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
  return out;
}

// ---------------------------------------------------------------- decoding

struct Frame {
  uint32_t version;
  const char* payload;
  size_t len;
};

// The header and checksum: the payload's bytes are exactly the ones written.
Frame check_frame(const std::string& bytes) {
  check(bytes.size() >= kHeader + sizeof(uint64_t), ErrorKind::CorruptState,
        "scheduler state is truncated: " + std::to_string(bytes.size()) + " bytes, the header alone needs " +
            std::to_string(kHeader + sizeof(uint64_t)));
  check(std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0, ErrorKind::CorruptState,
        "not an april_ext scheduler state: bad magic (expected \"APRILSCH\")");
  Frame f{0, bytes.data() + kHeader, 0};
  uint64_t len = 0;
  std::memcpy(&f.version, bytes.data() + sizeof(kMagic), sizeof(f.version));
  std::memcpy(&len, bytes.data() + sizeof(kMagic) + sizeof(f.version), sizeof(len));
  check(f.version >= 1 && f.version <= kStateFormatVersion, ErrorKind::CorruptState,
        "scheduler state has format version " + std::to_string(f.version) + "; this build reads versions 1 to " +
            std::to_string(kStateFormatVersion));
  check(len == bytes.size() - kHeader - sizeof(uint64_t), ErrorKind::CorruptState,
        "scheduler state is truncated or has trailing bytes: header says " + std::to_string(len) +
            " payload bytes, the data holds " + std::to_string(bytes.size() - kHeader - sizeof(uint64_t)));
  f.len = static_cast<size_t>(len);
  uint64_t stored = 0;
  std::memcpy(&stored, f.payload + f.len, sizeof(stored));
  check(stored == fnv1a64(f.payload, f.len), ErrorKind::CorruptState,
        "scheduler state is corrupted: checksum mismatch");
  return f;
}

// Files before format version 6 have no extra samples.
void check_shape(Reader& r, uint32_t version, const Config& config) {
  const auto n = r.get<int64_t>();
  const auto max_len = r.get<int64_t>();
  const auto extra = version >= 6 ? r.get<int64_t>() : 0;
  check(n == config.n_samples_per_prompt && max_len == config.max_response_len &&
            extra == config.tail_extra_samples,
        ErrorKind::InvalidArgument,
        "scheduler state was saved with n_samples_per_prompt=" + std::to_string(n) +
            ", max_response_len=" + std::to_string(max_len) + ", tail_extra_samples=" + std::to_string(extra) +
            "; this scheduler has " + std::to_string(config.n_samples_per_prompt) + ", " +
            std::to_string(config.max_response_len) + ", " + std::to_string(config.tail_extra_samples));
}

// The step's scalars, counters and staleness histogram.
void decode_step(Reader& r, uint32_t version, int64_t width, State& s) {
  s.next_group_id = r.get<int64_t>();
  s.prompts_consumed = r.get<int64_t>();
  s.step_open = r.get<uint8_t>() != 0;
  s.wave_launched = r.get<uint8_t>() != 0;
  s.policy_version = r.get<int64_t>();
  s.step_index = r.get<int64_t>();
  // Sample ids (group id x width + slot) must fit in int64.
  corrupt_unless(s.next_group_id >= 0 && s.next_group_id <= std::numeric_limits<int64_t>::max() / width &&
                     s.prompts_consumed >= 0 && s.policy_version >= -1 && s.policy_version <= INT32_MAX &&
                     s.step_index >= 0 && s.step_index < std::numeric_limits<int64_t>::max(),
                 "counters out of range");
  const auto n_counters = r.get<uint64_t>();
  const size_t expected_counters = version == 1   ? kV1CounterCount
                                   : version == 2 ? kV2CounterCount
                                   : version == 3 ? kV3CounterCount
                                   : version == 4 ? kV4CounterCount
                                   : version == 5 ? kV5CounterCount
                                   : version == 6 ? kV6CounterCount
                                                  : s.stats.counters().size();
  corrupt_unless(n_counters == expected_counters, "stats has " + std::to_string(n_counters) + " counters, expected " +
                                                 std::to_string(expected_counters));
  std::vector<int64_t> values(s.stats.counters().size(), 0);  // counters an older file lacks stay 0
  for (size_t i = 0; i < n_counters; ++i) values[i] = r.get<int64_t>();
  size_t k = 0;
#define APRIL_RESTORE(name) s.stats.name = values[k++];
  APRIL_STEP_COUNTERS(APRIL_RESTORE)
#undef APRIL_RESTORE
  s.stats.staleness_histogram = r.get_vec<int64_t>(static_cast<uint64_t>(INT32_MAX));
  const auto negative = [](int64_t v) { return v < 0; };
  corrupt_unless(std::none_of(values.begin(), values.end(), negative) &&
                     std::none_of(s.stats.staleness_histogram.begin(), s.stats.staleness_histogram.end(), negative),
                 "a step counter is negative");
}

// Env runs (format version 7): in order, not adjacent, each after a model token, within the response, with
// logprob 0.0; no version segment starts inside one. A sample waiting for its environment ends with a model
// token below the length cap.
void check_env_runs(const Sample& smp, int64_t max_len) {
  const auto ntok = static_cast<int64_t>(smp.tokens.size());
  int64_t prev_end = 0;
  for (const EnvRun& run : smp.env_runs) {
    corrupt_unless(run.len > 0 && run.start > prev_end && static_cast<int64_t>(run.start) + run.len <= ntok,
                   "a sample's env runs are out of order or range");
    prev_end = static_cast<int64_t>(run.start) + run.len;
    corrupt_unless(std::all_of(smp.logprobs.begin() + run.start, smp.logprobs.begin() + prev_end,
                               [](float x) { return x == 0.0f; }),
                   "a sample's env tokens have a logprob other than 0.0");
    for (const Segment& seg : smp.segments) {
      corrupt_unless(seg.start < run.start || seg.start >= prev_end, "a version segment starts at an env token");
    }
  }
  if (smp.state == SampleState::WaitingEnv) {
    corrupt_unless(ntok > 0 && ntok < max_len && !smp.ends_in_env(),
                   "a sample waiting for its environment has no model turn to answer, or is at the length cap");
  }
}

void decode_sample(Reader& r, const Config& config, uint32_t version, int64_t policy_version, Sample& smp) {
  const auto max_len = static_cast<uint64_t>(config.max_response_len);
  const auto st = r.get<uint8_t>();
  const auto fin = r.get<uint8_t>();
  corrupt_unless(st == static_cast<uint8_t>(SampleState::Queued) || st == static_cast<uint8_t>(SampleState::Done) ||
                     (st == static_cast<uint8_t>(SampleState::Cancelled) && config.tail_extra_samples > 0) ||
                     (st == static_cast<uint8_t>(SampleState::WaitingEnv) && version >= 7),
                 "sample state " + std::to_string(st));
  corrupt_unless(fin <= 1, "finish reason " + std::to_string(fin));
  smp.state = static_cast<SampleState>(st);
  smp.finish = static_cast<FinishReason>(fin);
  smp.dispatch_version = r.get<int64_t>();
  smp.tokens_at_step_start = r.get<int64_t>();
  smp.resumes = r.get<int64_t>();
  smp.tokens = r.get_vec<int32_t>(max_len);
  smp.logprobs = r.get_vec<float>(max_len);
  smp.segments = r.get_vec<Segment>(max_len);
  if (version >= 7) smp.env_runs = r.get_vec<EnvRun>(max_len);
  smp.tail_version = smp.segments.empty() ? -1 : smp.segments.back().version;
  const auto ntok = smp.tokens.size();
  corrupt_unless(smp.dispatch_version >= -1 && smp.dispatch_version <= policy_version && smp.resumes >= 0,
                 "a sample's dispatch version or resume count is out of range");
  corrupt_unless(token_ids_valid(smp.tokens), "a sample has a negative token id");
  corrupt_unless(smp.logprobs.size() == ntok, "a sample has tokens and logprobs of different lengths");
  corrupt_unless(smp.segments.empty() == (ntok == 0), "a sample's version segments do not cover its tokens");
  for (size_t i = 0; i < smp.segments.size(); ++i) {
    const Segment& seg = smp.segments[i];
    const bool ordered = i == 0 ? seg.start == 0
                                : seg.start > smp.segments[i - 1].start && seg.version > smp.segments[i - 1].version;
    corrupt_unless(ordered && static_cast<size_t>(seg.start) < ntok && seg.version >= 0 &&
                       seg.version <= policy_version,
                   "a sample's version segments are out of order or range");
  }
  corrupt_unless(smp.tokens_at_step_start >= 0 && smp.tokens_at_step_start <= static_cast<int64_t>(ntok),
                 "a sample's step-start length is out of range");
  corrupt_unless(smp.state != SampleState::Cancelled || ntok == 0, "a cancelled sample has tokens");
  check_env_runs(smp, config.max_response_len);
}

void decode_group(Reader& r, const Config& config, uint32_t version, State& s) {
  const int64_t n = config.n_samples_per_prompt;
  const auto gid = r.get<int64_t>();
  corrupt_unless(gid >= 0 && gid < s.next_group_id && !s.groups.count(gid),
                 "group id " + std::to_string(gid) + " is out of range or repeated");
  Group& g = s.groups[gid];
  g.prompt_index = r.get<int64_t>();
  const auto gstate = r.get<uint8_t>();
  corrupt_unless(gstate <= 2, "group state " + std::to_string(gstate));
  g.state = static_cast<GroupState>(gstate);
  g.stale_check_pending = r.get<uint8_t>() != 0;
  g.prompt = r.get_vec<int32_t>(r.size());
  g.rewards = r.get_vec<float>(static_cast<uint64_t>(n));
  corrupt_unless(g.prompt_index >= 0 && g.prompt_index < s.prompts_consumed && !g.prompt.empty() &&
                     token_ids_valid(g.prompt),
                 "group " + std::to_string(gid) + " has a bad prompt");
  corrupt_unless(g.rewards.size() == (g.state == GroupState::Accepted ? static_cast<size_t>(n) : 0) &&
                     std::all_of(g.rewards.begin(), g.rewards.end(), [](float x) { return std::isfinite(x); }),
                 "group " + std::to_string(gid) + " has " + std::to_string(g.rewards.size()) +
                     " rewards, or one that is not finite");
  g.samples.resize(config.group_width());
  int64_t cancelled = 0;
  for (auto& smp : g.samples) {
    decode_sample(r, config, version, s.policy_version, smp);
    if (smp.state == SampleState::Done) {
      g.n_done += 1;
    } else if (smp.state == SampleState::Cancelled) {
      cancelled += 1;
    } else if (smp.state == SampleState::WaitingEnv) {
      corrupt_unless(g.state == GroupState::Active, "a sample of a completed group waits for its environment");
      s.waiting_env_samples += 1;
    } else {
      s.queued_samples += 1;
    }
  }
  // n done samples make a group complete once its cancelled ones are back: saved while they were in flight, it
  // is still active (it completes on load). A group keeps at least n samples that are not cancelled.
  const bool shape_ok = g.state == GroupState::Active
                            ? (g.n_done < n || (g.n_done == n && config.tail_extra_samples > 0)) &&
                                  static_cast<int64_t>(g.samples.size()) - cancelled >= n
                            : g.n_done == n && static_cast<int64_t>(g.samples.size()) - cancelled == n;
  corrupt_unless(shape_ok, "group " + std::to_string(gid) + " state does not match its samples");
}

// The completed and accepted queues: each lists groups of its state, once, and together they list all.
void decode_queues(Reader& r, uint64_t n_groups, State& s) {
  const auto completed = r.get_vec<int64_t>(n_groups);
  const auto accepted = r.get_vec<int64_t>(n_groups);
  std::set<int64_t> seen;
  for (int64_t gid : completed) {
    auto it = s.groups.find(gid);
    corrupt_unless(it != s.groups.end() && it->second.state == GroupState::Completed && seen.insert(gid).second,
                   "completed group " + std::to_string(gid) + " is unknown, repeated or not completed");
    s.completed.push_back(gid);
  }
  for (int64_t gid : accepted) {
    auto it = s.groups.find(gid);
    corrupt_unless(it != s.groups.end() && it->second.state == GroupState::Accepted && seen.insert(gid).second,
                   "accepted group " + std::to_string(gid) + " is unknown, repeated or not accepted");
    s.accepted.push_back(gid);
  }
  size_t listed = 0;
  for (const auto& [gid, g] : s.groups) listed += g.state != GroupState::Active;
  corrupt_unless(listed == seen.size(), "a completed or accepted group is missing from its queue");
}

void decode_adaptive(Reader& r, State& s) {
  s.live_fraction = r.get<double>();
  s.adaptive_groups = r.get<int64_t>();
  corrupt_unless(s.live_fraction > 0.0 && s.live_fraction <= 1.0 && s.adaptive_groups >= 0,
                 "adaptive over-sampling state out of range");
}

// Length prediction: the prompts' history keys of the groups that have one, the final lengths per key and
// of all, and this step's (prediction, final length) pairs.
void encode_prediction(Writer& w, const State& s) {
  std::vector<int64_t> gids, keys;
  for (const auto& [gid, g] : s.groups) {
    if (!g.has_history_key) continue;
    gids.push_back(gid);
    keys.push_back(g.history_key);
  }
  w.put_vec(gids);
  w.put_vec(keys);
  std::vector<int64_t> hist_keys, sums, counts;
  for (const auto& [key, h] : s.length_history) {
    hist_keys.push_back(key);
    sums.push_back(h.sum);
    counts.push_back(h.count);
  }
  w.put_vec(hist_keys);
  w.put_vec(sums);
  w.put_vec(counts);
  w.put<int64_t>(s.final_lengths.sum);
  w.put<int64_t>(s.final_lengths.count);
  w.put_vec(s.stats.predicted_lens);
  w.put_vec(s.stats.final_lens);
}

// Sums of final lengths: each length within [0, max_len].
bool lengths_valid(const LengthStats& h, int64_t max_len) {
  return h.count >= 0 && h.sum >= 0 && (h.count == 0 ? h.sum == 0 : h.sum / h.count <= max_len);
}

void decode_prediction(Reader& r, const Config& config, State& s) {
  const auto limit = static_cast<uint64_t>(r.size());
  const auto gids = r.get_vec<int64_t>(s.groups.size());
  const auto keys = r.get_vec<int64_t>(s.groups.size());
  corrupt_unless(gids.size() == keys.size(), "history keys do not match their groups");
  for (size_t i = 0; i < gids.size(); ++i) {
    auto it = s.groups.find(gids[i]);
    corrupt_unless(it != s.groups.end() && (i == 0 || gids[i] > gids[i - 1]),
                   "a history key's group is unknown or repeated");
    it->second.has_history_key = true;
    it->second.history_key = keys[i];
  }
  const auto hist_keys = r.get_vec<int64_t>(limit);
  const auto sums = r.get_vec<int64_t>(limit);
  const auto counts = r.get_vec<int64_t>(limit);
  corrupt_unless(sums.size() == hist_keys.size() && counts.size() == hist_keys.size(),
                 "length history arrays of different sizes");
  const int64_t max_len = config.max_response_len;
  for (size_t i = 0; i < hist_keys.size(); ++i) {
    const LengthStats h{sums[i], counts[i]};
    corrupt_unless((i == 0 || hist_keys[i] > hist_keys[i - 1]) && h.count > 0 && lengths_valid(h, max_len),
                   "a length history entry is repeated or out of range");
    s.length_history.emplace(hist_keys[i], h);
  }
  s.final_lengths.sum = r.get<int64_t>();
  s.final_lengths.count = r.get<int64_t>();
  corrupt_unless(lengths_valid(s.final_lengths, max_len), "the final length totals are out of range");
  s.stats.predicted_lens = r.get_vec<int64_t>(limit);
  s.stats.final_lens = r.get_vec<int64_t>(limit);
  const auto out_of_range = [&](int64_t v) { return v < 0 || v > max_len; };
  corrupt_unless(s.stats.final_lens.size() == s.stats.predicted_lens.size() &&
                     static_cast<int64_t>(s.stats.predicted_lens.size()) == s.stats.prediction_samples &&
                     std::none_of(s.stats.predicted_lens.begin(), s.stats.predicted_lens.end(), out_of_range) &&
                     std::none_of(s.stats.final_lens.begin(), s.stats.final_lens.end(), out_of_range),
                 "the step's length predictions do not match prediction_samples or are out of range");
}

// Tail batching: the round, the long queue and the restarts waiting for samples in flight.
void decode_tail(Reader& r, uint64_t n_groups, State& s) {
  const auto round = r.get<uint8_t>();
  corrupt_unless(round <= static_cast<uint8_t>(Round::Drain), "round " + std::to_string(round));
  s.round = static_cast<Round>(round);
  for (int64_t gid : r.get_vec<int64_t>(n_groups)) {
    auto it = s.groups.find(gid);
    corrupt_unless(it != s.groups.end() && !it->second.long_queue,
                   "long-queue group " + std::to_string(gid) + " is unknown or repeated");
    it->second.long_queue = true;
  }
  for (int64_t gid : r.get_vec<int64_t>(n_groups)) {
    auto it = s.groups.find(gid);
    corrupt_unless(it != s.groups.end() && it->second.long_queue && it->second.stale_check_pending &&
                       it->second.state == GroupState::Active && !it->second.tail_restart,
                   "tail restart of group " + std::to_string(gid) + ": unknown, repeated, or not a pending "
                   "long-queue group");
    it->second.tail_restart = true;
  }
}

}  // namespace

std::string encode_state(const Config& config, const State& s) {
  Writer w;
  w.put<int64_t>(config.n_samples_per_prompt);
  w.put<int64_t>(config.max_response_len);
  w.put<int64_t>(config.tail_extra_samples);
  w.put<int64_t>(s.next_group_id);
  w.put<int64_t>(s.prompts_consumed);
  w.put<uint8_t>(s.step_open);
  w.put<uint8_t>(s.wave_launched);
  w.put<int64_t>(s.policy_version);
  w.put<int64_t>(s.step_index);
  const auto counters = s.stats.counters();
  w.put<uint64_t>(counters.size());
  for (const auto& kv : counters) w.put<int64_t>(kv.second);
  w.put_vec(s.stats.staleness_histogram);
  w.put<uint64_t>(s.groups.size());
  for (const auto& [gid, g] : s.groups) {
    w.put<int64_t>(gid);
    w.put<int64_t>(g.prompt_index);
    w.put<uint8_t>(static_cast<uint8_t>(g.state));
    w.put<uint8_t>(g.stale_check_pending);
    w.put_vec(g.prompt);
    w.put_vec(g.rewards);
    for (const auto& smp : g.samples) encode_sample(w, smp);
  }
  // Popped groups still waiting for a reward are handed out again after a load.
  std::vector<int64_t> completed(s.completed.begin(), s.completed.end());
  for (const auto& [gid, g] : s.groups) {
    if (g.state == GroupState::Completed && g.popped) completed.push_back(gid);
  }
  w.put_vec(completed);
  w.put_vec(std::vector<int64_t>(s.accepted.begin(), s.accepted.end()));
  w.put<double>(s.live_fraction);
  w.put<int64_t>(s.adaptive_groups);
  encode_prediction(w, s);
  w.put<uint8_t>(static_cast<uint8_t>(s.round));
  std::vector<int64_t> long_queue, tail_restart;
  for (const auto& [gid, g] : s.groups) {
    if (g.long_queue) long_queue.push_back(gid);
    if (g.tail_restart) tail_restart.push_back(gid);
  }
  w.put_vec(long_queue);
  w.put_vec(tail_restart);
  return frame(w.bytes());
}

State decode_state(const Config& config, const std::string& bytes) {
  const Frame f = check_frame(bytes);
  Reader r(f.payload, f.len);
  check_shape(r, f.version, config);
  State s;
  decode_step(r, f.version, config.group_width(), s);
  const auto n_groups = r.get<uint64_t>();
  corrupt_unless(n_groups <= f.len, "group count " + std::to_string(n_groups) + " exceeds the payload");
  for (uint64_t gi = 0; gi < n_groups; ++gi) decode_group(r, config, f.version, s);
  decode_queues(r, n_groups, s);
  if (f.version >= 2) decode_adaptive(r, s);
  if (f.version >= 4) decode_prediction(r, config, s);
  if (f.version >= 5) decode_tail(r, n_groups, s);
  corrupt_unless(r.at_end(), "trailing bytes after the state");
  return s;
}

}  // namespace april::sched
