// Length prediction: every queued sample's predicted final response length, and its accuracy. Work happens at
// dispatch and finish only, never on the token path.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/state.h"

namespace april::sched {

// Predicted final length of a group's unfinished samples, before the per-sample floor: the mean final length
// of its finished siblings (Seer: samples of one prompt have similar lengths); else of the prompt's samples in
// earlier epochs, by its history key (RhymeRL); else of every sample finished so far; else half the cap.
double group_length_prediction(const State& s, const Group& g, int64_t max_response_len);

// A sample's predicted final length: the group's prediction rounded, never below its length + 1 (it has not
// finished). Neither exceeds the cap: means of final lengths, half the cap, and a queued sample is below it.
int64_t sample_length_prediction(double group_prediction, int64_t length);

// A sample reached its final length: into the prompt's history, the global mean, and this step's pairs of
// (prediction at its last dispatch, final length) when it was dispatched since the state was loaded.
void record_final_length(State& s, const Group& g, const Sample& smp);

// Spearman rank correlation of x and y (ties share their mean rank); NaN with fewer than two pairs or when
// either side is constant.
double rank_correlation(const std::vector<int64_t>& x, const std::vector<int64_t>& y);

}  // namespace april::sched
