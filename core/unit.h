// A Unit is the movable piece of a model: one transformer layer, the embedding, or the
// output head. Invariant 2 of DESIGN.md lives here: a unit owns its parameters, their
// gradients (in the parameter tensors' .grad) and their optimizer state, all addressable
// by global name, so it can be checkpointed, restored or sent to another pipeline stage
// on its own without touching any other unit.
//
// Global names: a parameter `self_attention.linear_qkv.weight` of unit `layers.3` is
// `layers.3.self_attention.linear_qkv.weight`; each tensor of its optimizer state is
// `optimizer.layers.3.self_attention.linear_qkv.weight.<slot>` (AdamW's slots: `exp_avg`,
// `exp_avg_sq`), and the unit's step counter is `optimizer.layers.3.step`.
//
// NOTE [parameter identity]
// A parameter's `value` tensor is created once, in the unit's constructor, and never
// replaced: optimizer steps and checkpoint loads write into it in place. Units keep
// handles to their parameters (sharing the tensor) for their forward code and rely on it.
//
// Not thread-safe; a unit belongs to one stage at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum {

/// One trainable tensor of a unit and the AdamW state that travels with it.
// NOTE [parameter sharding]
// How one parameter lies over the parallel groups, as one value that every reader asks
// rather than working it out again from the fields: the gradient reduction (which
// data-parallel group sums it: ReducedOverExpertData), the gradient norm and the parameter
// counts (which ranks count their copy: CountedOn), the checkpoint (Saved; a tensor-parallel
// slice is gathered along tp_shard_dim), layer migration and re-packing (a mirror is rebuilt
// from its source), and plugins that sum per-layer gradient statistics over the model.
// The tensor-parallel sum of sequence-parallel gradients reads it too.
struct ShardingSpec {
  // Dimension split over the tensor-parallel group, -1 if replicated (NOTE
  // [tensor-parallel sharding] in core/tensor_parallel.h).
  int64_t tp_shard_dim = -1;
  // Global name of the parameter this one mirrors, or empty. A mirror is a replica kept on
  // another pipeline stage (the tied output weight on the last stage mirrors
  // embedding.word_embeddings.weight): both receive the summed gradient and the same
  // update, so they stay equal. A mirror is not checkpointed (it loads from its source)
  // and not counted in the gradient norm.
  std::string mirror_of;
  // Sharded over the expert-parallel group: each rank of that group holds different
  // parameters of this kind (an MoE layer's local experts, named by global expert id), so
  // their gradients are summed over the expert-data-parallel group instead of the data-
  // parallel one, the gradient norm sums them over the expert-parallel group, and each
  // expert-parallel rank writes its own to checkpoints.
  bool expert_parallel = false;
  // Replicated over the tensor-parallel group but used on this rank's sequence shard
  // (NOTE [sequence parallelism] in core/tensor_parallel.h: the norms, the row-parallel
  // biases, the position embeddings under --sequence_parallel): each rank's gradient covers
  // its rows only, so the gradients are summed over the tensor-parallel group before any
  // other reduction (ParallelContext::AllReduceModelParallelGradients).
  bool sequence_parallel = false;

  /// Split over a tensor-parallel group of `tp_size` ranks (each holds a slice).
  bool TensorParallelSharded(int tp_size) const { return tp_shard_dim >= 0 && tp_size > 1; }
  /// The dimension split over a tensor-parallel group of `tp_size` ranks, -1 when every
  /// rank holds the whole.
  int64_t TensorParallelDim(int tp_size) const {
    return TensorParallelSharded(tp_size) ? tp_shard_dim : -1;
  }
  /// Whether the copy on tensor-parallel rank `tp_rank` counts in sums over the model (the
  /// gradient norm, parameter counts, per-layer gradient statistics): a slice on every
  /// rank, a replicated parameter on rank 0 only (the others hold the same), a mirror never
  /// (its source counts). Sums over the model-parallel ranks of these count each once.
  bool CountedOn(int tp_rank, int tp_size) const {
    return mirror_of.empty() && (TensorParallelSharded(tp_size) || tp_rank == 0);
  }
  /// Its gradient is summed over the expert-data-parallel group, not the data-parallel one,
  /// and its share of the norm over the expert-parallel group too.
  bool ReducedOverExpertData() const { return expert_parallel; }
  /// Written to checkpoints (a mirror loads from its source).
  bool Saved() const { return mirror_of.empty(); }
};

struct Parameter {
  std::string name;      // Local name inside the unit, e.g. "mlp.linear_fc1.weight".
  at::Tensor value;      // fp32 leaf tensor with requires_grad; its .grad() is the gradient.
  bool weight_decay;     // False for biases and norm parameters (no decoupled decay).
  ShardingSpec sharding; // NOTE [parameter sharding].
  /// The optimizer's state of this parameter (NOTE [optimizer state residency] in
  /// core/optimizer/optimizer.h): tensors of its shape, each under the name the optimizer
  /// gives it (Optimizer::StateSlots(); AdamW: its two moments) — also the last part of its
  /// checkpoint name. Empty before the first step; an undefined tensor counts as absent.
  /// Checkpoints, layer moves, re-packing and plugins treat every slot alike: only the
  /// optimizer knows what one means.
  std::map<std::string, at::Tensor> optimizer_state;

