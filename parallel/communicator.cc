// Argument checks and error wording shared by the communicator backends.
#include "parallel/communicator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "parallel/internal/communicator_util.h"

namespace fulcrum::parallel::internal {
namespace {

// Past this many members a rank list in an error message is shortened: a 512-rank "dp"
// group would otherwise drown the line.
constexpr size_t kMaxListedRanks = 16;

[[noreturn]] void Fail(const char* op, const std::string& group, const std::string& detail) {
  throw CommError(absl::StrCat(op, " on ", group, ": ", detail));
}

}  // namespace

std::string ExceptionMessage(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

std::string DescribeGroup(const std::string& name, const std::vector<int>& global_ranks) {
  if (global_ranks.size() <= kMaxListedRanks) {
    return absl::StrCat("'", name, "' (ranks ", absl::StrJoin(global_ranks, ","), ")");
  }
  std::vector<int> head(global_ranks.begin(), global_ranks.begin() + kMaxListedRanks - 1);
  return absl::StrCat("'", name, "' (ranks ", absl::StrJoin(head, ","), ",...,",
                      global_ranks.back(), " (", global_ranks.size(), " ranks))");
}

std::string DescribePeer(int rank, const std::vector<int>& global_ranks) {
  if (rank >= 0 && rank < static_cast<int>(global_ranks.size())) {
    return absl::StrCat("rank ", rank, " (world rank ", global_ranks[rank], ")");
  }
  return absl::StrCat("rank ", rank);
}

void CheckTensor(const at::Tensor& tensor, const char* op, const std::string& group,
                 const char* what, TensorPlace place) {
  if (!tensor.defined()) Fail(op, group, absl::StrCat(what, " is an undefined tensor"));
  switch (tensor.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
      break;
    default:
      Fail(op, group,
           absl::StrCat(what, " has dtype ", c10::toString(tensor.scalar_type()),
                        "; expected float32/64, bfloat16, float16, int32, int64 or uint8"));
  }
  const bool on_cuda = tensor.device().is_cuda();
  if (place == TensorPlace::kCpu && !tensor.device().is_cpu()) {
    Fail(op, group,
         absl::StrCat(what, " is on ", tensor.device().str(),
                      "; the gloo backend takes CPU tensors"));
  }
  if (place == TensorPlace::kCuda && !on_cuda) {
    Fail(op, group,
         absl::StrCat(what, " is on ", tensor.device().str(),
                      "; the nccl backend takes CUDA tensors"));
  }
  if (!tensor.is_contiguous()) {
    Fail(op, group, absl::StrCat(what, " is not contiguous; call .contiguous() first"));
  }
}

void CheckHasRows(const at::Tensor& tensor, const char* op, const std::string& group) {
  if (tensor.dim() == 0) Fail(op, group, "input is 0-dimensional; rows are along dimension 0");
}

void CheckDivisible(int64_t dim0, int parts, const char* op, const std::string& group) {
  if (dim0 % parts != 0) {
    Fail(op, group,
         absl::StrCat("dimension 0 has ", dim0, " rows, not divisible by the ", parts, " members"));
  }
}

void CheckPeer(int peer, int size, const char* op, const std::string& group) {
  if (peer < 0 || peer >= size) {
    Fail(op, group, absl::StrCat("peer rank ", peer, " is outside [0, ", size, ")"));
  }
}

void CheckSplit(const std::vector<int>& ranks, const std::string& name, int my_rank, int size,
                const std::string& group) {
  if (name.empty()) Fail("split", group, "the new communicator needs a non-empty name");
  if (ranks.empty()) Fail("split", group, absl::StrCat("'", name, "': no ranks given"));
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size) {
      Fail("split", group,
           absl::StrCat("'", name, "': rank ", ranks[i], " is outside [0, ", size, ")"));
    }
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      Fail("split", group,
           absl::StrCat("'", name, "': ranks must be ascending without duplicates, got ",
                        absl::StrJoin(ranks, ",")));
    }
  }
  if (!std::binary_search(ranks.begin(), ranks.end(), my_rank)) {
    Fail("split", group,
         absl::StrCat("'", name, "': rank ", my_rank, " is not among the ranks ",
                      absl::StrJoin(ranks, ","), " (only members call Split)"));
  }
}

