// ReplicationStream's decisions over a real provider without a network: two shm fabrics in one
// process, the primary's stream writing into a backup's ring, which ReplicaApplier applies.
#include "server/replication_stream.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "server/replica_applier.h"

namespace shardps::server {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<transport::Fabric> OpenShm() {
  transport::FabricOptions o;
  o.provider = "shm";
  auto f = transport::Fabric::Open(o);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

class ReplicationStreamTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kSlots = 2;
  static constexpr uint64_t kBytes = 16;

  ReplicationStreamTest() : ring_layout_(kBytes, 4, /*entries=*/2), layout_({kBytes, kBytes}, 4) {}

  void SetUp() override {
    primary_ = OpenShm();
    backup_ = OpenShm();
    ASSERT_TRUE(primary_ && backup_);
    auto pcq = primary_->CreateCompletionQueue(2048);
    auto bcq = backup_->CreateCompletionQueue(2048);
    ASSERT_TRUE(pcq.ok() && bcq.ok());
    pcq_ = std::move(*pcq);
    bcq_ = std::move(*bcq);
    auto ring = backup_->AllocateMemory(ring_layout_.region_bytes(), transport::Access::kRemoteWrite);
    auto consumed = backup_->AllocateMemory(layout::kAlign, transport::Access::kRemoteRead);
    auto staging = primary_->AllocateMemory(ReplicationStream::StagingBytes(ring_layout_, kSlots),
                                            transport::Access::kLocalOnly);
    ASSERT_TRUE(ring.ok() && consumed.ok() && staging.ok());
    ring_ = std::move(*ring);
    consumed_ = std::move(*consumed);
    stream_ = std::make_unique<ReplicationStream>(primary_.get(), pcq_.get(), ring_layout_, kSlots,
                                                  /*group=*/3, std::move(*staging), &stats_,
                                                  [] { return uint64_t{5}; });
  }

  // Connects the stream to the backup; returns the backup's endpoint.
  void Connect() {
    auto l = backup_->Listen("");
    ASSERT_TRUE(l.ok()) << l.status();
    control::ReplicaTarget t;
    t.set_member_id(9);
    t.set_data_address((*l)->address());
    auto* r = t.add_regions();
    r->set_name("repl_ring");
    r->set_encoded_descriptor(ring_->descriptor().Encode());
    r = t.add_regions();
    r->set_name("repl_consumed");
    r->set_encoded_descriptor(consumed_->descriptor().Encode());
    Status connected = InternalError("not run");
    std::thread th([&] { connected = stream_->Connect(t, "", nullptr, true); });
    transport::EndpointOptions eo;
    eo.endpoint_id = 1;
    auto ep = (*l)->Accept(bcq_.get(), eo, milliseconds(10000));
    th.join();
    ASSERT_TRUE(ep.ok()) << ep.status();
    ASSERT_TRUE(connected.ok()) << connected;
    backup_ep_ = std::move(*ep);
    const transport::Completion hello = NextBackupImm();
    EXPECT_EQ(layout::ImmKindOf(hello.imm), layout::ImmKind::kReplHello);
    EXPECT_EQ(layout::ImmArg(hello.imm), 3u);
  }

  // Polls a CQ until `want` accepts a completion (others are handed to `other`).
  bool PollUntil(transport::CompletionQueue* cq,
                 const std::function<bool(const transport::Completion&)>& want) {
    const auto deadline = std::chrono::steady_clock::now() + milliseconds(5000);
    while (std::chrono::steady_clock::now() < deadline) {
      transport::Completion wc[8];
      const int n = cq->Wait(wc, 8, std::chrono::microseconds(1000));
      for (int i = 0; i < n; ++i) {
        if (want(wc[i])) return true;
      }
    }
    return false;
  }
  // The next completion of the stream's endpoint that names a slot (none: -1).
  int64_t NextPublishable() {
    int64_t slot = -1;
    PollUntil(pcq_.get(), [&](const transport::Completion& c) {
      EXPECT_TRUE(ReplicationStream::IsStreamEndpoint(c.endpoint_id));
      std::optional<uint32_t> s = stream_->OnCompletion(c);
      if (s) slot = *s;
      return s.has_value();
    });
    return slot;
  }
  transport::Completion NextBackupImm() {
    transport::Completion got;
    EXPECT_TRUE(PollUntil(bcq_.get(), [&](const transport::Completion& c) {
      got = c;
      return c.op == transport::OpType::kRecvImm;
    }));
    return got;
  }
  ReplRecord Record(uint32_t slot, uint64_t version, float value) {
    float* sum = stream_->sum(slot);
    for (uint64_t i = 0; i < kBytes / 4; ++i) sum[i] = value + static_cast<float>(i);
    ReplRecord r;
    r.slot = slot;
    r.kind = version == 1 ? layout::ReplKind::kInit : layout::ReplKind::kApply;
    r.version = version;
    r.min_clock_plus1 = version;
    r.bytes = kBytes;
    r.payload = stream_->sum_payload(slot, kBytes);
    r.contributors = {Contributor{1, 0, version, 77, static_cast<int64_t>(version) - 1}};
    return r;
  }

