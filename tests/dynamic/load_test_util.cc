#include "tests/dynamic/load_test_util.h"

namespace fulcrum::dynamic::balance_testing {

std::vector<pipeline::StageLoad> MakeLoads(const Placement& now, const Placement& ran_on,
                                           const SyntheticTimes& times) {
  const int num_stages = static_cast<int>(now.size());
  std::vector<pipeline::StageLoad> loads(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    pipeline::StageLoad& load = loads[s];
    load.stage = s;
    load.layer_begin = now[s].begin;
    load.layer_end = now[s].end;
    load.peak_in_flight = 1;
    for (int64_t l = now[s].begin; l < now[s].end; ++l) {
      load.layer_forward_ms.push_back(0.25 * times.layer_ms[l]);
      load.layer_backward_ms.push_back(0.5 * times.layer_ms[l]);
      load.layer_weight_ms.push_back(0.25 * times.layer_ms[l]);
    }
    for (int64_t l = ran_on[s].begin; l < ran_on[s].end; ++l) {
      load.forward_ms += 0.25 * times.layer_ms[l];
      load.backward_ms += 0.5 * times.layer_ms[l];
      load.weight_ms += 0.25 * times.layer_ms[l];
    }
    if (s == 0) load.forward_ms += times.first_ms;
    if (s == num_stages - 1) load.forward_ms += times.last_ms;
    load.total_ms = load.forward_ms + load.backward_ms + load.weight_ms;
  }
  return loads;
}

std::vector<pipeline::StageLoad> MakeLoads(const Placement& now, const SyntheticTimes& times) {
  return MakeLoads(now, now, times);
}

std::vector<pipeline::StageLoad> UnmeasuredLoads(const Placement& now) {
  std::vector<pipeline::StageLoad> loads(now.size());
  for (size_t s = 0; s < now.size(); ++s) {
    loads[s].stage = static_cast<int>(s);
    loads[s].layer_begin = now[s].begin;
    loads[s].layer_end = now[s].end;
    loads[s].peak_in_flight = 1;
    const int64_t n = now[s].size();
    loads[s].layer_forward_ms.assign(n, 0.0);
    loads[s].layer_backward_ms.assign(n, 0.0);
    loads[s].layer_weight_ms.assign(n, 0.0);
  }
  return loads;
}

}  // namespace fulcrum::dynamic::balance_testing
