#include "core/distributed_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/logging.h"
#include "core/status.h"
#include "core/trainer.h"

namespace fulcrum {

std::vector<std::pair<int64_t, int64_t>> GatherLayerPlacement(const GptModel& stage,
                                                              ParallelContext& collectives) {
  // With model chunks a rank's span [first chunk's begin, last chunk's end) is not its
  // layers: the placement is every chunk's range, in layer order (the model order), so the
  // checkpoint stays layout-free and loads under any schedule (every rank has the same
  // chunk count, so the gathers match). Without, chunk 0 is the stage's range.
  const int chunks = stage.num_chunks();
  std::vector<std::pair<int64_t, int64_t>> placement;
  for (const auto& stage_ranges :
       GatherChunkRanges(stage, chunks, [&collectives](const at::Tensor& row) {
         return collectives.StackOverPipeline(row);
       })) {
    placement.insert(placement.end(), stage_ranges.begin(), stage_ranges.end());
  }
  if (chunks > 1) std::sort(placement.begin(), placement.end());
  return placement;
}

CheckpointCollectives CheckpointCollectivesOf(ParallelContext& collectives) {
  CheckpointCollectives out;
  out.barrier = [&collectives] { collectives.Barrier(); };
  out.sum_over_job = [&collectives](std::vector<double>& values) {
    collectives.SumOverDataParallel(values);
    collectives.SumOverModelParallel(values);
  };
  if (TensorParallelGroup* tp = collectives.tensor_parallel()) {
    out.gather_shard = [tp](const at::Tensor& shard, int64_t dim) {
      return tp->AllGather(shard, dim);
    };
  }
  return out;
}

namespace {

// Where a tensor-parallel shard lies in its whole: the whole's shape and the box's start.
ckpt::TensorPiece TensorParallelBox(const std::string& name, const at::Tensor& shard,
                                    int64_t tp_dim, int tp_rank, int tp_size) {
  ckpt::TensorPiece piece;
  piece.name = name;
  piece.shape = shard.sizes().vec();
  piece.offsets.assign(piece.shape.size(), 0);
  if (tp_dim >= 0) {
    piece.shape[tp_dim] *= tp_size;
    piece.offsets[tp_dim] = tp_rank * shard.size(tp_dim);
  }
  piece.tensor = shard;
  return piece;
}

// What one rank writes to a sharded checkpoint (NOTE [sharded checkpoints]): its part's
// tensors, tensor-parallel shards as boxes and the rest only from tp rank 0 (the others
// hold copies), plus the moment slices it owns when the optimizer holds them sliced.
void ShardedState(const CheckpointSave& save, const std::vector<Unit*>& units, CheckpointPart part,
                  NamedTensors* whole, std::vector<ckpt::TensorPiece>* pieces) {
  const bool moments_sliced = save.moment_slices.has_value();
  if (part != CheckpointPart::kNothing) {
    for (Unit* unit : units) {
      for (Unit::LocalState& state : unit->LocalStateTensors(
               part == CheckpointPart::kExpertParallel, /*with_moments=*/!moments_sliced)) {
        if (state.tp_dim >= 0) {
          pieces->push_back(TensorParallelBox(state.name, state.tensor, state.tp_dim,
                                              unit->tp_rank(), unit->tp_size()));
        } else if (unit->tp_rank() == 0) {
          whole->emplace_back(std::move(state.name), std::move(state.tensor));
        }
      }
    }
  }
  if (!moments_sliced) return;
  for (const MomentSlice& slice : *save.moment_slices) {
    const Parameter& p = *slice.param;
    if (!slice.unit->SavesMomentsOf(p)) continue;
    const int64_t tp_dim = p.sharding.TensorParallelDim(slice.unit->tp_size());
    // A parameter replicated over tensor parallelism has the same slices on every tp rank.
    if (tp_dim < 0 && slice.unit->tp_rank() != 0) continue;
    const std::string base = OptimizerStatePrefix(slice.unit->GlobalName(p.name));
    for (const auto& [slot, values] : slice.state) {
      ckpt::TensorPiece piece = TensorParallelBox(base + slot, p.value.detach(), tp_dim,
                                                  slice.unit->tp_rank(), slice.unit->tp_size());
      piece.box = p.value.sizes().vec();
      piece.flat = true;
      piece.flat_begin = slice.begin;
      piece.flat_end = slice.end;
      piece.tensor = values;
      pieces->push_back(std::move(piece));
    }
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A copy in new CPU memory, so the model may change while it is written.
at::Tensor Snapshot(const at::Tensor& tensor) {
  return tensor.detach().to(tensor.options().device(at::kCPU), /*non_blocking=*/false,
                            /*copy=*/true, at::MemoryFormat::Contiguous);
}

}  // namespace

SaveInProgress::SaveInProgress() = default;
SaveInProgress::~SaveInProgress() = default;

int64_t SaveInProgress::bytes() const {
  int64_t total = 0;
  for (const auto& [name, tensor] : tensors_) total += tensor.nbytes();
  for (const ckpt::TensorPiece& piece : pieces_) total += piece.tensor.nbytes();
  return total;
}

std::unique_ptr<SaveInProgress> StartSave(const CheckpointSave& save,
                                          const std::vector<Unit*>& units, const RankRoles& roles,
                                          const CheckpointCollectives& collectives) {
  std::unique_ptr<SaveInProgress> out(new SaveInProgress());
  out->start_ = std::chrono::steady_clock::now();
  out->save_ = save;
  out->save_.moment_slices.reset();  // ShardedState turns them into pieces_.
  const int64_t iteration = save.iteration;
  // Checkpoints are layout-free (invariant 4). Full: tensor-parallel shards are gathered,
  // which every rank of the group takes part in; data-parallel replicas hold the same
  // state; expert-parallel ranks hold different experts: each saves its own. Sharded: every
  // rank writes the pieces it holds, the reader assembles them.
  out->committer_ = roles.commits_checkpoint;
  using Part = CheckpointPart;
  const Part part = roles.checkpoint_part;
  if (save.sharded) {
    ShardedState(save, units, part, &out->tensors_, &out->pieces_);
  } else if (part != Part::kNothing) {
    for (Unit* unit : units) {
      NamedTensors state =
          unit->StateTensors(collectives.gather_shard, part == Part::kExpertParallel);
      out->tensors_.insert(out->tensors_.end(), state.begin(), state.end());
    }
  }
  out->writer_ = save.sharded
                     ? (out->committer_ || !out->tensors_.empty() || !out->pieces_.empty())
                     : roles.writes_checkpoint_shard;
  out->shard_name_ =
      save.sharded ? absl::StrFormat("rank_%05d", roles.world_rank) : roles.checkpoint_shard_name;
  if (out->committer_) {
    // The default generator is not used by training itself (NOTE [layout-independent
    // randomness]) but user and plugin code may draw from it; restore it on resume.
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    out->tensors_.emplace_back("rng.torch_cpu", generator.get_state());
  }
  out->status_ = save.local_status;
  if (save.snapshot) {
    // The copy is where a host runs out of memory: that fails this save on every rank
    // (FinishSave), it does not skip the barrier below.
    try {
      for (auto& [name, tensor] : out->tensors_) tensor = Snapshot(tensor);
      for (ckpt::TensorPiece& piece : out->pieces_) piece.tensor = Snapshot(piece.tensor);
    } catch (const std::exception& e) {
      out->tensors_.clear();
      out->pieces_.clear();
      if (out->status_.ok()) {
        out->status_ = absl::ResourceExhaustedError(absl::StrCat(
            "copying the checkpoint of iteration ", iteration, " into host memory: ", e.what()));
      }
    }
  }
  // The committer creates the temporary directory; the other writers join it once it
  // exists, and the committer commits once every shard is written (FinishSave). Every rank
  // passes every barrier whatever fails, so an error on one rank is reported, never turned
  // into a hang.
  if (out->committer_ && out->status_.ok()) {
    auto begun = ckpt::CheckpointWriter::Begin(save.fs, save.dir, iteration);
    if (begun.ok()) {
      out->ckpt_writer_ = std::make_unique<ckpt::CheckpointWriter>(std::move(*begun));
    } else {
      out->status_ = begun.status();
    }
  }
  collectives.barrier();
  if (out->writer_ && !out->committer_ && out->status_.ok()) {
    auto joined = ckpt::CheckpointWriter::Join(save.fs, save.dir, iteration);
    if (joined.ok()) {
      out->ckpt_writer_ = std::make_unique<ckpt::CheckpointWriter>(std::move(*joined));
    } else {
      out->status_ = joined.status();
    }
  }
  out->start_seconds_ = SecondsSince(out->start_);
  return out;
}

void SaveInProgress::Write() {
  TORCH_INTERNAL_ASSERT(!written_, "SaveInProgress::Write called twice");
  written_ = true;
  if (writer_ && status_.ok()) status_ = ckpt_writer_->WriteShard(shard_name_, tensors_, pieces_);
  // What was written is on disk: the host copy goes now, not at FinishSave.
  tensors_.clear();
  pieces_.clear();
}

absl::Status FinishSave(SaveInProgress& save, const CheckpointCollectives& collectives) {
  TORCH_INTERNAL_ASSERT(save.written_, "FinishSave before SaveInProgress::Write");
  const int64_t iteration = save.iteration();
  absl::Status status = save.status_;
  // A writer that failed leaves its shard missing, and Commit refuses an incomplete set
  // only if it knows the set: the committer also checks every writer reported success.
  std::vector<double> failures{status.ok() ? 0.0 : 1.0};
  collectives.sum_over_job(failures);
  if (save.committer_ && status.ok()) {
    if (failures[0] > 0) {
      status = absl::InternalError(absl::StrCat("checkpoint of iteration ", iteration, ": ",
                                                failures[0], " rank(s) failed to write their shard"));
    } else {
      status = save.ckpt_writer_->Commit(save.save_.manifest_fields);
    }
  }
  // Every rank learns whether the checkpoint was committed: a save that failed anywhere
  // fails everywhere, so no rank trains on into collectives the others have left.
  std::vector<double> committed{save.committer_ && status.ok() ? 1.0 : 0.0};
  collectives.sum_over_job(committed);
  if (status.ok() && committed[0] == 0) {
    status = absl::InternalError(absl::StrCat(
        "the checkpoint of iteration ", iteration, " was not committed: ",
        failures[0] > 0 ? absl::StrCat(failures[0], " rank(s) failed to write their shard")
                        : std::string("its commit failed"),
        " (the failing ranks' and the committing rank's logs say why)"));
  }
  if (save.committer_) {
    if (status.ok()) {
      FULCRUM_LOG(INFO) << "checkpoint of iteration " << iteration << " written in "
                        << absl::StrFormat("%.2f s", SecondsSince(save.start_));
      if (save.save_.keep_last > 0) {
        auto removed = ckpt::RemoveOldCheckpoints(save.save_.fs, save.save_.dir,
                                                  save.save_.keep_last);
        if (!removed.ok()) {
          FULCRUM_LOG(WARNING) << "--save_keep_last: " << removed.status().message();
        } else if (!removed->empty()) {
          FULCRUM_LOG(INFO) << "removed " << absl::StrJoin(*removed, ", ")
                            << " (--save_keep_last=" << save.save_.keep_last << ")";
        }
      }
    }
  }
  if (save.committer_ && !status.ok() && save.ckpt_writer_ != nullptr) {
    // A failed save leaves nothing behind; the checkpoints before it are untouched.
    if (absl::Status aborted = save.ckpt_writer_->Abort(); !aborted.ok()) {
      FULCRUM_LOG(WARNING) << "could not remove " << save.ckpt_writer_->temp_dir() << ": "
                           << aborted;
    }
  }
  collectives.barrier();
  return status;
}

absl::Status SaveCheckpoint(const CheckpointSave& save, const std::vector<Unit*>& units,
                            const RankRoles& roles, const CheckpointCollectives& collectives) {
  std::unique_ptr<SaveInProgress> in_progress = StartSave(save, units, roles, collectives);
  in_progress->Write();
  return FinishSave(*in_progress, collectives);
}

BackgroundSave::BackgroundSave(std::unique_ptr<SaveInProgress> save) : save_(std::move(save)) {
  TORCH_INTERNAL_ASSERT(save_->save_.snapshot, "a background save must write a snapshot");
  try {
    thread_ = std::thread([this] { WriteAndMark(); });
  } catch (const std::system_error& e) {
    FULCRUM_LOG(WARNING) << "cannot start a thread for the background save of iteration "
                         << save_->iteration() << " (" << e.what() << "); writing it now";
    WriteAndMark();
  }
}

void BackgroundSave::WriteAndMark() {
  // Nothing may leave the thread (std::terminate): an exception fails this rank's save,
  // which FinishSave then fails on every rank.
  try {
    save_->Write();
  } catch (const std::exception& e) {
    save_->status_ = absl::InternalError(absl::StrCat("writing the checkpoint of iteration ",
                                                      save_->iteration(), ": ", e.what()));
  } catch (...) {
    save_->status_ = absl::InternalError(absl::StrCat("writing the checkpoint of iteration ",
                                                      save_->iteration(), ": unknown exception"));
  }
  written_.store(true, std::memory_order_release);
}

BackgroundSave::~BackgroundSave() {
  Join();
  if (!finished_) {
    FULCRUM_LOG(WARNING) << "the background save of iteration " << save_->iteration()
                         << " was never finished: it is not committed";
  }
}

void BackgroundSave::Join() {
  if (thread_.joinable()) thread_.join();
}

std::optional<absl::Status> BackgroundSave::FinishIfWritten(
    const CheckpointCollectives& collectives) {
  std::vector<double> writing{written() ? 0.0 : 1.0};
  collectives.sum_over_job(writing);
  if (writing[0] > 0) return std::nullopt;
  return Finish(collectives);
}

absl::Status BackgroundSave::Finish(const CheckpointCollectives& collectives) {
  TORCH_INTERNAL_ASSERT(!finished_, "BackgroundSave::Finish called twice");
  Join();
  finished_ = true;
  return FinishSave(*save_, collectives);
}

namespace {

// A unit's tensor-parallel shard of a checkpoint's tensor, reading only the bytes it needs
// when the tensor is stored as pieces (CheckpointReader::ReadSlice).
Unit::SliceLookup ShardLookup(const ckpt::CheckpointReader& reader) {
  Unit::SliceLookup lookup;
  lookup.shape = [&reader](const std::string& name) -> absl::StatusOr<std::vector<int64_t>> {
    FULCRUM_ASSIGN_OR_RETURN(auto described, reader.Describe(name));
    return std::move(described.second);
  };
  lookup.slice = [&reader](const std::string& name, int64_t dim, int64_t start, int64_t length) {
    return reader.ReadSlice(name, dim, start, length);
  };
  return lookup;
}

// LoadCheckpoint's --finetune half: the weights alone.
absl::StatusOr<LoadedCheckpoint> LoadWeightsOnly(const ckpt::CheckpointReader& reader,
                                                 const std::vector<Unit*>& units,
                                                 const CheckpointLoad& load,
                                                 const std::string& source) {
  // NOTE [finetune]: only the model's shape is checked; the optimizer, schedule, data
  // position and random state start afresh, as in a new run.
  std::vector<std::string> warnings;
  FULCRUM_RETURN_IF_ERROR(
      CheckFinetune(reader.manifest().value("config", nlohmann::json()), *load.config, source,
                    &warnings));
  if (load.log_warnings) {
    for (const std::string& warning : warnings) FULCRUM_LOG(WARNING) << warning;
  }
  auto lookup = [&reader](const std::string& name) { return reader.Read(name); };
  for (Unit* unit : units) {
    absl::Status status =
        unit->LoadStateTensors(lookup, /*optimizer_slots=*/{}, ShardLookup(reader));
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat(source, " (--finetune): ", status.message()));
    }
  }
  const nlohmann::json& manifest = reader.manifest();
  std::string origin = absl::StrCat("iteration ", reader.iteration());
  if (manifest.contains(ckpt::kImportedFromField) && manifest[ckpt::kImportedFromField].is_object()) {
    const nlohmann::json& from = manifest[ckpt::kImportedFromField];
    origin = absl::StrCat(from.value("architecture", std::string("?")), " imported from ",
                          from.value("source", std::string("?")));
  }
  LoadedCheckpoint loaded;
  loaded.summary = absl::StrCat("fine-tuning from the weights of ", reader.dir(), " (", origin,
                                "): iteration 0, fresh optimizer and schedule (--finetune)");
  return loaded;
}

}  // namespace

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const ckpt::CheckpointReader& reader,
                                                const std::vector<Unit*>& units,
                                                const CheckpointLoad& load) {
  const TrainerConfig& config = *load.config;
  const std::string source = JoinPath(reader.dir(), ckpt::kManifestFileName);
  const nlohmann::json& manifest = reader.manifest();
  if (manifest.contains(ckpt::kImportedFromField) && !config.train.finetune) {
    const nlohmann::json& from = manifest[ckpt::kImportedFromField];
    return absl::InvalidArgumentError(absl::StrCat(
        reader.dir(), " was imported (from ",
        from.is_object() ? from.value("architecture", std::string("?")) : std::string("?"),
        "): it holds model weights but no training state to resume; add --finetune to start "
        "training from its weights"));
  }
  // The data must be of the model's vocabulary, whichever the way in.
  if (manifest.contains("config") && manifest["config"].is_object()) {
    FULCRUM_RETURN_IF_ERROR(
        CheckDataFitsVocabulary(manifest["config"], load.data_max_token, source));
  }
  if (config.train.finetune) return LoadWeightsOnly(reader, units, load, source);
  FULCRUM_ASSIGN_OR_RETURN(const TrainingManifest saved,
                           ParseTrainingManifest(reader.manifest(), source));
  std::vector<std::string> warnings;
  FULCRUM_RETURN_IF_ERROR(CheckResume(saved, config, load.data, source, &warnings));
  if (load.log_warnings) {
    for (const std::string& warning : warnings) FULCRUM_LOG(WARNING) << warning;
  }
  auto lookup = [&reader](const std::string& name) { return reader.Read(name); };
  for (Unit* unit : units) {
    FULCRUM_RETURN_IF_ERROR(
        unit->LoadStateTensors(lookup, load.optimizer_slots, ShardLookup(reader)));
    // The tensors must agree with the manifest: no unit has taken more steps than the run.
    if (unit->optimizer_step() > saved.iteration) {
      return absl::DataLossError(absl::StrCat(
          source, ": ", unit->name(), " has taken ", unit->optimizer_step(),
          " optimizer steps but the checkpoint is of iteration ", saved.iteration));
    }
  }
  if (reader.Has("rng.torch_cpu")) {
    FULCRUM_ASSIGN_OR_RETURN(at::Tensor rng, reader.Read("rng.torch_cpu"));
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng);
  }
  LoadedCheckpoint loaded;
  loaded.iteration = saved.iteration;
  loaded.consumed_samples = saved.consumed_samples;
  loaded.summary = absl::StrCat("loaded checkpoint ", reader.dir(), ": iteration ",
                                saved.iteration, ", consumed samples ", saved.consumed_samples);
  return loaded;
}

}  // namespace fulcrum
