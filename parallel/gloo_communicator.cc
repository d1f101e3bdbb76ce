#include "parallel/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "parallel/internal/c10d_util.h"
#include "parallel/internal/communicator_util.h"
#include "parallel/internal/tcp_store.h"

namespace fulcrum::parallel {
namespace {

using Clock = std::chrono::steady_clock;
using internal::TensorPlace;

// Fulcrum issues one collective at a time and waits for it, so one worker thread per
// process group suffices (c10d's default of two only adds idle threads, and every Split
// makes another group). Point-to-point operations do not use the workers.
constexpr int kGlooThreads = 1;

// Gloo enforces the same timeout inside its own operations and reports it with more
// detail ("Timed out waiting 3000ms for recv operation to complete", or the peer address
// that closed the connection) than c10d's wait does ("Operation timed out!"); waiting a
// little longer than the timeout lets that message arrive first.
constexpr std::chrono::milliseconds kWaitGrace{250};
// How long a finished collective waits for c10d's worker to let go of its work (NOTE
// [collective tensors freed here]).
constexpr std::chrono::milliseconds kReleaseWait{20};

// Tags of the point-to-point steps inside collectives (NOTE [ring reduce-scatter]): far
// above the pipeline's tags, which count from 0, so no user send on the same group can
// match one of them.
constexpr int kRingTag = 1 << 20;
constexpr int kRingSegmentsPerStep = 256;
constexpr int64_t kRingSegmentBytes = 4 << 20;

// After a collective fails, how long the members are given to report in (see
// ProbeSilentMembers): long enough for live processes that failed at the same moment, short
// enough not to matter next to the timeout that usually came before.
constexpr std::chrono::milliseconds kProbeWindow{1000};

// The bound on each store call of the probe. A stopped (SIGSTOP) or hung store host accepts
// connections and requests but never answers; without this bound the probe would wait the
// whole store timeout again after the collective's, doubling the time a job takes to end.
constexpr std::chrono::milliseconds kProbeCallTimeout{2000};

// Gloo has no bfloat16; moving data only needs a 16-bit type it knows, and float16 words
// go through untouched (Gloo copies them, it never does arithmetic on moved data).
at::Tensor Movable(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kBFloat16 ? tensor.view(at::kHalf) : tensor;
}

void IgnoreSigpipe() {
  // A write to a socket whose peer died raises SIGPIPE, which kills the process by
  // default; Gloo's TCP transport reports the failed write itself, so ignoring the
  // signal turns a silent death into a CommError. Python does the same at start-up.
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

// The failure state shared by a communicator and its pending point-to-point handles: the
// first failure poisons both.
struct Health {
  std::string first_error;  // Empty while healthy.
};

class GlooWork final : public CommWork {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::string what, std::chrono::milliseconds timeout,
           std::shared_ptr<Health> health)
      : work_(std::move(work)),
        what_(std::move(what)),
        timeout_(timeout),
        health_(std::move(health)) {}

  ~GlooWork() override {
    // Destroying an unfinished Gloo send or recv frees the buffer the transport may still
    // write; waiting (bounded by the timeout) keeps that memory valid. Once the
    // communicator has failed, later works would each wait out the timeout for nothing
    // (c10d's work holds its own references to the tensors): skip them.
    if (!done_ && health_->first_error.empty()) {
      try {
        Wait();
      } catch (const std::exception& e) {
        FULCRUM_LOG(WARNING) << "dropping an unwaited operation that failed: " << e.what();
      }
    }
  }

  void Wait() override {
    if (done_) {
      if (!error_.empty()) throw CommError(error_);
      return;
    }
    done_ = true;
    const auto start = Clock::now();
    try {
      work_->wait(timeout_);
      return;
    } catch (const std::exception& e) {
      std::string cause = internal::ExceptionMessage(e);
      if (Clock::now() - start >= timeout_) {
        cause = absl::StrCat("timed out after ", timeout_.count(), " ms (", cause, ")");
      }
      error_ = absl::StrCat(what_, ": ", cause);
    }
    if (health_->first_error.empty()) health_->first_error = error_;
    throw CommError(error_);
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;  // "send on 'pp' (ranks 0,1) to rank 1 (world rank 1), tag 3"
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Health> health_;
  bool done_ = false;
  std::string error_;
};

// A non-blocking operation on a float32 copy of a bfloat16 tensor (Gloo has no bfloat16
// arithmetic): Wait() rounds the result into the caller's tensor, once.
class StagedBFloat16Work final : public CommWork {
 public:
  StagedBFloat16Work(std::unique_ptr<CommWork> inner, at::Tensor staged, at::Tensor target)
      : inner_(std::move(inner)), staged_(std::move(staged)), target_(std::move(target)) {}

  void Wait() override {
    if (inner_ == nullptr) return;
    inner_->Wait();
    target_.copy_(staged_);
    inner_.reset();
  }

 private:
  std::unique_ptr<CommWork> inner_;
  at::Tensor staged_;
  at::Tensor target_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> root_store, internal::GlooDevice device,
                   c10::intrusive_ptr<c10d::ProcessGroupGloo> group, int rank,
                   std::vector<int> global_ranks, std::string name, std::string key,
                   std::chrono::milliseconds timeout)
      : root_store_(std::move(root_store)),
        device_(std::move(device)),
        pg_(std::move(group)),
        rank_(rank),
        global_ranks_(std::move(global_ranks)),
        name_(std::move(name)),
        key_(std::move(key)),
        timeout_(timeout),
        group_(internal::DescribeGroup(name_, global_ranks_)),
        health_(std::make_shared<Health>()) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "gloo"; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void AllReduce(at::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    CheckUsable(kOp);
    internal::CheckTensor(tensor, kOp, group_, "tensor", TensorPlace::kCpu);
    // bfloat16 is reduced in float32 (Gloo has no bfloat16 arithmetic); the result is
    // rounded once, at the end, which is also more accurate than summing in bfloat16.
    const bool staged = tensor.scalar_type() == at::kBFloat16;
    at::Tensor target = staged ? tensor.to(at::kFloat) : tensor;
    Run(kOp, [&] {
      std::vector<at::Tensor> tensors{target};
      c10d::AllreduceOptions options;
      options.reduceOp = internal::ToC10dReduceOp(op);
      return pg_->allreduce(tensors, options);
    });
    if (staged) tensor.copy_(target);
  }

  std::unique_ptr<CommWork> IAllReduce(at::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    CheckUsable(kOp);
    internal::CheckTensor(tensor, kOp, group_, "tensor", TensorPlace::kCpu);
    const bool staged = tensor.scalar_type() == at::kBFloat16;
    at::Tensor target = staged ? tensor.to(at::kFloat) : tensor;
    ++collective_sequence_;
    // The work holds the tensor until the transport is done with it.
    std::unique_ptr<CommWork> work =
        IssueNonBlocking(absl::StrCat("non-blocking all_reduce on ", group_), [&] {
          std::vector<at::Tensor> tensors{target};
          c10d::AllreduceOptions options;
          options.reduceOp = internal::ToC10dReduceOp(op);
          return pg_->allreduce(tensors, options);
        });
    if (!staged) return work;
    return std::make_unique<StagedBFloat16Work>(std::move(work), target, tensor);
  }

  at::Tensor AllGather(const at::Tensor& input) override {
    constexpr const char* kOp = "all_gather";
    CheckUsable(kOp);
    internal::CheckTensor(input, kOp, group_, "input", TensorPlace::kCpu);
    internal::CheckHasRows(input, kOp, group_);
    std::vector<int64_t> sizes = input.sizes().vec();
    const int64_t rows = sizes[0];
    sizes[0] *= size();
    at::Tensor output = at::empty(sizes, input.options());
    Run(kOp, [&] {
      // Chunk r of `output` receives rank r's rows: dim-0 slices of a contiguous tensor
      // are contiguous, so Gloo writes straight into place.
      std::vector<std::vector<at::Tensor>> outputs(1);
      at::Tensor movable_output = Movable(output);
      for (int r = 0; r < size(); ++r) {
        outputs[0].push_back(movable_output.narrow(0, r * rows, rows));
      }
      std::vector<at::Tensor> inputs{Movable(input)};
      return pg_->allgather(outputs, inputs);
    });
    return output;
  }

  PendingTensor IReduceScatter(const at::Tensor& input, ReduceOp op) override {
    constexpr const char* kOp = "reduce_scatter";
    CheckUsable(kOp);
    internal::CheckTensor(input, kOp, group_, "input", TensorPlace::kCpu);
    internal::CheckHasRows(input, kOp, group_);
    internal::CheckDivisible(input.size(0), size(), kOp, group_);
    // The ring (ReduceScatter) sends and adds on the calling thread; off it, c10d's worker
    // all-reduces a copy (the caller may reuse `input`), and this rank keeps its chunk.
    at::Tensor whole = input.clone(at::MemoryFormat::Contiguous);
    const int64_t rows = input.size(0) / size();
    std::unique_ptr<CommWork> work = IAllReduce(whole, op);
    return PendingTensor{whole.narrow(0, static_cast<int64_t>(rank_) * rows, rows), std::move(work)};
  }

  at::Tensor ReduceScatter(const at::Tensor& input, ReduceOp op) override {
    constexpr const char* kOp = "reduce_scatter";
    CheckUsable(kOp);
    internal::CheckTensor(input, kOp, group_, "input", TensorPlace::kCpu);
    internal::CheckHasRows(input, kOp, group_);
    internal::CheckDivisible(input.size(0), size(), kOp, group_);
    // NOTE [ring reduce-scatter]: n − 1 steps around the ring of the group's ranks. At step
    // s rank r sends its running sum of chunk (r − s − 1) mod n to rank r + 1 and adds what
    // rank r − 1 sent into chunk (r − s − 2) mod n; after the last step chunk r holds every
    // rank's contribution. Each rank sends (n − 1)/n of the input's bytes — half of what an
    // all_reduce of the whole input moves (2(n − 1)/n), which this replaced — and reduces
    // only what it receives. bfloat16 travels and adds in float32 (Gloo has no bfloat16
    // arithmetic; one rounding at the end, as AllReduce). For two ranks the sum is x_r +
    // x_other, the same bits as an all_reduce; for more the association differs. Measured
    // (fulcrum_bench_comm --ops=all_reduce,reduce_scatter, 2 ranks, this 2-core machine,
    // 2026-11-26): 4 MiB input 1.2–2.0 ms against all_reduce's 3.7–3.8, 16 MiB 5.1–5.9
    // against 13.3–13.6; at 64 MiB it is slower (53–58 against 44–45 ms): its two 32 MiB
    // buffers are new pages every call.
    const bool staged = input.scalar_type() == at::kBFloat16;
    const int n = size();
    const int64_t rows = input.size(0) / n;
    if (n == 1) return input.clone();
    // The input is read, never copied whole (a full-size copy per call cost more than the
    // messages on large inputs): step 0 sends a slice of it, and each step's sum goes into
    // one chunk-sized buffer that the next step sends and the last step returns.
    const at::Tensor source = staged ? input.to(at::kFloat) : input.contiguous();
    auto chunk = [&](int c) { return source.narrow(0, static_cast<int64_t>(c) * rows, rows); };
    at::Tensor incoming = at::empty_like(chunk(0));
    at::Tensor sum = at::empty_like(incoming);
    const int right = (rank_ + 1) % n;
    const int left = (rank_ + n - 1) % n;
    for (int s = 0; s + 1 < n; ++s) {
      const int send_chunk = ((rank_ - s - 1) % n + n) % n;
      const int recv_chunk = ((rank_ - s - 2) % n + n) % n;
      RunPair(kOp, s == 0 ? chunk(send_chunk) : sum, right, incoming, left, kRingTag + s);
      switch (op) {
        case ReduceOp::kSum: at::add_out(sum, chunk(recv_chunk), incoming); break;
        case ReduceOp::kMax: at::maximum_out(sum, chunk(recv_chunk), incoming); break;
        case ReduceOp::kMin: at::minimum_out(sum, chunk(recv_chunk), incoming); break;
      }
    }
    return staged ? sum.to(at::kBFloat16) : sum;
  }

  void Broadcast(at::Tensor& tensor, int root) override {
    constexpr const char* kOp = "broadcast";
    CheckUsable(kOp);
    internal::CheckTensor(tensor, kOp, group_, "tensor", TensorPlace::kCpu);
    internal::CheckPeer(root, size(), kOp, group_);
    Run(kOp, [&] {
      std::vector<at::Tensor> tensors{Movable(tensor)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      return pg_->broadcast(tensors, options);
    });
  }

  at::Tensor AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits) override {
    internal::AllToAllRows rows;
    at::Tensor output = PrepareAllToAll(input, input_splits, output_splits, &rows);
    Run("all_to_all", [&] { return IssueAllToAll(output, input, rows); });
    return output;
  }

  PendingTensor IAllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                          const std::vector<int64_t>& output_splits) override {
    internal::AllToAllRows rows;
    at::Tensor output = PrepareAllToAll(input, input_splits, output_splits, &rows);
    ++collective_sequence_;
    // The work holds both tensors until the transport is done with them.
    return PendingTensor{output, IssueNonBlocking(absl::StrCat("non-blocking all_to_all on ", group_),
                                                  [&] { return IssueAllToAll(output, input, rows); })};
  }

