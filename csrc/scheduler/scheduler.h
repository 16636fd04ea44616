// The partial-rollout scheduler (APRIL): single owner of rollout state. One mutex guards every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "scheduler/config.h"
#include "scheduler/state.h"
#include "scheduler/stats.h"

namespace april::sched {

// Requests of one dispatch call, packed: request i sends input_ids[offsets[i]:offsets[i+1]].
struct Dispatch {
  std::vector<int64_t> sample_ids;
  std::vector<int64_t> group_ids;
  std::vector<int64_t> prompt_indices;
  std::vector<int32_t> input_ids;
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> prompt_lens;
  std::vector<int64_t> max_new_tokens;
  std::vector<uint8_t> is_resume;
};

struct CompletedGroup {
  int64_t group_id;
  int64_t prompt_index;
  std::vector<int64_t> sample_ids;
  std::vector<int64_t> response_lens;
  std::vector<uint8_t> finish_reasons;
  std::vector<int32_t> tokens;  // the responses, concatenated in sample order (lengths in response_lens)
};

// The TrainingBatch layout (april_ext/batch.py) as flat vectors.
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> prompt_lens;
  std::vector<uint8_t> loss_mask;
  std::vector<float> behavior_logprobs;
  std::vector<int32_t> versions;
  std::vector<float> rewards;
  std::vector<int32_t> group_index;
  std::vector<int64_t> sample_ids;
  std::vector<uint8_t> finish_reasons;
  std::vector<int64_t> group_ids;
  std::vector<int64_t> prompt_indices;
  int64_t policy_version = 0;
};

// A chunk-per-event view over the arrays of the batch calls. Event i carries counts[i] tokens.
struct EventBatch {
  const int64_t* sample_ids = nullptr;
  const int64_t* counts = nullptr;
  const int64_t* versions = nullptr;
  const uint8_t* reasons = nullptr;  // finish calls only
  size_t n_events = 0;
  const int32_t* tokens = nullptr;
  const float* logprobs = nullptr;
  size_t n_tokens = 0;
  size_t n_logprobs = 0;
};

struct MemoryUsage {
  int64_t samples = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;  // capacity of the token, logprob and segment arrays
};

class Scheduler {
 public:
  explicit Scheduler(const Config& config);

  // Data source
  void set_data_size(int64_t size);  // -1: unknown
  int64_t prompts_consumed() const;

  // Step control
  void begin_step(int64_t policy_version);
  bool step_open() const;
  bool step_done() const;
  std::vector<int64_t> samples_to_abort();
  Batch take_batch();

  // Dispatch: groups_to_launch() new prompts are wanted; add_group() each, then dispatch().
  int64_t groups_to_launch() const;
  int64_t add_group(int64_t prompt_index, const int32_t* prompt, size_t prompt_len);
  Dispatch dispatch();

  // Engine events
  void on_tokens(const EventBatch& events);
  void on_finish(const EventBatch& events);

  // Reward and filter
  std::vector<CompletedGroup> pop_completed_groups();
  void report_rewards(int64_t group_id, const float* rewards, size_t n, bool accepted);

  // Introspection
  StepStats stats() const;
  MemoryUsage buffered_memory() const;
  std::vector<int64_t> sample_ids(SampleState state) const;
  // The response of one sample: tokens, logprobs, per-token versions, state and times resumed.
  void sample_response(int64_t sample_id, std::vector<int32_t>& tokens, std::vector<float>& logprobs,
                       std::vector<int32_t>& versions, uint8_t& state, int64_t& resumes) const;
  int64_t policy_version() const;

  // Persistence: running samples are stored as buffered partials (the engine's requests do not survive).
  std::string serialize() const;
  void deserialize(const std::string& bytes);  // CorruptStateError leaves the state untouched
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  const Group& group_of(int64_t sample_id, int64_t* index) const;
  Group& group_of(int64_t sample_id, int64_t* index);
  bool step_done_locked() const;
  int64_t groups_to_launch_locked() const;
  int64_t inflight_cap() const;  // most samples dispatched at once; INT64_MAX when uncapped
  void retune_over_sampling();
  void apply_staleness(int64_t group_id);
  void complete_if_done(int64_t group_id, Group& g);
  void erase_group(int64_t group_id);
  std::vector<Sample*>& validate_events(const EventBatch& events, bool finishing);
  void append_tokens(Sample& sample, const int32_t* tokens, const float* logprobs, int64_t count,
                     int64_t version);

  Config config_;
  mutable std::mutex mu_;
  State s_;
  uint64_t epoch_ = 0;
  std::vector<Sample*> scratch_samples_;
};

}  // namespace april::sched
