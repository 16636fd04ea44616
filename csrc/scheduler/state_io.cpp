#include "scheduler/state_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <type_traits>

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

// Owns a file descriptor; closes it on every path out.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  throw Error(ErrorKind::Io, what + " " + path + ": " + std::strerror(errno));
}

}  // namespace

std::string encode_state(const Config& config, const State& s) {
  Writer w;
  w.put<int64_t>(config.n_samples_per_prompt);
  w.put<int64_t>(config.max_response_len);
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
    for (const auto& smp : g.samples) {
      // The engine's requests do not survive a restart: in-flight samples come back as buffered partials.
      const SampleState st = smp.in_flight() ? SampleState::Queued : smp.state;
      w.put<uint8_t>(static_cast<uint8_t>(st));
      w.put<uint8_t>(static_cast<uint8_t>(smp.finish));
      w.put<int64_t>(smp.dispatch_version);
      w.put<int64_t>(smp.tokens_at_step_start);
      w.put<int64_t>(smp.resumes);
      w.put_vec(smp.tokens);
      w.put_vec(smp.logprobs);
      w.put_vec(smp.segments);
    }
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

  const std::string& payload = w.bytes();
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

State decode_state(const Config& config, const std::string& bytes) {
  check(bytes.size() >= kHeader + sizeof(uint64_t), ErrorKind::CorruptState,
        "scheduler state is truncated: " + std::to_string(bytes.size()) + " bytes, the header alone needs " +
            std::to_string(kHeader + sizeof(uint64_t)));
  check(std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0, ErrorKind::CorruptState,
        "not an april_ext scheduler state: bad magic (expected \"APRILSCH\")");
  uint32_t version = 0;
  uint64_t len = 0;
  std::memcpy(&version, bytes.data() + sizeof(kMagic), sizeof(version));
  std::memcpy(&len, bytes.data() + sizeof(kMagic) + sizeof(version), sizeof(len));
  check(version == 1 || version == kStateFormatVersion, ErrorKind::CorruptState,
        "scheduler state has format version " + std::to_string(version) + "; this build reads versions 1 and " +
            std::to_string(kStateFormatVersion));
  check(len == bytes.size() - kHeader - sizeof(uint64_t), ErrorKind::CorruptState,
        "scheduler state is truncated or has trailing bytes: header says " + std::to_string(len) +
            " payload bytes, the data holds " + std::to_string(bytes.size() - kHeader - sizeof(uint64_t)));
  const char* payload = bytes.data() + kHeader;
  uint64_t stored = 0;
  std::memcpy(&stored, payload + len, sizeof(stored));
  check(stored == fnv1a64(payload, len), ErrorKind::CorruptState,
        "scheduler state is corrupted: checksum mismatch");

  Reader r(payload, len);
  const auto n = r.get<int64_t>();
  const auto max_len = r.get<int64_t>();
  check(n == config.n_samples_per_prompt && max_len == config.max_response_len, ErrorKind::InvalidArgument,
        "scheduler state was saved with n_samples_per_prompt=" + std::to_string(n) +
            ", max_response_len=" + std::to_string(max_len) + "; this scheduler has " +
            std::to_string(config.n_samples_per_prompt) + ", " + std::to_string(config.max_response_len));
  State s;
  s.next_group_id = r.get<int64_t>();
  s.prompts_consumed = r.get<int64_t>();
  s.step_open = r.get<uint8_t>() != 0;
  s.wave_launched = r.get<uint8_t>() != 0;
  s.policy_version = r.get<int64_t>();
  s.step_index = r.get<int64_t>();
  corrupt_unless(s.next_group_id >= 0 && s.prompts_consumed >= 0 && s.policy_version >= -1 &&
                     s.policy_version <= INT32_MAX && s.step_index >= 0,
                 "counters out of range");
  const auto n_counters = r.get<uint64_t>();
  const size_t expected_counters = version == 1 ? kV1CounterCount : s.stats.counters().size();
  corrupt_unless(n_counters == expected_counters, "stats has " + std::to_string(n_counters) + " counters, expected " +
                                                 std::to_string(expected_counters));
  std::vector<int64_t> values(s.stats.counters().size(), 0);  // counters a version 1 file lacks stay 0
  for (size_t i = 0; i < n_counters; ++i) values[i] = r.get<int64_t>();
  size_t k = 0;
#define APRIL_RESTORE(name) s.stats.name = values[k++];
  APRIL_STEP_COUNTERS(APRIL_RESTORE)
#undef APRIL_RESTORE
  s.stats.staleness_histogram = r.get_vec<int64_t>(static_cast<uint64_t>(INT32_MAX));
  const auto n_groups = r.get<uint64_t>();
  corrupt_unless(n_groups <= len, "group count " + std::to_string(n_groups) + " exceeds the payload");
  for (uint64_t gi = 0; gi < n_groups; ++gi) {
    const auto gid = r.get<int64_t>();
    corrupt_unless(gid >= 0 && gid < s.next_group_id && !s.groups.count(gid),
                   "group id " + std::to_string(gid) + " is out of range or repeated");
    Group& g = s.groups[gid];
    g.prompt_index = r.get<int64_t>();
    const auto gstate = r.get<uint8_t>();
    corrupt_unless(gstate <= 2, "group state " + std::to_string(gstate));
    g.state = static_cast<GroupState>(gstate);
    g.stale_check_pending = r.get<uint8_t>() != 0;
    g.prompt = r.get_vec<int32_t>(len);
    g.rewards = r.get_vec<float>(static_cast<uint64_t>(n));
    corrupt_unless(g.prompt_index >= 0 && g.prompt_index < s.prompts_consumed && !g.prompt.empty(),
                   "group " + std::to_string(gid) + " has a bad prompt");
    corrupt_unless(g.rewards.size() == (g.state == GroupState::Accepted ? static_cast<size_t>(n) : 0),
                   "group " + std::to_string(gid) + " has " + std::to_string(g.rewards.size()) + " rewards");
    g.samples.resize(n);
    for (auto& smp : g.samples) {
      const auto st = r.get<uint8_t>();
      const auto fin = r.get<uint8_t>();
      corrupt_unless(st == static_cast<uint8_t>(SampleState::Queued) || st == static_cast<uint8_t>(SampleState::Done),
                     "sample state " + std::to_string(st));
      corrupt_unless(fin <= 1, "finish reason " + std::to_string(fin));
      smp.state = static_cast<SampleState>(st);
      smp.finish = static_cast<FinishReason>(fin);
      smp.dispatch_version = r.get<int64_t>();
      smp.tokens_at_step_start = r.get<int64_t>();
      smp.resumes = r.get<int64_t>();
      smp.tokens = r.get_vec<int32_t>(static_cast<uint64_t>(max_len));
      smp.logprobs = r.get_vec<float>(static_cast<uint64_t>(max_len));
      smp.segments = r.get_vec<Segment>(static_cast<uint64_t>(max_len));
      const auto ntok = smp.tokens.size();
      corrupt_unless(smp.logprobs.size() == ntok, "a sample has tokens and logprobs of different lengths");
      corrupt_unless(smp.segments.empty() == (ntok == 0), "a sample's version segments do not cover its tokens");
      for (size_t i = 0; i < smp.segments.size(); ++i) {
        const Segment& seg = smp.segments[i];
        const bool ordered = i == 0 ? seg.start == 0
                                    : seg.start > smp.segments[i - 1].start && seg.version > smp.segments[i - 1].version;
        corrupt_unless(ordered && static_cast<size_t>(seg.start) < ntok && seg.version >= 0 &&
                           seg.version <= s.policy_version,
                       "a sample's version segments are out of order or range");
      }
      corrupt_unless(smp.tokens_at_step_start >= 0 && smp.tokens_at_step_start <= static_cast<int64_t>(ntok),
                     "a sample's step-start length is out of range");
      if (smp.state == SampleState::Done) {
        g.n_done += 1;
      } else {
        s.queued_samples += 1;
      }
    }
    corrupt_unless((g.state == GroupState::Active) == (g.n_done < n),
                   "group " + std::to_string(gid) + " state does not match its samples");
  }
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
  if (version >= 2) {
    s.live_fraction = r.get<double>();
    s.adaptive_groups = r.get<int64_t>();
    corrupt_unless(s.live_fraction > 0.0 && s.live_fraction <= 1.0 && s.adaptive_groups >= 0,
                   "adaptive over-sampling state out of range");
  }
  corrupt_unless(r.at_end(), "trailing bytes after the state");
  return s;
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) io_error("cannot create", tmp);
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t w = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        ::unlink(tmp.c_str());
        io_error("cannot write", tmp);
      }
      done += static_cast<size_t>(w);
    }
    if (::fsync(fd.get()) != 0) {
      ::unlink(tmp.c_str());
      io_error("cannot fsync", tmp);
    }
    if (::close(fd.release()) != 0) {
      ::unlink(tmp.c_str());
      io_error("cannot close", tmp);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    io_error("cannot rename " + tmp + " to", path);
  }
  // The rename is durable only once the folder's entry is on disk.
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() >= 0) ::fsync(dfd.get());
}

std::string read_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) io_error("cannot open", path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd.get(), buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_error("cannot read", path);
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

}  // namespace april::sched
