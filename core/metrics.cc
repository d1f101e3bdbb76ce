#include "core/metrics.h"

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace fulcrum {

absl::StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open ", path, " for appending: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsWriter>(new MetricsWriter(path, file));
}

MetricsWriter::~MetricsWriter() { std::fclose(file_); }

absl::Status MetricsWriter::Write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    return absl::InternalError(absl::StrCat("writing ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
