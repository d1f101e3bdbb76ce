// The NCCL backend. Compiled into every build; its body only where CMake found the CUDA
// toolkit and NCCL (FULCRUM_HAVE_NCCL, set for this file alone), elsewhere the factory
// returns Unimplemented.
#include "parallel/nccl_communicator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "parallel/world_communicator.h"

#if FULCRUM_HAVE_NCCL

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "parallel/internal/communicator_util.h"
#include "parallel/internal/nccl_check.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "Fulcrum's NCCL backend needs NCCL >= 2.14 (non-blocking communicators)"
#endif

namespace fulcrum::parallel {
namespace internal {

void ThrowCudaError(cudaError_t error, const char* expr, const char* file, int line, int rank,
                    const std::string& context) {
  throw CommError(absl::StrCat(
      context.empty() ? "" : context + ": ", expr, " failed: ", cudaGetErrorName(error), " (",
      cudaGetErrorString(error), ") (rank ", rank, ", ", file, ":", line, ")"));
}

void ThrowNcclError(ncclResult_t result, const char* expr, const char* file, int line, int rank,
                    const std::string& context) {
  // ncclGetLastError(nullptr) returns the last error of any communicator of this thread:
  // the detail ("peer 3 closed the connection") that the result code lacks.
  const char* detail = ncclGetLastError(nullptr);
  throw CommError(absl::StrCat(
      context.empty() ? "" : context + ": ", expr, " failed: ", ncclGetErrorString(result),
      detail != nullptr && *detail != '\0' ? absl::StrCat(" (", detail, ")") : std::string(),
      " (rank ", rank, ", ", file, ":", line, ")"));
}

}  // namespace internal

namespace {

using Clock = std::chrono::steady_clock;
using internal::TensorPlace;

ncclDataType_t ToNcclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      // CheckTensor rejected every other dtype before we got here.
      TORCH_INTERNAL_ASSERT(false, "no NCCL type for ", c10::toString(type));
  }
}

ncclRedOp_t ToNcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp ", static_cast<int>(op));
}

