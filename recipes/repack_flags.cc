#include "recipes/repack_flags.h"

#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "core/status.h"
#include "pipeline/schedule.h"
#include "pipeline/shrink.h"
#include "recipes/relaunch_protocol.h"
#include "recipes/train_flags.h"

DEFINE_string(repack, "off",
              "Re-packing: off, or auto (every --repack_interval iterations, pack the pipeline "
              "onto fewer stages when the schedule simulator predicts a slowdown of at most "
              "--repack_max_slowdown on the measured per-layer costs and every stage fits "
              "--rebalance_memory_budget_mb). Live by default: released ranks exit 0.");
DEFINE_int32(repack_min_stages, 1, "Re-packing never leaves fewer pipeline stages than this.");
DEFINE_int64(repack_interval, 100, "--repack=auto considers re-packing every this many iterations.");
DEFINE_double(repack_max_slowdown, 0.05,
              "Largest predicted rise of the iteration time re-packing may cost, as a fraction "
              "(0.05: 5%); tokens/s per rank rises by about the stage ratio.");
DEFINE_string(repack_script, "",
              "Forced re-packing ITER:STAGES[;ITER:STAGES...]: after iteration ITER the pipeline "
              "runs on STAGES stages (consecutive stages merged evenly), e.g. 15:2.");
DEFINE_bool(repack_via_checkpoint, false,
            "Re-pack through a checkpoint instead of live: save, exit with code 75, and "
            "fulcrum_launch relaunches fewer ranks with the smaller "
            "--pipeline_model_parallel_size, resuming from --save (new process groups "
            "and a fresh allocation for free).");
DEFINE_string(on_release_command, "",
              "Shell command (sh -c) a rank released by a live shrink runs before it exits 0, "
              "with FULCRUM_RELEASED_RANK set (e.g. to hand its GPU back to the cluster).");

// recipes/train_flags.cc's: re-packing keeps the chunks per stage, not the layers per chunk.
DECLARE_int32(num_layers_per_virtual_pipeline_stage);

