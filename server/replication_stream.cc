#include "server/replication_stream.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include <glog/logging.h>

#include "common/trace.h"

namespace shardps::server {

namespace {

// Contexts of the operations on the endpoint to the backup.
enum ReplOp : uint64_t { kOpRecord = 1, kOpConsumed = 2, kOpHello = 3, kOpPayload = 4 };
uint64_t ReplContext(ReplOp op, uint32_t slot) { return (static_cast<uint64_t>(op) << 32) | slot; }
ReplOp ReplOpOf(uint64_t ctx) { return static_cast<ReplOp>(ctx >> 32); }
uint32_t ReplSlotOf(uint64_t ctx) { return static_cast<uint32_t>(ctx & 0xffffffffu); }

}  // namespace

uint64_t EncodeRecord(const ReplRecord& r, uint64_t seq, uint64_t epoch, char* dst) {
  auto* h = reinterpret_cast<layout::ReplHeader*>(dst);
  std::memset(h, 0, sizeof(*h));
  h->seq = seq;
  h->kind = static_cast<uint32_t>(r.kind);
  h->slot = r.slot;
  h->version = r.version;
  h->min_clock_plus1 = r.min_clock_plus1;
  h->scale = r.scale;
  h->lr_scale = r.lr_scale;
  h->rule = r.rule;
  h->flags = r.skip ? layout::kReplSkip : 0;
  h->op = static_cast<uint32_t>(r.op);
  h->steps = r.steps;
  h->contributors = static_cast<uint32_t>(r.contributors.size());
  h->bytes = r.bytes;
  h->epoch = epoch;
  h->magic = layout::kReplMagic;
  auto* k = reinterpret_cast<layout::ReplContributor*>(dst + sizeof(layout::ReplHeader));
  for (size_t i = 0; i < r.contributors.size(); ++i) {
    const Contributor& a = r.contributors[i];
    k[i] = layout::ReplContributor{a.worker, 0, a.incarnation, a.seq, a.clock};
  }
  return sizeof(layout::ReplHeader) + sizeof(layout::ReplContributor) * r.contributors.size();
}

uint64_t ReplicationStream::StagingBytes(const layout::ReplLayout& ring, uint32_t slots) {
  return ring.entry_offset(1) * slots + layout::kAlign + sizeof(layout::ReplHello);
}

ReplicationStream::ReplicationStream(transport::Fabric* fabric, transport::CompletionQueue* cq,
                                     const layout::ReplLayout& ring, uint32_t slots, uint32_t group,
                                     std::unique_ptr<transport::MemoryRegion> staging,
                                     ServerStats* stats, std::function<uint64_t()> epoch)
    : fabric_(fabric),
      cq_(cq),
      ring_(ring),
      group_(group),
      staging_(std::move(staging)),
      stats_(stats),
      epoch_(std::move(epoch)),
      stride_(ring.entry_offset(1)),
      consumed_offset_(ring.entry_offset(1) * slots),
      hello_offset_(consumed_offset_ + layout::kAlign),
      records_(slots) {}

ReplicationStream::~ReplicationStream() = default;

char* ReplicationStream::stage(uint32_t slot) const {
  return static_cast<char*>(staging_->data()) + stride_ * slot;
}

float* ReplicationStream::sum(uint32_t slot) const {
  return reinterpret_cast<float*>(stage(slot) + ring_.payload_offset(0));
}

transport::LocalSlice ReplicationStream::sum_payload(uint32_t slot, uint64_t bytes) const {
  return {staging_.get(), stride_ * slot + ring_.payload_offset(0), bytes};
}

Status ReplicationStream::Connect(const control::ReplicaTarget& t, const std::string& identity,
                                  const Snapshot* snapshot, bool wait_for_hello) {
  backup_ring_ = transport::RegionDescriptor();
  backup_consumed_ = transport::RegionDescriptor();
  for (const auto& r : t.regions()) {
    ASSIGN_OR_RETURN(transport::RegionDescriptor d,
                     transport::RegionDescriptor::Decode(r.encoded_descriptor()));
    if (r.name() == "repl_ring") backup_ring_ = d;
    if (r.name() == "repl_consumed") backup_consumed_ = d;
  }
  if (backup_ring_.length < ring_.region_bytes() || backup_consumed_.length < 8) {
    return FailedPreconditionError("backup's replication regions are smaller than the ring");
  }
  auto* hello = reinterpret_cast<layout::ReplHello*>(static_cast<char*>(staging_->data()) +
                                                     hello_offset_);
  std::memset(hello, 0, sizeof(*hello));
  hello->magic = layout::kReplHelloMagic;
  if (snapshot != nullptr) {
    if (snapshot->descriptor.size() > layout::kReplHelloDescriptorMax) {
      return InternalError("snapshot descriptor too long for the replication hello");
    }
    hello->snapshot_bytes = snapshot->bytes;
    hello->snapshot_crc = snapshot->crc;
    hello->descriptor_bytes = static_cast<uint32_t>(snapshot->descriptor.size());
    std::memcpy(hello->descriptor, snapshot->descriptor.data(), snapshot->descriptor.size());
  }
  transport::EndpointOptions eo;
  eo.endpoint_id = kEndpointId | ++generation_;
  eo.send_depth = static_cast<int>(2 * ring_.entries() + 16);
  eo.recv_depth = 4;
  eo.connect_timeout = std::chrono::milliseconds(10000);
  // The backup accepts a replication stream only from a peer that proves a server identity
  // with the key the coordinator gave this primary alone (ReplicaTarget.peer_key).
  eo.auth_identity = identity;
  eo.auth_key = t.peer_key();
  endpoint_.reset();
  auto ep = fabric_->Connect(t.data_address(), cq_, eo);
  if (!ep.ok())
    return ep.status().WithContext("connecting to the backup of group " + std::to_string(group_));
  endpoint_ = std::move(*ep);
  // A new stream: sequence numbers start again, the ring is empty.
  next_seq_ = 1;
  known_consumed_ = 0;
  consumed_read_outstanding_ = false;
  ring_wait_.clear();
  for (auto& r : records_) r.reset();
  RETURN_IF_ERROR(endpoint_->PostWriteImm(
      {staging_.get(), hello_offset_, sizeof(layout::ReplHello)},
      transport::AtOffset(backup_ring_, ring_.hello_offset()),
      layout::MakeImm(layout::ImmKind::kReplHello, group_), ReplContext(kOpHello, 0)));
  // Wait for the hello to complete (nothing else is on this CQ yet).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(10000);
  while (wait_for_hello) {
    transport::Completion wc[8];
    const int n = cq_->Wait(wc, 8, std::chrono::microseconds(2000));
    bool done = false;
    for (int i = 0; i < n; ++i) {
      if (wc[i].endpoint_id != (kEndpointId | generation_)) continue;
      if (!wc[i].ok()) return UnavailableError("backup refused the replication stream");
      done = true;
    }
    if (done) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceededError("backup did not answer");
    }
  }
  state_ = State::kConnected;
  backup_member_ = t.member_id();
  stats_->Update([](ShardServerCounters& c) { c.replicating = true; });
  return Status::OK();
}

