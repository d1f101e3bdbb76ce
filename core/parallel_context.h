// What the training loop needs from the parallel layout. core/ knows no communicators: the
// implementation over process groups lives in parallel/ (parallel/parallel_context.h) and is
// injected into the Trainer. A null ParallelContext* means one process.
//
// Not thread-safe; every method except the accessors is collective over the group it names.
#pragma once

#include <string>
#include <vector>

#include "core/tensor_parallel.h"
#include "core/unit.h"

namespace fulcrum {

class ParallelContext {
 public:
  virtual ~ParallelContext() = default;

  virtual int world_rank() const = 0;
  virtual int world_size() const = 0;
  virtual int tp_size() const = 0;
  virtual int pp_size() const = 0;
  virtual int ep_size() const = 0;
  virtual int dp_rank() const = 0;
  virtual int dp_size() const = 0;

  /// The tensor-parallel group the model shards over; null when tp == 1.
  virtual TensorParallelGroup* tensor_parallel() = 0;

  /// Sums every defined gradient of `units` over the data-parallel group, in place.
  virtual void AllReduceGradients(const std::vector<Unit*>& units) = 0;
  /// Sums each value over the data-parallel group, in place.
  virtual void SumOverDataParallel(std::vector<double>& values) = 0;
  /// Sums each value over the ranks that hold different parts of one model replica
  /// (tensor × pipeline parallel), in place.
  virtual void SumOverModelParallel(std::vector<double>& values) = 0;
  /// Waits for every rank of the job.
  virtual void Barrier() = 0;

  /// Whether this rank logs iterations and writes the metrics file (one rank per job).
  virtual bool is_logging_rank() const = 0;
  /// Whether this rank writes a checkpoint shard (one rank per part of the model).
  virtual bool writes_checkpoint_shard() const = 0;
  /// Whether this rank commits checkpoints (one rank per job).
  virtual bool commits_checkpoint() const = 0;
  /// Name of this rank's checkpoint shard file, unique among writers.
  virtual std::string checkpoint_shard_name() const = 0;
};

}  // namespace fulcrum