namespace fulcrum {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::StatusOr<RepackSettings> RepackSettingsFromFlags(const parallel::ParallelConfig& layout,
                                                       const TrainerConfig& config,
                                                       std::optional<int64_t> resumed_iteration) {
  RepackSettings out;
  if (FLAGS_repack != "off" && FLAGS_repack != "auto") {
    return Invalid(absl::StrCat("--repack='", FLAGS_repack, "' is unknown; expected off or auto"));
  }
  const bool automatic = FLAGS_repack == "auto";
  out.enabled = automatic || !FLAGS_repack_script.empty();
  out.via_checkpoint = FLAGS_repack_via_checkpoint;
  out.on_release_command = FLAGS_on_release_command;
  dynamic::RepackTriggerOptions& t = out.trigger;
  t.automatic = automatic;
  t.interval = FLAGS_repack_interval;
  t.decision.min_stages = FLAGS_repack_min_stages;
  t.decision.max_slowdown = FLAGS_repack_max_slowdown;
  if (FLAGS_repack_interval < 1) {
    return Invalid(absl::StrCat("--repack_interval=", FLAGS_repack_interval, " must be ≥ 1"));
  }
  if (absl::Status s = t.decision.Validate(); !s.ok()) return s;
  if (!out.enabled) {
    if (FLAGS_repack_via_checkpoint) {
      return Invalid("--repack_via_checkpoint says how to re-pack; it needs --repack=auto or a "
                     "--repack_script");
    }
    if (!FLAGS_on_release_command.empty()) {
      return Invalid("--on_release_command runs on ranks a re-packing releases; it needs "
                     "--repack=auto or a --repack_script");
    }
    return out;
  }
  if (FLAGS_num_layers_per_virtual_pipeline_stage > 0) {
    // NOTE [re-packing under chunks] in dynamic/repack.h: ranks merge chunk by chunk, so a
    // stage keeps its chunk count and the layers per chunk grow; a relaunch would instead
    // recompute the chunks from this flag, a different schedule from the one predicted.
    return Invalid(absl::StrCat(
        "re-packing keeps the model chunks per stage and merges their layers, so it cannot "
        "keep --num_layers_per_virtual_pipeline_stage=",
        FLAGS_num_layers_per_virtual_pipeline_stage,
        "; give the chunks per stage (--virtual_pipeline_model_parallel_size) instead"));
  }
  if (automatic && !FLAGS_repack_script.empty()) {
    return Invalid(absl::StrCat("--repack=auto and --repack_script='", FLAGS_repack_script,
                                "' both decide when to re-pack; give one of them"));
  }
  // A relaunch after re-packing comes back with the same flags on fewer stages, resuming
  // from the checkpoint the re-packing saved: what it already did is no error then.
  const bool resumed = resumed_iteration.has_value();
  if (automatic && layout.pp > 1 &&
      (FLAGS_repack_min_stages > layout.pp || (FLAGS_repack_min_stages == layout.pp && !resumed))) {
    return Invalid(absl::StrCat("--repack_min_stages=", FLAGS_repack_min_stages,
                                " leaves no stage of --pipeline_model_parallel_size=", layout.pp,
                                " to spare; nothing could be re-packed"));
  }
  if (!FLAGS_repack_script.empty()) {
    auto script = dynamic::ParseRepackScript(FLAGS_repack_script);
    if (!script.ok()) return script.status();
    for (const auto& [iteration, stages] : *script) {
      if (iteration >= config.train.train_iters) {
        return Invalid(absl::StrCat("--repack_script: iteration ", iteration,
                                    " is not before the last (--train_iters=",
                                    config.train.train_iters, ")"));
      }
    }
    t.script = std::move(*script);
  }
  if (FLAGS_repack_via_checkpoint && !FLAGS_on_release_command.empty()) {
    return Invalid("--on_release_command runs on ranks released by a live shrink; with "
                   "--repack_via_checkpoint no rank is released in place (the launcher starts "
                   "fewer)");
  }
  if (FLAGS_repack_via_checkpoint && config.train.save.empty()) {
    return Invalid("--repack_via_checkpoint saves a checkpoint and resumes from it; it needs --save");
  }
  gflags::CommandLineFlagInfo script_info;
  if (gflags::GetCommandLineFlagInfo("rebalance_script", &script_info) &&
      !script_info.current_value.empty()) {
    return Invalid("--rebalance_script's placements are for the first stage count; re-packing "
                   "changes it, so give one of --rebalance_script and re-packing");
  }
  if (automatic && layout.pp < 2 && !resumed) {
    return Invalid("--repack=auto merges pipeline stages onto fewer ranks; "
                   "--pipeline_model_parallel_size=1 has one stage");
  }
  for (const auto& [iteration, stages] : t.script) {
    // A step onto as many stages as there are, or more, cannot happen, unless the
    // checkpoint is of a run that took it (and then was relaunched on that many).
    if (stages >= layout.pp && !(resumed && iteration <= *resumed_iteration)) {
      return Invalid(absl::StrCat(
          "--repack_script: step ", iteration, ":", stages, " cannot happen: re-packing merges "
          "pipeline stages onto fewer, and --pipeline_model_parallel_size=", layout.pp, " has ",
          layout.pp,
          resumed ? absl::StrCat(" (the --load checkpoint, of iteration ", *resumed_iteration,
                                 ", is not past the step)")
                  : ""));
    }
  }
  if (layout.pp < 2) {
    // Nothing left to pack: a relaunch onto one stage comes back here with the same flags.
    out.enabled = false;
    return out;
  }
  const int64_t micro =
      config.train.global_batch_size / (config.train.micro_batch_size * layout.dp());
  t.num_microbatches = static_cast<int>(micro);
  t.schedule = PipelineScheduleFlag();
  t.measured_zbv_order = MeasuredZbvOrderFlag();
  FULCRUM_ASSIGN_OR_RETURN(t.num_chunks, VirtualPipelineChunksFromFlags(layout.pp));
  // A step onto a stage count the schedule cannot run (interleaved: the micro-batches a
  // multiple of the stages) is refused now, not at the shrink (NOTE [re-packing under
  // chunks] in dynamic/repack.h; one stage runs the one-chunk form).
  for (const auto& [iteration, stages] : t.script) {
    if (stages < 2 || stages >= layout.pp) continue;
    if (auto made = pipeline::MakeSchedule(t.schedule, stages, t.num_microbatches, t.num_chunks);
        !made.ok()) {
      return Invalid(absl::StrCat("--repack_script: step ", iteration, ":", stages,
                                  " cannot run --pipeline_schedule=", t.schedule, " on ", stages,
                                  " stages: ", made.status().message()));
    }
  }
  auto balancing = BalancerOptionsFromFlags();
  if (!balancing.ok()) return balancing.status();
  t.memory_budget = balancing->load.memory_budget_bytes;
  return out;
}

absl::StatusOr<std::string> WriteRelaunchRequest(const parallel::ParallelConfig& layout,
                                                 int num_stages, const std::string& save_dir,
                                                 const std::string& reason,
                                                 const std::vector<std::string>& extra_args) {
  const int world_size = layout.world_size / layout.pp * num_stages;
  std::vector<std::string> args = {absl::StrCat("--pipeline_model_parallel_size=", num_stages),
                                   absl::StrCat("--load=", save_dir)};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  const std::string flags = absl::StrJoin(args, " ");
  const char* path = std::getenv(kRelaunchFileEnv);
  if (path == nullptr || *path == '\0') return flags;
  nlohmann::json request = {{"world_size", world_size}, {"args", args}, {"reason", reason}};
  const std::string text = request.dump() + "\n";
  const std::string temp = absl::StrCat(path, ".tmp");
  std::FILE* file = std::fopen(temp.c_str(), "w");
  if (file == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write the relaunch request ", temp));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  if (std::fclose(file) != 0 || !written || std::rename(temp.c_str(), path) != 0) {
    return absl::InternalError(absl::StrCat("cannot write the relaunch request ", path));
  }
  return flags;
}

absl::StatusOr<std::unique_ptr<parallel::ProcessGroupContext>> ShrinkLive(
    parallel::ProcessGroupContext& old, Trainer& trainer, const pipeline::LayerRanges& old_ranges,
    const pipeline::LayerRanges& new_ranges, const std::vector<std::pair<int, int>>& new_chunks,
    bool tie_embeddings, const RunnerFactory& make_runner) {
  pipeline::ShrinkPlan plan;
  plan.old_config = old.config();
  plan.old_ranges = old_ranges;
  plan.new_ranges = new_ranges;
  plan.old_owner = old.VirtualStageRanks();
  for (const auto& [stage, chunk] : new_chunks) plan.new_owner.push_back(stage);
  plan.tie_embeddings = tie_embeddings;
  if (absl::Status s = pipeline::ValidateShrinkPlan(plan); !s.ok()) return s;
  if (pipeline::NewRank(plan, old.roles().world_rank) < 0) {
    if (absl::Status s = pipeline::ExchangeState(old.world(), plan, trainer.model(), nullptr);
        !s.ok()) {
      return s;
    }
    return std::unique_ptr<parallel::ProcessGroupContext>();
  }
  // Only the survivors split: a new generation of groups on the rendezvous store.
  std::unique_ptr<parallel::Communicator> world =
      old.world().Split(pipeline::SurvivingRanks(plan), "world_repacked");
  auto context = parallel::ProcessGroupContext::Create(std::move(world),
                                                       pipeline::ShrunkConfig(plan), tie_embeddings);
  if (!context.ok()) return context.status();
  if (!new_chunks.empty()) (*context)->SetVirtualStages(new_chunks);
  (*context)->SetInitialPlacement(new_ranges);
  absl::StatusOr<ForwardBackwardRunner*> runner = make_runner(**context);
  if (!runner.ok()) return runner.status();
  if (absl::Status s = trainer.ChangeLayout(
          TrainerLayout{context->get(), (*context)->roles(), *runner},
          [&](const GptModel& old_model, GptModel& new_model) {
            return pipeline::ExchangeState(old.world(), plan, old_model, &new_model);
          });
      !s.ok()) {
    return s;
  }
  return std::move(*context);
}

void MarkReleased(int rank) {
  const char* request = std::getenv(kRelaunchFileEnv);
  if (request == nullptr || *request == '\0') return;
  std::string dir(request);
  dir = dir.substr(0, dir.rfind('/') + 1);
  if (std::FILE* file = std::fopen((dir + ReleaseMarkerName(rank)).c_str(), "w")) std::fclose(file);
}

void RunOnReleaseCommand(const std::string& command, int rank) {
  if (command.empty()) return;
  setenv("FULCRUM_RELEASED_RANK", std::to_string(rank).c_str(), 1);
  const int status = std::system(command.c_str());
  if (status != 0) {
    FULCRUM_LOG(WARNING) << "--on_release_command '" << command << "' returned status " << status;
  }
}

}  // namespace fulcrum
