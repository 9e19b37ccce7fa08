#include "bench/target.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>

#include <glog/logging.h>

#include "bench/bench_util.h"
#include "bench/bounds.h"

extern char** environ;

namespace shardps::bench {

using transport::Access;
using transport::Completion;
using transport::EndpointOptions;
using transport::Fabric;

namespace {

// True once stdin has reached EOF or an error (the parent closed its end).
bool StdinClosed() {
  pollfd p{STDIN_FILENO, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
  char c[256];
  const ssize_t n = read(STDIN_FILENO, c, sizeof c);
  return n <= 0;
}

}  // namespace

int RunTarget(const TargetConfig& config) {
  auto fabric = Fabric::Open(config.fabric);
  if (!fabric.ok()) {
    LOG(ERROR) << "target: " << fabric.status();
    return 2;
  }
  auto region = (*fabric)->AllocateMemory(config.region_bytes, Access::kRemoteReadWrite);
  if (!region.ok()) {
    LOG(ERROR) << "target: allocate " << config.region_bytes << " bytes: " << region.status();
    return 2;
  }
  Prefault((*region)->data(), (*region)->length());
  auto cq = (*fabric)->CreateCompletionQueue(1024);
  if (!cq.ok()) {
    LOG(ERROR) << "target: completion queue: " << cq.status();
    return 2;
  }
  auto listener = (*fabric)->Listen(config.listen_address);
  if (!listener.ok()) {
    LOG(ERROR) << "target: listen on '" << config.listen_address << "': " << listener.status();
    return 2;
  }
  (*listener)->set_authenticator(BenchAuthenticator());
  std::unique_ptr<RawTcpServer> raw;
  if (config.raw_tcp_bound) {
    auto r = RawTcpServer::Start(config.raw_tcp_bind_ip);
    if (!r.ok()) {
      LOG(ERROR) << "target: raw tcp bound server: " << r.status();
      return 2;
    }
    raw = std::move(*r);
  }
  printf("ADDR %s\nDESC %s\nBOUND %s\nREADY\n", (*listener)->address().c_str(),
         ToHex((*region)->descriptor().Encode()).c_str(), raw ? raw->address().c_str() : "-");
  fflush(stdout);
  LOG(INFO) << "target: " << (*fabric)->DebugString() << " listening on " << (*listener)->address()
            << ", region " << (*region)->descriptor().DebugString();

  const double deadline = NowSeconds() + config.max_seconds;
  auto done = [&] { return NowSeconds() >= deadline || (config.watch_stdin && StdinClosed()); };
  uint64_t next_id = 1;
  bool warned = false;
  while (!done()) {
    EndpointOptions eo;
    eo.endpoint_id = next_id++;
    eo.send_depth = 16;
    eo.recv_depth = 16;
    auto ep = (*listener)->Accept(cq->get(), eo, std::chrono::milliseconds(1000));
    if (!ep.ok()) {
      if (ep.status().code() != StatusCode::kDeadlineExceeded && !warned) {
        LOG(WARNING) << "target: accept: " << ep.status() << " (retrying until told to stop)";
        warned = true;
      }
      continue;
    }
    LOG(INFO) << "target: serving " << (*ep)->DebugString();
    Completion wc[16];
    while (!done()) {
      const int n = (*cq)->Wait(wc, 16, std::chrono::milliseconds(20));
      for (int i = 0; i < n; ++i) {
        if (!wc[i].ok()) {
          LOG(WARNING) << "target: completion " << transport::WcStatusName(wc[i].status);
        }
      }
      if (!(*ep)->status().ok()) {
        LOG(INFO) << "target: initiator gone (" << (*ep)->status() << "); accepting again";
        break;
      }
    }
  }
  LOG(INFO) << "target: exiting";
  return 0;
}

// ---- TargetProcess ----

TargetProcess::~TargetProcess() { Stop(); }

Status TargetProcess::Start(const std::vector<std::string>& args, double timeout_s) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  UniqueFd out_r(fds[0]), out_w(fds[1]);  // the child's stdout
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  UniqueFd in_r(fds[0]), in_w(fds[1]);  // the child's stdin
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_w.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, in_r.get(), STDIN_FILENO);
  std::vector<std::string> all;
  all.push_back("/proc/self/exe");
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  out_w.reset();
  in_r.reset();
  if (rc != 0) {
    pid_ = -1;
    return ErrnoError("posix_spawn target", rc);
  }
  stdin_fd_ = std::move(in_w);
  std::string buf;
  const double deadline = NowSeconds() + timeout_s;
  while (buf.find("READY\n") == std::string::npos) {
    const double left = deadline - NowSeconds();
    if (left <= 0) {
      return DeadlineExceededError("target did not report READY within " +
                                   std::to_string(timeout_s) + " s; it said: " + buf);
    }
    pollfd p{out_r.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
    char tmp[4096];
    const ssize_t n = read(out_r.get(), tmp, sizeof tmp);
    if (n <= 0) {
      return UnavailableError("target exited before READY (see its log above); it said: " + buf);
    }
    buf.append(tmp, static_cast<size_t>(n));
  }
  out_r.reset();
  std::istringstream is(buf);
  std::string line;
  while (std::getline(is, line)) {
    if (line.rfind("ADDR ", 0) == 0) address_ = line.substr(5);
    if (line.rfind("DESC ", 0) == 0) descriptor_hex_ = line.substr(5);
    if (line.rfind("BOUND ", 0) == 0) bound_address_ = line.substr(6) == "-" ? "" : line.substr(6);
  }
  if (descriptor_hex_.empty()) return InternalError("target printed no DESC line: " + buf);
  return Status::OK();
}

void TargetProcess::Stop() {
  stdin_fd_.reset();
  if (pid_ <= 0) return;
  const double deadline = NowSeconds() + 10;
  int st = 0;
  while (waitpid(pid_, &st, WNOHANG) == 0) {
    if (NowSeconds() > deadline) {
      LOG(WARNING) << "target " << pid_ << " did not exit 10 s after stdin closed; killing it";
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
      break;
    }
    usleep(10000);
  }
  pid_ = -1;
}

}  // namespace shardps::bench