absl::Status CheckWorldArguments(const char* backend, bool has_store, int rank, int size,
                                 std::chrono::milliseconds timeout) {
  if (!has_store) return absl::InvalidArgumentError(absl::StrCat(backend, ": the store is null"));
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(backend, ": rank ", rank, " is outside a world of ", size, " processes"));
  }
  if (timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(backend, ": timeout must be positive, got ", timeout.count(), " ms"));
  }
  return absl::OkStatus();
}

AllToAllRows ResolveAllToAllRows(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                                 const std::vector<int64_t>& output_splits, int size,
                                 const std::string& group) {
  constexpr const char* kOp = "all_to_all";
  if (input.dim() == 0) Fail(kOp, group, "input is 0-dimensional; rows are split along dim 0");
  const int64_t rows = input.size(0);
  auto check = [&](const std::vector<int64_t>& splits, const char* which) {
    if (static_cast<int>(splits.size()) != size) {
      Fail(kOp, group,
           absl::StrCat(which, " has ", splits.size(), " entries; expected one per member (", size,
                        ") or none for equal splits"));
    }
    for (size_t j = 0; j < splits.size(); ++j) {
      if (splits[j] < 0) {
        Fail(kOp, group, absl::StrCat(which, "[", j, "] is negative (", splits[j], ")"));
      }
    }
  };
  AllToAllRows result;
  if (input_splits.empty() || output_splits.empty()) CheckDivisible(rows, size, kOp, group);
  if (input_splits.empty()) {
    result.send.assign(size, rows / size);
  } else {
    check(input_splits, "input_splits");
    const int64_t total = std::accumulate(input_splits.begin(), input_splits.end(), int64_t{0});
    if (total != rows) {
      Fail(kOp, group,
           absl::StrCat("input_splits add up to ", total, " rows but input has ", rows));
    }
    result.send = input_splits;
  }
  if (output_splits.empty()) {
    result.recv.assign(size, rows / size);
  } else {
    check(output_splits, "output_splits");
    result.recv = output_splits;
  }
  result.recv_total = std::accumulate(result.recv.begin(), result.recv.end(), int64_t{0});
  return result;
}

std::string SplitKey(const std::string& parent_key, const std::string& name,
                     const std::vector<int>& member_global_ranks, int generation) {
  return absl::StrCat(parent_key, "/", name, "[", absl::StrJoin(member_global_ranks, ","), "]#",
                      generation);
}

SplitPlan PlanSplit(const std::string& parent_key, const std::string& name,
                    const std::vector<int>& ranks, const std::vector<int>& global_ranks,
                    int my_rank, std::map<std::string, int>& generations) {
  SplitPlan plan;
  plan.member_globals.reserve(ranks.size());
  for (int r : ranks) plan.member_globals.push_back(global_ranks[r]);
  const int generation = generations[SplitKey(parent_key, name, plan.member_globals, 0)]++;
  plan.key = SplitKey(parent_key, name, plan.member_globals, generation);
  plan.new_rank =
      static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), my_rank) - ranks.begin());
  plan.sub_group = DescribeGroup(name, plan.member_globals);
  return plan;
}

}  // namespace fulcrum::parallel::internal

namespace fulcrum::parallel {

namespace {
class DoneWork final : public CommWork {
 public:
  void Wait() override {}
};
}  // namespace

std::unique_ptr<CommWork> Communicator::IAllReduce(at::Tensor& tensor, ReduceOp op) {
  AllReduce(tensor, op);
  return std::make_unique<DoneWork>();
}

PendingTensor Communicator::IReduceScatter(const at::Tensor& input, ReduceOp op) {
  return PendingTensor{ReduceScatter(input, op), std::make_unique<DoneWork>()};
}

PendingTensor Communicator::IAllToAll(const at::Tensor& input,
                                      const std::vector<int64_t>& input_splits,
                                      const std::vector<int64_t>& output_splits) {
  return PendingTensor{AllToAll(input, input_splits, output_splits), std::make_unique<DoneWork>()};
}

}  // namespace fulcrum::parallel
