// Finding dynamism plugins by name (--plugins=NAME[,NAME...]): the registry every plugin
// file adds itself to, and how fulcrum_train selects, checks and builds the run's plugins.
// The plugins themselves are one file each in this folder (plugins/README.md says how to
// write one); this file and plugins/plugin_registry.cc are the only others here.
//
// NOTE [plugin registration]
// A plugin file registers itself with FULCRUM_REGISTER_PLUGIN, a static object. The files
// of this folder are compiled as an object library (plugins/CMakeLists.txt), which a
// program links whole, so a registration is never dropped the way a static archive drops
// an object nothing references: adding a plugin is adding one .cc file here. A test's own
// plugin registers the same way from the test's .cc file.
//
// Thread-safety: the registry is written during static initialisation only.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/config.h"
#include "core/data/gpt_dataset.h"
#include "core/data/indexed_dataset.h"
#include "core/plugin.h"
#include "core/rank_roles.h"
#include "core/registry.h"

namespace fulcrum::plugins {

/// What a plugin is checked against and built from. It carries no process groups: a plugin
/// learns them, and learns them again after every change of layout, in Plugin::OnLayout
/// (NOTE [plugin doors] in core/parallel_context.h).
struct PluginSetup {
  ModelOptions model;               // The model (the padded vocabulary known).
  /// The starting layout's sizes (tp_size, pp_size, ep_size, world_size) as this rank sees
  /// them: a plain core value, so plugins need nothing from parallel/.
  RankRoles layout;
  /// The training corpus and how samples are cut from it; null while checking.
  std::shared_ptr<const data::IndexedDataset> corpus;
  data::GptDatasetOptions data;
};

/// A registered plugin.
struct PluginEntry {
  /// Whether the plugin's own flags ask for it without --plugins (moe: --num_experts > 0).
  /// May be empty: only --plugins selects it.
  std::function<bool()> requested_by_flags;
  /// Checks the plugin's flags against the model and the layout, before any work (no
  /// groups, no corpus yet). May be empty.
  std::function<absl::Status(const PluginSetup&)> validate;
  /// Builds the plugin from its flags. Not collective: what depends on the groups is built
  /// in Plugin::OnLayout.
  std::function<absl::StatusOr<std::unique_ptr<Plugin>>(const PluginSetup&)> create;
  /// Whether the plugin's layers use the expert-parallel group (MoE layers share out their
  /// experts over it): --expert_model_parallel_size > 1 needs a selected plugin that does.
  bool uses_expert_parallel_group = false;
  /// Whether the plugin's tensors follow the activations' dtype under --bf16 (NOTE [mixed
  /// precision] in core/linear.h): a selected plugin that does not is refused under --bf16
  /// before any work, rather than compute half-converted.
  bool supports_bf16 = false;
};

using PluginRegistry = Registry<PluginEntry>;

/// The plugins `list` names (comma-separated, in order), then those not named whose flags
/// ask for them (PluginEntry::requested_by_flags), in name order. InvalidArgument naming
/// --plugins for an unknown name (listing the plugins) or a name given twice.
absl::StatusOr<std::vector<std::string>> SelectPlugins(const std::string& list);

/// InvalidArgument when a flag defined in plugins/NAME.cc, NAME a registered plugin, was set
/// (on the command line, in a flag file or by a recipe) while that plugin is not in
/// `selected`: such a flag would do nothing. The message names the flag, the plugin and
/// the fix.
absl::Status CheckFlagsOfUnselectedPlugins(const std::vector<std::string>& selected);

/// Runs every selected plugin's check (PluginEntry::validate), in order, then refuses an
/// expert-parallel layout (setup.layout.ep_size > 1) that no selected plugin uses
/// (PluginEntry::uses_expert_parallel_group), and bf16 mixed precision
/// (setup.model.device_spec) with a selected plugin that does not support it
/// (PluginEntry::supports_bf16), naming those plugins and the ones that do.
absl::Status ValidatePlugins(const std::vector<std::string>& names, const PluginSetup& setup);

/// Builds the selected plugins, in order (NOTE [plugin order] in core/plugin.h).
absl::StatusOr<std::shared_ptr<PluginSet>> MakePlugins(const std::vector<std::string>& names,
                                                       const PluginSetup& setup);

/// One line per registered plugin, "  name       help", for --help.
std::string PluginHelp();

/// A plugin flag's list of layers, "0,1" or "0-3" or "1,4-6" (items separated by commas,
/// whitespace skipped), each in [0, num_layers), in the order given. nullopt on the first
/// item that is not a layer or an ascending range of them, which goes to `bad_item`.
std::optional<std::vector<int64_t>> ParseLayerList(absl::string_view text, int64_t num_layers,
                                                   std::string* bad_item);

}  // namespace fulcrum::plugins

/// Registers a plugin: FULCRUM_REGISTER_PLUGIN(freeze, "one-line help", PluginEntry{...}).
#define FULCRUM_REGISTER_PLUGIN(name, help, entry) \
  FULCRUM_REGISTER(::fulcrum::plugins::PluginEntry, name, help, entry)
