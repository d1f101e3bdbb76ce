// Moving a layer between neighbouring pipeline stages over the pipeline communicator: the
// sender packs the layer's MigrationTensors (values, gradients, Adam moments, step — NOTE
// [layer migration] in core/gpt_model.h) into three messages (sizes, names, one payload,
// fp32 or — for fp64 parameters — fp64), the receiver unpacks them into a shell of the
// same layer. Values travel as their exact bits, so a moved layer continues bit-identically.
//
// Both ends may split their half in two, so a migration can overlap other work (NOTE
// [early migration] in pipeline/stage_executor.h): StartSendUnit packs and posts the sends
// and returns at once; StartReceiveUnit posts the receive of the fixed-size first message
// early, and UnitReceive::Finish receives the rest. Gloo and NCCL move the bytes only once
// both ends have posted, so the bulk of a transfer starts when the receiver calls Finish.
//
// Each unit's three messages travel under tags of their own (UnitTag), so several units may
// be in flight between one pair of ranks at once, in any order.
//
// Not thread-safe.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/unit.h"
#include "parallel/communicator.h"

namespace fulcrum::pipeline {

/// The first of the three message tags of a transfer of the unit of transformer layer
/// `layer` (-1: any other unit): apart from each other and from the executor's
/// micro-batch tags (2·mb, 2·mb+1).
int UnitTag(int64_t layer);

/// A unit's state on its way out: the posted sends and the buffers they read.
class UnitSend {
 public:
  UnitSend() = default;
  UnitSend(UnitSend&&) = default;
  UnitSend& operator=(UnitSend&&) = default;
  /// Blocks until the transport is done with every message (bounded by the communicator's
  /// timeout; communication failures throw parallel::CommError).
  void Wait();
  /// Bytes of the three messages.
  int64_t bytes() const { return bytes_; }

 private:
  friend absl::StatusOr<UnitSend> StartSendUnit(parallel::Communicator&, int, const Unit&, int);
  std::vector<at::Tensor> buffers_;
  std::vector<std::unique_ptr<parallel::CommWork>> works_;
  int64_t bytes_ = 0;
};

/// Packs `unit`'s migration state and posts its sends to rank `dst` of `pp` under tags
/// `tag`, `tag`+1, `tag`+2 (UnitTag); the unit may be destroyed as soon as this returns (the
/// messages are copies).
absl::StatusOr<UnitSend> StartSendUnit(parallel::Communicator& pp, int dst, const Unit& unit,
                                       int tag = UnitTag(-1));

/// A unit's state on its way in, from the moment its first message's receive is posted.
class UnitReceive {
 public:
  UnitReceive(UnitReceive&&) = default;
  UnitReceive& operator=(UnitReceive&&) = default;
  /// Receives the rest and loads it into `shell` (built for the same unit). DataLoss when a
  /// tensor does not belong to the shell.
  absl::Status Finish(Unit& shell);
  /// Bytes received (after Finish).
  int64_t bytes() const { return bytes_; }

 private:
  friend UnitReceive StartReceiveUnit(parallel::Communicator&, int, int);
  UnitReceive(parallel::Communicator* pp, int src, int tag);
  parallel::Communicator* pp_;
  int src_;
  int tag_;
  at::Tensor header_;
  std::unique_ptr<parallel::CommWork> header_work_;
  int64_t bytes_ = 0;
};

/// Posts the receive of a unit's first message from rank `src` of `pp`, sent under `tag`;
/// `pp` must outlive the result.
UnitReceive StartReceiveUnit(parallel::Communicator& pp, int src, int tag = UnitTag(-1));

/// Sends `unit`'s migration state to rank `dst` of `pp` and waits for the send.
absl::Status SendUnit(parallel::Communicator& pp, int dst, const Unit& unit,
                      int tag = UnitTag(-1));

/// Receives a unit's state from rank `src` into `shell` (built for the same unit).
absl::Status ReceiveUnit(parallel::Communicator& pp, int src, Unit& shell, int tag = UnitTag(-1));

}  // namespace fulcrum::pipeline
