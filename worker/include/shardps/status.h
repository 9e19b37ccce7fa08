// Status and StatusOr<T>: errors are values.
//
// A small, dependency-free equivalent of absl::Status. A Status is either OK (no allocation) or
// carries a code and a message. Anything a peer, a file or a user can cause is reported through
// Status; glog CHECK is reserved for programmer errors.
//
// Thread safety: Status and StatusOr are values; distinct objects may be used from any thread,
// a single object needs external synchronisation like any other value type.
#ifndef SHARDPS_STATUS_H_
#define SHARDPS_STATUS_H_

#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "shardps/export.h"

namespace shardps {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

SHARDPS_EXPORT const char* StatusCodeName(StatusCode code);

namespace internal {
// Aborts with a message: value() on an error StatusOr is a programmer error.
[[noreturn]] SHARDPS_EXPORT void StatusOrValueOnError(const char* what, const std::string& status);
}  // namespace internal

class [[nodiscard]] SHARDPS_EXPORT Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string_view message);

  static Status OK() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  std::string ToString() const;

  // Returns a copy with "context: " prepended to the message (OK stays OK).
  Status WithContext(std::string_view context) const;

  // Explicitly ignore a status (e.g. best-effort cleanup).
  void IgnoreError() const {}

  Status(const Status& other) : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}
  Status& operator=(const Status& other) {
    if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

SHARDPS_EXPORT std::ostream& operator<<(std::ostream& os, const Status& s);

// Convenience constructors, named after the code.
SHARDPS_EXPORT Status InvalidArgumentError(std::string_view msg);
SHARDPS_EXPORT Status NotFoundError(std::string_view msg);
SHARDPS_EXPORT Status AlreadyExistsError(std::string_view msg);
SHARDPS_EXPORT Status PermissionDeniedError(std::string_view msg);
SHARDPS_EXPORT Status ResourceExhaustedError(std::string_view msg);
SHARDPS_EXPORT Status FailedPreconditionError(std::string_view msg);
SHARDPS_EXPORT Status AbortedError(std::string_view msg);
SHARDPS_EXPORT Status OutOfRangeError(std::string_view msg);
SHARDPS_EXPORT Status UnimplementedError(std::string_view msg);
SHARDPS_EXPORT Status InternalError(std::string_view msg);
SHARDPS_EXPORT Status UnavailableError(std::string_view msg);
SHARDPS_EXPORT Status DeadlineExceededError(std::string_view msg);
SHARDPS_EXPORT Status DataLossError(std::string_view msg);
SHARDPS_EXPORT Status CancelledError(std::string_view msg);
// An error from a failed system call: "what: strerror(err)", code chosen from errno.
SHARDPS_EXPORT Status ErrnoError(std::string_view what, int err);

// StatusOr<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) {  // NOLINT: implicit by design
    if (status_.ok()) internal::StatusOrValueOnError("StatusOr from an OK Status", "");
  }
  StatusOr(Status&& status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) internal::StatusOrValueOnError("StatusOr from an OK Status", "");
  }
  StatusOr(const T& value) : value_(value) {}       // NOLINT
  StatusOr(T&& value) : value_(std::move(value)) {}  // NOLINT
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U&&, T> &&
                                                    !std::is_same_v<std::decay_t<U>, Status>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  const T& value() const& {
    if (!ok()) internal::StatusOrValueOnError("StatusOr::value() on error", status_.ToString());
    return *value_;
  }
  T& value() & {
    if (!ok()) internal::StatusOrValueOnError("StatusOr::value() on error", status_.ToString());
    return *value_;
  }
  T&& value() && {
    if (!ok()) internal::StatusOrValueOnError("StatusOr::value() on error", status_.ToString());
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

namespace internal {
inline Status AsStatus(const Status& s) { return s; }
inline Status AsStatus(Status&& s) { return std::move(s); }
template <typename T>
Status AsStatus(const StatusOr<T>& s) {
  return s.status();
}
}  // namespace internal

}  // namespace shardps

#define SHARDPS_CONCAT_INNER_(a, b) a##b
#define SHARDPS_CONCAT_(a, b) SHARDPS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)                                   \
  do {                                                          \
    ::shardps::Status _shardps_status = (expr);                 \
    if (!_shardps_status.ok()) return _shardps_status;          \
  } while (0)

// ASSIGN_OR_RETURN(auto x, StatusOrExpr): declares/assigns x or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(SHARDPS_CONCAT_(_shardps_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()

#endif  // SHARDPS_STATUS_H_
