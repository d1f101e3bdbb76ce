// The balancer registry: what --rebalancer names (DESIGN.md "Dynamic load balancing").
//
//   none       never move (the static placement)
//   partition  BalancingRebalancer with PartitionBalance (exact; partition.h)
//   diffusion  BalancingRebalancer with DiffusionBalance (neighbour exchanges; diffusion.h)
//
// The registrations live in balancers.cc, next to MakeRebalancer, so that any user of
// MakeRebalancer links that translation unit and with it the registrations (a static
// library drops unreferenced objects). Registering a name twice aborts at start-up.
//
// Thread-safety: Registry's (core/registry.h).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/registry.h"
#include "dynamic/balancing_rebalancer.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

/// Builds a rebalancer from the balancing options; registered by name. Errors: the
/// options' InvalidArgument.
using RebalancerFactory =
    std::function<absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>>(const BalancerOptions&)>;
using BalancerRegistry = Registry<RebalancerFactory>;

/// The rebalancer registered as `name` (--rebalancer), built from `options` (whose
/// `algorithm` is ignored: `name` says it). InvalidArgument listing the balancers for an
/// unknown name, or naming the flag of a bad option.
absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> MakeRebalancer(
    const std::string& name, const BalancerOptions& options);

/// "diffusion, none, partition" (for error messages).
std::string BalancerNames();

/// One line per balancer, "  name       help", names aligned, for --help.
std::string BalancerHelp();

}  // namespace fulcrum::dynamic
