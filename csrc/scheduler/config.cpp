#include "scheduler/config.h"

#include <limits>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "scheduler/names.h"

namespace april::sched {

namespace {

// One rule of a field: the field's value as the message spells it, whether the config keeps the rule, and
// what the field allows.
struct Rule {
  const char* field;
  std::string value;
  bool kept;
  std::string allowed;
};

std::string spelled(int64_t v) { return std::to_string(v); }
std::string spelled(bool v) { return v ? "True" : "False"; }
std::string spelled(const std::optional<int64_t>& v) { return v ? std::to_string(*v) : "None"; }
template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>>
std::string spelled(E v) {
  const char* name = name_of(v);
  return name != nullptr ? "'" + std::string(name) + "'" : std::to_string(static_cast<int64_t>(v));
}

// An enum-valued field: refuses a number that a C++ caller cast into the enum.
template <typename E>
Rule named(const char* field, E v) {
  return {field, spelled(v), name_of(v) != nullptr, allowed_names(field)};
}

// A bool field: any value of its type.
Rule either(const char* field, bool v) { return {field, spelled(v), true, "True or False"}; }

// Every rule, in field order. Each field has one (a bool's first is its type), so that refuse() can say what any
// field allows: its first rule's text.
std::vector<Rule> rules(const Config& c) {
  const std::string n = "n_samples_per_prompt (" + std::to_string(c.n_samples_per_prompt) + ")";
  const auto& n_prime = c.over_sampling_batch_size;
  const auto& target = c.target_inflight_samples;
  return {
      {"rollout_batch_size", spelled(c.rollout_batch_size), c.rollout_batch_size >= 1, "an int >= 1"},
      {"n_samples_per_prompt", spelled(c.n_samples_per_prompt), c.n_samples_per_prompt >= 1, "an int >= 1"},
      // Unset, it becomes 2N, which must fit.
      {"over_sampling_batch_size", spelled(n_prime),
       n_prime ? *n_prime >= c.rollout_batch_size : c.rollout_batch_size <= std::numeric_limits<int64_t>::max() / 2,
       "an int >= rollout_batch_size (" + std::to_string(c.rollout_batch_size) + "), or None for 2x"},
      {"max_response_len", spelled(c.max_response_len),
       c.max_response_len >= 1 && c.max_response_len <= std::numeric_limits<int32_t>::max(),
       "an int in [1, 2**31 - 1]"},
      named("refill", c.refill),
      {"max_staleness", spelled(c.max_staleness), !c.max_staleness || *c.max_staleness >= 0,
       "an int >= 0, or None for unlimited"},
      named("staleness_policy", c.staleness_policy),
      either("mask_offpolicy", c.mask_offpolicy),
      named("resume_order", c.resume_order),
      either("keep_surplus", c.keep_surplus),
      {"max_inflight_samples", spelled(c.max_inflight_samples),
       !c.max_inflight_samples || *c.max_inflight_samples >= c.n_samples_per_prompt,
       "an int >= " + n + ", or None for no cap"},
      named("over_sampling", c.over_sampling),
      c.over_sampling == OverSampling::Adaptive
          ? Rule{"target_inflight_samples", spelled(target), target && *target >= c.n_samples_per_prompt,
                 "an int >= " + n + "; adaptive over-sampling needs it"}
          : Rule{"target_inflight_samples", spelled(target), !target, "None unless over_sampling='adaptive'"},
      named("step_boundary", c.step_boundary),
      named("dispatch_order", c.dispatch_order),
      either("resume_priority", c.resume_priority),
      {"chunk_tokens", spelled(c.chunk_tokens), !c.chunk_tokens || *c.chunk_tokens >= 1,
       "an int >= 1, or None for no chunking"},
      either("tail_batching", c.tail_batching),
      either("tail_batching_restart", c.tail_batching_restart),
      {"tail_batching_restart", spelled(c.tail_batching_restart), !c.tail_batching_restart || c.tail_batching,
       "False unless tail_batching=True"},
      {"tail_extra_samples", spelled(c.tail_extra_samples), c.tail_extra_samples >= 0, "an int >= 0"},
      {"tail_extra_samples", spelled(c.tail_extra_samples), c.tail_extra_samples == 0 || c.tail_batching,
       "0 unless tail_batching=True"},
  };
}

[[noreturn]] void throw_refused(const std::string& field, const std::string& value, const std::string& allowed) {
  throw Error(ErrorKind::Config, "SchedulerConfig." + field + "=" + value + " is not allowed: " + allowed);
}

}  // namespace

Config Config::validated() const {
  for (const Rule& rule : rules(*this)) {
    if (!rule.kept) throw_refused(rule.field, rule.value, rule.allowed);
  }
  Config out = *this;
  if (!out.over_sampling_batch_size) out.over_sampling_batch_size = 2 * rollout_batch_size;
  return out;
}

void Config::refuse(const std::string& field, const std::string& value) const {
  for (const Rule& rule : rules(*this)) {
    if (field == rule.field) throw_refused(field, value, rule.allowed);
  }
  throw Error(ErrorKind::Internal, "SchedulerConfig has no field " + field);
}

}  // namespace april::sched