  std::unique_ptr<CommWork> ISend(const at::Tensor& tensor, int dst, int tag) override {
    constexpr const char* kOp = "send";
    CheckUsable(kOp);
    internal::CheckTensor(tensor, kOp, group_, "tensor", TensorPlace::kCpu);
    internal::CheckPeer(dst, size(), kOp, group_);
    const std::string what = absl::StrCat(
        kOp, " on ", group_, " to ", internal::DescribePeer(dst, global_ranks_), ", tag ", tag);
    // The work keeps a reference to the tensor until the transport is done with it.
    return IssueNonBlocking(what, [&] {
      std::vector<at::Tensor> tensors{tensor};
      return pg_->send(tensors, dst, tag);
    });
  }

  std::unique_ptr<CommWork> IRecv(at::Tensor& tensor, int src, int tag) override {
    constexpr const char* kOp = "recv";
    CheckUsable(kOp);
    internal::CheckTensor(tensor, kOp, group_, "tensor", TensorPlace::kCpu);
    internal::CheckPeer(src, size(), kOp, group_);
    const std::string what = absl::StrCat(
        kOp, " on ", group_, " from ", internal::DescribePeer(src, global_ranks_), ", tag ", tag);
    return IssueNonBlocking(what, [&] {
      std::vector<at::Tensor> tensors{tensor};
      return pg_->recv(tensors, src, tag);
    });
  }

