// The partial-rollout scheduler (APRIL): single owner of rollout state. One mutex guards every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "scheduler/config.h"
#include "scheduler/sample_ids.h"
#include "scheduler/sample_index.h"
#include "scheduler/state.h"
#include "scheduler/stats.h"

namespace april::sched {

// The finish code of a turn that ended at a stop token while the trajectory goes on (multi-turn): the sample waits
// for its environment (SampleState::WaitingEnv). Never a sample's final reason, so not a FinishReason.
constexpr uint8_t kEnvWaitReason = 3;

// Requests of one dispatch call, packed: request i sends input_ids[offsets[i]:offsets[i+1]].
struct Dispatch {
  std::vector<int64_t> sample_ids;
  std::vector<int64_t> group_ids;
  std::vector<int64_t> prompt_indices;
  std::vector<int32_t> input_ids;
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> prompt_lens;
  std::vector<int64_t> max_new_tokens;
  std::vector<uint8_t> is_resume;        // input_ids hold a partial response
  std::vector<uint8_t> is_continuation;  // of a chunk that came back at this policy version (KV still held)
  std::vector<int64_t> predicted_lens;   // predicted final response length
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

// New groups of one dispatch, packed: group i has prompt tokens[offsets[i]:offsets[i+1]] and prompt index
// first_index + i.
struct PromptBatch {
  int64_t first_index = 0;
  const int32_t* tokens = nullptr;
  size_t n_tokens = 0;
  const int64_t* offsets = nullptr;  // n_groups + 1 entries
  size_t n_groups = 0;
  // Optional, n_groups entries: each prompt's identity across epochs (length prediction from its history).
  const int64_t* history_keys = nullptr;
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

  // Step control. step_boundary=abort: once the step is done, samples_to_abort() lists the running samples
  // and take_batch() waits until none runs. step_boundary=carry: running samples stay running through
  // take_batch() and begin_step(); right after begin_step(), samples_to_abort() lists the carried samples
  // past the staleness bound under the restart and drop policies, and with tail_batching_restart those of
  // long-queue groups restarting.
  void begin_step(int64_t policy_version);
  bool step_open() const;
  bool step_done() const;
  std::vector<int64_t> samples_to_abort();
  Batch take_batch();

  // Dispatch: groups_to_launch() new prompts are wanted; add_groups() them (all or, on an invalid prompt,
  // none), then dispatch().
  int64_t groups_to_launch() const;
  void add_groups(const PromptBatch& prompts);
  Dispatch dispatch();

  // Engine events
  void on_tokens(const EventBatch& events);
  // reasons: FinishReason codes, or kEnvWaitReason (the sample waits for its environment). A sample waiting for
  // its environment takes a stop or length finish with no tokens (the environment ended the trajectory).
  void on_finish(const EventBatch& events);
  // Environment events: event i appends counts[i] > 0 tokens (logprobs and versions unused) to a sample waiting
  // for its environment, which is queued for dispatch again (done with length if the tokens reach the cap).
  void on_env_tokens(const EventBatch& events);

  // Reward and filter
  std::vector<CompletedGroup> pop_completed_groups();
  void report_rewards(int64_t group_id, const float* rewards, size_t n, bool accepted);

  // Introspection
  StepStats stats() const;
  MemoryUsage buffered_memory() const;
  std::vector<int64_t> sample_ids(SampleState state) const;
  // The response of one sample: tokens, logprobs, per-token versions, state and times resumed.
  // Env tokens have logprob 0.0, version -1 and env_mask 1.
  void sample_response(int64_t sample_id, std::vector<int32_t>& tokens, std::vector<float>& logprobs,
                       std::vector<int32_t>& versions, std::vector<uint8_t>& env_mask, SampleState& state,
                       int64_t& resumes) const;
  int64_t policy_version() const;

  // Persistence: running samples (carried ones too) are stored as buffered partials (the engine's requests
  // and their KV do not survive);
  // on load, a partial at the length cap finishes as a length finish. Bytes that do not decode
  // (CorruptStateError, or InvalidArgumentError for another shape) leave the state untouched.
  std::string serialize() const;
  void deserialize(const std::string& bytes);
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  // A queued sample picked for dispatch; len is its partial response's length, predicted its predicted final one.
  struct Pick {
    int64_t gid;
    int64_t index;
    int64_t len;
    int64_t predicted;
  };
  // Creation order of the picks' groups (group ids grow with launch order).
  static bool older(const Pick& a, const Pick& b) { return a.gid < b.gid; }

