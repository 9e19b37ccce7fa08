#include "tests/integration/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

extern char** environ;

namespace shardps::testing_util {

namespace {
// coreutils timeout, if installed.
std::string FindTimeout() {
  for (const char* p : {"/usr/bin/timeout", "/bin/timeout"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}
}  // namespace

StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                            const std::string& log_path,
                                                            std::chrono::seconds lifetime) {
  if (argv.empty()) return InvalidArgumentError("ChildProcess::Spawn: empty argv");
  std::unique_ptr<ChildProcess> p(new ChildProcess());
  p->log_path_ = log_path;
  p->name_ = argv[0].substr(argv[0].find_last_of('/') + 1);
  std::vector<std::string> full;
  static const std::string timeout = FindTimeout();
  if (!timeout.empty()) {
    full = {timeout, "-s", "KILL", std::to_string(lifetime.count())};
    p->group_ = true;
  }
  full.insert(full.end(), argv.begin(), argv.end());
  std::vector<char*> args;
  for (const std::string& a : full) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  // The group is made here rather than left to `timeout`, so that it exists before Kill() can
  // be called.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (p->group_) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  // Tests read their children's logs (INFO and WARNING lines): a GLOG_minloglevel set for the
  // run to quiet it must not hide them, so the children log everything into their files.
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "GLOG_minloglevel=", 17) != 0) env.push_back(*e);
  }
  static char kAllLevels[] = "GLOG_minloglevel=0";
  env.push_back(kAllLevels);
  env.push_back(nullptr);
  const int rc = posix_spawn(&p->pid_, full[0].c_str(), &fa, &attr, args.data(), env.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    p->pid_ = -1;
    return ErrnoError("posix_spawn " + full[0], rc);
  }
  return p;
}

ChildProcess::~ChildProcess() { Kill(); }

void ChildProcess::Reaped(int st) {
  exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  pid_ = -1;
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (pid_ > 0) {
    int st = 0;
    const pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      Reaped(st);
      break;
    }
    if (r < 0 && errno != EINTR) {  // not our child any more: nothing to wait for
      exit_code_ = -1;
      pid_ = -1;
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return exit_code_;
}

bool ChildProcess::Running() { return !Wait(std::chrono::milliseconds(0)).has_value(); }

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  if (group_) kill(-pid_, SIGKILL);  // `timeout` and the program under it
  kill(pid_, SIGKILL);
  int st = 0;
  while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
  }
  Reaped(st);
}

void ChildProcess::Signal(int sig) {
  if (pid_ <= 0 || exit_code_.has_value()) return;
  if (group_) {
    kill(-pid_, sig);
  } else {
    kill(pid_, sig);
  }
}

std::string ChildProcess::LogTail(size_t max_bytes) const {
  auto s = ReadFile(log_path_);
  if (!s.ok()) return "(no log: " + s.status().ToString() + ")";
  return s->size() > max_bytes ? "..." + s->substr(s->size() - max_bytes) : *s;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

StatusOr<std::string> WaitForFile(const std::string& path, std::chrono::milliseconds timeout,
                                  ChildProcess* writer) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    auto s = ReadFile(path);
    if (s.ok() && !s->empty()) return s;
    if (writer != nullptr && !writer->Running()) {
      return UnavailableError(writer->name() + " exited before writing " + path + ":\n" +
                              writer->LogTail());
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceededError(path + " did not appear within " +
                                   std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace shardps::testing_util
