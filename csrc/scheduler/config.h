// Scheduler configuration: the one definition of its fields' defaults and rules. The binding exposes Config as
// april_ext._C.SchedulerConfig; the Python SchedulerConfig takes its defaults from it and is validated by it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

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

// An unset optional is None in Python.
struct Config {
  int64_t rollout_batch_size = 32;   // N: accepted groups per step
  int64_t n_samples_per_prompt = 8;  // samples per group
  // N' >= N: groups generating at a time; unset: 2N, which validated() fills in (so the core always has it).
  std::optional<int64_t> over_sampling_batch_size;
  int64_t max_response_len = 16384;  // response token cap per sample
  Refill refill = Refill::Batch;
  std::optional<int64_t> max_staleness;  // unset: unlimited
  StalenessPolicy staleness_policy = StalenessPolicy::Keep;
  bool mask_offpolicy = false;
  ResumeOrder resume_order = ResumeOrder::OldestFirst;
  bool keep_surplus = true;
  std::optional<int64_t> max_inflight_samples;  // unset: no cap
  // Adaptive: launch groups to keep target_inflight_samples live (queued or generating) and dispatch at most
  // that many; the group ceiling N'_t is retuned each step from the observed live share of groups in hand.
  OverSampling over_sampling = OverSampling::Fixed;
  std::optional<int64_t> target_inflight_samples;  // adaptive only, and required there
  StepBoundary step_boundary = StepBoundary::Abort;
  // Long-tail strategies (docs/strategies.md).
  DispatchOrder dispatch_order = DispatchOrder::Fifo;
  bool resume_priority = true;  // buffered partials before new samples; within each, dispatch_order
  std::optional<int64_t> chunk_tokens;  // divided rollout: most new tokens per dispatch; unset: the whole budget
  bool tail_batching = false;  // short rounds send still-running groups to a long queue, run as a long round
  bool tail_batching_restart = false;  // a long-queue group restarts from its prompt (strict on-policy)
  // Tail batching: extra samples per group in short rounds (RollPacker); a group completes with its first
  // n_samples_per_prompt finishes and cancels the rest.
  int64_t tail_extra_samples = 0;

  // Sample slots per group: n_samples_per_prompt + tail_extra_samples.
  int64_t group_width() const { return n_samples_per_prompt + tail_extra_samples; }

  // This config with over_sampling_batch_size set, if it keeps every rule; otherwise throws ConfigError
  // "SchedulerConfig.<field>=<value> is not allowed: <what is>" for the first field (in declaration order) that
  // does not. Values are spelled as Python spells them (True, None, 'name'): SchedulerConfig is set there.
  Config validated() const;
  // Throws the ConfigError of `field` holding `value` (spelled by the caller), saying what the field allows
  // given the fields before it: for a value the binding cannot convert (a str or a float for an int).
  [[noreturn]] void refuse(const std::string& field, const std::string& value) const;
};

}  // namespace april::sched
