// Sample ids: group id x the group's slot count + slot. The one place ids are encoded and decoded.
#pragma once

#include <cstdint>

namespace april::sched {

struct SampleIds {
  int64_t width;  // slots per group: Config::group_width()

  int64_t id(int64_t group_id, int64_t slot) const { return group_id * width + slot; }
  int64_t group(int64_t sample_id) const { return sample_id / width; }
  int64_t slot(int64_t sample_id) const { return sample_id % width; }
};

}  // namespace april::sched
