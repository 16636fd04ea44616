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
constexpr std::array<Named<SampleState>, 5> kSampleState{{{"queued", SampleState::Queued},
                                                          {"running", SampleState::Running},
                                                          {"aborting", SampleState::Aborting},
                                                          {"done", SampleState::Done},
                                                          {"cancelled", SampleState::Cancelled}}};

template <typename E, size_t N>
std::vector<std::string> names(const std::array<Named<E>, N>& table) {
  std::vector<std::string> out;
  for (const auto& entry : table) out.emplace_back(entry.name);
  return out;
}

template <typename E, size_t N>
E parse(const std::array<Named<E>, N>& table, const std::string& name, ErrorKind kind, const std::string& what) {
  for (const auto& entry : table) {
    if (name == entry.name) return entry.value;
  }
  std::string allowed;
  for (const auto& entry : table) allowed += (allowed.empty() ? "'" : ", '") + std::string(entry.name) + "'";
  throw Error(kind, what + "='" + name + "' is not allowed: one of " + allowed);
}

template <typename E, size_t N>
const char* find_name(const std::array<Named<E>, N>& table, E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return nullptr;
}

}  // namespace

Refill parse_refill(const std::string& name) {
  return parse(kRefill, name, ErrorKind::Config, "SchedulerConfig.refill");
}

OverSampling parse_over_sampling(const std::string& name) {
  return parse(kOverSampling, name, ErrorKind::Config, "SchedulerConfig.over_sampling");
}

StalenessPolicy parse_staleness_policy(const std::string& name) {
  return parse(kStaleness, name, ErrorKind::Config, "SchedulerConfig.staleness_policy");
}

ResumeOrder parse_resume_order(const std::string& name) {
  return parse(kResume, name, ErrorKind::Config, "SchedulerConfig.resume_order");
}

StepBoundary parse_step_boundary(const std::string& name) {
  return parse(kStepBoundary, name, ErrorKind::Config, "SchedulerConfig.step_boundary");
}

DispatchOrder parse_dispatch_order(const std::string& name) {
  return parse(kDispatchOrder, name, ErrorKind::Config, "SchedulerConfig.dispatch_order");
}

SampleState parse_sample_state(const std::string& name) {
  return parse(kSampleState, name, ErrorKind::InvalidArgument, "sample state");
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

}  // namespace april::sched
