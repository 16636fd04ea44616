#include "scheduler/names.h"

#include <array>
#include <cstddef>

#include "common/error.h"

namespace april::sched {

namespace {

template <typename E>
struct Named {
  const char* name;
  E value;
};

constexpr std::array<Named<Refill>, 2> kRefill{{{"batch", Refill::Batch}, {"continuous", Refill::Continuous}}};
constexpr std::array<Named<OverSampling>, 2> kOverSampling{
    {{"fixed", OverSampling::Fixed}, {"adaptive", OverSampling::Adaptive}}};
constexpr std::array<Named<StalenessPolicy>, 4> kStaleness{{{"keep", StalenessPolicy::Keep},
                                                            {"mask", StalenessPolicy::Mask},
                                                            {"restart", StalenessPolicy::Restart},
                                                            {"drop", StalenessPolicy::Drop}}};
constexpr std::array<Named<ResumeOrder>, 3> kResume{{{"oldest_first", ResumeOrder::OldestFirst},
                                                     {"newest_first", ResumeOrder::NewestFirst},
                                                     {"longest_first", ResumeOrder::LongestFirst}}};
constexpr std::array<Named<StepBoundary>, 2> kStepBoundary{
    {{"abort", StepBoundary::Abort}, {"carry", StepBoundary::Carry}}};
constexpr std::array<Named<DispatchOrder>, 4> kDispatchOrder{
    {{"fifo", DispatchOrder::Fifo},
     {"oldest_first", DispatchOrder::OldestFirst},
     {"longest_predicted_first", DispatchOrder::LongestPredictedFirst},
     {"shortest_first", DispatchOrder::ShortestFirst}}};
constexpr std::array<Named<SampleState>, 6> kSampleState{{{"queued", SampleState::Queued},
                                                          {"running", SampleState::Running},
                                                          {"aborting", SampleState::Aborting},
                                                          {"done", SampleState::Done},
                                                          {"cancelled", SampleState::Cancelled},
                                                          {"waiting_env", SampleState::WaitingEnv}}};

template <typename E, size_t N>
std::vector<std::string> names(const std::array<Named<E>, N>& table) {
  std::vector<std::string> out;
  for (const auto& entry : table) out.emplace_back(entry.name);
  return out;
}

std::string one_of(const std::vector<std::string>& values) {
  std::string out = "one of ";
  for (size_t i = 0; i < values.size(); ++i) out += (i == 0 ? "'" : ", '") + values[i] + "'";
  return out;
}

template <typename E, size_t N>
bool find_value(const std::array<Named<E>, N>& table, const std::string& name, E& out) {
  for (const auto& entry : table) {
    if (name == entry.name) {
      out = entry.value;
      return true;
    }
  }
  return false;
}

template <typename E, size_t N>
const char* find_name(const std::array<Named<E>, N>& table, E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return nullptr;
}

}  // namespace

bool parse(const std::string& name, Refill& out) { return find_value(kRefill, name, out); }
bool parse(const std::string& name, OverSampling& out) { return find_value(kOverSampling, name, out); }
bool parse(const std::string& name, StalenessPolicy& out) { return find_value(kStaleness, name, out); }
bool parse(const std::string& name, ResumeOrder& out) { return find_value(kResume, name, out); }
bool parse(const std::string& name, StepBoundary& out) { return find_value(kStepBoundary, name, out); }
bool parse(const std::string& name, DispatchOrder& out) { return find_value(kDispatchOrder, name, out); }

SampleState parse_sample_state(const std::string& name) {
  SampleState out{};
  if (!find_value(kSampleState, name, out)) {
    throw Error(ErrorKind::InvalidArgument,
                "sample state='" + name + "' is not allowed: " + one_of(names(kSampleState)));
  }
  return out;
}

const char* name_of(Refill value) { return find_name(kRefill, value); }
const char* name_of(OverSampling value) { return find_name(kOverSampling, value); }
const char* name_of(StalenessPolicy value) { return find_name(kStaleness, value); }
const char* name_of(ResumeOrder value) { return find_name(kResume, value); }
const char* name_of(StepBoundary value) { return find_name(kStepBoundary, value); }
const char* name_of(DispatchOrder value) { return find_name(kDispatchOrder, value); }
const char* name_of(SampleState value) { return find_name(kSampleState, value); }

std::vector<std::pair<std::string, std::vector<std::string>>> config_choices() {
  return {{"refill", names(kRefill)},
          {"staleness_policy", names(kStaleness)},
          {"resume_order", names(kResume)},
          {"over_sampling", names(kOverSampling)},
          {"step_boundary", names(kStepBoundary)},
          {"dispatch_order", names(kDispatchOrder)}};
}

std::string allowed_names(const std::string& field) {
  for (const auto& [name, values] : config_choices()) {
    if (name == field) return one_of(values);
  }
  throw Error(ErrorKind::Internal, field + " is not an enum-valued SchedulerConfig field");
}

}  // namespace april::sched
