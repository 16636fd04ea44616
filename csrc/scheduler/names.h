// The names of the scheduler's enums, as Python spells them: settings and sample states cross the
// binding by name, and each name is parsed here.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "scheduler/config.h"
#include "scheduler/state.h"

namespace april::sched {

// Each sets `out` to the value called `name`; false for any other name (Config::refuse words the error).
bool parse(const std::string& name, Refill& out);
bool parse(const std::string& name, OverSampling& out);
bool parse(const std::string& name, StalenessPolicy& out);
bool parse(const std::string& name, ResumeOrder& out);
bool parse(const std::string& name, StepBoundary& out);
bool parse(const std::string& name, DispatchOrder& out);
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
// "one of '<a>', '<b>', ...": what the enum-valued SchedulerConfig field `field` allows.
std::string allowed_names(const std::string& field);

}  // namespace april::sched