// Sets the current device for a scope and restores the caller's afterwards.
class DeviceGuard {
 public:
  DeviceGuard(int device, int rank, const std::string& context) {
    FULCRUM_CUDA_CHECK(cudaGetDevice(&previous_), rank, context);
    if (previous_ != device) FULCRUM_CUDA_CHECK(cudaSetDevice(device), rank, context);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Sleeps a little longer on each poll: the first polls catch the common short operations
// with little delay, later ones do not burn a core that the training thread could use.
class Backoff {
 public:
  void Pause() {
    if (spins_ < 64) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  int spins_ = 0;
  std::chrono::microseconds sleep_{20};
};

// The NCCL communicator handle, its failure state and the polling that bounds every wait;
// shared by a communicator and its point-to-point handles.
class NcclComm {
 public:
  NcclComm(ncclComm_t comm, int device, int rank, std::chrono::milliseconds timeout)
      : comm_(comm), device_(device), rank_(rank), timeout_(timeout) {}

  ~NcclComm() {
    if (comm_ == nullptr) return;
    // Finalize flushes outstanding work and can wait on peers; bounded like everything
    // else, and aborted when it does not finish in time. (No DeviceGuard: a destructor
    // must not throw.)
    int previous_device = device_;
    cudaGetDevice(&previous_device);
    cudaSetDevice(device_);
    ncclResult_t state = ncclCommFinalize(comm_);
    const auto deadline = Clock::now() + timeout_;
    Backoff backoff;
    while (state == ncclInProgress && Clock::now() < deadline) {
      backoff.Pause();
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else {
      FULCRUM_LOG(WARNING) << "nccl: finalize did not finish cleanly (" << ncclGetErrorString(state)
                           << "); aborting the communicator";
      ncclCommAbort(comm_);
    }
    cudaSetDevice(previous_device);
  }

  ncclComm_t get() const { return comm_; }
  int device() const { return device_; }
  int rank() const { return rank_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& first_error() const { return first_error_; }

  /// Throws CommError(context + ": unusable ...") once the communicator has failed.
  void CheckUsable(const std::string& context) const {
    if (!first_error_.empty()) {
      throw CommError(absl::StrCat(context, ": unusable after an earlier failure: ", first_error_));
    }
  }

  /// Aborts the communicator (so no kernel stays stuck on a dead peer) and throws
  /// CommError(message). Later calls fail through CheckUsable.
  [[noreturn]] void Abort(const std::string& message) {
    if (first_error_.empty()) first_error_ = message;
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    throw CommError(message);
  }

  /// Waits until the communicator has finished the call that returned `result`
  /// (ncclInProgress on a non-blocking communicator), bounded by `deadline`.
  void Settle(ncclResult_t result, const char* expr, const std::string& context,
              Clock::time_point deadline) {
    Backoff backoff;
    while (result == ncclInProgress) {
      if (Clock::now() >= deadline) {
        Abort(absl::StrCat(context, ": timed out after ", timeout_.count(), " ms in ", expr,
                           " (rank ", rank_, ")"));
      }
      backoff.Pause();
      if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) break;
    }
    if (result != ncclSuccess) {
      try {
        internal::ThrowNcclError(result, expr, __FILE__, __LINE__, rank_, context);
      } catch (const CommError& e) {
        Abort(e.what());
      }
    }
  }

  /// Waits until `event` (recorded after the operation) has completed, bounded by
  /// `deadline`; aborts on an asynchronous NCCL error (a peer died) or on timeout.
  void AwaitEvent(cudaEvent_t event, const std::string& context, Clock::time_point deadline) {
    Backoff backoff;
    while (true) {
      const cudaError_t query = cudaEventQuery(event);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady) {
        try {
          internal::ThrowCudaError(query, "cudaEventQuery", __FILE__, __LINE__, rank_, context);
        } catch (const CommError& e) {
          Abort(e.what());
        }
      }
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        try {
          internal::ThrowNcclError(async_error, "ncclCommGetAsyncError", __FILE__, __LINE__, rank_,
                                   context);
        } catch (const CommError& e) {
          Abort(e.what());
        }
      }
      if (Clock::now() >= deadline) {
        Abort(absl::StrCat(context, ": timed out after ", timeout_.count(),
                           " ms waiting for the operation to complete (rank ", rank_,
                           "); a peer is dead, stuck, or in a different call"));
      }
      backoff.Pause();
    }
  }

 private:
  ncclComm_t comm_;
  int device_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::string first_error_;
};

// A CUDA event that owns itself.
class Event {
 public:
  Event(int rank, const std::string& context) {
    FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), rank, context);
  }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// One queued point-to-point operation and, once launched, the event that marks its end.
struct P2POp {
  bool send = true;
  at::Tensor tensor;  // Keeps the memory alive until the operation completes.
  int peer = 0;
  std::string what;  // "send on 'pp' (ranks 0,1) to rank 1 (world rank 1), tag 3"
  bool launched = false;
  std::shared_ptr<Event> ready;  // On the compute stream when queued (NOTE [nccl stream]).
  std::shared_ptr<Event> done;
  Clock::time_point deadline;
};

class NcclCommunicator;

class NcclWork final : public CommWork {
 public:
  NcclWork(NcclCommunicator* owner, std::shared_ptr<P2POp> op)
      : owner_(owner), op_(std::move(op)) {}
  ~NcclWork() override;
  void Wait() override;

