// Scheduler configuration as the C++ core sees it. The Python SchedulerConfig validates first and
// names fields in its messages; validate() here guards the core against any other caller.
#pragma once

#include <cstdint>

namespace april::sched {

// Settings cross the binding by name (scheduler/names.h), never by these numbers.
enum class Refill : int32_t { Batch, Continuous };
enum class OverSampling : int32_t { Fixed, Adaptive };
enum class StalenessPolicy : int32_t { Keep, Mask, Restart, Drop };
enum class ResumeOrder : int32_t { OldestFirst, NewestFirst, LongestFirst };
// What happens to running samples when a step's batch is taken: aborted (the paper) or kept generating
// across the weight update with their KV (carried).
enum class StepBoundary : int32_t { Abort, Carry };
// Order in which queued work is dispatched: the paper's (fifo), by group age, or by predicted remaining length
// (longest first: Seer's context-aware scheduling; shortest first: SortedRL).
enum class DispatchOrder : int32_t { Fifo, OldestFirst, LongestPredictedFirst, ShortestFirst };
// Also the codes of the finish_reasons arrays (april_ext.batch.FinishReason), so the numbers are fixed.
enum class FinishReason : uint8_t { Stop = 0, Length = 1, Abort = 2 };

struct Config {
  int64_t rollout_batch_size = 32;        // N: accepted groups per step
  int64_t n_samples_per_prompt = 8;       // samples per group
  int64_t over_sampling_batch_size = 64;  // N' >= N: groups generating at a time
  int64_t max_response_len = 16384;       // response token cap per sample
  Refill refill = Refill::Batch;
  int64_t max_staleness = -1;  // -1: unlimited
  StalenessPolicy staleness_policy = StalenessPolicy::Keep;
  bool mask_offpolicy = false;
  ResumeOrder resume_order = ResumeOrder::OldestFirst;
  bool keep_surplus = true;
  int64_t max_inflight_samples = 0;  // 0: no cap
  // Adaptive: launch groups to keep target_inflight_samples live (queued or generating) and dispatch at most
  // that many; the group ceiling N'_t is retuned each step from the observed live share of groups in hand.
  OverSampling over_sampling = OverSampling::Fixed;
  int64_t target_inflight_samples = 0;  // adaptive only; 0 in fixed mode
  StepBoundary step_boundary = StepBoundary::Abort;
  // Long-tail strategies (docs/strategies.md).
  DispatchOrder dispatch_order = DispatchOrder::Fifo;
  bool resume_priority = true;  // buffered partials before new samples; within each, dispatch_order
  int64_t chunk_tokens = 0;     // divided rollout: most new tokens per dispatch; 0: the whole remaining budget
  bool tail_batching = false;   // short rounds send still-running groups to a long queue, run as a long round
  bool tail_batching_restart = false;  // a long-queue group restarts from its prompt (strict on-policy)
  // Tail batching: extra samples per group in short rounds (RollPacker); a group completes with its first
  // n_samples_per_prompt finishes and cancels the rest.
  int64_t tail_extra_samples = 0;

  // Sample slots per group: n_samples_per_prompt + tail_extra_samples.
  int64_t group_width() const { return n_samples_per_prompt + tail_extra_samples; }

  // Throws ConfigError naming the first field that is not allowed.
  void validate() const;
};

}  // namespace april::sched
