#include "core/unit.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/tensor_parallel.h"

namespace fulcrum {

std::string OptimizerStatePrefix(const std::string& param) { return "optimizer." + param + "."; }

std::map<std::string, at::Tensor> OptimizerSlotsIn(const std::map<std::string, at::Tensor>& tensors,
                                                   const std::string& param) {
  const std::string prefix = OptimizerStatePrefix(param);
  std::map<std::string, at::Tensor> slots;
  for (auto it = tensors.lower_bound(prefix);
       it != tensors.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    std::string slot = it->first.substr(prefix.size());
    if (slot.find('.') == std::string::npos) slots.emplace(std::move(slot), it->second);
  }
  return slots;
}

Unit::Unit(std::string name, int tp_rank, int tp_size)
    : name_(std::move(name)), tp_rank_(tp_rank), tp_size_(tp_size) {}
Unit::~Unit() = default;

Parameter* Unit::FindParameter(const std::string& local_name) {
  for (auto& p : parameters_) {
    if (p.name == local_name) return &p;
  }
  return nullptr;
}

int64_t Unit::NumParameterElements() const {
  int64_t n = 0;
  for (const auto& p : parameters_) n += p.value.numel();
  return n;
}

void Unit::ZeroGrad() {
  for (auto& p : parameters_) p.value.mutable_grad() = at::Tensor();
}

at::Tensor& Unit::AddParameter(const std::string& local_name, at::Tensor init,
                               bool weight_decay, int64_t tp_shard_dim,
                               const std::string& mirror_of, bool expert_parallel) {
  TORCH_INTERNAL_ASSERT(FindParameter(local_name) == nullptr, "duplicate parameter ",
                        GlobalName(local_name));
  at::Tensor value = init.to(params_device_, params_dtype_).contiguous().detach();
  value.set_requires_grad(true);
  parameters_.push_back(Parameter{local_name, std::move(value), weight_decay,
                                 ShardingSpec{tp_shard_dim, mirror_of, expert_parallel}, {}});
  return parameters_.back().value;
}

at::Tensor& Unit::AddBuffer(const std::string& local_name, at::Tensor init) {
  for (const auto& [name, tensor] : buffers_) {
    TORCH_INTERNAL_ASSERT(name != local_name, "duplicate buffer ", GlobalName(local_name));
  }
  TORCH_CHECK(init.is_contiguous(), "buffer ", GlobalName(local_name), " must be contiguous");
  // Layer migration carries tensors as fp32 or fp64 (pipeline/migration.cc): a buffer's
  // values must survive that exactly.
  const at::ScalarType dtype = init.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBool ||
                  dtype == at::kByte || dtype == at::kChar || dtype == at::kShort,
              "buffer ", GlobalName(local_name),
              " must be float32, float64, bool, uint8, int8 or int16, got ", dtype);
  buffers_.emplace_back(local_name, init.detach());
  return buffers_.back().second;
}

NamedTensors Unit::ParameterTensors() const {
  NamedTensors out;
  out.reserve(parameters_.size());
  for (const auto& p : parameters_) out.emplace_back(GlobalName(p.name), p.value.detach());
  return out;
}

std::vector<Unit::LocalState> Unit::LocalStateTensors(bool expert_parallel_only,
                                                       bool with_moments) const {
  auto split = [&](const Parameter& p) { return p.sharding.TensorParallelDim(tp_size_); };
  auto saved = [&](const Parameter& p) {
    return p.sharding.Saved() && (!expert_parallel_only || p.sharding.expert_parallel);
  };
  std::vector<LocalState> out;
  for (const auto& p : parameters_) {
    if (saved(p)) out.push_back({GlobalName(p.name), p.value.detach(), split(p)});
  }
  if (!expert_parallel_only) {
    for (const auto& [name, tensor] : buffers_) out.push_back({GlobalName(name), tensor.detach()});
  }
  if (optimizer_step_ == 0) return out;
  if (with_moments) {
    for (const auto& p : parameters_) {
      if (!saved(p) || !SavesMomentsOf(p)) continue;
      const std::string base = OptimizerStatePrefix(GlobalName(p.name));
      for (const auto& [slot, tensor] : p.optimizer_state) {
        if (tensor.defined()) out.push_back({base + slot, tensor, split(p)});
      }
    }
  }
  if (expert_parallel_only) return out;
  out.push_back({"optimizer." + name_ + ".step",
                 at::scalar_tensor(optimizer_step_, at::TensorOptions().dtype(at::kLong))});
  return out;
}

