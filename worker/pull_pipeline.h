// The pull pipeline: per chunk the version last pulled, which buffer it was in, and the state
// of the pull in flight. A pull reads the server's memory only (no server code runs):
//
//   pull = READ header, READ buffer b, READ header   (one round trip when b is guessed right)
//          consistent iff gen[b] is the same in both header reads; retried otherwise.
//
// A pull is done when the version read satisfies the consistency bound at the worker's clock
// (BSP: every worker's pushes of the clocks before; SSP/VSGD: within the staleness), else it
// reads the header again until the wait bound: at once for the first kImmediateRereads, then
// after a delay doubling from kFirstBackoff to kMaxBackoff (Tick() starts them), so that a
// worker waiting for a straggler does not keep the server's transport busy with header reads
// (over tcp each is a request the server answers; measured 400-900 per step under BSP with a
// 3x slower worker before the backoff). While it waits, one chunk per pull and server re-reads
// (the scout: the highest-numbered chunk of that pull on that server still waiting, which
// workers pushing a tensor in chunk order have applied last); the pull's other waiting chunks on
// that server are parked until the scout turns ready, then each reads again at once, the data
// with its header, as a first read does (a parked chunk also re-reads after kParkedBackoff,
// whatever the scout does). A BSP worker waiting for a
// straggler thus costs each server one header read per kMaxBackoff (longer in long waits:
// kWaitedFraction) and tensor, not one per chunk: on emulated hosts (16 workers, 8 chunks on 2 servers, all on 2 cores) the per-chunk
// re-reads were 2,000-4,500 per step (docs/benchmarks.md, "Hierarchical aggregation").
//
// Both buffers, for small chunks. The guess fails when the number of versions published
// between two pulls is not steady: with several workers pushing under ASP or SSP, each pull of
// a 4 KiB chunk missed its guess ~1 time in 4 (tcp 2x2; shm 1x1 too, where no server-side
// ordering helps). A chunk of at most kBothBuffersBytes whose guess missed in any of its last 8
// pulls (`misses`) reads both buffers in its first round trip: header, the guessed buffer into
// the trainer's buffer, the other buffer into this chunk's own staging, header. If the header
// names the other buffer, the snapshot is taken from staging (one copy of the chunk) under the
// same check as always, gen[b] the same in both header reads. The version returned is the one
// the header names, as before; only the round trip is saved. After 8 right guesses the chunk
// reads one buffer again. (`pull_other_buffer` counts the pulls served from the copy.) Not on
// endpoints whose reads are local copies (shm): there a second read costs no round trip, and
// reading both buffers every time made shm push-pull at 4-16 KiB slower, not faster.
//
// Thread safety: none. Owned by the client; called from the client's (trainer's) thread only.
#ifndef SHARDPS_WORKER_PULL_PIPELINE_H_
#define SHARDPS_WORKER_PULL_PIPELINE_H_

#include <chrono>
#include <string>
#include <vector>

#include "proto/control_client.h"
#include "worker/data_path.h"
#include "worker/server_sessions.h"

namespace shardps::worker {

// "bsp", "ssp(s=2)", ...
std::string ConsistencyName(const control::ClusterConfig& config);

class PullPipeline {
 public:
  PullPipeline(const ClientOptions& options, const control::ClusterConfig& config,
               ServerSessions& sessions, std::vector<Tensor>& tensors,
               const std::vector<ChunkPlacement>& chunks, HandleTable& handles,
               const StepClock& step);

  // Staging for the other buffer of each small dense chunk (kBothBuffersBytes) of a tensor in
  // host memory or staged through it: how many bytes, then where they start in the sessions'
  // staging region (after ServerSessions::AllocateStaging).
  uint64_t SpareStagingBytes() const;
  void PlaceSpareStaging(uint64_t base);

  // Pulls every chunk of a tensor, satisfying the consistency mode at the current clock.
  StatusOr<Handle> Pull(uint32_t tensor);
  // Starts the header re-reads whose backoff has passed; called by the wait loop.
  void Tick();
  // How long the wait loop may sleep before Tick has a re-read to start: 0 when one is due,
  // `cap` when none is deferred (or later than that).
  std::chrono::microseconds UntilTick(std::chrono::microseconds cap) const;
  static constexpr int kImmediateRereads = 2;
  static constexpr std::chrono::microseconds kFirstBackoff{10};
  static constexpr std::chrono::microseconds kMaxBackoff{200};
  // A scout that has waited long re-reads less often: after at most max(kMaxBackoff, waited /
  // kWaitedFraction), capped at kLongWaitBackoff. It then sees the bound met at most that late:
  // on average 1/64 of the wait so far, against a re-read every 200 us that, with many workers
  // waiting on an oversubscribed host, took the CPU the last pushers needed (docs/plan.md).
  static constexpr int kWaitedFraction = 32;
  static constexpr std::chrono::microseconds kLongWaitBackoff{2000};
  static constexpr std::chrono::microseconds kParkedBackoff{10000};
  void OnCompletion(uint32_t chunk, uint64_t handle, const Status& err);
  // After a reconnect or failover of `server`: its pulls in flight start over.
  void Restart(uint32_t server);
  // While a recovery runs no pull times out (the consistency bound cannot move while the
  // cluster fails over: the other workers wait for the same failover); when it ends, every
  // pull in flight gets a whole wait timeout again from then.
  void HoldDeadlines(bool hold);

