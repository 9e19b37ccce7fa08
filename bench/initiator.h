// The initiator side of the transport benchmark: one endpoint to a target's region, and the
// measurement loops over it.
//
// Bandwidth: up to `window` operations in flight; with selective signaling, one operation in
// every `signal_every` (default window/4) is signaled, and so is any post that fills the window
// (so a full window always has a completion coming); a completion with context c retires every
// operation up to c (completions arrive in post order). Operation i uses local slot i % slots
// and remote slot i % slots. Timed from the first post to the drained end; bytes = completed
// operations × size.
// Latency: one signaled operation in flight, post→completion time per operation (for a write
// that is the full round trip: data out, acknowledgement back).
//
// Thread safety: a TransportInitiator and everything it owns belong to the calling thread.
#ifndef SHARDPS_BENCH_INITIATOR_H_
#define SHARDPS_BENCH_INITIATOR_H_

#include <memory>
#include <string>

#include "bench/bounds.h"
#include "common/status.h"
#include "transport/transport.h"

namespace shardps::bench {

enum class PollMode { kWait, kSpin };

struct InitiatorConfig {
  transport::FabricOptions fabric;
  std::string peer_address;
  transport::RegionDescriptor remote;
  size_t local_bytes = 0;   // source / sink slots
  size_t verify_bytes = 0;  // largest size to verify
  PollMode poll = PollMode::kWait;
  bool unsignaled = true;
  int signal_every = 0;     // 0 = max(1, window / 4)
};

class TransportInitiator {
 public:
  // Largest window the endpoint supports (its send_depth is one more, for the drain post).
  static constexpr int kMaxWindow = 256;

  static StatusOr<std::unique_ptr<TransportInitiator>> Connect(const InitiatorConfig& config);
  ~TransportInitiator() = default;

  Status Bandwidth(BenchOp op, const PointParams& p, BwResult* out);
  Status Latency(BenchOp op, const PointParams& p, LatResult* out);
  // Writes a seeded pattern of `size` bytes to the start of the remote region, reads it back
  // into a separate zeroed buffer, and compares: DataLoss on any difference.
  Status Verify(size_t size, uint64_t seed);

  std::string DebugString() const;

 private:
  explicit TransportInitiator(const InitiatorConfig& config) : config_(config) {}
  Status Post(BenchOp op, const transport::LocalSlice& local, uint64_t remote_offset,
              uint64_t context, uint32_t flags);
  // Waits for at least one completion (Wait or spinning Poll); error after 60 s of nothing.
  StatusOr<int> WaitSome(transport::Completion* wc, int max);
  Status RunWindow(BenchOp op, const PointParams& p, double seconds, uint64_t* ops);
  Status OneOp(BenchOp op, const transport::LocalSlice& local, uint64_t remote_offset);

  const InitiatorConfig config_;
  // Dependency order: the endpoint goes first, the fabric last.
  std::unique_ptr<transport::Fabric> fabric_;
  std::unique_ptr<transport::MemoryRegion> local_;
  std::unique_ptr<transport::MemoryRegion> verify_;
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<transport::Endpoint> ep_;
  uint64_t next_context_ = 0;
};

}  // namespace shardps::bench

#endif  // SHARDPS_BENCH_INITIATOR_H_