NamedTensors Unit::StateTensors(const ShardGatherer& gather, bool expert_parallel_only) const {
  NamedTensors out;
  for (LocalState& state : LocalStateTensors(expert_parallel_only)) {
    out.emplace_back(std::move(state.name), (gather && state.tp_dim >= 0)
                                                ? gather(state.tensor, state.tp_dim)
                                                : std::move(state.tensor));
  }
  return out;
}

NamedTensors Unit::MigrationTensors() const {
  NamedTensors out = StateTensors();
  for (const auto& p : parameters_) {
    if (p.value.grad().defined()) out.emplace_back(GlobalName(p.name) + ".grad", p.value.grad());
  }
  return out;
}

absl::Status Unit::LoadMigrationTensors(const std::map<std::string, at::Tensor>& tensors) {
  auto find = [&](const std::string& name) -> const at::Tensor* {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  };
  auto check_shape = [](const std::string& name, const at::Tensor& got,
                        const at::Tensor& like) -> absl::Status {
    if (got.sizes() != like.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("migrated tensor ", name, " has shape ",
                                                     c10::str(got.sizes()), ", expected ",
                                                     c10::str(like.sizes())));
    }
    return absl::OkStatus();
  };
  const at::Tensor* step = find("optimizer." + name_ + ".step");
  optimizer_step_ = step ? step->item<int64_t>() : 0;
  at::NoGradGuard no_grad;
  for (auto& [local, buffer] : buffers_) {
    const at::Tensor* value = find(GlobalName(local));
    if (value == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("migrated unit ", name_, " lacks ", GlobalName(local)));
    }
    FULCRUM_RETURN_IF_ERROR(check_shape(GlobalName(local), *value, buffer));
    buffer.copy_(*value);
  }
  for (auto& p : parameters_) {
    const std::string name = GlobalName(p.name);
    const at::Tensor* value = find(name);
    if (value == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("migrated unit ", name_, " lacks ", name));
    }
    FULCRUM_RETURN_IF_ERROR(check_shape(name, *value, p.value));
    p.value.copy_(*value);  // in place: NOTE [parameter identity]
    const at::Tensor* grad = find(name + ".grad");
    if (grad != nullptr) FULCRUM_RETURN_IF_ERROR(check_shape(name + ".grad", *grad, p.value));
    // Migrations may carry a wider dtype than the parameter's; state takes the parameter's.
    auto own = [&p](const at::Tensor& t) { return t.to(p.value.options(), false, /*copy=*/true); };
    p.value.mutable_grad() = grad ? own(*grad) : at::Tensor();
    // Every slot of its optimizer state that came with it, whatever the optimizer's.
    p.optimizer_state.clear();
    if (step != nullptr) {
      for (const auto& [slot, tensor] : OptimizerSlotsIn(tensors, name)) {
        FULCRUM_RETURN_IF_ERROR(check_shape(OptimizerStatePrefix(name) + slot, tensor, p.value));
        p.optimizer_state[slot] = own(tensor);
      }
      if (p.optimizer_state.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("migrated unit ", name_, " lacks the optimizer state of ", name));
      }
    }
  }
  // Every parameter carries the same slots (the sender's optimizer gave each the same).
  std::set<std::string> slots;
  for (const auto& p : parameters_) {
    for (const auto& [slot, tensor] : p.optimizer_state) slots.insert(slot);
  }
  for (const auto& p : parameters_) {
    for (const std::string& slot : slots) {
      if (p.optimizer_state.count(slot) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("migrated unit ", name_, " lacks ",
                                                       OptimizerStatePrefix(GlobalName(p.name)), slot));
      }
    }
  }
  StateLoaded();
  return absl::OkStatus();
}