 private:
  NcclCommunicator* owner_;
  std::shared_ptr<P2POp> op_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, std::shared_ptr<NcclComm> comm, int rank,
                   std::vector<int> global_ranks, std::string name, std::string key,
                   NcclStreamProvider stream_provider)
      : store_(std::move(store)),
        comm_(std::move(comm)),
        rank_(rank),
        global_ranks_(std::move(global_ranks)),
        name_(std::move(name)),
        key_(std::move(key)),
        group_(internal::DescribeGroup(name_, global_ranks_)),
        stream_provider_(std::move(stream_provider)) {
    DeviceGuard guard(comm_->device(), rank_, group_);
    done_ = std::make_unique<Event>(rank_, group_);
    inputs_ready_ = std::make_unique<Event>(rank_, group_);
    // NOTE [nccl stream]: non-blocking, so it neither waits for nor holds up the legacy
    // default stream that LibTorch computes on.
    FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), rank_, group_);
    FULCRUM_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof(float)), rank_, group_);
    FULCRUM_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(float)), rank_, group_);
  }

  ~NcclCommunicator() override {
    if (!pending_.empty()) {
      FULCRUM_LOG(WARNING) << group_ << ": destroyed with " << pending_.size()
                           << " point-to-point operations never waited on; dropping them";
    }
    cudaFree(barrier_word_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  const std::string& name() const override { return name_; }
  const char* backend() const override { return "nccl"; }
  std::chrono::milliseconds timeout() const override { return comm_->timeout(); }

  void AllReduce(at::Tensor& tensor, ReduceOp op) override {
    const std::string context = Context("all_reduce");
    CheckTensor(tensor, "all_reduce", "tensor");
    Collective(context, [&](cudaStream_t stream) {
      return std::make_pair(
          ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                        ToNcclType(tensor.scalar_type()), ToNcclOp(op), comm_->get(), stream),
          "ncclAllReduce");
    });
  }

  at::Tensor AllGather(const at::Tensor& input) override {
    const std::string context = Context("all_gather");
    CheckTensor(input, "all_gather", "input");
    internal::CheckHasRows(input, "all_gather", group_);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] *= size();
    at::Tensor output = at::empty(sizes, input.options());
    Collective(context, [&](cudaStream_t stream) {
      return std::make_pair(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                          ToNcclType(input.scalar_type()), comm_->get(), stream),
                            "ncclAllGather");
    });
    return output;
  }

  at::Tensor ReduceScatter(const at::Tensor& input, ReduceOp op) override {
    const std::string context = Context("reduce_scatter");
    CheckTensor(input, "reduce_scatter", "input");
    internal::CheckHasRows(input, "reduce_scatter", group_);
    internal::CheckDivisible(input.size(0), size(), "reduce_scatter", group_);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] /= size();
    at::Tensor output = at::empty(sizes, input.options());
    Collective(context, [&](cudaStream_t stream) {
      return std::make_pair(
          ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                            ToNcclType(input.scalar_type()), ToNcclOp(op), comm_->get(), stream),
          "ncclReduceScatter");
    });
    return output;
  }

  void Broadcast(at::Tensor& tensor, int root) override {
    const std::string context = Context("broadcast");
    CheckTensor(tensor, "broadcast", "tensor");
    internal::CheckPeer(root, size(), "broadcast", group_);
    Collective(context, [&](cudaStream_t stream) {
      return std::make_pair(
          ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                        ToNcclType(tensor.scalar_type()), root, comm_->get(), stream),
          "ncclBroadcast");
    });
  }

  at::Tensor AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits) override {
    const std::string context = Context("all_to_all");
    CheckTensor(input, "all_to_all", "input");
    const internal::AllToAllRows rows =
        internal::ResolveAllToAllRows(input, input_splits, output_splits, size(), group_);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] = rows.recv_total;
    at::Tensor output = at::empty(sizes, input.options());
    int64_t row_elements = 1;
    for (size_t d = 1; d < sizes.size(); ++d) row_elements *= sizes[d];
    const size_t row_bytes = row_elements * input.element_size();
    const ncclDataType_t type = ToNcclType(input.scalar_type());
    Collective(context, [&](cudaStream_t stream) {
      // One group of sends and receives, the way NCCL expresses all-to-all-v: NCCL runs
      // them concurrently, so their order within the group cannot deadlock.
      const char* send_base = static_cast<const char*>(input.data_ptr());
      char* recv_base = static_cast<char*>(output.data_ptr());
      ncclResult_t result = ncclGroupStart();
      int64_t send_offset = 0;
      int64_t recv_offset = 0;
      for (int j = 0; j < size() && (result == ncclSuccess || result == ncclInProgress); ++j) {
        if (rows.send[j] > 0) {
          result = ncclSend(send_base + send_offset * row_bytes, rows.send[j] * row_elements, type,
                            j, comm_->get(), stream);
        }
        if (rows.recv[j] > 0 && (result == ncclSuccess || result == ncclInProgress)) {
          result = ncclRecv(recv_base + recv_offset * row_bytes, rows.recv[j] * row_elements, type,
                            j, comm_->get(), stream);
        }
        send_offset += rows.send[j];
        recv_offset += rows.recv[j];
      }
      const ncclResult_t end = ncclGroupEnd();
      return std::make_pair(result == ncclSuccess || result == ncclInProgress ? end : result,
                            "ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd");
    });
    return output;
  }

  std::unique_ptr<CommWork> ISend(const at::Tensor& tensor, int dst, int tag) override {
    return QueueP2P(/*send=*/true, tensor, dst, tag);
  }

  std::unique_ptr<CommWork> IRecv(at::Tensor& tensor, int src, int tag) override {
    return QueueP2P(/*send=*/false, tensor, src, tag);
  }

  void Barrier() override {
    const std::string context = Context("barrier");
    Collective(context, [&](cudaStream_t stream) {
      return std::make_pair(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum,
                                          comm_->get(), stream),
                            "ncclAllReduce");
    });
  }

  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override {
    const std::string context = Context("split");
    internal::CheckSplit(ranks, name, rank_, size(), group_);
    internal::SplitPlan plan =
        internal::PlanSplit(key_, name, ranks, global_ranks_, rank_, split_generations_);
    const std::string& key = plan.key;
    const int new_rank = plan.new_rank;
    const std::string& sub_group = plan.sub_group;
    absl::StatusOr<std::shared_ptr<NcclComm>> comm =
        Connect(store_, key, new_rank, static_cast<int>(ranks.size()), comm_->device(),
                comm_->timeout(), name);
    if (!comm.ok()) {
      throw CommError(
          absl::StrCat("split of ", group_, " into ", sub_group, ": ", comm.status().message()));
    }
    return std::make_unique<NcclCommunicator>(
        store_, *std::move(comm), new_rank, std::move(plan.member_globals), name, key, stream_provider_);
  }

  /// Creates the NCCL communicator of `size` ranks whose unique id rank 0 publishes under
  /// `key` in `store`; bounded by `timeout`.
  static absl::StatusOr<std::shared_ptr<NcclComm>> Connect(
      const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank, int size,
      int device, std::chrono::milliseconds timeout, const std::string& name) {
    const auto deadline = Clock::now() + timeout;
    const std::string context =
        absl::StrCat("nccl init of '", name, "' (rank ", rank, " of ", size, ")");
    ncclComm_t raw = nullptr;
    try {
      DeviceGuard guard(device, rank, context);
      ncclUniqueId id;
      const std::string id_key = key + "/nccl_unique_id";
      if (rank == 0) {
        FULCRUM_NCCL_CHECK(ncclGetUniqueId(&id), rank, context);
        std::vector<uint8_t> bytes(sizeof(id));
        std::memcpy(bytes.data(), &id, sizeof(id));
        store->set(id_key, bytes);
      } else {
        store->wait({id_key}, timeout);
        const std::vector<uint8_t> bytes = store->get(id_key);
        if (bytes.size() != sizeof(id)) {
          return absl::InternalError(absl::StrCat(context, ": the unique id in the store has ",
                                                  bytes.size(), " bytes, expected ", sizeof(id)));
        }
        std::memcpy(&id, bytes.data(), sizeof(id));
      }
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // So a peer that never joins cannot hang us: we poll instead.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
      config.commName = name.c_str();
#endif
      FULCRUM_NCCL_CHECK(ncclCommInitRankConfig(&raw, size, id, rank, &config), rank, context);
      auto comm = std::make_shared<NcclComm>(raw, device, rank, timeout);
      comm->Settle(ncclInProgress, "ncclCommInitRankConfig", context, deadline);
      return comm;
    } catch (const std::exception& e) {
      // Settle aborted (and so freed) the communicator on its failures; the other throws
      // come before it exists.
      const bool timed_out = Clock::now() >= deadline;
      const std::string message = internal::ExceptionMessage(e);
      if (timed_out) {
        return absl::DeadlineExceededError(absl::StrCat(context, ": not every rank joined within ",
                                                        timeout.count(), " ms (", message, ")"));
      }
      return absl::UnavailableError(absl::StrCat(context, ": ", message));
    }
  }

  /// Launches every queued point-to-point operation in one NCCL group. Called by the first
  /// Wait() and before any collective, so all ranks launch matching groups.
  void FlushP2P() {
    if (pending_.empty()) return;
    std::vector<std::shared_ptr<P2POp>> batch;
    batch.swap(pending_);
    const std::string context = absl::StrCat(
        batch.front()->what,
        batch.size() > 1 ? absl::StrCat(" (and ", batch.size() - 1, " more)") : std::string());
    comm_->CheckUsable(context);
    DeviceGuard guard(comm_->device(), rank_, context);
    // Each operation waits for the compute work queued before its ISend/IRecv only.
    const cudaStream_t stream = stream_;
    for (const auto& op : batch) {
      FULCRUM_CUDA_CHECK(cudaStreamWaitEvent(stream, op->ready->get(), 0), rank_, context);
    }
    const auto deadline = Clock::now() + comm_->timeout();
    ncclResult_t result = ncclGroupStart();
    for (const auto& op : batch) {
      if (result != ncclSuccess && result != ncclInProgress) break;
      const ncclDataType_t type = ToNcclType(op->tensor.scalar_type());
      result = op->send ? ncclSend(op->tensor.data_ptr(), op->tensor.numel(), type, op->peer,
                                   comm_->get(), stream)
                        : ncclRecv(op->tensor.data_ptr(), op->tensor.numel(), type, op->peer,
                                   comm_->get(), stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    comm_->Settle(result == ncclSuccess || result == ncclInProgress ? end : result,
                  "ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd", context, deadline);
    auto done = std::make_shared<Event>(rank_, context);
    FULCRUM_CUDA_CHECK(cudaEventRecord(done->get(), stream), rank_, context);
    for (const auto& op : batch) {
      op->launched = true;
      op->done = done;
      op->deadline = deadline;
    }
  }

  NcclComm& comm() { return *comm_; }

 private:
  std::string Context(const char* op) const {
    std::string context = absl::StrCat(op, " on ", group_);
    comm_->CheckUsable(context);
    return context;
  }

  void CheckTensor(const at::Tensor& tensor, const char* op, const char* what) const {
    internal::CheckTensor(tensor, op, group_, what, TensorPlace::kCuda);
    if (tensor.device().index() != comm_->device()) {
      throw CommError(absl::StrCat(op, " on ", group_, ": ", what, " is on ", tensor.device().str(),
                                   " but this communicator uses cuda:", comm_->device()));
    }
  }

  // NOTE [nccl stream]
  // Each communicator launches on a stream of its own, ordered through events after the
  // work queued on the compute stream (the provider's, else the legacy default stream) up
  // to the call, so the tensors it reads are written. Collectives are then awaited by the
  // host, so nothing overlaps them. What overlaps compute is point-to-point traffic (the
  // pipeline's activations and gradients, the layer moves of migration): an ISend/IRecv
  // records its event when it is queued, so kernels queued between it and Wait() run on
  // the compute stream while the transfer runs on this one. Results are read only after
  // Wait() has seen the operation finish, so the compute stream needs no event back.
  cudaStream_t ComputeStream() const {
    return stream_provider_ ? static_cast<cudaStream_t>(stream_provider_()) : cudaStreamLegacy;
  }
  cudaStream_t Stream(const std::string& context) {
    FULCRUM_CUDA_CHECK(cudaEventRecord(inputs_ready_->get(), ComputeStream()), rank_, context);
    FULCRUM_CUDA_CHECK(cudaStreamWaitEvent(stream_, inputs_ready_->get(), 0), rank_, context);
    return stream_;
  }

  // Launches a collective after any queued point-to-point operations, then waits for it,
  // bounded by the timeout.
  template <typename Launch>
  void Collective(const std::string& context, Launch&& launch) {
    FlushP2P();
    DeviceGuard guard(comm_->device(), rank_, context);
    const cudaStream_t stream = Stream(context);
    const auto deadline = Clock::now() + comm_->timeout();
    const auto [result, expr] = launch(stream);
    comm_->Settle(result, expr, context, deadline);
    FULCRUM_CUDA_CHECK(cudaEventRecord(done_->get(), stream), rank_, context);
    comm_->AwaitEvent(done_->get(), context, deadline);
  }

  std::unique_ptr<CommWork> QueueP2P(bool send, const at::Tensor& tensor, int peer, int tag) {
    const char* op = send ? "send" : "recv";
    const std::string context = Context(op);
    CheckTensor(tensor, op, "tensor");
    internal::CheckPeer(peer, size(), op, group_);
    auto p2p = std::make_shared<P2POp>();
    p2p->send = send;
    p2p->tensor = tensor;
    p2p->peer = peer;
    p2p->what = absl::StrCat(context, send ? " to " : " from ",
                             internal::DescribePeer(peer, global_ranks_), ", tag ", tag);
    {
      DeviceGuard guard(comm_->device(), rank_, p2p->what);
      p2p->ready = std::make_shared<Event>(rank_, p2p->what);
      FULCRUM_CUDA_CHECK(cudaEventRecord(p2p->ready->get(), ComputeStream()), rank_, p2p->what);
    }
    pending_.push_back(p2p);
    return std::make_unique<NcclWork>(this, std::move(p2p));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<NcclComm> comm_;
  int rank_;
  std::vector<int> global_ranks_;
  std::string name_;
  std::string key_;  // Unique store key of this communicator (NOTE [split keys]).
  std::string group_;
  NcclStreamProvider stream_provider_;
  std::unique_ptr<Event> done_;  // Recorded after each collective.
  std::unique_ptr<Event> inputs_ready_;  // Compute stream → stream_ (NOTE [nccl stream]).
  cudaStream_t stream_ = nullptr;        // This communicator's own (NOTE [nccl stream]).
  float* barrier_word_ = nullptr;
  std::vector<std::shared_ptr<P2POp>> pending_;
  std::map<std::string, int> split_generations_;
};

NcclWork::~NcclWork() {
  // A queued operation the peer expects must still be launched, and a launched one must
  // finish before its tensor may be freed: wait, bounded by the timeout.
  if (!waited_) {
    try {
      Wait();
    } catch (const std::exception& e) {
      FULCRUM_LOG(WARNING) << "dropping an unwaited operation that failed: " << e.what();
    }
  }
}

void NcclWork::Wait() {
  waited_ = true;
  if (!op_->launched) owner_->FlushP2P();
  NcclComm& comm = owner_->comm();
  comm.CheckUsable(op_->what);
  if (!op_->launched) {
    // Its batch failed to launch (the error went to whoever flushed it).
    throw CommError(absl::StrCat(op_->what, ": never launched; an earlier failure dropped it"));
  }
  DeviceGuard guard(comm.device(), comm.rank(), op_->what);
  comm.AwaitEvent(op_->done->get(), op_->what, op_->deadline);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
    std::chrono::milliseconds timeout, NcclStreamProvider stream_provider) {
  if (absl::Status bad = internal::CheckWorldArguments("nccl", static_cast<bool>(store), rank,
                                                        size, timeout);
      !bad.ok()) {
    return bad;
  }
  const int devices = NcclVisibleDevices();
  if (device < 0 || device >= devices) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: rank ", rank, " needs GPU ", device, " but this process sees ", devices,
                     " (LOCAL_RANK, CUDA_VISIBLE_DEVICES and --nproc_per_node must agree)"));
  }
  std::string key;
  try {
    key = absl::StrCat("fulcrum/nccl/world#",
                       store->add(absl::StrCat("fulcrum/nccl/world_count/", rank), 1));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("nccl: the rendezvous store failed on rank ", rank, ": ", e.what()));
  }
  auto comm = NcclCommunicator::Connect(store, key, rank, size, device, timeout, "world");
  if (!comm.ok()) return comm.status();
  std::vector<int> global_ranks(size);
  for (int r = 0; r < size; ++r) global_ranks[r] = r;
  try {
    return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(
        std::move(store), *std::move(comm), rank, std::move(global_ranks), "world", key,
        std::move(stream_provider)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(e.what());
  }
}

int NcclVisibleDevices() {
  int count = 0;
  // No driver or no GPU is an error from the runtime; for us it means none.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Clear the sticky-free error so later calls start clean.
    return 0;
  }
  return count;
}

bool HaveNccl() { return true; }

}  // namespace fulcrum::parallel

#else  // !FULCRUM_HAVE_NCCL

namespace fulcrum::parallel {

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    c10::intrusive_ptr<c10d::Store>, int, int, int, std::chrono::milliseconds, NcclStreamProvider) {
  return absl::UnimplementedError(
      "the nccl backend is not in this build (CMake found no CUDA toolkit with NCCL)");
}

int NcclVisibleDevices() { return 0; }

bool HaveNccl() { return false; }

}  // namespace fulcrum::parallel

#endif  // FULCRUM_HAVE_NCCL