  // The version of a chunk last pulled (0: none yet).
  uint64_t pulled_version(uint32_t chunk) const { return pull_[chunk].pulled_version; }
  // The cluster's clock as seen by the pulls so far: the highest min clock (+1) read.
  uint64_t ClusterClock() const;
  // The lowest min clock (+1) among the chunks pulled so far (0: none): the step staleness
  // of the weights a trainer holds is its clock minus this.
  uint64_t OldestPulledPlus1() const;

  // The min clock (+1) a pull at the current clock must see (the consistency bound).
  uint64_t RequiredPlus1() const;

  // While set, each pull's last post goes with transport::kMore: the caller (PullMany) posts a
  // burst and then polls, which sends it. Re-reads (EvaluatePull, Tick) never do.
  void set_more(bool more) { more_ = more; }

  uint64_t pulls() const { return pulls_; }
  uint64_t pull_retries() const { return pull_retries_; }
  uint64_t pull_other_buffer() const { return pull_other_buffer_; }
  uint64_t bytes_pulled() const { return bytes_pulled_; }

 private:
  enum class Phase { kAll, kHeaderOnly, kDataCheck };
  struct ChunkPull {
    uint64_t pulled_version = 0;
    uint64_t pulled_min_clock_plus1 = 0;
    uint32_t last_buf = 1;  // version 1 is published into buffer 0
    // Parity of the number of versions published between our last two pulls: every new version
    // flips the buffer, so the next pull guesses last_buf ^ flip. 1 fits a training step (one
    // version per step); 0 fits repeated pulls of an unchanged chunk (or two versions per pull).
    uint32_t flip = 1;
    // Whether the next pull reads the data with its first header read (kAll) or the header
    // alone first (kHeaderOnly): kAll saves a round trip when the chunk is already at the bound,
    // but reads the data twice when it is not (a BSP worker that is not the clock's last to
    // push), which on a bandwidth-bound link costs up to one more model per step. Set by each
    // pull's first header read: would the data read alongside it have been the right one?
    bool speculate = true;
    bool first_read = false;  // the pull in flight has not evaluated a header yet
    // Both buffers (above): this chunk's staging offset for the other buffer (0: none, the
    // chunk is too large or not in host memory), the last 8 guesses (bit set: missed, newest
    // lowest), and whether the pull in flight read both.
    uint64_t spare = 0;
    uint8_t misses = 0;
    bool both = false;
    // The pull in flight.
    uint64_t handle = 0;
    Phase phase = Phase::kAll;
    uint32_t guess = 0;
    uint64_t required_plus1 = 0;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point started;  // when Pull posted it
    int not_ready = 0;     // consecutive header reads below the bound
    bool deferred = false;  // a header re-read waits in deferred_ until retry_at
    bool scout = false;     // re-reads for the chunks of its pull (handle) on its server
    bool parked = false;    // deferred behind that scout, for at most kParkedBackoff
    bool woken = false;     // its scout turned ready: the re-read reads the data too (kAll)
    std::chrono::steady_clock::time_point retry_at;
    int64_t trace_start_ns = 0;  // trace::NowNs() at Pull (0: not traced)
  };

  void StartPull(uint32_t id, Phase phase);
  // Both header reads (and the data) are in: done, or read again.
  void EvaluatePull(uint32_t id);
  // Ends the pull in flight of a chunk with `s`.
  void Finish(uint32_t id, const Status& s);
  // A header re-read found chunk `id` below the bound again (after the immediate ones): it
  // becomes its server's scout, or parks behind it.
  void Defer(uint32_t id);
  // If chunk `id` scouts for its pull on its server, it stops; the chunks parked behind it
  // re-read now.
  void ReleaseScout(uint32_t id);

  const ClientOptions& options_;
  const control::ClusterConfig& config_;
  ServerSessions& sessions_;
  std::vector<Tensor>& tensors_;
  const std::vector<ChunkPlacement>& chunks_;
  HandleTable& handles_;
  const StepClock& step_;
  std::vector<ChunkPull> pull_;  // by chunk id
  std::vector<uint32_t> deferred_;  // chunks whose re-read waits (ChunkPull::deferred)
  uint64_t pulls_ = 0;
  uint64_t pull_retries_ = 0;
  uint64_t pull_other_buffer_ = 0;  // pulls served from the other buffer's copy in staging
  uint64_t bytes_pulled_ = 0;
  bool hold_deadlines_ = false;  // a recovery is under way
  bool more_ = false;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_PULL_PIPELINE_H_