absl::Status Unit::LoadStateTensors(
    const std::function<absl::StatusOr<at::Tensor>(const std::string&)>& lookup,
    const std::vector<std::string>& optimizer_slots,
    const std::optional<SliceLookup>& slice_lookup) {
  absl::Status status = LoadState(lookup, optimizer_slots, slice_lookup);
  if (status.ok()) StateLoaded();
  return status;
}

absl::Status Unit::LoadState(
    const std::function<absl::StatusOr<at::Tensor>(const std::string&)>& lookup,
    const std::vector<std::string>& optimizer_slots,
    const std::optional<SliceLookup>& slice_lookup) {
  auto load_into = [&](const std::string& name, const Parameter& p,
                       at::Tensor* out) -> absl::Status {
    const at::Tensor& like = p.value;
    const int64_t dim = p.sharding.TensorParallelDim(tp_size_);
    at::Tensor t;
    if (dim >= 0) {
      // This rank's shard, read alone when the lookup can (a sharded checkpoint).
      std::vector<int64_t> whole;
      if (slice_lookup) {
        FULCRUM_ASSIGN_OR_RETURN(whole, slice_lookup->shape(name));
      } else {
        FULCRUM_ASSIGN_OR_RETURN(t, lookup(name));
        whole = t.sizes().vec();
      }
      if (dim >= static_cast<int64_t>(whole.size()) || whole[dim] != like.size(dim) * tp_size_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", name, " has shape ", c10::str(c10::IntArrayRef(whole)), "; sharding it over ",
            tp_size_, " tensor-parallel ranks along dimension ", dim, " cannot give ",
            c10::str(like.sizes())));
      }
      if (slice_lookup) {
        FULCRUM_ASSIGN_OR_RETURN(
            t, slice_lookup->slice(name, dim, tp_rank_ * like.size(dim), like.size(dim)));
      } else {
        t = ShardOf(t, dim, tp_rank_, tp_size_);
      }
    } else {
      FULCRUM_ASSIGN_OR_RETURN(t, lookup(name));
    }
    if (t.sizes() != like.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", name, " has shape ", c10::str(t.sizes()), ", the model expects ",
          c10::str(like.sizes())));
    }
    // The parameter's device and dtype: a checkpoint is read on the host, and Adam's
    // moments must sit beside the weights they update (NOTE [device seam]).
    *out = t.to(like.options(), /*non_blocking=*/false, /*copy=*/true).contiguous();
    return absl::OkStatus();
  };
  // A mirror loads its source's tensors (Parameter::mirror_of).
  auto stored_name = [&](const Parameter& p) {
    return p.sharding.Saved() ? GlobalName(p.name) : p.sharding.mirror_of;
  };
  for (auto& p : parameters_) {
    at::Tensor loaded;
    FULCRUM_RETURN_IF_ERROR(load_into(stored_name(p), p, &loaded));
    at::NoGradGuard no_grad;
    p.value.copy_(loaded);
  }
  for (auto& [local, buffer] : buffers_) {
    const std::string name = GlobalName(local);
    FULCRUM_ASSIGN_OR_RETURN(at::Tensor t, lookup(name));
    if (t.sizes() != buffer.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape ",
                                                     c10::str(t.sizes()), ", the model expects ",
                                                     c10::str(buffer.sizes())));
    }
    buffer.copy_(t);
  }
  if (optimizer_slots.empty()) return absl::OkStatus();
  auto step = lookup("optimizer." + name_ + ".step");
  if (!step.ok()) {
    if (!absl::IsNotFound(step.status())) return step.status();
    // A checkpoint saved before the first optimizer step has no optimizer state.
    optimizer_step_ = 0;
    for (auto& p : parameters_) p.optimizer_state.clear();
    return absl::OkStatus();
  }
  optimizer_step_ = step->item<int64_t>();
  for (auto& p : parameters_) {
    const std::string base = OptimizerStatePrefix(stored_name(p));
    p.optimizer_state.clear();
    for (const std::string& slot : optimizer_slots) {
      FULCRUM_RETURN_IF_ERROR(load_into(base + slot, p, &p.optimizer_state[slot]));
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