  layout::ReplLayout ring_layout_;
  layout::ServerLayout layout_;
  ServerStats stats_;
  std::unique_ptr<transport::Fabric> primary_, backup_;
  std::unique_ptr<transport::CompletionQueue> pcq_, bcq_;
  std::unique_ptr<transport::MemoryRegion> ring_, consumed_;
  std::unique_ptr<ReplicationStream> stream_;
  std::unique_ptr<transport::Endpoint> backup_ep_;
};

TEST_F(ReplicationStreamTest, WithoutABackupVersionsArePublishedAtOnce) {
  EXPECT_EQ(stream_->Submit(Record(0, 1, 0.0f)), ReplicationStream::Disposition::kPublishNow);
  stream_->NoBackup();
  EXPECT_FALSE(stream_->connected());
  EXPECT_EQ(stream_->Submit(Record(0, 1, 0.0f)), ReplicationStream::Disposition::kPublishNow);
}

TEST_F(ReplicationStreamTest, AVersionIsPublishableOnceItsRecordLandedWhole) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  EXPECT_TRUE(stream_->connected());
  EXPECT_TRUE(stats_.Snapshot().replicating);
  EXPECT_EQ(stream_->Submit(Record(1, 1, 10.0f)), ReplicationStream::Disposition::kWaitForRecord);
  EXPECT_EQ(NextPublishable(), 1);
  EXPECT_EQ(stats_.Snapshot().records_sent, 1u);
  const transport::Completion imm = NextBackupImm();
  ASSERT_EQ(layout::ImmKindOf(imm.imm), layout::ImmKind::kRepl);
  // The backup applies what landed: the payload and the exactly-once state.
  struct alignas(64) Line {
    char b[64];
  };
  std::vector<Line> weights(layout_.weights_bytes() / 64 + 1), acks(layout_.acks_bytes() / 64 + 1);
  ChunkStore chunks(ChunkStore::Options(), layout_, weights.data(), {4, 5}, {kBytes, kBytes});
  WorkerTable workers(kSlots);
  ConsistencyGate gate(ConsistencyMode::kSsp, kSlots);
  AckBoard board(acks.data(), layout_);
  ReplicaApplier applier(ring_layout_, ring_->data(), consumed_->data(), 4);
  ASSERT_TRUE(applier.Apply(layout::ImmArg(imm.imm), 0, chunks, workers, gate, board).ok());
  EXPECT_EQ(chunks.version(1), 1u);
  EXPECT_EQ(chunks.published(1)[3], 13.0f);
  EXPECT_EQ(board.Get(1, 1), 1u);
  EXPECT_EQ(workers.Find(1)->incarnation, 77u);
}

TEST_F(ReplicationStreamTest, AFullRingStallsUntilTheBackupConsumed) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  EXPECT_EQ(stream_->Submit(Record(0, 1, 0.0f)), ReplicationStream::Disposition::kWaitForRecord);
  EXPECT_EQ(NextPublishable(), 0);
  EXPECT_EQ(stream_->Submit(Record(1, 1, 0.0f)), ReplicationStream::Disposition::kWaitForRecord);
  EXPECT_EQ(NextPublishable(), 1);
  // Two records in a two-entry ring, none consumed: the third waits and the stream asks how
  // far the backup got.
  EXPECT_EQ(stream_->Submit(Record(0, 2, 1.0f)), ReplicationStream::Disposition::kWaitForRecord);
  EXPECT_EQ(stats_.Snapshot().replication_stalls, 1u);
  EXPECT_EQ(stats_.Snapshot().records_sent, 2u);
  // The read answers 0: still full; nothing is posted and no slot is publishable.
  EXPECT_TRUE(PollUntil(pcq_.get(), [&](const transport::Completion& c) {
    EXPECT_FALSE(stream_->OnCompletion(c).has_value());
    return c.op == transport::OpType::kRead;
  }));
  EXPECT_EQ(stats_.Snapshot().records_sent, 2u);
  // The backup consumed one record; the next stall's read sees it and the record goes out.
  static_cast<std::atomic<uint64_t>*>(consumed_->data())->store(1);
  EXPECT_EQ(stream_->Submit(Record(1, 2, 1.0f)), ReplicationStream::Disposition::kWaitForRecord);
  int64_t published = NextPublishable();
  EXPECT_EQ(published, 0);
  EXPECT_EQ(stats_.Snapshot().records_sent, 3u);
  // Slot 1's record waits for the next entry; the backup is declared gone meanwhile.
  EXPECT_TRUE(stream_->OnBackupGone());
  EXPECT_FALSE(stats_.Snapshot().replicating);
  EXPECT_EQ(stream_->Submit(Record(1, 2, 1.0f)), ReplicationStream::Disposition::kPublishNow);
}

}  // namespace
}  // namespace shardps::server