  void Barrier() override {
    constexpr const char* kOp = "barrier";
    CheckUsable(kOp);
    Run(kOp, [&] { return pg_->barrier(); });
  }

  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override {
    constexpr const char* kOp = "split";
    CheckUsable(kOp);
    internal::CheckSplit(ranks, name, rank_, size(), group_);
    internal::SplitPlan plan =
        internal::PlanSplit(key_, name, ranks, global_ranks_, rank_, split_generations_);
    const std::string& key = plan.key;
    const int new_rank = plan.new_rank;
    const std::string& sub_group = plan.sub_group;
    const auto start = Clock::now();
    try {
      auto group = internal::MakeGlooProcessGroup(internal::MakePrefixStore(key, root_store_),
                                                  new_rank, static_cast<int>(ranks.size()),
                                                  timeout_, device_, kGlooThreads);
      return std::make_unique<GlooCommunicator>(root_store_, device_, std::move(group), new_rank,
                                                std::move(plan.member_globals), name, key, timeout_);
    } catch (const std::exception& e) {
      std::string cause = internal::ExceptionMessage(e);
      if (Clock::now() - start >= timeout_) {
        cause = absl::StrCat("not every member called Split within ", timeout_.count(), " ms (",
                             cause, ")");
      }
      // A half-built group leaves no state behind in this communicator, so it stays usable.
      throw CommError(absl::StrCat("split of ", group_, " into ", sub_group, ": ", cause));
    }
  }

