// A transport::Fabric decorator that injects data-path errors, for tests: the fault is put in
// front of the transport contract (transport/transport.h) instead of inside the code under test
// (in the spirit of LevelDB's FaultInjectionTestEnv and Mooncake TENT's fault proxy).
//
// Everything is forwarded to a real fabric. On every Nth eligible post an endpoint forwards the
// operation naming a wrong rkey, so the peer's side refuses it: a real kRemoteAccessError
// completion, after which the real endpoint is in the error state exactly as after a genuine
// fault ("Errors" in transport.h). Memory regions and completion queues are the real fabric's.
//
// Eligible posts: signaled writes-with-immediate (the operations that deliver a message to the
// peer), except the first `skip_first_posts` of each endpoint (so a fresh connection's opening
// message always gets through), and at most one per endpoint (after it the endpoint is in the
// error state anyway, so each injected error costs exactly one endpoint).
//
// Thread safety: as transport.h. The fabric is thread-safe; each endpoint belongs to the polling
// thread of its completion queue; the counters may be read from any thread.
#ifndef SHARDPS_TESTS_INTEGRATION_FAULT_INJECTING_FABRIC_H_
#define SHARDPS_TESTS_INTEGRATION_FAULT_INJECTING_FABRIC_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/transport.h"

namespace shardps::test {

struct FaultOptions {
  uint64_t error_every = 0;  // every Nth eligible post fails; 0: none
  int skip_first_posts = 1;  // per endpoint: its first posts are never failed
  // A hostile peer's rewrite: called with the local bytes of every write-with-immediate before
  // it is forwarded (the bytes it will carry; a push header comes first), which it may change.
  std::function<void(char* data, uint64_t length, uint32_t imm)> rewrite;
  // A hostile peer's later rewrite of what it already sent (a worker rewriting a push's header
  // in its inbox slot while the server still holds the push): `keep` picks writes-with-
  // immediate whose first bytes (at most kKeptBytes) and target are kept; before each later
  // read of that endpoint `rewrite_now` is asked whether to write them again now, changed by
  // `change`, as a plain unsignaled write to the same place (once per kept write).
  static constexpr uint64_t kKeptBytes = 256;
  std::function<bool(const char* data, uint64_t length, uint32_t imm)> keep;
  std::function<bool()> rewrite_now;
  std::function<void(char* data, uint64_t length)> change;
  // A provider that refuses a post (its send queue full past the caller's patience, a transient
  // local error): a write-with-immediate `refuse` picks is not posted, its post returns
  // UNAVAILABLE, and the endpoint stays healthy (nothing of it reached the peer).
  std::function<bool(const char* data, uint64_t length, uint32_t imm)> refuse;
};

// What was injected, shared by the fabric and its endpoints; outlives both if the caller holds it.
struct FaultCounters {
  std::atomic<uint64_t> eligible{0};  // eligible posts seen
  std::atomic<uint64_t> injected{0};  // posts sent with a wrong rkey (each one error completion)
};

class FaultInjectingFabric final : public transport::Fabric {
 public:
  FaultInjectingFabric(std::unique_ptr<transport::Fabric> inner, const FaultOptions& options);

  std::shared_ptr<const FaultCounters> counters() const { return counters_; }

  std::string name() const override { return inner_->name(); }
  std::string DebugString() const override;
  StatusOr<std::unique_ptr<transport::MemoryRegion>> RegisterMemory(
      void* addr, size_t length, transport::Access access, transport::MemoryKind kind) override {
    return inner_->RegisterMemory(addr, length, access, kind);
  }
  StatusOr<std::unique_ptr<transport::MemoryRegion>> AllocateMemory(
      size_t length, transport::Access access) override {
    return inner_->AllocateMemory(length, access);
  }
  StatusOr<std::unique_ptr<transport::CompletionQueue>> CreateCompletionQueue(int depth) override {
    return inner_->CreateCompletionQueue(depth);
  }
  // Accepted endpoints are passed through undecorated: the faults are the initiator's.
  StatusOr<std::unique_ptr<transport::Listener>> Listen(const std::string& address) override {
    return inner_->Listen(address);
  }
  StatusOr<std::unique_ptr<transport::Endpoint>> Connect(
      const std::string& address, transport::CompletionQueue* cq,
      const transport::EndpointOptions& options) override;

 private:
  const std::unique_ptr<transport::Fabric> inner_;
  const FaultOptions options_;
  const std::shared_ptr<FaultCounters> counters_ = std::make_shared<FaultCounters>();
};

}  // namespace shardps::test

#endif  // SHARDPS_TESTS_INTEGRATION_FAULT_INJECTING_FABRIC_H_
