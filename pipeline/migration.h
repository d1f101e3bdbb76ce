// Moving a layer between neighbouring pipeline stages over the pipeline communicator: the
// sender packs the layer's MigrationTensors (values, gradients, Adam moments, step — NOTE
// [layer migration] in core/gpt_model.h) into three messages (sizes, names, one fp32
// payload), the receiver unpacks them into a shell of the same layer. Values travel as
// their exact fp32 bits, so a moved layer continues bit-identically.
//
// Not thread-safe; both ends call in the same order as the plan.
#pragma once

#include "absl/status/status.h"
#include "core/unit.h"
#include "parallel/communicator.h"

namespace fulcrum::pipeline {

/// Sends `unit`'s migration state to rank `dst` of `pp` and waits for the send.
absl::Status SendUnit(parallel::Communicator& pp, int dst, const Unit& unit);

/// Receives a unit's state from rank `src` into `shell` (built for the same unit).
absl::Status ReceiveUnit(parallel::Communicator& pp, int src, Unit& shell);

}  // namespace fulcrum::pipeline
