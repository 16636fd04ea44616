// Sample id -> record in O(1), for the event hot path. Sample ids are group_id * width + slot and group ids
// count up from 0, so the live samples fill a window of ids: a vector over that window replaces a tree
// search per event. The window runs from the oldest live group to the newest (8 bytes per id in it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "scheduler/sample_ids.h"
#include "scheduler/state.h"

namespace april::sched {

class SampleIndex {
 public:
  explicit SampleIndex(SampleIds ids) : ids_(ids) {}

  // The record of a live sample, or nullptr (never launched, or its group is gone; negative ids too).
  Sample* find(int64_t sample_id) const {
    const uint64_t k = static_cast<uint64_t>(sample_id) - static_cast<uint64_t>(base_);
    return k < slots_.size() ? slots_[k].sample : nullptr;
  }
  // The group of a sample that find() resolves.
  Group& group(int64_t sample_id) const {
    return *slots_[static_cast<size_t>(static_cast<uint64_t>(sample_id) - static_cast<uint64_t>(base_))].group;
  }
  // Group ids must come in increasing order (the scheduler's launch order).
  void add(int64_t group_id, Group& g);
  void remove(int64_t group_id);
  void rebuild(std::map<int64_t, Group>& groups);

 private:
  struct Slot {
    Sample* sample;
    Group* group;
  };

  SampleIds ids_;
  int64_t base_ = 0;   // sample id of slots_[0]
  size_t head_ = 0;    // slots before head_ are all empty
  std::vector<Slot> slots_;
};

// Throws UnknownIdError for a sample id that names no live sample; for a negative one, naming the range of ids.
[[noreturn]] void throw_unknown_sample(int64_t sample_id);

}  // namespace april::sched