  /// The state of `slot`, created (undefined) when absent, for the optimizer to fill.
  at::Tensor& OptimizerState(const std::string& slot) { return optimizer_state[slot]; }
  /// The state of `slot`, or an undefined tensor.
  at::Tensor OptimizerState(const std::string& slot) const {
    auto it = optimizer_state.find(slot);
    return it == optimizer_state.end() ? at::Tensor() : it->second;
  }
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// "optimizer.<param>.": the prefix of the names of parameter `param`'s optimizer state
/// (its global name; each slot is the prefix + the slot's name).
std::string OptimizerStatePrefix(const std::string& param);
/// The slots of `param`'s optimizer state among `tensors` (named as above), by slot name.
/// A slot's name has no dot, so another parameter whose name extends `param`'s is not read.
std::map<std::string, at::Tensor> OptimizerSlotsIn(const std::map<std::string, at::Tensor>& tensors,
                                                   const std::string& param);

class Unit {
 public:
  /// `tp_rank`/`tp_size`: this rank's place in the tensor-parallel group, which decides the
  /// slice of each sharded parameter it holds.
  explicit Unit(std::string name, int tp_rank = 0, int tp_size = 1);
  virtual ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  /// Global unit name: "embedding", "layers.<i>", "head".
  const std::string& name() const { return name_; }
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }

  /// The parameter with local name `local_name`, or nullptr.
  Parameter* FindParameter(const std::string& local_name);

  /// Number of optimizer steps applied to this unit (AdamW bias correction uses it).
  int64_t optimizer_step() const { return optimizer_step_; }
  void set_optimizer_step(int64_t step) { optimizer_step_ = step; }

  /// Total number of scalars in this unit's parameters.
  int64_t NumParameterElements() const;

  /// Clears every parameter's gradient (sets it to undefined).
  void ZeroGrad();

  /// Parameter values under their global names.
  NamedTensors ParameterTensors() const;

  /// Gathers a shard split along `dim` over the tensor-parallel group into the full tensor.
  using ShardGatherer = std::function<at::Tensor(const at::Tensor& shard, int64_t dim)>;

  /// One tensor of the unit's persistent state as this rank holds it.
  struct LocalState {
    std::string name;  // Global.
    at::Tensor tensor;
    /// ≥ 0: `tensor` is this rank's shard (tp_rank() of tp_size() equal slices along this
    /// dimension) of the whole; −1: it is the whole.
    int64_t tp_dim = -1;
  };
  /// Parameter values, buffers, then (when the optimizer has stepped) the moments — unless
  /// `with_moments` is false (an optimizer that holds them sliced writes its slices) — and
  /// the step counter, under their global names: the unit's whole persistent state as this
  /// rank holds it, nothing gathered. With `expert_parallel_only`, only the
  /// expert-parallel parameters and their moments (what an expert-parallel rank other than
  /// the first adds to a checkpoint).
  std::vector<LocalState> LocalStateTensors(bool expert_parallel_only = false,
                                            bool with_moments = true) const;

  /// LocalStateTensors as named tensors: tensor-parallel shards as they are, or gathered
  /// into the whole when `gather` is given (a full checkpoint, a layer moving between ranks
  /// of different tensor-parallel sizes).
  NamedTensors StateTensors(const ShardGatherer& gather = nullptr,
                            bool expert_parallel_only = false) const;

  /// Restores what StateTensors(gather) produced: full tensors, of which this rank keeps its
  /// shard. `lookup(global_name)` returns the tensor, a
  /// NotFound error when it is absent, or another error. Every parameter must be present
  /// with the right shape, and every buffer. With `optimizer_slots` (the optimizer's
  /// Optimizer::StateSlots(); empty: the weights alone), each parameter's state is read
  /// when the step counter is present (absent: the checkpoint predates the first step,
  /// state resets).
  /// `slice_lookup`, when given, reads a tensor-parallel shard alone (a sharded checkpoint
  /// reads just its bytes): `shape(name)` is the whole tensor's shape, `slice(name, dim,
  /// start, length)` the rows [start, start + length) of it along `dim`.
  struct SliceLookup {
    std::function<absl::StatusOr<std::vector<int64_t>>(const std::string& name)> shape;
    std::function<absl::StatusOr<at::Tensor>(const std::string& name, int64_t dim,
                                              int64_t start, int64_t length)>
        slice;
  };
  absl::Status LoadStateTensors(
      const std::function<absl::StatusOr<at::Tensor>(const std::string&)>& lookup,
      const std::vector<std::string>& optimizer_slots,
      const std::optional<SliceLookup>& slice_lookup = std::nullopt);

  /// Whether a checkpoint holds Adam's moments of `p`: none before the first step, none for
  /// a mirror (it loads its source's).
  bool SavesMomentsOf(const Parameter& p) const {
    return optimizer_step_ > 0 && p.sharding.Saved();
  }

