#include "recipes/cli.h"

#include <gflags/gflags.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#ifndef FULCRUM_SOURCE_DIR
#error "FULCRUM_SOURCE_DIR must be defined (recipes/CMakeLists.txt)"
#endif

namespace fulcrum::cli {
namespace {

// gflags' own flags that act on the command line itself rather than set a value.
constexpr const char* kFileFlags[] = {"flagfile", "fromenv", "tryfromenv"};
constexpr const char* kHelpFlags[] = {"help", "h", "helpshort"};
// gflags' flags that make ParseCommandLineFlags print something and exit on its own. On the
// command line kHelpFlags and "helpfull" are ours; anywhere else (a flag file, --fromenv)
// these are refused, so gflags never exits behind our back.
// --tab_completion_word makes it print completions and exit.
constexpr const char* kGflagsExitFlags[] = {"help",      "h",           "helpshort",
                                            "helpfull",  "helpxml",     "helpon",
                                            "helpmatch", "helppackage", "version",
                                            "tab_completion_word"};
constexpr int kMaxFlagfileDepth = 8;
constexpr size_t kMaxFlagfileBytes = size_t{16} << 20;
constexpr size_t kHelpWidth = 100;

bool IsOurs(const gflags::CommandLineFlagInfo& info) {
  return absl::StartsWith(info.filename, FULCRUM_SOURCE_DIR);
}

// "plugins/freeze.cc" → "freeze" when the flag lives in spec.per_file_dir; else empty.
std::string PerFileName(const HelpSpec& spec, const gflags::CommandLineFlagInfo& info) {
  if (spec.per_file_dir.empty()) return "";
  const std::string marker = absl::StrCat("/", spec.per_file_dir, "/");
  const size_t at = info.filename.rfind(marker);
  if (at == std::string::npos) return "";
  absl::string_view name = absl::string_view(info.filename).substr(at + marker.size());
  if (!absl::ConsumeSuffix(&name, ".cc") || absl::StrContains(name, "/")) return "";
  return std::string(name);
}

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string Suggestion(const std::string& name) {
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  std::string best;
  size_t best_distance = std::max<size_t>(3, name.size() / 3) + 1;
  for (const auto& info : flags) {
    if (!IsOurs(info)) continue;
    const size_t d = EditDistance(name, info.name);
    if (d < best_distance) {
      best_distance = d;
      best = info.name;
    }
  }
  return best.empty() ? "" : absl::StrCat("; did you mean --", best, "?");
}

std::string WrapText(const std::string& text, size_t indent, size_t first_column) {
  std::string out;
  size_t column = first_column;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (column > indent && column + 1 + word.size() > kHelpWidth) {
      absl::StrAppend(&out, "\n", std::string(indent, ' '));
      column = indent;
    } else if (column > indent) {
      out += ' ';
      ++column;
    }
    absl::StrAppend(&out, word);
    column += word.size();
  }
  return out;
}

std::string FlagLine(const gflags::CommandLineFlagInfo& info) {
  std::string head = absl::StrCat("  --", info.name);
  double number = 0;
  if (info.type == "string") {
    absl::StrAppend(&head, "=", info.default_value.empty() ? "\"\"" : info.default_value);
  } else if (info.type == "double" && absl::SimpleAtod(info.default_value, &number)) {
    absl::StrAppend(&head, "=", absl::StrFormat("%g", number));  // 0.05, not 0.050000000000000003
  } else {
    absl::StrAppend(&head, "=", info.default_value);
  }
  constexpr size_t kTextColumn = 34;
  if (head.size() + 2 > kTextColumn) {
    return absl::StrCat(head, "\n", std::string(kTextColumn, ' '),
                        WrapText(info.description, kTextColumn, kTextColumn), "\n");
  }
  head.resize(kTextColumn, ' ');
  return absl::StrCat(head, WrapText(info.description, kTextColumn, kTextColumn), "\n");
}

// The lines of a flag file with their 1-based numbers, split exactly as gflags splits them
// (ProcessOptionsFromStringLocked in gflags.cc) so that the checks see the values gflags
// will parse: the text ends at its first NUL (gflags reads it as a C string); a line starts
// after leading white space and ends at the next '\r' if one follows anywhere, else at the
// next '\n'; nothing is stripped from its end ("--lr=0.1 " is a bad value to gflags).
std::vector<std::pair<int, std::string>> FlagfileLines(std::string_view contents) {
  contents = contents.substr(0, contents.find('\0'));
  std::vector<std::pair<int, std::string>> lines;
  int number = 1;
  size_t start = 0;
  while (true) {
    while (start < contents.size() && absl::ascii_isspace(contents[start])) {
      if (contents[start++] == '\n') ++number;
    }
    size_t end = contents.find('\r', start);
    if (end == std::string_view::npos) end = contents.find('\n', start);
    const std::string_view line = contents.substr(start, end - start);
    lines.emplace_back(number, std::string(line));
    if (end == std::string_view::npos) break;
    number += static_cast<int>(std::count(line.begin(), line.end(), '\n'));
    if (contents[end] == '\n') ++number;
    start = end + 1;
  }
  return lines;
}

// One flag setting to check: where it came from, for the message.
struct Setting {
  std::string name;
  std::optional<std::string> value;  // nullopt: "--name" alone.
  std::string where;                 // "" (command line) or " (in FILE:LINE)".
};

class Checker {
 public:
  explicit Checker(std::string program) : program_(std::move(program)) {}

