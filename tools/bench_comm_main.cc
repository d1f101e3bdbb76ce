// bench_comm: bandwidth of the collectives of a Communicator backend, reported the way
// nccl-tests reports them, so numbers compare across tools and machines.
//
//   fulcrum_launch --nproc_per_node=4 -- build/bin/fulcrum_bench_comm [--backend=gloo]
//       [--min_bytes=8] [--max_bytes=67108864] [--step_factor=4] [--iters=20] [--warmup=5]
//
// For each operation and size: `warmup` untimed calls, then `iters` timed ones; the time of
// a size is the slowest rank's mean (all_reduce MAX over ranks). size is the per-rank
// buffer that nccl-tests calls size: the tensor all_reduce'd, all_gather's output,
// reduce_scatter's input, the all_to_all input. algbw = size / time;
// busbw = algbw * 2(n-1)/n for all_reduce and algbw * (n-1)/n for the others: the bytes
// each rank's link must carry, comparable with the link's bandwidth. --ops=p2p (not in the
// default list) times a ping-pong between rank pairs and reports one way: half a round
// trip, algbw = busbw = size / that time — what the simulator's --p2p_bandwidth_gbps and
// --p2p_latency_us describe.
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "core/logging.h"
#include "parallel/communicator.h"
#include "parallel/world.h"
#include "parallel/world_communicator.h"
#include "recipes/cli.h"

DEFINE_string(backend, "gloo", "Communication backend: gloo (CPU tensors) or nccl (GPU).");
DEFINE_string(ops, "all_reduce,all_gather,reduce_scatter,all_to_all",
              "Operations to time; also p2p (a ping-pong between rank pairs, one way reported).");
DEFINE_int64(min_bytes, 8, "Smallest per-rank buffer, in bytes.");
DEFINE_int64(max_bytes, 64 << 20, "Largest per-rank buffer, in bytes.");
DEFINE_int32(step_factor, 4, "Each size is this many times the previous one.");
DEFINE_int32(iters, 20, "Timed calls per size (fewer for large sizes, see max_iter_bytes).");
DEFINE_int32(warmup, 5, "Untimed calls per size before timing.");
DEFINE_int64(max_iter_bytes, int64_t{1} << 30,
             "Caps iters at max(2, this / size) so the large sizes do not take minutes.");
DEFINE_int32(timeout_s, 300, "Timeout of every communication call, in seconds.");

