#include "scheduler/prediction.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace april::sched {

namespace {

// Ranks 1..n of v, ties sharing their mean rank.
std::vector<double> ranks(const std::vector<int64_t>& v) {
  std::vector<size_t> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
    const double mean_rank = 0.5 * static_cast<double>(i + j) + 1.0;
    for (size_t k = i; k <= j; ++k) r[order[k]] = mean_rank;
    i = j + 1;
  }
  return r;
}

}  // namespace

double group_length_prediction(const State& s, const Group& g, int64_t max_response_len) {
  int64_t sum = 0, done = 0;
  for (const Sample& smp : g.samples) {
    if (smp.state != SampleState::Done) continue;
    sum += static_cast<int64_t>(smp.tokens.size());
    done += 1;
  }
  if (done > 0) return static_cast<double>(sum) / static_cast<double>(done);
  if (g.has_history_key) {
    auto it = s.length_history.find(g.history_key);
    if (it != s.length_history.end() && it->second.count > 0) return it->second.mean();
  }
  if (s.final_lengths.count > 0) return s.final_lengths.mean();
  return static_cast<double>(max_response_len) / 2.0;
}

int64_t sample_length_prediction(double group_prediction, int64_t length) {
  return std::max(static_cast<int64_t>(std::llround(group_prediction)), length + 1);
}

void record_final_length(State& s, const Group& g, const Sample& smp) {
  const auto len = static_cast<int64_t>(smp.tokens.size());
  s.final_lengths.add(len);
  if (g.has_history_key) s.length_history[g.history_key].add(len);
  if (smp.predicted_len > 0) {
    s.stats.predicted_lens.push_back(smp.predicted_len);
    s.stats.final_lens.push_back(len);
    s.stats.prediction_samples += 1;
  }
}

double rank_correlation(const std::vector<int64_t>& x, const std::vector<int64_t>& y) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (x.size() < 2 || x.size() != y.size()) return nan;
  const std::vector<double> rx = ranks(x), ry = ranks(y);
  const double mean = 0.5 * static_cast<double>(x.size() + 1);  // of ranks 1..n, ties included
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mean) * (ry[i] - mean);
    sxx += (rx[i] - mean) * (rx[i] - mean);
    syy += (ry[i] - mean) * (ry[i] - mean);
  }
  if (sxx == 0 || syy == 0) return nan;
  return sxy / std::sqrt(sxx * syy);
}

}  // namespace april::sched
