// Argument checks and error wording shared by the communicator backends (Gloo, NCCL), so
// both reject the same mistakes with the same messages. Internal to parallel/.
//
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fulcrum::parallel::internal {

/// The message of an exception thrown by c10d, c10 or Gloo, without c10's backtrace.
std::string ExceptionMessage(const std::exception& e);

/// "'dp' (ranks 0,2)": the communicator as errors name it, with world ranks. Long rank lists
/// are shortened ("ranks 0,1,2,...,63 (64 ranks)").
std::string DescribeGroup(const std::string& name, const std::vector<int>& global_ranks);

/// "rank 1 (world rank 3)": a member as errors name it.
std::string DescribePeer(int rank, const std::vector<int>& global_ranks);

/// Where a tensor argument must live.
enum class TensorPlace { kCpu, kCuda };

/// Throws CommError("<op> on <group>: <what> ...") unless `tensor` is defined, contiguous,
/// of a supported dtype (float32/64, bfloat16, float16, int32, int64, uint8) and at `place`.
/// `what` names the argument ("tensor", "input").
void CheckTensor(const at::Tensor& tensor, const char* op, const std::string& group,
                 const char* what, TensorPlace place);

/// Throws CommError unless `tensor` has a dimension 0 for the rows a collective splits or
/// gathers along.
void CheckHasRows(const at::Tensor& tensor, const char* op, const std::string& group);

/// Throws CommError unless `dim0` rows split into `parts` equal chunks.
void CheckDivisible(int64_t dim0, int parts, const char* op, const std::string& group);

/// Throws CommError unless `peer` is a rank of a communicator of `size` members.
void CheckPeer(int peer, int size, const char* op, const std::string& group);

/// Throws CommError unless `ranks` is ascending, within [0, size), without duplicates, and
/// contains `my_rank` (the contract of Communicator::Split), and `name` is non-empty.
void CheckSplit(const std::vector<int>& ranks, const std::string& name, int my_rank, int size,
                const std::string& group);

/// The arguments every backend's world communicator is created from: InvalidArgument,
/// prefixed with `backend` ("gloo", "nccl"), unless there is a store, `rank` is in
/// [0, size) and `timeout` is positive.
absl::Status CheckWorldArguments(const char* backend, bool has_store, int rank, int size,
                                 std::chrono::milliseconds timeout);

/// Rows exchanged by an all_to_all, one entry per rank, resolved from the caller's split
/// vectors (empty = equal splits) and checked against `input`.
struct AllToAllRows {
  std::vector<int64_t> send;  // Rows sent to rank j.
  std::vector<int64_t> recv;  // Rows received from rank j.
  int64_t recv_total = 0;     // Rows of the output.
};

/// Resolves and checks the split vectors of Communicator::AllToAll. An empty vector means
/// equal splits: input.size(0) / size rows to (or from) every rank, so an empty
/// `output_splits` assumes every rank sends here as many rows as this rank sends to each.
/// Throws CommError naming the bad vector and what was expected.
AllToAllRows ResolveAllToAllRows(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                                 const std::vector<int64_t>& output_splits, int size,
                                 const std::string& group);

/// Key (within a store) under which the members of a split find each other: unique for the
/// (parent, name, member world ranks) triple and for the n-th split with that triple, so
/// non-members never take part and repeated splits never collide.
/// NOTE [split keys]: both backends build their sub-communicator rendezvous under this key.
std::string SplitKey(const std::string& parent_key, const std::string& name,
                     const std::vector<int>& member_global_ranks, int generation);

/// What a member needs to build the sub-communicator of a Split, computed the same way by
/// both backends (NOTE [split keys]).
struct SplitPlan {
  std::vector<int> member_globals;  // World rank of each member, by new rank.
  std::string key;                  // SplitKey of this (parent, name, members, generation).
  int new_rank = 0;                 // This rank's rank in the sub-communicator.
  std::string sub_group;            // DescribeGroup of the sub-communicator, for errors.
};

/// Plans a Split of ranks `ranks` (ascending, `my_rank` among them) of a communicator whose
/// members are `global_ranks` and whose key is `parent_key`. `generations` counts earlier
/// splits with the same (name, members): members call Split in the same order, so counting
/// repeats locally gives every member the same generation without talking to anyone.
SplitPlan PlanSplit(const std::string& parent_key, const std::string& name,
                    const std::vector<int>& ranks, const std::vector<int>& global_ranks,
                    int my_rank, std::map<std::string, int>& generations);

}  // namespace fulcrum::parallel::internal
