#include "core/distributed_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>

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

}  // namespace

absl::Status SaveCheckpoint(const CheckpointSave& save, const std::vector<Unit*>& units,
                            const RankRoles& roles, const CheckpointCollectives& collectives) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t iteration = save.iteration;
  // Checkpoints are layout-free (invariant 4). Full: tensor-parallel shards are gathered,
  // which every rank of the group takes part in; data-parallel replicas hold the same
  // state; expert-parallel ranks hold different experts: each saves its own. Sharded: every
  // rank writes the pieces it holds, the reader assembles them.
  const bool committer = roles.commits_checkpoint;
  using Part = CheckpointPart;
  const Part part = roles.checkpoint_part;
  NamedTensors tensors;
  std::vector<ckpt::TensorPiece> pieces;
  if (save.sharded) {
    ShardedState(save, units, part, &tensors, &pieces);
  } else if (part != Part::kNothing) {
    for (Unit* unit : units) {
      NamedTensors state =
          unit->StateTensors(collectives.gather_shard, part == Part::kExpertParallel);
      tensors.insert(tensors.end(), state.begin(), state.end());
    }
  }
  const bool writer = save.sharded ? (committer || !tensors.empty() || !pieces.empty())
                                   : roles.writes_checkpoint_shard;
  const std::string shard_name =
      save.sharded ? absl::StrFormat("rank_%05d", roles.world_rank) : roles.checkpoint_shard_name;
  if (committer) {
    // The default generator is not used by training itself (NOTE [layout-independent
    // randomness]) but user and plugin code may draw from it; restore it on resume.
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    tensors.emplace_back("rng.torch_cpu", generator.get_state());
  }
  // The committer creates the temporary directory; the other writers join it once it
  // exists, and the committer commits once every shard is written. Every rank passes every
  // barrier whatever fails, so an error on one rank is reported, never turned into a hang.
  absl::Status status = save.local_status;
  std::optional<ckpt::CheckpointWriter> ckpt_writer;
  if (committer && status.ok()) {
    auto begun = ckpt::CheckpointWriter::Begin(save.fs, save.dir, iteration);
    if (begun.ok()) ckpt_writer.emplace(std::move(*begun)); else status = begun.status();
  }
  collectives.barrier();
  if (writer && !committer && status.ok()) {
    auto joined = ckpt::CheckpointWriter::Join(save.fs, save.dir, iteration);
    if (joined.ok()) ckpt_writer.emplace(std::move(*joined)); else status = joined.status();
  }
  if (writer && status.ok()) {
    status = ckpt_writer->WriteShard(shard_name, tensors, pieces);
  }
  collectives.barrier();
  // A writer that failed leaves its shard missing, and Commit refuses an incomplete set
  // only if it knows the set: the committer also checks every writer reported success.
  std::vector<double> failures{status.ok() ? 0.0 : 1.0};
  collectives.sum_over_job(failures);
  if (committer && status.ok()) {
    if (failures[0] > 0) {
      status = absl::InternalError(absl::StrCat("checkpoint of iteration ", iteration, ": ",
                                                failures[0], " rank(s) failed to write their shard"));
    } else {
      status = ckpt_writer->Commit(save.manifest_fields);
    }
    if (status.ok()) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      FULCRUM_LOG(INFO) << "checkpoint of iteration " << iteration << " written in "
                        << absl::StrFormat("%.2f s", seconds);
      if (save.keep_last > 0) {
        auto removed = ckpt::RemoveOldCheckpoints(save.fs, save.dir, save.keep_last);
        if (!removed.ok()) {
          FULCRUM_LOG(WARNING) << "--save_keep_last: " << removed.status().message();
        } else if (!removed->empty()) {
          FULCRUM_LOG(INFO) << "removed " << absl::StrJoin(*removed, ", ") << " (--save_keep_last="
                            << save.keep_last << ")";
        }
      }
    }
  }
  if (committer && !status.ok() && ckpt_writer.has_value()) {
    // A failed save leaves nothing behind; the checkpoints before it are untouched.
    if (absl::Status aborted = ckpt_writer->Abort(); !aborted.ok()) {
      FULCRUM_LOG(WARNING) << "could not remove " << ckpt_writer->temp_dir() << ": " << aborted;
    }
  }
  collectives.barrier();
  return status;
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
