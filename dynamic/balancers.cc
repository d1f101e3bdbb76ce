// The balancer registry; see balancers.h. The registrations live in this file, next to
// MakeRebalancer, so that they survive static linking.
#include "dynamic/balancers.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum::dynamic {
namespace {

absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> MakeNone(const BalancerOptions&) {
  return std::make_unique<pipeline::NoOpRebalancer>();
}

// A BalancingRebalancer running `algorithm`.
RebalancerFactory Balancing(const char* algorithm) {
  return
      [algorithm](
          const BalancerOptions& options) -> absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> {
        BalancerOptions named = options;
        named.algorithm = algorithm;
        absl::StatusOr<std::unique_ptr<BalancingRebalancer>> made =
            BalancingRebalancer::Create(std::move(named));
        if (!made.ok()) return made.status();
        return std::unique_ptr<pipeline::Rebalancer>(std::move(*made));
      };
}

}  // namespace

FULCRUM_REGISTER(RebalancerFactory, none, "never move a layer: the static (even) placement",
                 MakeNone);
FULCRUM_REGISTER(RebalancerFactory, partition,
                 "exact contiguous partition minimising the slowest stage (fewest moves among "
                 "the optima), within --rebalance_memory_budget_mb",
                 Balancing("partition"));
FULCRUM_REGISTER(RebalancerFactory, diffusion,
                 "neighbouring stages pass boundary layers from the heavier to the lighter "
                 "while Σ|L_u − L_v| falls (DynMo §3.3), up to --diffusion_max_rounds rounds",
                 Balancing("diffusion"));

absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> MakeRebalancer(
    const std::string& name, const BalancerOptions& options) {
  const BalancerRegistry::Entry* entry = BalancerRegistry::Global().Find(name);
  if (entry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rebalancer=", name, " is not a known balancer; known: ", BalancerNames()));
  }
  return entry->value(options);
}

std::string BalancerNames() { return BalancerRegistry::Global().Names(); }

std::string BalancerHelp() {
  size_t width = 0;
  for (const BalancerRegistry::Entry* entry : BalancerRegistry::Global().List()) {
    width = std::max(width, entry->name.size());
  }
  std::string out;
  for (const BalancerRegistry::Entry* entry : BalancerRegistry::Global().List()) {
    absl::StrAppendFormat(&out, "  %-*s  %s\n", static_cast<int>(width), entry->name, entry->help);
  }
  return out;
}

}  // namespace fulcrum::dynamic
