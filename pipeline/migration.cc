#include "pipeline/migration.h"

#include <cstring>
#include <map>
#include <set>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace fulcrum::pipeline {
namespace {

// Offsets of the three messages from a transfer's tag (UnitTag).
constexpr int kHeaderTag = 0;
constexpr int kNamesTag = 1;
constexpr int kPayloadTag = 2;
// Above every micro-batch tag (2·mb + 1 < 2^20 for any plausible micro-batch count).
constexpr int kFirstUnitTag = 1 << 20;
// names bytes, payload elements, optimizer step, payload dtype (0 fp32, 1 fp64)
constexpr int64_t kHeaderLength = 4;

int64_t WireBytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace

int UnitTag(int64_t layer) { return kFirstUnitTag + 4 * static_cast<int>(layer + 1); }

void UnitSend::Wait() {
  for (auto& work : works_) work->Wait();
  works_.clear();
  buffers_.clear();
}

// NOTE [migration payload on the host]
// A moving layer's state travels as one flat payload, and the receiver (a shell of the
// layer) allocates the buffer before it knows where each piece lived: the payload is built
// on the host, from a layer whose parameters are on the GPU as from one on the CPU. That
// also keeps both ends on one plane of a split communicator (NOTE [control plane]): a CPU
// tensor rides Gloo on both sides, where a device payload sent over NCCL would meet a host
// receive on Gloo. The cost is a device-to-host and a host-to-device copy of each moving
// layer; a payload kept on the device (sent over NCCL, the pieces that live on the host
// sent apart) is the faster form, not built yet.
absl::StatusOr<UnitSend> StartSendUnit(parallel::Communicator& pp, int dst, const Unit& unit,
                                       int tag) {
  NamedTensors tensors = unit.MigrationTensors();
  std::string names;
  std::vector<at::Tensor> values;
  int64_t step = 0;
  // fp32 carries fp32 state bit for bit; a unit with fp64 parameters (ModelOptions::
  // params_dtype) travels as fp64, so nothing is rounded on the way.
  at::ScalarType dtype = at::kFloat;
  for (auto& [name, tensor] : tensors) {
    if (tensor.scalar_type() == at::kDouble) dtype = at::kDouble;
  }
  for (auto& [name, tensor] : tensors) {
    if (tensor.scalar_type() == at::kLong) {  // the step counter
      step = tensor.item<int64_t>();
      continue;
    }
    // "name:d0,d1,...": the receiver takes the shape from here, since some tensors (a
    // block's step state) have shapes that only the sender knows.
    absl::StrAppend(&names, name, ":", absl::StrJoin(tensor.sizes(), ","), "\n");
    // NOTE [migration payload on the host]: one host buffer, whatever device each piece
    // lives on (a layer's parameters on the GPU, an MoE block's step state on the host).
    values.push_back(tensor.detach().to(at::kCPU, dtype).reshape({-1}));
  }
  UnitSend send;
  at::Tensor payload = values.empty() ? at::empty({0}, dtype) : at::cat(values);
  at::Tensor header = at::tensor({static_cast<int64_t>(names.size()), payload.numel(), step,
                                  dtype == at::kDouble ? int64_t{1} : int64_t{0}},
                                 at::kLong);
  at::Tensor blob = at::empty({static_cast<int64_t>(names.size())}, at::kByte);
  std::memcpy(blob.data_ptr<uint8_t>(), names.data(), names.size());
  for (auto [tensor, offset] : {std::pair{header, kHeaderTag}, std::pair{blob, kNamesTag},
                                std::pair{payload, kPayloadTag}}) {
    send.buffers_.push_back(tensor);
    send.works_.push_back(pp.ISend(send.buffers_.back(), dst, tag + offset));
    send.bytes_ += WireBytes(tensor);
  }
  return send;
}

UnitReceive::UnitReceive(parallel::Communicator* pp, int src, int tag)
    : pp_(pp), src_(src), tag_(tag), header_(at::empty({kHeaderLength}, at::kLong)) {
  header_work_ = pp_->IRecv(header_, src_, tag_ + kHeaderTag);
}

UnitReceive StartReceiveUnit(parallel::Communicator& pp, int src, int tag) {
  return UnitReceive(&pp, src, tag);
}

absl::Status UnitReceive::Finish(Unit& shell) {
  header_work_->Wait();
  const int64_t names_bytes = header_[0].item<int64_t>();
  const int64_t numel = header_[1].item<int64_t>();
  const int64_t step = header_[2].item<int64_t>();
  const at::ScalarType dtype = header_[3].item<int64_t>() == 1 ? at::kDouble : at::kFloat;
  // Both receives posted before either is waited on: one round trip, not two.
  at::Tensor blob = at::empty({names_bytes}, at::kByte);
  at::Tensor payload = at::empty({numel}, dtype);
  auto blob_work = pp_->IRecv(blob, src_, tag_ + kNamesTag);
  auto payload_work = pp_->IRecv(payload, src_, tag_ + kPayloadTag);
  blob_work->Wait();
  payload_work->Wait();
  bytes_ = WireBytes(header_) + WireBytes(blob) + WireBytes(payload);

  // The names the shell expects: its parameters with their gradients and the slots of
  // their optimizer state (whatever the optimizer names them: "optimizer.<name>.<slot>"),
  // and whatever else it migrates (buffers, a block's step state). Shapes come with the
  // names; LoadMigrationTensors checks them against the shell's.
  std::set<std::string> expected;
  std::set<std::string> state_prefixes;
  for (const Parameter& p : shell.parameters()) {
    const std::string name = shell.GlobalName(p.name);
    expected.insert(name);
    expected.insert(name + ".grad");
    state_prefixes.insert(OptimizerStatePrefix(name));
  }
  for (const auto& [name, tensor] : shell.MigrationTensors()) expected.insert(name);
  auto is_expected = [&](const std::string& key) {
    if (expected.count(key) > 0) return true;
    const size_t dot = key.rfind('.');
    return dot != std::string::npos && state_prefixes.count(key.substr(0, dot + 1)) > 0;
  };
  std::map<std::string, at::Tensor> tensors;
  const std::string names(reinterpret_cast<const char*>(blob.data_ptr<uint8_t>()), names_bytes);
  int64_t offset = 0;
  for (absl::string_view line : absl::StrSplit(names, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 1));
    std::vector<int64_t> shape;
    int64_t count = 1;
    bool well_formed = true;
    for (absl::string_view dim : absl::StrSplit(parts.second, ',', absl::SkipEmpty())) {
      int64_t d = 0;
      well_formed = well_formed && absl::SimpleAtoi(dim, &d) && d >= 0;
      shape.push_back(d);
      count *= d;
    }
    if (!well_formed || !is_expected(parts.first) || offset + count > numel) {
      return absl::DataLossError(absl::StrCat("migration from stage ", src_, " into ", shell.name(),
                                              ": unexpected tensor ", line));
    }
    tensors[parts.first] = payload.narrow(0, offset, count).view(shape).clone();
    offset += count;
  }
  if (step > 0) {
    tensors["optimizer." + shell.name() + ".step"] = at::scalar_tensor(step, at::kLong);
  }
  return shell.LoadMigrationTensors(tensors);
}

absl::Status SendUnit(parallel::Communicator& pp, int dst, const Unit& unit, int tag) {
  FULCRUM_ASSIGN_OR_RETURN(UnitSend send, StartSendUnit(pp, dst, unit, tag));
  send.Wait();
  return absl::OkStatus();
}

absl::Status ReceiveUnit(parallel::Communicator& pp, int src, Unit& shell, int tag) {
  return StartReceiveUnit(pp, src, tag).Finish(shell);
}

}  // namespace fulcrum::pipeline
