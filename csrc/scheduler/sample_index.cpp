#include "scheduler/sample_index.h"

#include <string>

#include "common/error.h"

namespace april::sched {

void throw_unknown_sample(int64_t sample_id) {
  throw Error(ErrorKind::UnknownId, "sample id " + std::to_string(sample_id) + " is not known: " +
                                        (sample_id < 0 ? "sample ids are in [0, 2**63 - 1]"
                                                       : "it was never dispatched, or its group was trained, "
                                                         "filtered or dropped"));
}

void SampleIndex::add(int64_t group_id, Group& g) {
  const int64_t first = ids_.id(group_id, 0);
  if (slots_.empty()) {
    base_ = first;
    head_ = 0;
  }
  slots_.resize(static_cast<size_t>(first - base_), Slot{nullptr, nullptr});  // ids of groups already gone
  for (Sample& smp : g.samples) slots_.push_back(Slot{&smp, &g});
}

void SampleIndex::remove(int64_t group_id) {
  const uint64_t k = static_cast<uint64_t>(ids_.id(group_id, 0)) - static_cast<uint64_t>(base_);
  if (k >= slots_.size()) return;
  for (int64_t i = 0; i < ids_.width; ++i) slots_[k + static_cast<uint64_t>(i)] = Slot{nullptr, nullptr};
  while (head_ < slots_.size() && slots_[head_].sample == nullptr) ++head_;
  if (head_ == slots_.size()) {
    slots_.clear();
    head_ = 0;
  } else if (head_ >= slots_.size() / 2) {  // amortized O(1): the dropped prefix is at least what stays
    slots_.erase(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(head_));
    base_ += static_cast<int64_t>(head_);
    head_ = 0;
  }
}

void SampleIndex::rebuild(std::map<int64_t, Group>& groups) {
  slots_.clear();
  head_ = 0;
  for (auto& [gid, g] : groups) add(gid, g);
}

}  // namespace april::sched