  /// Everything that travels with the unit when it moves to another pipeline stage (NOTE
  /// [layer migration] in core/gpt_model.h), under global names: values, gradients
  /// ("<name>.grad", when defined), moments and the step counter. Tensor-parallel shards
  /// travel as they are: a unit moves between stages of the same tensor-parallel rank.
  /// Units with state that lives outside their parameters and buffers (a TransformerLayer's
  /// FeedForward) add it here.
  virtual NamedTensors MigrationTensors() const;

  /// Restores what MigrationTensors() produced into this unit (a shell of the same layer).
  /// Values and moments are copied bit for bit; gradients are installed as they arrived.
  virtual absl::Status LoadMigrationTensors(const std::map<std::string, at::Tensor>& tensors);

  /// The global name of a local parameter name.
  std::string GlobalName(const std::string& local_name) const { return name_ + "." + local_name; }

  /// Registers a parameter during construction — by the unit itself or by a block it owns
  /// (a FeedForward, core/feed_forward.h), never later. `init` is this rank's initial value
  /// (a shard along `tp_shard_dim`, or the whole tensor when -1); it is made a leaf of
  /// params_dtype() that requires grad. Returns the stored tensor (NOTE [parameter identity]).
  at::Tensor& AddParameter(const std::string& local_name, at::Tensor init, bool weight_decay,
                           int64_t tp_shard_dim = -1, const std::string& mirror_of = "",
                           bool expert_parallel = false);

  /// The dtype AddParameter stores values in (the master dtype of ModelOptions::device_spec):
  /// fp32 by default.
  at::ScalarType params_dtype() const { return params_dtype_; }
  /// The device AddParameter puts values on (ModelOptions::device_spec.device): cpu by default.
  c10::Device params_device() const { return params_device_; }

  /// Registers persistent state that is not trained (e.g. the expert bias of an
  /// auxiliary-loss-free router, a pruning mask, a frozen flag): checkpointed and migrated
  /// with the unit under its global name, restored in place. The unit keeps `init` itself
  /// (sharing its storage, which must be contiguous), so the owner and the unit see the
  /// same values; the owner updates it in place only. Its dtype is fp32, fp64, or one that
  /// fp32 holds exactly (bool, uint8, int8, int16): migrations carry fp32 or fp64.
  at::Tensor& AddBuffer(const std::string& local_name, at::Tensor init);

  /// Registers `callback`, run after every load of this unit's state (LoadStateTensors and
  /// LoadMigrationTensors, once everything is restored): what derives from the unit's state
  /// — a plugin's sparse structure from its mask, parameters frozen by a flag — is derived
  /// again there. Registered during construction, by the unit or a plugin's EditLayer.
  void OnStateLoaded(std::function<void(Unit&)> callback) {
    state_loaded_.push_back(std::move(callback));
  }
  /// Derived state a plugin keeps with the unit under `key` (not saved, not migrated: a
  /// migrated layer's shell gets its own from the plugin's EditLayer and rebuilds it in an
  /// OnStateLoaded callback). Replaces an earlier value under the same key.
  void Attach(const std::string& key, std::shared_ptr<void> value) {
    attachments_[key] = std::move(value);
  }
  /// The value attached under `key` as a T (the type it was attached with), or null.
  template <typename T>
  T* Attached(const std::string& key) const {
    auto it = attachments_.find(key);
    return it == attachments_.end() ? nullptr : static_cast<T*>(it->second.get());
  }

  /// Runs the OnStateLoaded callbacks (the loaders call it; so may a plugin that changed
  /// the state in place).
  void StateLoaded() {
    for (auto& callback : state_loaded_) callback(*this);
  }
  /// Buffers by local name.
  const std::vector<std::pair<std::string, at::Tensor>>& buffers() const { return buffers_; }
  /// The buffer with local name `local_name` (a handle sharing its storage), or an undefined
  /// tensor.
  at::Tensor FindBuffer(const std::string& local_name) const {
    for (const auto& [name, buffer] : buffers_) {
      if (name == local_name) return buffer;
    }
    return at::Tensor();
  }

 private:
  std::string name_;
  int tp_rank_;
  int tp_size_;
  std::vector<Parameter> parameters_;
  std::vector<std::pair<std::string, at::Tensor>> buffers_;
  // LoadStateTensors without the callbacks.
  absl::Status LoadState(
      const std::function<absl::StatusOr<at::Tensor>(const std::string&)>& lookup,
      const std::vector<std::string>& optimizer_slots,
      const std::optional<SliceLookup>& slice_lookup);

  int64_t optimizer_step_ = 0;
  at::ScalarType params_dtype_ = at::kFloat;
  c10::Device params_device_ = c10::Device(c10::kCPU);
  std::vector<std::function<void(Unit&)>> state_loaded_;
  std::map<std::string, std::shared_ptr<void>> attachments_;

 protected:
  /// Sets params_dtype() and params_device() — in a subclass's constructor, before its
  /// first AddParameter.
  void set_params_dtype(at::ScalarType dtype, c10::Device device = c10::Device(c10::kCPU)) {
    params_dtype_ = dtype;
    params_device_ = device;
  }
};

}  // namespace fulcrum