  // Records (scheduler.cpp)
  const Group& group_of(int64_t sample_id, int64_t* index) const;
  Group& group_of(int64_t sample_id, int64_t* index);
  void settle_after_load();
  // A running sample whose abort the scheduler asks for: Aborting, its id appended to `out`.
  void mark_aborting(Sample& smp, int64_t sample_id, std::vector<int64_t>& out);
  // Step boundary and batch assembly (step.cpp)
  bool step_done_locked() const;
  void pack_group(Batch& b, int64_t group_id, int32_t index_in_batch);
  void drop_surplus();
  // Group life cycle: completion, reward and filter, removal (groups.cpp)
  // A group with n samples done cancels its other samples, and completes once none of them is in flight.
  void complete_if_done(int64_t group_id, Group& g);
  // Tail batching over-provisioning: a sample slot the group gives up. Queued: Cancelled now, tokens discarded;
  // in flight: aborted (listed for samples_to_abort), Cancelled when its result comes back.
  void cancel_sample(int64_t group_id, int64_t slot);
  void discard_cancelled(Sample& smp);
  void unlist(int64_t group_id);  // out of the completed and accepted queues
  void erase_group(int64_t group_id);
  // erase_group for a group the scheduler gives up (surplus, stale): a reward still due for it is expected.
  void drop_group(int64_t group_id);
  // Dispatch and refill (dispatch.cpp)
  int64_t groups_to_launch_locked() const;
  int64_t inflight_cap() const;  // most samples dispatched at once; INT64_MAX when uncapped
  int64_t launch_width() const;  // samples a group launched now runs: n, plus tail_extra_samples in a short round
  void retune_over_sampling();
  std::vector<Pick> queued_in_dispatch_order() const;
  void sort_by_dispatch_order(std::vector<Pick>& picks) const;
  void launch(Dispatch& d, const Pick& pick);
  // Tail batching: rounds and the long queue (tail.cpp)
  bool in_round(const Group& g) const;      // runs in the current round and counts toward its batch
  bool dispatchable(const Group& g) const;  // its queued samples may be dispatched now
  int64_t round_accepted() const;           // accepted groups that count toward the current batch
  std::vector<int64_t> batch_group_ids() const;
  void begin_round();
  void end_round();
  void trim_long_group(int64_t group_id, Group& g);  // keep n samples: done first, then the longest partials
  void restart_long_group(int64_t group_id);
  // Staleness (staleness.cpp)
  bool staleness_enforced() const;  // restart or drop with a bound
  bool is_stale(const Sample& smp) const;
  // Back to the prompt: the response, its logprobs and versions go (the caller counts them).
  void restart_sample(Group& g, Sample& smp);
  void reopen_group(int64_t group_id, Group& g);  // a completed or accepted group generates again
  void apply_staleness(int64_t group_id);
  void apply_staleness_carried(int64_t group_id);
  // Token and finish events (events.cpp)
  Sample* const* validate_events(const EventBatch& events, bool finishing);
  void check_event(Sample& sample, const EventBatch& events, size_t e, bool finishing);
  // Returns the tokens appended (0 or count) for the caller to add to the step counters once per call.
  int64_t append_tokens(Sample& sample, const int32_t* tokens, const float* logprobs, int64_t count,
                        int64_t version);
  void finish(Sample& sample, Group& group, int64_t group_id, FinishReason reason);

  Config config_;
  SampleIds ids_;
  mutable std::mutex mu_;
  State s_;
  SampleIndex index_;  // kept in step with s_.groups
  uint64_t epoch_ = 0;
  std::vector<Sample*> scratch_samples_;  // the events' samples; grows to the largest call, never shrinks
  // Samples set aborting outside the abort-mode step end, until samples_to_abort() hands them out: carried
  // samples begin_step aborts (staleness, tail restarts) and cancelled surplus samples. Not persisted: a loaded
  // state has nothing in flight.
  std::vector<int64_t> pending_aborts_;
  // Groups dropped (surplus at take_batch, staleness drop) after pop_completed_groups handed them out and
  // before their rewards came: report_rewards ignores those once. Not persisted (a loop reports its pending
  // rewards before a save).
  std::unordered_set<int64_t> dropped_unrewarded_;
};

}  // namespace april::sched