  // Checks one setting; on failure sets error_ and returns false.
  bool Check(const Setting& s) {
    if (std::find(std::begin(kGflagsExitFlags), std::end(kGflagsExitFlags), s.name) !=
        std::end(kGflagsExitFlags)) {
      const bool ours =
          s.name == "helpfull" ||
          std::find(std::begin(kHelpFlags), std::end(kHelpFlags), s.name) != std::end(kHelpFlags);
      return Fail(s, ours ? "asks for help, which only the command line can"
                          : "is gflags' own help, not offered here; --help lists the flags");
    }
    if (std::find(std::begin(kFileFlags), std::end(kFileFlags), s.name) != std::end(kFileFlags)) {
      if (!s.value.has_value() || s.value->empty()) return Fail(s, "needs a value");
      std::vector<std::string> items;
      if (!SplitFlagList(s, &items)) return false;
      for (const std::string& item : items) {
        const bool ok = s.name == "flagfile" ? CheckFlagfile(item, s)
                                             : CheckFromEnv(item, s.name == "fromenv", s);
        if (!ok) return false;
      }
      return true;
    }
    // gflags reads --undefok's value as a list after parsing, and exits on a bad entry.
    std::vector<std::string> undefok;
    if (s.name == "undefok" && s.value.has_value() && !SplitFlagList(s, &undefok)) return false;
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(s.name.c_str(), &info)) {
      // --nofoo is gflags' spelling of --foo=false.
      if (absl::StartsWith(s.name, "no") &&
          gflags::GetCommandLineFlagInfo(s.name.substr(2).c_str(), &info) && info.type == "bool") {
        if (s.value.has_value()) return Fail(s, "takes no value");
        return true;
      }
      error_ = absl::StrCat(program_, ": unknown flag --", s.name, s.where, Suggestion(s.name));
      return false;
    }
    if (!s.value.has_value()) {
      if (info.type == "bool") return true;
      return Fail(s, absl::StrCat("needs a value (", info.type, ")"));
    }
    // gflags' own parser decides; the value it sets now is set again by the real parse.
    if (gflags::SetCommandLineOption(s.name.c_str(), s.value->c_str()).empty()) {
      return Fail(s, absl::StrCat("='", *s.value, "' is not a valid ", TypeName(info.type)));
    }
    return true;
  }

  const std::string& error() const { return error_; }

 private:
  static std::string TypeName(const std::string& type) {
    if (type == "bool") return "boolean (true/false)";
    if (type == "double") return "number";
    if (type == "int32") return "integer in [-2147483648, 2147483647]";
    if (type == "uint32") return "integer in [0, 4294967295]";
    if (type == "int64") return "64-bit integer";
    if (type == "uint64") return "non-negative 64-bit integer";
    return type;
  }

