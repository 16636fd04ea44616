// The names of the scheduler's enums, as Python spells them: settings and sample states cross the
// binding by name, and each name is parsed (and rejected) here.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "scheduler/config.h"
#include "scheduler/state.h"

namespace april::sched {

// Each throws ConfigError "SchedulerConfig.<field>='<name>' is not allowed: one of '<a>', '<b>', ...".
Refill parse_refill(const std::string& name);
OverSampling parse_over_sampling(const std::string& name);
StalenessPolicy parse_staleness_policy(const std::string& name);
ResumeOrder parse_resume_order(const std::string& name);
StepBoundary parse_step_boundary(const std::string& name);
DispatchOrder parse_dispatch_order(const std::string& name);
// Throws InvalidArgumentError naming the allowed states.
SampleState parse_sample_state(const std::string& name);

// The name of a value; nullptr for a number outside the enum.
const char* name_of(Refill value);
const char* name_of(OverSampling value);
const char* name_of(StalenessPolicy value);
const char* name_of(ResumeOrder value);
const char* name_of(StepBoundary value);
const char* name_of(DispatchOrder value);
const char* name_of(SampleState value);

// Each enum-valued SchedulerConfig field with its allowed names, in declaration order.
std::vector<std::pair<std::string, std::vector<std::string>>> config_choices();

}  // namespace april::sched