 private:
  void CheckUsable(const char* op) const {
    if (!health_->first_error.empty()) {
      throw CommError(absl::StrCat(op, " on ", group_,
                                   ": unusable after an earlier failure: ", health_->first_error));
    }
  }

  [[noreturn]] void Fail(const std::string& message) {
    if (health_->first_error.empty()) health_->first_error = message;
    throw CommError(message);
  }

  // Issues a collective and waits for it; any failure becomes a CommError that names the
  // operation, this communicator and the members that did not report the failure too.
  // Checks an all-to-all's arguments (CheckUsable included), resolves its row splits into
  // *rows and allocates its output.
  at::Tensor PrepareAllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                             const std::vector<int64_t>& output_splits, internal::AllToAllRows* rows) {
    constexpr const char* kOp = "all_to_all";
    CheckUsable(kOp);
    internal::CheckTensor(input, kOp, group_, "input", TensorPlace::kCpu);
    *rows = internal::ResolveAllToAllRows(input, input_splits, output_splits, size(), group_);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] = rows->recv_total;
    return at::empty(sizes, input.options());
  }

  c10::intrusive_ptr<c10d::Work> IssueAllToAll(at::Tensor& output, const at::Tensor& input,
                                               const internal::AllToAllRows& rows) {
    at::Tensor movable_output = Movable(output);
    at::Tensor movable_input = Movable(input);
    // c10d counts in rows of dimension 0, as Fulcrum does.
    std::vector<int64_t> recv = rows.recv;
    std::vector<int64_t> send = rows.send;
    return pg_->alltoall_base(movable_output, movable_input, recv, send);
  }

  // Issues a non-blocking operation described by `what`: a failure to issue fails the
  // communicator (as Run does); otherwise the work, waited for with the group's timeout.
  template <typename Issue>
  std::unique_ptr<CommWork> IssueNonBlocking(const std::string& what, Issue&& issue) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = issue();
    } catch (const std::exception& e) {
      Fail(absl::StrCat(what, ": ", internal::ExceptionMessage(e)));
    }
    return std::make_unique<GlooWork>(std::move(work), what, timeout_, health_);
  }

  // One step of a collective built from point-to-point messages: sends `out` to `dst` and
  // receives `in` from `src` under `tag`, all in flight at once. Large messages go as several
  // segments: one message per step ran at a quarter of all_reduce's bytes per second on two
  // local ranks.
  void RunPair(const char* op, const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
    RunAll(op, [&] {
      const int64_t numel = out.numel();
      const int64_t per = std::max<int64_t>(1, kRingSegmentBytes / out.element_size());
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      at::Tensor flat_out = out.view({-1});
      at::Tensor flat_in = in.view({-1});
      for (int64_t begin = 0, k = 0; begin < numel; begin += per, ++k) {
        std::vector<at::Tensor> ins{flat_in.narrow(0, begin, std::min(per, numel - begin))};
        works.push_back(pg_->recv(ins, src, tag * kRingSegmentsPerStep + static_cast<int>(k)));
      }
      for (int64_t begin = 0, k = 0; begin < numel; begin += per, ++k) {
        std::vector<at::Tensor> outs{flat_out.narrow(0, begin, std::min(per, numel - begin))};
        works.push_back(pg_->send(outs, dst, tag * kRingSegmentsPerStep + static_cast<int>(k)));
      }
      return works;
    });
  }

  template <typename Issue>
  void Run(const char* op, Issue&& issue) {
    RunAll(op, [&] { return std::vector<c10::intrusive_ptr<c10d::Work>>{issue()}; });
  }

  // Issues the works of collective `op` and waits for all of them; a failure or timeout
  // fails the communicator, naming the members that are gone.
  template <typename Issue>
  void RunAll(const char* op, Issue&& issue) {
    const uint64_t sequence = ++collective_sequence_;
    const auto start = Clock::now();
    std::string cause;
    try {
      std::vector<c10::intrusive_ptr<c10d::Work>> works = issue();
      for (auto& work : works) work->wait(timeout_ + kWaitGrace);
      ReleaseHere(works);
      return;
    } catch (const std::exception& e) {
      cause = internal::ExceptionMessage(e);
    }
    if (Clock::now() - start >= timeout_) {
      cause = absl::StrCat("timed out after ", timeout_.count(), " ms (", cause, ")");
    }
    Fail(absl::StrCat(op, " on ", group_, ": ", cause, "; ", ProbeSilentMembers(sequence)));
  }

  // NOTE [collective tensors freed here]
  // A finished work holds the collective's tensors, and c10d's worker thread holds the work
  // a moment past its completion. Were the worker's reference the last, those tensors would
  // be freed on the worker thread, where this thread's c10 memory reporter (the pipeline's
  // activation meter, core/tests' LiveBytes) never sees the free: a measured activation
  // would read high by the buffers, differently on every run. So the works are dropped here
  // once only this thread holds them (bounded: a worker that keeps one longer than
  // kReleaseWait leaves it to the worker, as before).
  static void ReleaseHere(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
    const auto deadline = Clock::now() + kReleaseWait;
    for (auto& work : works) {
      while (work.use_count() > 1 && Clock::now() < deadline) std::this_thread::yield();
      work.reset();
    }
  }

  // Finds out which members are gone after collective number `sequence` failed: every
  // member that sees the failure leaves a mark in the store, and those without a mark
  // after a short window are the suspects. Gloo's own messages name socket addresses,
  // not ranks; this turns them into ranks. Bounded by kProbeWindow plus kProbeCallTimeout
  // (each store call is bounded by the latter, so a stuck store host cannot hold it longer).
  std::string ProbeSilentMembers(uint64_t sequence) {
    if (size() == 1) return "no other member";
    const std::string prefix = absl::StrCat(key_, "/failed/", sequence, "/");
    const std::chrono::milliseconds call_timeout = std::min(kProbeCallTimeout, timeout_);
    std::vector<int> silent;
    try {
      internal::SetWithin(*root_store_, prefix + std::to_string(rank_), std::vector<uint8_t>{1},
                          call_timeout);
      for (int r = 0; r < size(); ++r) {
        if (r != rank_) silent.push_back(r);
      }
      const auto deadline = Clock::now() + std::min(kProbeWindow, timeout_);
      while (!silent.empty()) {
        silent.erase(std::remove_if(silent.begin(), silent.end(),
                                    [&](int r) {
                                      return internal::CheckWithin(
                                          *root_store_, {prefix + std::to_string(r)}, call_timeout);
                                    }),
                     silent.end());
        if (silent.empty() || Clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception& e) {
      return absl::StrCat(
          "the rendezvous store is unreachable too, so world rank 0 (its "
          "host) is probably gone or stuck (",
          internal::ExceptionMessage(e), ")");
    }
    if (silent.empty()) return "every member saw the failure";
    std::vector<std::string> names;
    for (int r : silent) names.push_back(internal::DescribePeer(r, global_ranks_));
    return absl::StrCat("no sign of ", absl::StrJoin(names, ", "),
                        " (dead, stuck, or in a different call)");
  }

  c10::intrusive_ptr<c10d::Store> root_store_;  // Unprefixed: splits and probes key into it.
  internal::GlooDevice device_;                 // Shared by every group of this process.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  int rank_;
  std::vector<int> global_ranks_;
  std::string name_;
  std::string key_;  // Unique store key of this communicator (NOTE [split keys]).
  std::chrono::milliseconds timeout_;
  std::string group_;  // DescribeGroup(name_, global_ranks_), for messages.
  std::shared_ptr<Health> health_;
  uint64_t collective_sequence_ = 0;
  std::map<std::string, int> split_generations_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
    const GlooOptions& options) {
  if (absl::Status bad = internal::CheckWorldArguments("gloo", static_cast<bool>(store), rank,
                                                        size, timeout);
      !bad.ok()) {
    return bad;
  }
  IgnoreSigpipe();

  std::string interface = options.interface;
  if (interface.empty()) {
    if (const char* env = std::getenv("GLOO_SOCKET_IFNAME"); env != nullptr) interface = env;
  }
  internal::GlooDevice device;
  try {
    device = internal::MakeGlooDevice(interface, options.hostname);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo: cannot bind the TCP transport (",
                     !interface.empty()          ? absl::StrCat("interface '", interface, "'")
                     : !options.hostname.empty() ? absl::StrCat("host '", options.hostname, "'")
                                                 : std::string("this machine's hostname"),
                     ") on rank ", rank, ": ", internal::ExceptionMessage(e),
                     "; set GLOO_SOCKET_IFNAME to a working interface"));
  }

  // Each rank counts the world communicators it created on this store; ranks create them
  // in the same order, so the count keys a fresh namespace, and a second world
  // communicator never reads the first one's addresses.
  std::string key;
  try {
    const int64_t generation = store->add(absl::StrCat("fulcrum/gloo/world_count/", rank), 1);
    key = absl::StrCat("fulcrum/gloo/world#", generation);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo: the rendezvous store failed on rank ", rank,
                                               ": ", internal::ExceptionMessage(e)));
  }

  const auto start = Clock::now();
  try {
    auto group = internal::MakeGlooProcessGroup(internal::MakePrefixStore(key, store), rank, size,
                                                timeout, device, kGlooThreads);
    std::vector<int> global_ranks(size);
    for (int r = 0; r < size; ++r) global_ranks[r] = r;
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(std::move(store), std::move(device), std::move(group),
                                           rank, std::move(global_ranks), "world", key, timeout));
  } catch (const std::exception& e) {
    const std::string cause = internal::ExceptionMessage(e);
    if (Clock::now() - start >= timeout * 9 / 10) {
      return absl::DeadlineExceededError(absl::StrCat(
          "gloo: rank ", rank, " of ", size, " could not connect to every peer within ",
          timeout.count(), " ms; did every rank start and create its communicator? (", cause, ")"));
    }
    return absl::UnavailableError(absl::StrCat("gloo: rank ", rank, " of ", size,
                                               " could not connect to its peers: ", cause));
  }
}

}  // namespace fulcrum::parallel
