// ChildProcess: one real process started by a test with posix_spawn, its stdout and stderr
// captured in a log file. Every wait is bounded; the destructor kills (SIGKILL) and reaps a
// child that is still running, so a failing test leaves nothing behind.
//
// The child runs under coreutils `timeout -s KILL <lifetime>`, which makes itself a process
// group leader with the program in its group: Kill() SIGKILLs that group, so the program gets
// SIGKILL itself (as a crash would), and even if the test process dies without its teardown
// (a crash, a ctest timeout) no child outlives `lifetime`. Without `timeout` on the PATH the
// program is spawned directly.
//
// Thread safety: a ChildProcess belongs to the test thread that created it.
#ifndef SHARDPS_TESTS_INTEGRATION_CHILD_PROCESS_H_
#define SHARDPS_TESTS_INTEGRATION_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace shardps::testing_util {

class ChildProcess {
 public:
  // Starts argv[0] (a path) with argv, stdout and stderr appended to log_path, killed after
  // `lifetime` at the latest.
  static StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      const std::vector<std::string>& argv, const std::string& log_path,
      std::chrono::seconds lifetime = std::chrono::seconds(150));
  ~ChildProcess();  // SIGKILL + reap if still running
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }

  // Waits up to timeout for the child to exit; its exit code (128 + signal for a signal), or
  // nullopt if it is still running when the timeout passes.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  // True while the child has not exited (reaps it if it has).
  bool Running();
  // SIGKILL now, then reap (bounded by the kernel: SIGKILL cannot be ignored).
  void Kill();
  // Sends `sig` to the program (and its `timeout` wrapper): SIGSTOP / SIGCONT make a hung or
  // descheduled process of it.
  void Signal(int sig);
  // The last max_bytes of the child's log, for failure messages.
  std::string LogTail(size_t max_bytes = 3000) const;

 private:
  ChildProcess() = default;
  void Reaped(int wait_status);

  pid_t pid_ = -1;
  bool group_ = false;  // pid_ leads a process group (it is `timeout`)
  std::optional<int> exit_code_;
  std::string name_;
  std::string log_path_;
};

// Reads a whole file; NotFound if it does not exist.
StatusOr<std::string> ReadFile(const std::string& path);
// Polls until path exists and is non-empty; fails when the timeout passes or when `writer`
// (if given) exits first.
StatusOr<std::string> WaitForFile(const std::string& path, std::chrono::milliseconds timeout,
                                  ChildProcess* writer = nullptr);

}  // namespace shardps::testing_util

#endif  // SHARDPS_TESTS_INTEGRATION_CHILD_PROCESS_H_
