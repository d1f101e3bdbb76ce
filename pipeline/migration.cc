#include "pipeline/migration.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fulcrum::pipeline {
namespace {

// Tags of the three messages; a migration never overlaps a micro-batch's messages (it runs
// after the schedule has drained), but distinct tags keep a mismatch detectable.
constexpr int kHeaderTag = 1 << 20;
constexpr int kNamesTag = kHeaderTag + 1;
constexpr int kPayloadTag = kHeaderTag + 2;

}  // namespace

absl::Status SendUnit(parallel::Communicator& pp, int dst, const Unit& unit) {
  NamedTensors tensors = unit.MigrationTensors();
  std::string names;
  std::vector<at::Tensor> values;
  int64_t step = 0;
  for (auto& [name, tensor] : tensors) {
    if (tensor.scalar_type() == at::kLong) {  // the step counter
      step = tensor.item<int64_t>();
      continue;
    }
    absl::StrAppend(&names, name, ":", tensor.numel(), "\n");
    values.push_back(tensor.detach().to(at::kFloat).reshape({-1}));
  }
  at::Tensor payload = at::cat(values);
  at::Tensor header = at::tensor({static_cast<int64_t>(names.size()), payload.numel(), step}, at::kLong);
  at::Tensor blob = at::empty({static_cast<int64_t>(names.size())}, at::kByte);
  std::memcpy(blob.data_ptr<uint8_t>(), names.data(), names.size());
  pp.Send(header, dst, kHeaderTag);
  pp.Send(blob, dst, kNamesTag);
  pp.Send(payload, dst, kPayloadTag);
  return absl::OkStatus();
}

absl::Status ReceiveUnit(parallel::Communicator& pp, int src, Unit& shell) {
  at::Tensor header = at::empty({3}, at::kLong);
  pp.Recv(header, src, kHeaderTag);
  const int64_t names_bytes = header[0].item<int64_t>();
  const int64_t numel = header[1].item<int64_t>();
  const int64_t step = header[2].item<int64_t>();
  at::Tensor blob = at::empty({names_bytes}, at::kByte);
  pp.Recv(blob, src, kNamesTag);
  at::Tensor payload = at::empty({numel}, at::kFloat);
  pp.Recv(payload, src, kPayloadTag);

  // Shapes come from the shell: every tensor of a parameter has the parameter's shape.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const Parameter& p : shell.parameters()) {
    const std::string name = shell.GlobalName(p.name);
    for (const std::string& key : {name, name + ".grad", "optimizer." + name + ".exp_avg",
                                   "optimizer." + name + ".exp_avg_sq"}) {
      shapes[key] = p.value.sizes().vec();
    }
  }
  std::map<std::string, at::Tensor> tensors;
  const std::string names(reinterpret_cast<const char*>(blob.data_ptr<uint8_t>()), names_bytes);
  int64_t offset = 0;
  for (absl::string_view line : absl::StrSplit(names, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 1));
    const int64_t count = std::stoll(parts.second);
    auto shape = shapes.find(parts.first);
    if (shape == shapes.end() || offset + count > numel) {
      return absl::DataLossError(absl::StrCat("migration from stage ", src, " into ", shell.name(),
                                              ": unexpected tensor ", parts.first));
    }
    tensors[parts.first] = payload.narrow(0, offset, count).view(shape->second).clone();
    offset += count;
  }
  if (step > 0) {
    tensors["optimizer." + shell.name() + ".step"] = at::scalar_tensor(step, at::kLong);
  }
  return shell.LoadMigrationTensors(tensors);
}

}  // namespace fulcrum::pipeline
