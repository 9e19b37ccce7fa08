#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <glog/logging.h>

#include "common/fd.h"
#include "tests/conformance/conformance_env.h"

extern char** environ;

namespace shardps::transport::conformance {
namespace {

std::string ToHex(const std::string& s) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string FromHex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16)));
  }
  return out;
}

bool HasRdmaDevice() {
  // /sys/class/infiniband lists RDMA devices without opening libibverbs.
  DIR* d = opendir("/sys/class/infiniband");
  if (d == nullptr) return false;
  bool any = false;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') any = true;
  }
  closedir(d);
  return any;
}

}  // namespace

ProviderEnv EnvFor(const std::string& provider) {
  ProviderEnv env;
  env.initiator.provider = provider;
  env.target.provider = provider;
  if (provider == "tcp") {
    env.initiator.bind_ip = "127.0.0.1";
    env.target.bind_ip = "127.0.0.1";
    env.listen_address = "127.0.0.1:0";
    env.peer_death_bound = std::chrono::seconds(5);
  } else if (provider == "shm") {
    env.listen_address = "";
    env.peer_death_bound = std::chrono::seconds(5);
  } else if (provider == "verbs") {
    // softroce-up.sh 2: rxe0 on 192.168.77.1, rxe1 on 192.168.77.2, one veth between them.
    const char* ini = getenv("SHARDPS_TEST_VERBS_INITIATOR_IP");
    const char* tgt = getenv("SHARDPS_TEST_VERBS_TARGET_IP");
    env.initiator.bind_ip = ini ? ini : "192.168.77.1";
    env.target.bind_ip = tgt ? tgt : "192.168.77.2";
    env.listen_address = env.target.bind_ip + ":0";
    // 4.096us * 2^12 = 16.8 ms ACK timeout, 7 retries: ~0.13 s on hardware; TCG is far slower.
    env.initiator.rdma_timeout = 12;
    env.target.rdma_timeout = 12;
    env.peer_death_bound = std::chrono::seconds(30);
    env.op_timeout = std::chrono::seconds(300);
  }
  return env;
}

std::string SkipReason(const std::string& provider) {
  if (provider != "verbs") return "";
  const char* require = getenv("SHARDPS_REQUIRE_VERBS");
  const bool required = require != nullptr && std::string(require) == "1";
  if (CompiledProviders().find("verbs") == std::string::npos) {
    return required ? "" : "built without verbs support";
  }
  if (!HasRdmaDevice()) {
    return required ? ""
                    : "no RDMA device (/sys/class/infiniband is empty); run the verbs tier "
                      "inside the SoftRoCE guest (scripts/test.sh does)";
  }
  return "";
}

PeerProcess::~PeerProcess() { Kill(); }

void PeerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int st = 0;
  waitpid(pid_, &st, 0);
  pid_ = -1;
}

Status PeerProcess::Start(const std::string& provider, size_t region_bytes) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  UniqueFd out_r(fds[0]), out_w(fds[1]);  // the peer's stdout
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_w.get(), STDOUT_FILENO);
  const std::string a1 = "--conformance_peer=" + provider;
  const std::string a2 = "--conformance_peer_bytes=" + std::to_string(region_bytes);
  char exe[] = "/proc/self/exe";
  char* argv[] = {exe, const_cast<char*>(a1.c_str()), const_cast<char*>(a2.c_str()), nullptr};
  const int rc = posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  out_w.reset();
  if (rc != 0) {
    pid_ = -1;
    return ErrnoError("posix_spawn peer", rc);
  }
  // Read "ADDR <address>\nDESC <hex>\n" within 60 s.
  std::string buf;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::count(buf.begin(), buf.end(), '\n') < 2) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceededError("peer process did not report its address within 60 s");
    }
    pollfd p{out_r.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char tmp[4096];
    const ssize_t n = read(out_r.get(), tmp, sizeof(tmp));
    if (n <= 0) {
      return UnavailableError("peer process exited before reporting its address: " + buf);
    }
    buf.append(tmp, n);
  }
  out_r.reset();
  const size_t nl = buf.find('\n');
  const std::string l1 = buf.substr(0, nl);
  const std::string l2 = buf.substr(nl + 1, buf.find('\n', nl + 1) - nl - 1);
  if (l1.rfind("ADDR ", 0) != 0 || l2.rfind("DESC ", 0) != 0) {
    return InternalError("peer process said: " + buf);
  }
  address_ = l1.substr(5);
  ASSIGN_OR_RETURN(region_, RegionDescriptor::Decode(FromHex(l2.substr(5))));
  return Status::OK();
}

int RunPeerMain(const std::string& provider, size_t region_bytes) {
  const ProviderEnv env = EnvFor(provider);
  auto fabric = Fabric::Open(env.target);
  if (!fabric.ok()) {
    LOG(ERROR) << "peer: " << fabric.status();
    return 2;
  }
  auto region = (*fabric)->AllocateMemory(region_bytes, Access::kRemoteReadWrite);
  auto cq = (*fabric)->CreateCompletionQueue(1024);
  auto listener = (*fabric)->Listen(env.listen_address);
  if (!region.ok() || !cq.ok() || !listener.ok()) {
    LOG(ERROR) << "peer: setup failed: " << region.status() << " " << cq.status() << " "
               << listener.status();
    return 2;
  }
  printf("ADDR %s\nDESC %s\n", (*listener)->address().c_str(),
         ToHex((*region)->descriptor().Encode()).c_str());
  fflush(stdout);
  EndpointOptions eo;
  eo.endpoint_id = 7;
  auto ep = (*listener)->Accept(cq->get(), eo, std::chrono::milliseconds(60000));
  if (!ep.ok()) {
    LOG(ERROR) << "peer: accept: " << ep.status();
    return 2;
  }
  // Serve until killed (bounded: a forgotten peer exits by itself after two minutes).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  Completion wc[16];
  while (std::chrono::steady_clock::now() < deadline) {
    (*cq)->Wait(wc, 16, std::chrono::milliseconds(10));
  }
  return 0;
}

}  // namespace shardps::transport::conformance
