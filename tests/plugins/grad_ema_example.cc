// The worked example of plugins/README.md, compiled and tested as part of the build
// (tests/plugins/readme_example_test.cc checks that the README shows this file verbatim).
// BEGIN EXAMPLE
// plugins/grad_ema.cc — keeps, for every transformer layer, an exponential moving average
// of its gradient norm; reports the largest in the metrics file; predicts each layer's load
// from it. Select it with --plugins=grad_ema.
#include <gflags/gflags.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/gpt_model.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

// 1. The plugin's flags live in its own file.
DEFINE_double(grad_ema_decay, 0.9, "grad_ema: weight of the past in the moving average.");

namespace fulcrum::plugins {
namespace {

class GradEmaPlugin final : public Plugin {
 public:
  explicit GradEmaPlugin(double decay) : decay_(decay) {}
  const char* name() const override { return "grad_ema"; }

  // 2. Per-layer state is a buffer of the layer: it moves with the layer between pipeline
  //    stages and is saved in checkpoints.
  void EditLayer(TransformerLayer& layer, bool initialize) override {
    at::Tensor ema = layer.AddBuffer("grad_ema.norm", at::zeros({1}, at::kFloat));
    // A handle shares the buffer's storage: it sees every later update and restore.
    layer.SetLoadReporter([ema] { return ema.item<float>(); });
  }

  // 3. After the backward every gradient is complete and equal on every replica; read them
  //    through ctx.gradients() (this rank's parts: whole, or its slices under the
  //    distributed optimizer), here summed per layer for us.
  absl::Status AfterBackward(PluginContext& ctx) override {
    // 4. Decisions over the whole model: every stage, shard and slice adds its part, so
    //    every rank gets the same squares.
    const std::vector<double> squares = ctx.LayerGradientSquares();
    largest_ = 0;
    for (const auto& [index, layer] : ctx.model().layers()) {
      layer->FindBuffer("grad_ema.norm").mul_(decay_).add_((1 - decay_) * std::sqrt(squares[index]));
    }
    for (double s : squares) largest_ = std::max(largest_, std::sqrt(s));
    return absl::OkStatus();
  }

  // 5. Fields of the metrics file and the log line.
  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log) override {
    (*record)["largest_layer_grad_norm"] = largest_;
    return absl::OkStatus();
  }

 private:
  double decay_;
  double largest_ = 0;
};

}  // namespace

// 6. Registration by name, with a one-line help for --help.
FULCRUM_REGISTER_PLUGIN(
    grad_ema, "example: a moving average of each layer's gradient norm (plugins/README.md)",
    (PluginEntry{
        /*requested_by_flags=*/nullptr,
        /*validate=*/[](const PluginSetup&) -> absl::Status {
          if (FLAGS_grad_ema_decay < 0 || FLAGS_grad_ema_decay >= 1) {
            return absl::InvalidArgumentError("--grad_ema_decay must be in [0, 1)");
          }
          return absl::OkStatus();
        },
        /*create=*/[](const PluginSetup& setup) -> absl::StatusOr<std::unique_ptr<Plugin>> {
          return std::unique_ptr<Plugin>(new GradEmaPlugin(FLAGS_grad_ema_decay));
        }}));

}  // namespace fulcrum::plugins
// END EXAMPLE
