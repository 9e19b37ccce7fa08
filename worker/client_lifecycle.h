// The lifecycle of a shardps::Client as an explicit state machine (the states and what each
// public call does in each are documented in shardps/client.h, "Lifecycle"). Internal.
//
//   kJoined ──Start()──> kStarting ──ok──> kRunning ──unrecoverable data-path error──> kBroken
//                            └──error──> kStartFailed
//   any state ──Close()──> kClosed
//
// Thread safety: none; owned by the client, called from the client's (trainer's) thread only.
#ifndef SHARDPS_WORKER_CLIENT_LIFECYCLE_H_
#define SHARDPS_WORKER_CLIENT_LIFECYCLE_H_

#include <initializer_list>

#include "shardps/status.h"

namespace shardps::worker {

enum class ClientState {
  kJoined,       // connected and joined; tensors may be registered
  kStarting,     // inside Start() (never seen by a caller: Start runs on the caller's thread)
  kRunning,      // started: the data path works
  kStartFailed,  // Start() failed; only Close() and the getters remain
  kBroken,       // an unrecoverable data-path error; only Close() and the getters remain
  kClosed,       // Close() was called (or the destructor ran)
};

// How a refusal names a state: "before Start()", "after Close()", ...
const char* ClientStateName(ClientState s);

class ClientLifecycle {
 public:
  ClientState state() const { return state_; }
  // Why Start failed or the data path broke (OK otherwise).
  const Status& cause() const { return cause_; }

  // OK when `call` (e.g. "Clock()") may run in the current state, one of `allowed`; else
  // FAILED_PRECONDITION naming the call and the state, and the cause of a failed or broken
  // client: "Clock() before Start()".
  Status Require(const char* call, std::initializer_list<ClientState> allowed) const;

  // kJoined -> kStarting.
  void BeginStart() { state_ = ClientState::kStarting; }
  // kStarting -> kRunning when `result` is OK, else -> kStartFailed (remembering why).
  Status FinishStart(Status result);
  // kRunning -> kBroken, remembering `cause`; returns it. Other states are left as they are (a
  // failure inside Start() is Start's error).
  Status Break(Status cause);
  // Any state -> kClosed. Returns true the first time.
  bool Close();

 private:
  ClientState state_ = ClientState::kJoined;
  Status cause_;  // why Start failed or the data path broke
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CLIENT_LIFECYCLE_H_
