// Re-replication (docs/fault-tolerance.md, "Redundancy restored"): a new backup for a group that
// is already training. The primary snapshots the group's state into a registered remote-read
// region and starts its stream to the new backup in the same apply-thread step; the backup
// copies the snapshot with one-sided reads while training goes on, restores it, applies the
// records that arrived meanwhile, and follows the stream from then on. Apply thread only.
#include <algorithm>
#include <cstring>
#include <string>

#include <glog/logging.h>

#include "common/crash_point.h"
#include "common/crc32c.h"
#include "proto/credentials.h"
#include "server/replica_handoff.h"
#include "server/shard_server.h"

namespace shardps::server {

namespace {

// Reads of the snapshot: at most this much each, this many in flight (the endpoint's send
// queue also carries nothing else on the backup's side).
constexpr uint64_t kReadPiece = 4ull << 20;
constexpr int kReadsInFlight = 8;
// A snapshot larger than this is not one this build wrote (weights + optimizer state + VSGD
// history of one group; checked before anything is allocated).
constexpr uint64_t kMaxSnapshotBytes = 1ull << 40;

int64_t MsSince(ShardServer::Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(ShardServer::Clock::now() - t0)
      .count();
}

}  // namespace

void ShardServer::ReplicateTo(const control::ReplicaTarget& t) {
  if (backup_ && t.group() == group_ && !catch_up_ && !awaiting_snapshot_) {
    // The promotion that makes this server the primary is still on its way (or draining):
    // the target is taken up right after it.
    deferred_target_ = t;
    return;
  }
  if (backup_ || config_.replicas() < 2 || t.group() != group_) {
    LOG(WARNING) << "server rank " << rank_ << ": replica target for group " << t.group()
                 << " ignored (this server is " << (backup_ ? "the backup" : "the primary")
                 << " of group " << group_ << ")";
    return;
  }
  if (stream_->has_backup() && (stream_->connected() || stream_->failed())) {
    DropBackup();  // a new backup replaces one the coordinator gave up on
  }
  const auto t0 = Clock::now();
  ReplicationStream::Snapshot snap;
  if (t.catch_up()) {
    // Nothing is in flight (the stream had no backup, so every version was published at once):
    // the snapshot is exactly the published state, and every later version becomes a record.
    const HandoffState hs{chunks_.get(), workers_.get(), gate_.get(), ack_board_.get()};
    const uint64_t need = HandoffBytes(hs);
    handoff_.reset();
    auto region = fabric_->AllocateMemory(std::max<uint64_t>(need, layout::kAlign),
                                          transport::Access::kRemoteRead);
    if (!region.ok()) {
      LOG(ERROR) << "server rank " << rank_ << ": cannot register a " << need
                 << "-byte snapshot for group " << group_ << "'s new backup: " << region.status()
                 << "; the group stays without a backup";
      return;
    }
    handoff_ = std::move(*region);
    auto n = WriteHandoff(hs, group_, static_cast<char*>(handoff_->data()), handoff_->length());
    if (!n.ok()) {
      LOG(ERROR) << "server rank " << rank_ << ": snapshot for the new backup: " << n.status();
      handoff_.reset();
      return;
    }
    snap.bytes = *n;
    snap.crc = crc32c::Value(handoff_->data(), *n);
    transport::RegionDescriptor d = handoff_->descriptor();
    d.length = *n;
    snap.descriptor = d.Encode();
    CrashPoint("server.after_handoff");
  }
  const auto t1 = Clock::now();
  const std::string identity = control::IdentityString(
      {control_->member_id(), static_cast<int>(control::ROLE_SERVER), rank_});
  const Status st = stream_->Connect(t, identity, t.catch_up() ? &snap : nullptr,
                                     /*wait_for_hello=*/false);
  if (!st.ok()) {
    // The coordinator hears of it from the backup (no hello: it leaves) or sees it die.
    LOG(ERROR) << "server rank " << rank_ << ": cannot reach group " << group_ << "'s new backup"
               << " (member " << t.member_id() << " at " << t.data_address() << "): " << st
               << "; going on without replication";
    handoff_.reset();
    return;
  }
  stats_.Bump(&ShardServerCounters::rereplications);
  LOG(WARNING) << "server rank " << rank_ << ": REPLICATING group " << group_
               << " to a NEW BACKUP, member " << t.member_id() << " at " << t.data_address()
               << (t.catch_up() ? " (snapshot of " + std::to_string(snap.bytes) + " bytes taken in " +
                                      std::to_string(std::chrono::duration_cast<
                                                         std::chrono::microseconds>(t1 - t0)
                                                         .count()) +
                                      " us; it copies it with one-sided reads)"
                                : std::string())
               << "; connected in " << MsSince(t1) << " ms";
}

void ShardServer::StartCatchUp(uint64_t endpoint_id, const layout::ReplHello& hello) {
  auto fail = [&](const std::string& why) {
    catch_up_error_ = FailedPreconditionError("new backup of group " + std::to_string(group_) +
                                              ": " + why);
    catch_up_.reset();
  };
  if (!awaiting_snapshot_ || catch_up_) return fail("a snapshot it was not waiting for");
  CrashPoint("server.before_catch_up");
  const uint32_t dn = std::min<uint32_t>(hello.descriptor_bytes, layout::kReplHelloDescriptorMax);
  auto d = transport::RegionDescriptor::Decode(std::string_view(hello.descriptor, dn));
  if (!d.ok()) return fail("the snapshot's descriptor: " + d.status().ToString());
  if (hello.snapshot_bytes == 0 || hello.snapshot_bytes > kMaxSnapshotBytes ||
      d->length < hello.snapshot_bytes) {
    return fail("a snapshot of " + std::to_string(hello.snapshot_bytes) + " bytes in a region of " +
                std::to_string(d->length));
  }
  auto local = fabric_->AllocateMemory(hello.snapshot_bytes, transport::Access::kLocalOnly);
  if (!local.ok()) return fail("cannot allocate the snapshot's copy: " + local.status().ToString());
  catch_up_ = std::make_unique<CatchUp>();
  catch_up_->endpoint_id = endpoint_id;
  catch_up_->local = std::move(*local);
  catch_up_->remote = *d;
  catch_up_->bytes = hello.snapshot_bytes;
  catch_up_->crc = hello.snapshot_crc;
  catch_up_->started = Clock::now();
  awaiting_snapshot_ = false;
  LOG(INFO) << "server rank " << rank_ << ": copying group " << group_ << "'s snapshot ("
            << catch_up_->bytes << " bytes) from its primary with one-sided reads";
  PostCatchUpReads();
}

void ShardServer::PostCatchUpReads() {
  CatchUp& c = *catch_up_;
  transport::Endpoint* ep = endpoints_->Find(c.endpoint_id);
  if (ep == nullptr) {
    catch_up_error_ = UnavailableError("the primary's endpoint closed during the snapshot copy");
    return;
  }
  const uint64_t piece = std::min(kReadPiece, ep->max_operation_bytes());
  while (c.posted < c.bytes && c.outstanding < kReadsInFlight) {
    const uint64_t n = std::min(piece, c.bytes - c.posted);
    Status st = ep->PostRead({c.local.get(), c.posted, n}, transport::AtOffset(c.remote, c.posted),
                             /*context=*/n);
    if (!st.ok()) {
      catch_up_error_ = st.WithContext("reading the primary's snapshot");
      return;
    }
    c.posted += n;
    ++c.outstanding;
  }
}

void ShardServer::OnCatchUpRead(const transport::Completion& wc) {
  CatchUp& c = *catch_up_;
  if (!wc.ok()) {
    catch_up_error_ = UnavailableError(std::string("reading the primary's snapshot failed: ") +
                                       transport::WcStatusName(wc.status));
    return;
  }
  --c.outstanding;
  c.completed += wc.context;  // the read's length
  if (c.completed < c.bytes) {
    PostCatchUpReads();
    return;
  }
  FinishCatchUp();
}

void ShardServer::FinishCatchUp() {
  std::unique_ptr<CatchUp> c = std::move(catch_up_);
  const char* data = static_cast<const char*>(c->local->data());
  Status st = crc32c::Value(data, c->bytes) == c->crc
                  ? Status::OK()
                  : DataLossError("the snapshot read does not match its checksum");
  if (st.ok()) {
    st = RestoreHandoff(data, c->bytes, group_, layout_->max_workers(),
                        {chunks_.get(), workers_.get(), gate_.get(), ack_board_.get()});
  }
  if (!st.ok()) {
    catch_up_error_ = st.WithContext("restoring group " + std::to_string(group_) + "'s snapshot");
    return;
  }
  const int64_t copy_ms = MsSince(c->started);
  const size_t held = c->held.size();
  // The records that arrived during the copy follow the snapshot: apply them in order.
  for (uint32_t entry : c->held) ApplyRecord(entry);
  stats_.Bump(&ShardServerCounters::catch_ups);
  LOG(WARNING) << "server rank " << rank_ << ": IN SYNC as the new backup of group " << group_
               << ": snapshot of " << c->bytes << " bytes copied and restored in " << copy_ms
               << " ms; " << held << " records held meanwhile applied ("
               << applier_->applied() << " so far); following the stream";
  CrashPoint("server.after_catch_up");
  control::Envelope e;
  control::ReplicaSynced* rs = e.mutable_replica_synced();
  rs->set_group(group_);
  rs->set_snapshot_bytes(c->bytes);
  rs->set_copy_ms(static_cast<uint32_t>(std::max<int64_t>(0, copy_ms)));
  rs->set_records_held(static_cast<uint32_t>(held));
  // Again after a coordinator restart: until it knows, it will not promote this backup.
  Status sent = control_->SendAndRepeatOnRejoin(e);
  if (!sent.ok()) LOG(WARNING) << "server rank " << rank_ << ": ReplicaSynced: " << sent;
}

}  // namespace shardps::server
