#include "worker/client_lifecycle.h"

#include <string>
#include <utility>

namespace shardps::worker {

const char* ClientStateName(ClientState s) {
  switch (s) {
    case ClientState::kJoined:
      return "before Start()";
    case ClientState::kStarting:
      return "during Start()";
    case ClientState::kRunning:
      return "after Start()";
    case ClientState::kStartFailed:
      return "after a failed Start()";
    case ClientState::kBroken:
      return "after an unrecoverable data-path error";
    case ClientState::kClosed:
      return "after Close()";
  }
  return "in an unknown state";
}

Status ClientLifecycle::Require(const char* call,
                                std::initializer_list<ClientState> allowed) const {
  for (ClientState s : allowed) {
    if (s == state_) return Status::OK();
  }
  std::string m = std::string(call) + " " + ClientStateName(state_);
  if (!cause_.ok() && (state_ == ClientState::kStartFailed || state_ == ClientState::kBroken ||
                       state_ == ClientState::kClosed)) {
    m += " (" + cause_.ToString() + ")";
  }
  return FailedPreconditionError(m);
}

Status ClientLifecycle::FinishStart(Status result) {
  if (state_ == ClientState::kStarting) {
    state_ = result.ok() ? ClientState::kRunning : ClientState::kStartFailed;
    if (!result.ok()) cause_ = result;
  }
  return result;
}

Status ClientLifecycle::Break(Status cause) {
  if (state_ == ClientState::kRunning && !cause.ok()) {
    state_ = ClientState::kBroken;
    cause_ = cause;
  }
  return cause;
}

bool ClientLifecycle::Close() {
  if (state_ == ClientState::kClosed) return false;
  state_ = ClientState::kClosed;
  return true;
}

}  // namespace shardps::worker
