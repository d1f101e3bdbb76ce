#include "plugins/plugin_registry.h"

#include <gflags/gflags.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status.h"

namespace fulcrum::plugins {

absl::StatusOr<std::vector<std::string>> SelectPlugins(const std::string& list) {
  const PluginRegistry& registry = PluginRegistry::Global();
  std::vector<std::string> names;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    const std::string name(absl::StripAsciiWhitespace(part));
    if (registry.Find(name) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--plugins: '", name,
                                                     "' is not a plugin; plugins: ",
                                                     registry.Names()));
    }
    if (std::find(names.begin(), names.end(), name) != names.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--plugins names '", name, "' twice"));
    }
    names.push_back(name);
  }
  for (const auto* entry : registry.List()) {
    const bool named = std::find(names.begin(), names.end(), entry->name) != names.end();
    if (!named && entry->value.requested_by_flags && entry->value.requested_by_flags()) {
      names.push_back(entry->name);
    }
  }
  return names;
}

absl::Status CheckFlagsOfUnselectedPlugins(const std::vector<std::string>& selected) {
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  for (const gflags::CommandLineFlagInfo& flag : flags) {
    if (flag.is_default) continue;
    // A plugin defines its flags in its own file (plugins/README.md), named after it.
    const std::filesystem::path file(flag.filename);
    if (file.parent_path().filename() != "plugins") continue;
    const std::string plugin = file.stem().string();
    if (PluginRegistry::Global().Find(plugin) == nullptr) continue;
    if (std::find(selected.begin(), selected.end(), plugin) != selected.end()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag.name, "=", flag.current_value, " is a flag of the '", plugin,
        "' plugin, which is not selected, so it would do nothing; add ", plugin,
        " to --plugins (selected: ", selected.empty() ? "none" : absl::StrJoin(selected, ","),
        ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidatePlugins(const std::vector<std::string>& names, const PluginSetup& setup) {
  bool expert_parallel_used = false;
  std::vector<std::string> without_bf16;
  for (const std::string& name : names) {
    const auto* entry = PluginRegistry::Global().Find(name);
    if (entry == nullptr) return absl::InvalidArgumentError(absl::StrCat("no plugin '", name, "'"));
    if (entry->value.validate) FULCRUM_RETURN_IF_ERROR(entry->value.validate(setup));
    expert_parallel_used = expert_parallel_used || entry->value.uses_expert_parallel_group;
    if (!entry->value.supports_bf16) without_bf16.push_back(name);
  }
  if (setup.model.device_spec.mixed_precision() && !without_bf16.empty()) {
    std::vector<std::string> with_bf16;
    for (const auto* entry : PluginRegistry::Global().List()) {
      if (entry->value.supports_bf16) with_bf16.push_back(entry->name);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--bf16 does not combine with --plugins=", absl::StrJoin(without_bf16, ","),
        ": their tensors are not yet written for bf16 activations (plugins that run under "
        "--bf16: ", with_bf16.empty() ? "none" : absl::StrJoin(with_bf16, ", "), ")"));
  }
  if (setup.layout.ep_size > 1 && !expert_parallel_used) {
    // The layers that share out experts come from a plugin; --num_experts selects the
    // registered one by itself.
    return absl::InvalidArgumentError(absl::StrCat(
        "--expert_model_parallel_size=", setup.layout.ep_size,
        " needs MoE layers (--num_experts): no selected plugin uses the expert-parallel group"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PluginSet>> MakePlugins(const std::vector<std::string>& names,
                                                       const PluginSetup& setup) {
  auto set = std::make_shared<PluginSet>();
  for (const std::string& name : names) {
    const auto* entry = PluginRegistry::Global().Find(name);
    if (entry == nullptr) return absl::InvalidArgumentError(absl::StrCat("no plugin '", name, "'"));
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<Plugin> plugin, entry->value.create(setup));
    set->Add(std::move(plugin));
  }
  return set;
}

std::string PluginHelp() {
  std::string out;
  size_t width = 0;
  for (const auto* entry : PluginRegistry::Global().List()) width = std::max(width, entry->name.size());
  for (const auto* entry : PluginRegistry::Global().List()) {
    absl::StrAppend(&out, "  ", entry->name, std::string(width + 2 - entry->name.size(), ' '),
                    entry->help, "\n");
  }
  return out;
}

std::optional<std::vector<int64_t>> ParseLayerList(absl::string_view text, int64_t num_layers,
                                                   std::string* bad_item) {
  std::vector<int64_t> layers;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> range = absl::StrSplit(item, absl::MaxSplits('-', 1));
    int64_t first = 0, last = 0;
    if (!absl::SimpleAtoi(range.first, &first) ||
        !absl::SimpleAtoi(range.second.empty() ? range.first : range.second, &last) || first < 0 ||
        last < first || last >= num_layers) {
      *bad_item = std::string(item);
      return std::nullopt;
    }
    for (int64_t l = first; l <= last; ++l) layers.push_back(l);
  }
  return layers;
}

}  // namespace fulcrum::plugins
