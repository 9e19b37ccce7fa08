// ReplicationStream: the primary side of replication (docs/fault-tolerance.md). Each new
// version of a chunk becomes one record, written into the backup's registered ring with
// one-sided writes (payload first, unsignaled; then header and contributors with the immediate:
// writes on one endpoint are placed in order, so the backup sees the record whole when the
// immediate lands). A version is published only once its record's write has completed.
//
// The stream returns decisions instead of publishing: Submit() says whether the version may be
// published now (no backup) or waits for its record; OnCompletion() names the slot whose record
// completed; OnBackupGone() tells the caller to publish every version that waited.
//
// It also owns the registered staging memory of the records (per slot: header, contributors,
// and the BSP sum, which is a record's payload) and of the read of the backup's consumed word.
//
// Thread safety: not thread-safe. Owned by the server's apply thread (which polls the CQ its
// endpoint completes on).
#ifndef SHARDPS_SERVER_REPLICATION_STREAM_H_
#define SHARDPS_SERVER_REPLICATION_STREAM_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/control.pb.h"
#include "server/consistency_gate.h"
#include "server/server_stats.h"
#include "transport/transport.h"
#include "wire/region_layout.h"

namespace shardps::server {

// One new version of a chunk, as replicated.
struct ReplRecord {
  uint32_t slot = 0;
  layout::ReplKind kind = layout::ReplKind::kApply;
  uint64_t version = 0;  // the version the record creates
  uint64_t min_clock_plus1 = 0;
  float scale = 1.0f;
  float lr_scale = 1.0f;
  layout::UpdateRule rule{};  // the pushes' update rule (kind 0: the server's)
  bool skip = false;          // a skipped update: the version repeats the previous one
  layout::PushOp op = layout::PushOp::kGradient;  // kSet: what is set
  uint64_t steps = 0;                             // kSet: the optimizer step count
  uint64_t bytes = 0;
  transport::LocalSlice payload;  // registered memory holding `bytes` of payload
  std::vector<Contributor> contributors;
};

// Writes the record's header and contributors (as the backup reads them) into `dst`; returns
// the bytes written. Pure.
uint64_t EncodeRecord(const ReplRecord& r, uint64_t seq, uint64_t epoch, char* dst);

// Whether a record of sequence `next_seq` fits in a ring of `entries` of which the backup has
// consumed records up to `consumed`. Pure.
inline bool RingHasSpace(uint64_t next_seq, uint64_t consumed, uint32_t entries) {
  return next_seq - 1 - consumed < entries;
}

class ReplicationStream {
 public:
  // Endpoint ids of the stream: kEndpointId | the connection's generation (a completion of an
  // earlier backup's endpoint, still in the CQ, is told apart and ignored).
  static constexpr uint64_t kEndpointId = 1ull << 62;
  static bool IsStreamEndpoint(uint64_t id) { return (id & kEndpointId) != 0; }

  // `staging` holds `slots` record stages of layout.stride bytes plus one aligned word.
  ReplicationStream(transport::Fabric* fabric, transport::CompletionQueue* cq,
                    const layout::ReplLayout& ring, uint32_t slots, uint32_t group,
                    std::unique_ptr<transport::MemoryRegion> staging, ServerStats* stats,
                    std::function<uint64_t()> epoch);
  ~ReplicationStream();
  // Bytes of staging memory to allocate for `slots` slots.
  static uint64_t StagingBytes(const layout::ReplLayout& ring, uint32_t slots);

  // BSP sums: registered memory, so that the sum is the record's payload.
  float* sum(uint32_t slot) const;
  transport::LocalSlice sum_payload(uint32_t slot, uint64_t bytes) const;

  // A snapshot for a new backup to copy before it follows (server/replica_handoff.h).
  struct Snapshot {
    std::string descriptor;  // transport::RegionDescriptor::Encode() of the registered region
    uint64_t bytes = 0;
    uint32_t crc = 0;
  };
  // Connects to the backup named by `t` as `identity` (control::IdentityString of this
  // primary: the backup checks it with t.peer_key()) and says hello, naming `snapshot` if
  // given. The stream starts anew (sequence 1). With wait_for_hello (start-up: nothing else may
  // be on the CQ yet) it blocks up to 10 s until the hello completed; otherwise (a new backup
  // while training) records may follow at once: they are placed after the hello, and a failed
  // hello fails the stream like any failed write.
  Status Connect(const control::ReplicaTarget& t, const std::string& identity,
                 const Snapshot* snapshot, bool wait_for_hello);
  // The coordinator says there is no backup (at start, or after a failure).
  void NoBackup();

  enum class Disposition { kPublishNow, kWaitForRecord };
  Disposition Submit(ReplRecord r);
  // A completion of this stream's endpoint (endpoint_id == kEndpointId). Returns the slot whose
  // record completed: its version may be published.
  std::optional<uint32_t> OnCompletion(const transport::Completion& c);
  // Checks the endpoint's health (a failure means versions wait for the coordinator).
  // `expected_end` is asked only on a failure: true when the job's workers are done, so the
  // backup going away is the job's end (logged at INFO, not WARNING).
  void CheckEndpoint(const std::function<bool()>& expected_end);
  // The coordinator declared the backup gone: returns true if versions were waiting on it
  // (every version in flight is then to be published).
  bool OnBackupGone();

  bool connected() const { return state_ == State::kConnected; }
  bool failed() const { return state_ == State::kFailed; }
  bool has_backup() const { return state_ != State::kNone; }
  uint32_t backup_member() const { return backup_member_; }
  void Close() { endpoint_.reset(); }

 private:
  enum class State { kNone, kConnected, kFailed, kGone };
  void PostWaiting();
  void Post(uint32_t slot);
  void Failed(const Status& why, bool expected_end = false);
  void LogFailure(bool expected_end);
  // A failure is logged at once if it is the job's end, else after this grace (CheckEndpoint).
  static constexpr std::chrono::milliseconds kFailureGrace{1000};
  Status failure_;
  std::chrono::steady_clock::time_point failed_at_;
  bool failure_logged_ = true;
  char* stage(uint32_t slot) const;

  transport::Fabric* fabric_;
  transport::CompletionQueue* cq_;
  const layout::ReplLayout& ring_;
  uint32_t group_;
  std::unique_ptr<transport::MemoryRegion> staging_;
  ServerStats* stats_;
  std::function<uint64_t()> epoch_;
  uint64_t stride_;
  uint64_t consumed_offset_;
  uint64_t hello_offset_;

  State state_ = State::kNone;
  uint32_t backup_member_ = 0;
  std::unique_ptr<transport::Endpoint> endpoint_;
  transport::RegionDescriptor backup_ring_, backup_consumed_;
  uint64_t generation_ = 0;  // connections made so far
  uint64_t next_seq_ = 1;
  uint64_t known_consumed_ = 0;
  bool consumed_read_outstanding_ = false;
  std::vector<std::optional<ReplRecord>> records_;  // per slot: the record to post
  std::deque<uint32_t> ring_wait_;                  // slots whose records wait for ring space
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_REPLICATION_STREAM_H_