void ReplicationStream::NoBackup() {
  state_ = State::kGone;
  endpoint_.reset();
  ring_wait_.clear();
  for (auto& r : records_) r.reset();
  stats_->Update([](ShardServerCounters& c) { c.replicating = false; });
}

ReplicationStream::Disposition ReplicationStream::Submit(ReplRecord r) {
  switch (state_) {
    case State::kConnected: {
      const uint32_t slot = r.slot;
      records_[slot] = std::move(r);
      ring_wait_.push_back(slot);
      PostWaiting();
      return Disposition::kWaitForRecord;
    }
    case State::kFailed:
      // Published once the coordinator has decided the backup's fate (OnBackupGone).
      return Disposition::kWaitForRecord;
    case State::kNone:
    case State::kGone:
      break;
  }
  return Disposition::kPublishNow;
}

void ReplicationStream::PostWaiting() {
  while (!ring_wait_.empty() && state_ == State::kConnected) {
    if (!RingHasSpace(next_seq_, known_consumed_, ring_.entries())) {
      // The ring is full of records the backup has not applied yet: ask how far it got.
      if (!consumed_read_outstanding_) {
        Status s = endpoint_->PostRead({staging_.get(), consumed_offset_, 8},
                                       transport::AtOffset(backup_consumed_, 0),
                                       ReplContext(kOpConsumed, 0));
        if (!s.ok()) {
          Failed(s);
          return;
        }
        consumed_read_outstanding_ = true;
        stats_->Bump(&ShardServerCounters::replication_stalls);
      }
      return;
    }
    const uint32_t slot = ring_wait_.front();
    ring_wait_.pop_front();
    Post(slot);
  }
}

