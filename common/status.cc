#include "common/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shardps {

namespace internal {
void StatusOrValueOnError(const char* what, const std::string& status) {
  std::fprintf(stderr, "shardps: %s %s\n", what, status.c_str());
  std::abort();
}
}  // namespace internal

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code != StatusCode::kOk) rep_ = std::make_unique<Rep>(Rep{code, std::string(message)});
}

const std::string& Status::message() const {
  static const std::string* const kEmpty = new std::string();
  return rep_ ? rep_->message : *kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s = StatusCodeName(rep_->code);
  s += ": ";
  s += rep_->message;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += rep_->message;
  return Status(rep_->code, m);
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

Status InvalidArgumentError(std::string_view m) { return Status(StatusCode::kInvalidArgument, m); }
Status NotFoundError(std::string_view m) { return Status(StatusCode::kNotFound, m); }
Status AlreadyExistsError(std::string_view m) { return Status(StatusCode::kAlreadyExists, m); }
Status PermissionDeniedError(std::string_view m) {
  return Status(StatusCode::kPermissionDenied, m);
}
Status ResourceExhaustedError(std::string_view m) {
  return Status(StatusCode::kResourceExhausted, m);
}
Status FailedPreconditionError(std::string_view m) {
  return Status(StatusCode::kFailedPrecondition, m);
}
Status AbortedError(std::string_view m) { return Status(StatusCode::kAborted, m); }
Status OutOfRangeError(std::string_view m) { return Status(StatusCode::kOutOfRange, m); }
Status UnimplementedError(std::string_view m) { return Status(StatusCode::kUnimplemented, m); }
Status InternalError(std::string_view m) { return Status(StatusCode::kInternal, m); }
Status UnavailableError(std::string_view m) { return Status(StatusCode::kUnavailable, m); }
Status DeadlineExceededError(std::string_view m) {
  return Status(StatusCode::kDeadlineExceeded, m);
}
Status DataLossError(std::string_view m) { return Status(StatusCode::kDataLoss, m); }
Status CancelledError(std::string_view m) { return Status(StatusCode::kCancelled, m); }

Status ErrnoError(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT: code = StatusCode::kNotFound; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    case EACCES:
    case EPERM: code = StatusCode::kPermissionDenied; break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EDQUOT: code = StatusCode::kResourceExhausted; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case ETIMEDOUT: code = StatusCode::kDeadlineExceeded; break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EAGAIN:
    case ENODEV: code = StatusCode::kUnavailable; break;
    case ENOSYS:
    case EOPNOTSUPP: code = StatusCode::kUnimplemented; break;
    default: break;
  }
  return Status(code, m);
}

}  // namespace shardps