  // s's value as gflags' ParseFlagList reads a comma-separated list, which exits the process
  // on an empty entry or one that starts with '-'; those fail here instead.
  bool SplitFlagList(const Setting& s, std::vector<std::string>* items) {
    *items = absl::StrSplit(*s.value, ',');
    if (!items->empty() && items->back().empty()) items->pop_back();  // "a,": gflags ignores it.
    for (const std::string& item : *items) {
      if (item.empty() || item[0] == '-') {
        return Fail(s, absl::StrCat("='", *s.value, "' has an entry '", item,
                                    "'; expected a comma-separated list of ",
                                    s.name == "flagfile" ? "files" : "flag names"));
      }
    }
    return true;
  }

  bool Fail(const Setting& s, const std::string& what) {
    const bool joined = !what.empty() && what[0] == '=';
    error_ = absl::StrCat(program_, ": --", s.name, joined ? "" : " ", what, s.where);
    return false;
  }

  bool CheckFlagfile(const std::string& path, const Setting& from) {
    if (++depth_ > kMaxFlagfileDepth) {
      return Fail(from, absl::StrCat("=", path, " nests flag files deeper than ",
                                     kMaxFlagfileDepth, " levels"));
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) return Fail(from, absl::StrCat("=", path, ": cannot read that file"));
    std::string contents;
    char chunk[1 << 16];
    while (contents.size() <= kMaxFlagfileBytes && in.read(chunk, sizeof(chunk)).gcount() > 0) {
      contents.append(chunk, static_cast<size_t>(in.gcount()));
    }
    if (contents.size() > kMaxFlagfileBytes) {  // /dev/zero, or a file given by mistake.
      return Fail(from, absl::StrCat("=", path, " is larger than ", kMaxFlagfileBytes >> 20,
                                     " MB, too large for a flag file"));
    }
    for (const auto& [number, text] : FlagfileLines(contents)) {
      // gflags: blank lines and comments are skipped; a line without a leading dash names
      // the programs the following flags apply to, which Fulcrum does not use.
      if (text.empty() || text[0] != '-') continue;
      Setting s = Split(text);
      s.where = absl::StrFormat(" (in %s:%d)", path, number);
      if (!Check(s)) return false;
    }
    --depth_;
    return true;
  }

  // --fromenv / --tryfromenv naming `name`: gflags sets the flag from $FLAGS_<name>, and
  // exits on an unknown name, a variable --fromenv needs but does not find, or a bad value.
  bool CheckFromEnv(const std::string& name, bool required, const Setting& from) {
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      return Fail(from, absl::StrCat("names an unknown flag --", name, Suggestion(name)));
    }
    const std::string variable = "FLAGS_" + name;
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) {
      return required ? Fail(from, absl::StrCat("=", name, ": $", variable, " is not set")) : true;
    }
    if (std::string_view(value) == "fromenv" || std::string_view(value) == "tryfromenv") {
      return Fail(from, absl::StrCat("=", name, ": $", variable, " recurses"));
    }
    if (++depth_ > kMaxFlagfileDepth) {
      return Fail(from, absl::StrCat("=", name, " nests deeper than ", kMaxFlagfileDepth,
                                     " levels"));
    }
    const bool ok = Check(Setting{name, value, absl::StrCat(" (from $", variable, ")")});
    --depth_;
    return ok;
  }

 public:
  static Setting Split(absl::string_view arg) {
    while (!arg.empty() && arg[0] == '-') arg.remove_prefix(1);
    Setting s;
    const size_t eq = arg.find('=');
    s.name = std::string(arg.substr(0, eq));
    if (eq != absl::string_view::npos) s.value = std::string(arg.substr(eq + 1));
    return s;
  }

 private:
  std::string program_;
  std::string error_;
  int depth_ = 0;
};

}  // namespace

