// fulcrum_train: trains a GPT from the command line. See TrainUsage() / --help.
// Exit codes: 0 success, 2 bad input (flags, files, checkpoint), 1 failure while training.
#include <gflags/gflags.h>

#include <iostream>

#include "core/logging.h"
#include "core/trainer.h"
#include "recipes/train_flags.h"

namespace {

bool IsCallerError(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return true;
    default:
      return false;
  }
}

int Fail(const absl::Status& status) {
  std::cerr << "fulcrum_train: " << status.message() << std::endl;
  return IsCallerError(status) ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(fulcrum::TrainUsage());
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/true);
  if (argc > 1) {
    std::cerr << "fulcrum_train: unexpected argument '" << argv[1] << "' (flags are --name=value)"
              << std::endl;
    return 2;
  }
  fulcrum::InitLogging(argv[0]);
  if (absl::Status s = fulcrum::ApplyRecipe(); !s.ok()) return Fail(s);
  // Validate the flags before reading any data: a vocabulary of 1 stands in for the real one.
  if (auto early = fulcrum::ConfigFromFlags(/*vocab_size=*/1); !early.ok()) {
    return Fail(early.status());
  }
  auto data = fulcrum::LoadTrainData();
  if (!data.ok()) return Fail(data.status());
  auto config = fulcrum::ConfigFromFlags(data->vocab_size);
  if (!config.ok()) return Fail(config.status());
  FULCRUM_LOG(INFO) << "data: " << data->description << "; vocabulary " << data->vocab_size
                    << " padded to " << config->model.vocab_size;

  auto trainer = fulcrum::Trainer::Create(*config, data->corpus);
  if (!trainer.ok()) return Fail(trainer.status());
  if (const std::string load = fulcrum::LoadPathFlag(); !load.empty()) {
    if (absl::Status s = (*trainer)->Load(load); !s.ok()) return Fail(s);
  }
  if (absl::Status s = (*trainer)->Run(); !s.ok()) return Fail(s);
  if (!config->train.save.empty()) {
    FULCRUM_LOG(INFO) << "checkpoints are in " << config->train.save;
  }
  return 0;
}
