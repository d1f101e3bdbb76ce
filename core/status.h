// Status helpers shared by every module: absl::Status propagation macros and a few
// constructors for the error kinds Fulcrum uses. Caller errors (bad flags, bad files,
// bad layouts) travel as absl::Status up to main(), which alone picks the exit code.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

/// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define FULCRUM_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status fulcrum_status_ = (expr);           \
    if (!fulcrum_status_.ok()) return fulcrum_status_; \
  } while (0)

#define FULCRUM_STATUS_CONCAT_INNER_(a, b) a##b
#define FULCRUM_STATUS_CONCAT_(a, b) FULCRUM_STATUS_CONCAT_INNER_(a, b)

/// `FULCRUM_ASSIGN_OR_RETURN(auto x, MaybeX());` unwraps an absl::StatusOr or returns its error.
#define FULCRUM_ASSIGN_OR_RETURN(lhs, expr) \
  FULCRUM_ASSIGN_OR_RETURN_IMPL_(FULCRUM_STATUS_CONCAT_(fulcrum_statusor_, __LINE__), lhs, expr)
#define FULCRUM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

namespace fulcrum {

/// Throws std::runtime_error carrying `status`'s message when it is not OK. For the few
/// places (constructors, autograd callbacks) that cannot return a Status.
void ThrowIfError(const absl::Status& status);

}  // namespace fulcrum