std::vector<std::string> UngroupedFlags(const HelpSpec& spec) {
  std::set<std::string> grouped;
  for (const HelpGroup& group : spec.groups) grouped.insert(group.flags.begin(), group.flags.end());
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  std::vector<std::string> out;
  for (const auto& info : flags) {
    if (IsOurs(info) && grouped.count(info.name) == 0 && PerFileName(spec, info).empty()) {
      out.push_back(info.name);
    }
  }
  return out;
}

std::string HelpText(const HelpSpec& spec) {
  std::string out = spec.usage;
  if (!out.empty() && out.back() != '\n') out += '\n';
  for (const HelpGroup& group : spec.groups) {
    absl::StrAppend(&out, "\n", group.title, ":\n");
    for (const std::string& name : group.flags) {
      gflags::CommandLineFlagInfo info;
      if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) absl::StrAppend(&out, FlagLine(info));
    }
  }
  // The per-file groups hold what the titled groups do not list.
  std::set<std::string> grouped;
  for (const HelpGroup& group : spec.groups) grouped.insert(group.flags.begin(), group.flags.end());
  std::map<std::string, std::vector<gflags::CommandLineFlagInfo>> per_file;
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  for (const auto& info : flags) {
    const std::string file = PerFileName(spec, info);
    if (!file.empty() && grouped.count(info.name) == 0) per_file[file].push_back(info);
  }
  for (const auto& [file, infos] : per_file) {
    absl::StrAppend(&out, "\n", spec.per_file_title, ": ", file, ":\n");
    for (const auto& info : infos) absl::StrAppend(&out, FlagLine(info));
  }
  const std::vector<std::string> rest = UngroupedFlags(spec);
  if (!rest.empty()) {
    absl::StrAppend(&out, "\nOther:\n");
    for (const std::string& name : rest) {
      gflags::CommandLineFlagInfo info;
      gflags::GetCommandLineFlagInfo(name.c_str(), &info);
      absl::StrAppend(&out, FlagLine(info));
    }
  }
  absl::StrAppend(&out, "\n--helpfull also lists the flags of the libraries (LibTorch, glog, gflags).\n");
  return out;
}

std::optional<int> ParseCommandLine(int* argc, char*** argv, const HelpSpec& spec) {
  gflags::SetUsageMessage(spec.usage);
  Checker checker(spec.program);
  std::vector<std::string> args(*argv + 1, *argv + *argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") break;  // gflags stops here too
    if (arg.size() < 2 || arg[0] != '-') continue;
    Setting s = Checker::Split(arg);
    if (std::find(std::begin(kHelpFlags), std::end(kHelpFlags), s.name) != std::end(kHelpFlags)) {
      std::cout << HelpText(spec);
      return 0;
    }
    if (s.name == "helpfull") {
      std::cout << HelpText(spec) << "\nEvery flag, the libraries' included:\n";
      gflags::ShowUsageWithFlags((*argv)[0]);
      return 0;
    }
    // gflags takes "--name value" for a non-boolean flag written without '='.
    gflags::CommandLineFlagInfo info;
    const bool known = gflags::GetCommandLineFlagInfo(s.name.c_str(), &info);
    const bool file_flag =
        std::find(std::begin(kFileFlags), std::end(kFileFlags), s.name) != std::end(kFileFlags);
    if (!s.value.has_value() && ((known && info.type != "bool") || file_flag) &&
        i + 1 < args.size()) {
      s.value = args[++i];
    }
    if (!checker.Check(s)) {
      std::cerr << checker.error() << " (" << spec.program << " --help lists the flags)"
                << std::endl;
      return 2;
    }
  }
  gflags::ParseCommandLineFlags(argc, argv, /*remove_flags=*/true);
  if (!spec.takes_arguments && *argc > 1) {
    std::cerr << spec.program << ": unexpected argument '" << (*argv)[1]
              << "' (flags are --name=value; " << spec.program << " --help lists them)"
              << std::endl;
    return 2;
  }
  return std::nullopt;
}

}  // namespace fulcrum::cli