void ReplicationStream::Post(uint32_t slot) {
  const ReplRecord& r = *records_[slot];
  const uint64_t seq = next_seq_++;
  const uint32_t entry = static_cast<uint32_t>((seq - 1) % ring_.entries());
  const uint64_t header_bytes = EncodeRecord(r, seq, epoch_(), stage(slot));
  Status s = endpoint_->PostWrite(r.payload,
                                  transport::AtOffset(backup_ring_, ring_.payload_offset(entry)),
                                  ReplContext(kOpPayload, slot), transport::kUnsignaled);
  if (s.ok()) {
    s = endpoint_->PostWriteImm({staging_.get(), stride_ * slot, header_bytes},
                                transport::AtOffset(backup_ring_, ring_.entry_offset(entry)),
                                layout::MakeImm(layout::ImmKind::kRepl, entry),
                                ReplContext(kOpRecord, slot));
  }
  if (!s.ok()) {
    Failed(s);
    return;
  }
  stats_->Bump(&ShardServerCounters::records_sent);
  trace::Instant("repl_send", "server",
                 {{"slot", slot}, {"version", r.version}, {"seq", seq}, {"bytes", r.bytes}});
}

std::optional<uint32_t> ReplicationStream::OnCompletion(const transport::Completion& wc) {
  if (wc.endpoint_id != (kEndpointId | generation_)) return std::nullopt;  // an earlier backup's
  if (!wc.ok()) {
    Failed(UnavailableError(std::string("replication write failed: ") +
                            transport::WcStatusName(wc.status)));
    return std::nullopt;
  }
  switch (ReplOpOf(wc.context)) {
    case kOpRecord: {
      const uint32_t slot = ReplSlotOf(wc.context);
      if (slot < records_.size() && state_ == State::kConnected) {
        records_[slot].reset();
        return slot;
      }
      return std::nullopt;
    }
    case kOpConsumed: {
      consumed_read_outstanding_ = false;
      uint64_t v = 0;
      std::memcpy(&v, static_cast<char*>(staging_->data()) + consumed_offset_, 8);
      known_consumed_ = std::max(known_consumed_, v);
      PostWaiting();
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

void ReplicationStream::CheckEndpoint(const std::function<bool()>& expected_end) {
  if (endpoint_ && state_ == State::kConnected && !endpoint_->status().ok()) {
    Failed(endpoint_->status(), expected_end());
  }
  // A failure not yet known to be the job's end is logged once the membership had time to say
  // so: at the job's end the backup may close before this server sees the workers leave.
  if (!failure_logged_ && std::chrono::steady_clock::now() - failed_at_ > kFailureGrace) {
    LogFailure(expected_end());
  }
}

void ReplicationStream::Failed(const Status& why, bool expected_end) {
  if (state_ != State::kConnected) return;
  state_ = State::kFailed;
  failure_ = why;
  failed_at_ = std::chrono::steady_clock::now();
  failure_logged_ = false;
  if (expected_end) LogFailure(true);
}

void ReplicationStream::LogFailure(bool expected_end) {
  failure_logged_ = true;
  if (expected_end) {
    LOG(INFO) << "replication to the backup of group " << group_ << " ended after the job's "
              << "workers were done: " << failure_;
    return;
  }
  LOG(WARNING) << "replication to the backup of group " << group_ << " failed: " << failure_
               << "; new versions wait until the coordinator declares the backup gone";
}

bool ReplicationStream::OnBackupGone() {
  if (state_ == State::kNone) return false;
  NoBackup();
  return true;
}

}  // namespace shardps::server
