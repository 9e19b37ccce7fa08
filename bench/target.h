// The target side of the transport benchmark, and the handle the initiator keeps on it when it
// runs as a child process.
//
// A target opens a fabric, allocates one remote-read/write region, listens, and prints on
// stdout (one line each, in this order):
//   ADDR <listen address>
//   DESC <hex of RegionDescriptor::Encode()>
//   BOUND <raw TCP bound server address, or "-">
//   READY
// It then accepts initiators one after another and serves them (Wait on its completion queue)
// until stdin reaches EOF (with watch_stdin), or max_seconds pass.
//
// Thread safety: RunTarget owns its thread. TargetProcess belongs to the thread that made it.
#ifndef SHARDPS_BENCH_TARGET_H_
#define SHARDPS_BENCH_TARGET_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "transport/transport.h"

namespace shardps::bench {

struct TargetConfig {
  transport::FabricOptions fabric;
  std::string listen_address;  // for Fabric::Listen
  size_t region_bytes = 0;
  bool raw_tcp_bound = false;   // also serve the raw TCP bound (tcp provider)
  std::string raw_tcp_bind_ip;  // "" = 127.0.0.1
  double max_seconds = 600;
  bool watch_stdin = true;
};

// Entry point of --role=target; returns the process exit code.
int RunTarget(const TargetConfig& config);

// A target running as a child of this process (this binary re-executed with --role=target).
class TargetProcess {
 public:
  TargetProcess() = default;
  ~TargetProcess();  // Stop()
  TargetProcess(const TargetProcess&) = delete;
  TargetProcess& operator=(const TargetProcess&) = delete;

  // Spawns /proc/self/exe with args (argv[1..]) and reads its four lines (up to timeout_s).
  Status Start(const std::vector<std::string>& args, double timeout_s);
  // Closes the child's stdin and reaps it (SIGKILL after 10 s).
  void Stop();

  pid_t pid() const { return pid_; }
  const std::string& address() const { return address_; }
  const std::string& descriptor_hex() const { return descriptor_hex_; }
  const std::string& bound_address() const { return bound_address_; }

 private:
  pid_t pid_ = -1;
  UniqueFd stdin_fd_;  // the child's stdin: closing it asks the target to exit
  std::string address_;
  std::string descriptor_hex_;
  std::string bound_address_;
};

}  // namespace shardps::bench

#endif  // SHARDPS_BENCH_TARGET_H_