namespace fulcrum {
namespace {

using parallel::Communicator;
using Clock = std::chrono::steady_clock;

struct Op {
  std::string name;
  double bus_factor;  // busbw / algbw for n ranks.
  int transfers = 1;  // A call's time is divided by this (p2p: a round trip is two).
};

// One call of `op` on the per-rank buffer (nccl-tests' "size").
void RunOnce(Communicator& comm, const std::string& op, at::Tensor& buffer) {
  if (op == "all_reduce") {
    comm.AllReduce(buffer);
  } else if (op == "all_gather") {
    // buffer is the output size; each rank contributes 1/n of it.
    comm.AllGather(buffer.narrow(0, 0, buffer.size(0) / comm.size()));
  } else if (op == "reduce_scatter") {
    comm.ReduceScatter(buffer);
  } else if (op == "p2p") {
    // A ping-pong between ranks 2k and 2k+1 (an odd last rank sits out): one call is a
    // round trip, two one-way transfers of the buffer — the hand-over of an activation or a
    // gradient between two pipeline stages (fulcrum_sim's --p2p_* flags model one).
    const int peer = comm.rank() ^ 1;
    if (peer >= comm.size()) return;
    if (comm.rank() % 2 == 0) {
      comm.Send(buffer, peer, /*tag=*/0);
      comm.Recv(buffer, peer, /*tag=*/1);
    } else {
      comm.Recv(buffer, peer, /*tag=*/0);
      comm.Send(buffer, peer, /*tag=*/1);
    }
  } else {
    comm.AllToAll(buffer, {}, {});
  }
}

int Run() {
  auto world = parallel::WorldInfoFromEnvironment();
  if (!world.ok()) {
    FULCRUM_LOG(ERROR) << world.status();
    return 1;
  }
  SetLogRank(world->rank, world->world_size);
  auto backend = parallel::ParseBackend(FLAGS_backend);
  if (!backend.ok()) {
    FULCRUM_LOG(ERROR) << backend.status();
    return 2;
  }
  auto created =
      parallel::CreateWorldCommunicator(*world, *backend, std::chrono::seconds(FLAGS_timeout_s));
  if (!created.ok()) {
    FULCRUM_LOG(ERROR) << created.status();
    return 1;
  }
  Communicator& comm = **created;
  const int n = comm.size();
  const at::Device device = *backend == parallel::Backend::kNccl
                                ? at::Device(at::kCUDA, world->local_rank)
                                : at::Device(at::kCPU);
  std::vector<Op> ops;
  for (const auto& name : absl::StrSplit(FLAGS_ops, ',')) {
    const std::string op(name);
    if (op == "all_reduce") {
      ops.push_back({op, 2.0 * (n - 1) / n});
    } else if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") {
      ops.push_back({op, double(n - 1) / n});
    } else if (op == "p2p") {
      if (n < 2) {
        FULCRUM_LOG(ERROR) << "--ops=p2p needs at least 2 ranks";
        return 2;
      }
      ops.push_back({op, 1.0, /*transfers=*/2});
    } else {
      FULCRUM_LOG(ERROR) << "unknown operation '" << op
                         << "'; expected all_reduce, all_gather, reduce_scatter, all_to_all, p2p";
      return 2;
    }
  }
  const bool printer = comm.rank() == 0;
  if (printer) {
    std::printf("# fulcrum_bench_comm: %s, %d ranks, float32, %d timed iterations (%d warm-up)\n",
                comm.backend(), n, FLAGS_iters, FLAGS_warmup);
  }
  constexpr int64_t kElement = sizeof(float);
  for (const Op& op : ops) {
    if (printer) {
      std::printf("# %s\n# %12s %12s %12s %12s %12s\n", op.name.c_str(), "size(B)", "count",
                  "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    for (int64_t bytes = FLAGS_min_bytes; bytes <= FLAGS_max_bytes;
         bytes *= std::max(2, FLAGS_step_factor)) {
      // Collectives that split the buffer in n need a multiple of n elements (nccl-tests
      // rounds the same way).
      const int64_t count = std::max<int64_t>(n, bytes / kElement / n * n);
      at::Tensor buffer = at::ones({count}, at::TensorOptions().device(device));
      const int iters = static_cast<int>(std::clamp<int64_t>(
          FLAGS_max_iter_bytes / (count * kElement), 2, std::max(2, FLAGS_iters)));
      for (int i = 0; i < FLAGS_warmup; ++i) RunOnce(comm, op.name, buffer);
      comm.Barrier();
      const auto start = Clock::now();
      for (int i = 0; i < iters; ++i) RunOnce(comm, op.name, buffer);
      const double seconds =
          std::chrono::duration<double>(Clock::now() - start).count() / iters / op.transfers;
      at::Tensor slowest =
          at::full({1}, seconds, at::TensorOptions().dtype(at::kDouble).device(device));
      comm.AllReduce(slowest, parallel::ReduceOp::kMax);
      const double time = slowest.cpu().item<double>();
      const double algbw = count * kElement / time / 1e9;
      if (printer) {
        std::printf("  %12lld %12lld %12.1f %12.3f %12.3f\n",
                    static_cast<long long>(count * kElement), static_cast<long long>(count),
                    time * 1e6, algbw, algbw * op.bus_factor);
        std::fflush(stdout);
      }
    }
  }
  comm.Barrier();
  return 0;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_comm";
  help.usage =
      "fulcrum_bench_comm: bandwidth of all_reduce, all_gather, reduce_scatter and all_to_all\n"
      "of a Communicator backend, reported as nccl-tests reports it (algbw, busbw).\n\n"
      "  fulcrum_launch --nproc_per_node=4 -- fulcrum_bench_comm [--backend=gloo]\n"
      "      [--min_bytes=8] [--max_bytes=67108864] [--step_factor=4] [--iters=20] [--warmup=5]\n\n"
      "Exit status: 0 done, 2 bad flags (--backend, --ops), 1 no world from fulcrum_launch or\n"
      "a communication failure.\n";
  help.groups = {
      {"Backend and operations", {"backend", "ops", "timeout_s"}},
      {"Sizes and timing", {"min_bytes", "max_bytes", "step_factor", "iters", "warmup",
                            "max_iter_bytes"}},
  };
  if (std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }

  fulcrum::InitLogging(argv[0]);
  try {
    return fulcrum::Run();
  } catch (const fulcrum::parallel::CommError& e) {
    FULCRUM_LOG(ERROR) << e.what();
    return 1;
  }
}
