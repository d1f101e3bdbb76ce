// The command line of Fulcrum's programs (fulcrum_train, fulcrum_preprocess, fulcrum_sim,
// fulcrum_plot, fulcrum_ckpt and the benchmarks; fulcrum_launch parses its own, since what
// follows its "--" belongs to the program it starts): gflags with the behaviour a user
// expects instead of gflags' own.
//
//  - A bad flag (unknown name, a value that does not parse or is out of range for its type,
//    a missing value, an unreadable --flagfile or a bad line in it) prints one line naming
//    the flag and the program exits 2 — gflags itself exits 1 and may print several lines.
//    An unknown name gets the closest known one as a suggestion.
//  - --help (-h, -help, --helpshort) prints the program's usage and only its own flags,
//    grouped, and exits 0; --helpfull adds the flags of the libraries linked in (LibTorch,
//    glog, gflags) and exits 0.
//
// Every check runs before gflags parses, with gflags' own value parser (so the two never
// disagree), and only then does gflags parse the command line — which can no longer fail.
//
// Thread-safety: call once, from main, before anything reads a flag.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fulcrum::cli {

/// A titled group of flags in --help, listed in this order.
struct HelpGroup {
  std::string title;               // "Model", "Pipeline and balancing", ...
  std::vector<std::string> flags;  // Flag names without dashes.
};

struct HelpSpec {
  std::string program;  // "fulcrum_train": prefixes every message.
  std::string usage;    // What the program does and how to call it (first lines of --help).
  std::vector<HelpGroup> groups;
  /// Flags defined in a source file whose path contains "/<dir>/<name>.cc" are this
  /// program's too, grouped under "<title>: <name>" per file unless a titled group lists
  /// them — how the flags of plugins (one file each) reach --help without a list here.
  std::string per_file_dir;    // e.g. "plugins"; empty for none.
  std::string per_file_title;  // e.g. "Plugins".
  /// Whether the program takes arguments beside its flags (fulcrum_plot's files,
  /// fulcrum_ckpt's subcommand). When false, ParseCommandLine refuses a leftover one: one
  /// line naming it, exit 2.
  bool takes_arguments = false;
};

/// The flags of this program that no group of `spec` lists and no per-file directory
/// holds (defined in the project's own sources, not by a library). fulcrum_train's tests
/// require this to be empty, so every new flag lands in a --help group.
std::vector<std::string> UngroupedFlags(const HelpSpec& spec);

/// The --help text: spec.usage, then each group with its flags, defaults and help texts.
std::string HelpText(const HelpSpec& spec);

/// Handles help requests and checks every flag of argv[1..] (up to a "--"), then lets gflags
/// parse and remove them; argv then holds the program name and its arguments. Returns
/// nullopt when the program should go on, or the exit code to return from main: 0 after
/// printing help, 2 after printing one line about a bad flag or, unless
/// spec.takes_arguments, an argument that is not a flag.
std::optional<int> ParseCommandLine(int* argc, char*** argv, const HelpSpec& spec);

}  // namespace fulcrum::cli
