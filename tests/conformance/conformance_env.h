// Shared pieces of the transport conformance suite: per-provider options, the peer process,
// and helpers that drive both completion queues until something arrives or a deadline passes.
#ifndef SHARDPS_TESTS_CONFORMANCE_CONFORMANCE_ENV_H_
#define SHARDPS_TESTS_CONFORMANCE_CONFORMANCE_ENV_H_

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace shardps::transport::conformance {

// The two sides of a connection as a provider wants them configured: the verbs instance binds
// the initiator and the target to two different rxe devices so traffic crosses a wire.
struct ProviderEnv {
  FabricOptions initiator;
  FabricOptions target;
  std::string listen_address;  // for the target's Listen
  // Upper bound for detecting a killed peer (verbs: QP retry timeouts under TCG emulation).
  std::chrono::seconds peer_death_bound{10};
  // How long one operation may take to complete (SoftRoCE under TCG emulation moves ~1 MB/s
  // on large reads when the guest is loaded).
  std::chrono::seconds op_timeout{60};
};

ProviderEnv EnvFor(const std::string& provider);

// Why a provider cannot run here ("" when it can). Only the absence of hardware is a reason to
// skip; SHARDPS_REQUIRE_VERBS=1 turns a verbs skip into a failure (CI inside the SoftRoCE guest).
std::string SkipReason(const std::string& provider);

// A peer in a child process (this binary re-executed with --conformance_peer): it allocates a
// remote-read/write region, listens, accepts one endpoint and polls until killed.
class PeerProcess {
 public:
  PeerProcess() = default;
  ~PeerProcess();  // kills (SIGKILL) and reaps the child if still running
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  Status Start(const std::string& provider, size_t region_bytes);
  const std::string& address() const { return address_; }
  const RegionDescriptor& region() const { return region_; }
  void Kill();  // SIGKILL now, reap

 private:
  pid_t pid_ = -1;
  std::string address_;
  RegionDescriptor region_;
};

// Entry point of the child; returns the process exit code.
int RunPeerMain(const std::string& provider, size_t region_bytes);

}  // namespace shardps::transport::conformance

#endif  // SHARDPS_TESTS_CONFORMANCE_CONFORMANCE_ENV_H_
