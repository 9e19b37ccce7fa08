// One conformance suite for every provider (TEST_P): the contract of transport.h, checked on
// the bytes that arrive. The verbs instance runs inside the SoftRoCE guest (scripts/test.sh);
// elsewhere it skips with the reason.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/byte_pattern.h"

#include "tests/conformance/conformance_env.h"
#include "transport/transport.h"

namespace shardps::transport::conformance {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kTargetId = 101;
constexpr uint64_t kInitiatorId = 202;

bool AllZero(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::all_of(b, b + n, [](uint8_t c) { return c == 0; });
}

class TransportConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string reason = SkipReason(GetParam());
    if (!reason.empty()) GTEST_SKIP() << GetParam() << ": " << reason;
    env_ = EnvFor(GetParam());
    auto t = Fabric::Open(env_.target);
    ASSERT_TRUE(t.ok()) << t.status();
    target_ = std::move(*t);
    auto i = Fabric::Open(env_.initiator);
    ASSERT_TRUE(i.ok()) << i.status();
    initiator_ = std::move(*i);
    ASSERT_EQ(target_->name(), GetParam());
    ASSERT_EQ(initiator_->name(), GetParam());
  }

  // Creates CQs and a connected endpoint pair with the given depths.
  void Connect(int send_depth = 256, int recv_depth = 256, int cq_depth = 2048) {
    auto tcq = target_->CreateCompletionQueue(cq_depth);
    ASSERT_TRUE(tcq.ok()) << tcq.status();
    tcq_ = std::move(*tcq);
    auto icq = initiator_->CreateCompletionQueue(cq_depth);
    ASSERT_TRUE(icq.ok()) << icq.status();
    icq_ = std::move(*icq);
    auto listener = target_->Listen(env_.listen_address);
    ASSERT_TRUE(listener.ok()) << listener.status();
    EndpointOptions to;
    to.endpoint_id = kTargetId;
    to.send_depth = send_depth;
    to.recv_depth = recv_depth;
    EndpointOptions io = to;
    io.endpoint_id = kInitiatorId;
    StatusOr<std::unique_ptr<Endpoint>> iep = InternalError("not connected");
    std::thread connector(
        [&] { iep = initiator_->Connect((*listener)->address(), icq_.get(), io); });
    auto tep = (*listener)->Accept(tcq_.get(), to, milliseconds(30000));
    connector.join();
    ASSERT_TRUE(tep.ok()) << tep.status();
    ASSERT_TRUE(iep.ok()) << iep.status();
    tep_ = std::move(*tep);
    iep_ = std::move(*iep);
    EXPECT_EQ(tep_->endpoint_id(), kTargetId);
    EXPECT_EQ(iep_->endpoint_id(), kInitiatorId);
    EXPECT_TRUE(iep_->status().ok());
  }

  std::unique_ptr<MemoryRegion> Alloc(Fabric* f, size_t n, Access a) {
    auto r = f->AllocateMemory(n, a);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return nullptr;
    EXPECT_EQ((*r)->length(), n);
    EXPECT_TRUE(AllZero((*r)->data(), n)) << "AllocateMemory must zero-fill";
    return std::move(*r);
  }

  // Polls both CQs until `n` initiator completions arrived (kept in order) or the deadline.
  std::vector<Completion> WaitInitiator(size_t n, seconds timeout = seconds(0)) {
    if (timeout.count() == 0) timeout = env_.op_timeout;
    std::vector<Completion> got;
    const auto deadline = Clock::now() + timeout;
    Completion wc[64];
    while (got.size() < n && Clock::now() < deadline) {
      const int k = icq_->Poll(wc, std::min<int>(64, static_cast<int>(n - got.size())));
      got.insert(got.end(), wc, wc + std::max(k, 0));
      DrainTarget();
    }
    EXPECT_EQ(got.size(), n) << "initiator completions missing after " << timeout.count() << " s";
    return got;
  }

  // Polls the target CQ (providers may need it for receive credits); keeps kRecvImm events.
  void DrainTarget() {
    Completion wc[64];
    const int k = tcq_->Poll(wc, 64);
    for (int j = 0; j < k; ++j) target_events_.push_back(wc[j]);
  }

  Completion WaitOne(seconds timeout = seconds(0)) {
    auto v = WaitInitiator(1, timeout);
    return v.empty() ? Completion{} : v[0];
  }

  // Expects the endpoint to be in the error state and a later post to fail or flush.
  void ExpectErroredAndFlushes(MemoryRegion* local, const RemoteSlice& dst) {
    EXPECT_FALSE(iep_->status().ok()) << "endpoint must enter the error state";
    Status s = iep_->PostWrite({local, 0, 8}, dst, 99);
    if (s.ok()) {
      Completion c = WaitOne(seconds(30));
      EXPECT_EQ(c.context, 99u);
      EXPECT_EQ(c.status, WcStatus::kFlushed) << WcStatusName(c.status);
    }
  }

  ProviderEnv env_;
  std::unique_ptr<Fabric> target_;
  std::unique_ptr<Fabric> initiator_;
  std::unique_ptr<CompletionQueue> tcq_;
  std::unique_ptr<CompletionQueue> icq_;
  std::unique_ptr<Endpoint> tep_;
  std::unique_ptr<Endpoint> iep_;
  std::vector<Completion> target_events_;
};

TEST_P(TransportConformance, DescriptorNamesTheRegion) {
  auto r = Alloc(target_.get(), 1 << 16, Access::kRemoteWrite);
  ASSERT_NE(r, nullptr);
  const RegionDescriptor d = r->descriptor();
  EXPECT_EQ(d.provider, GetParam());
  EXPECT_EQ(d.length, 1u << 16);
  EXPECT_EQ(d.access, Access::kRemoteWrite);
  auto back = RegionDescriptor::Decode(d.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->addr, d.addr);
  EXPECT_EQ(back->rkey, d.rkey);
  EXPECT_EQ(back->provider_data, d.provider_data);
}

// Every size from 1 B to 64 MiB, at odd local and remote offsets; written, then read back into
// another buffer. Bytes around the written range must stay untouched.
TEST_P(TransportConformance, WriteAndReadIntegrityAtOddOffsets) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t kMax = 64u << 20;
  const size_t kSlack = 4096;
  auto remote = Alloc(target_.get(), kMax + 2 * kSlack, Access::kRemoteReadWrite);
  ASSERT_NE(remote, nullptr);
  std::vector<uint8_t> src_mem(kMax + kSlack), dst_mem(kMax + kSlack);
  auto src = initiator_->RegisterMemory(src_mem.data(), src_mem.size(), Access::kLocalOnly,
                                        MemoryKind::kHost);
  ASSERT_TRUE(src.ok()) << src.status();
  auto dst = initiator_->RegisterMemory(dst_mem.data(), dst_mem.size(), Access::kLocalOnly,
                                        MemoryKind::kHost);
  ASSERT_TRUE(dst.ok()) << dst.status();
  const RegionDescriptor rd = remote->descriptor();
  auto* rbytes = static_cast<uint8_t*>(remote->data());

  const size_t sizes[] = {1,
                          2,
                          3,
                          7,
                          63,
                          64,
                          65,
                          255,
                          4095,
                          4096,
                          4097,
                          65535,
                          65537,
                          1u << 20,
                          (1u << 20) + 13,
                          (4u << 20) - 5,
                          16u << 20,
                          (16u << 20) + 3,
                          kMax};
  uint64_t seed = 1;
  for (const size_t n : sizes) {
    SCOPED_TRACE("size " + std::to_string(n));
    const size_t loff = 1 + (seed * 3) % 7;
    const size_t roff = kSlack - 1 - (seed % 5) * 2;  // odd, below kSlack
    FillPattern(src_mem.data() + loff, n, ++seed);
    std::memset(rbytes, 0, remote->length());
    ASSERT_TRUE(iep_->PostWrite({src->get(), loff, n}, AtOffset(rd, roff), seed).ok());
    Completion c = WaitOne();
    ASSERT_TRUE(c.ok()) << WcStatusName(c.status) << " " << iep_->status();
    EXPECT_EQ(c.op, OpType::kWrite);
    EXPECT_EQ(c.context, seed);
    EXPECT_EQ(c.endpoint_id, kInitiatorId);
    ASSERT_EQ(FirstMismatch(rbytes + roff, src_mem.data() + loff, n), -1);
    EXPECT_TRUE(AllZero(rbytes, roff)) << "bytes before the range were touched";
    EXPECT_TRUE(AllZero(rbytes + roff + n, remote->length() - roff - n))
        << "bytes after the range were touched";

    const size_t doff = 3 + seed % 4;
    std::memset(dst_mem.data(), 0xAB, dst_mem.size());
    ASSERT_TRUE(iep_->PostRead({dst->get(), doff, n}, AtOffset(rd, roff), seed + 1000).ok());
    c = WaitOne();
    ASSERT_TRUE(c.ok()) << WcStatusName(c.status) << " " << iep_->status();
    EXPECT_EQ(c.op, OpType::kRead);
    EXPECT_EQ(c.context, seed + 1000);
    ASSERT_EQ(FirstMismatch(dst_mem.data() + doff, src_mem.data() + loff, n), -1);
    EXPECT_EQ(dst_mem[doff - 1], 0xAB);
    EXPECT_EQ(dst_mem[doff + n], 0xAB);
  }
  EXPECT_EQ(iep_->outstanding(), 0);
}

// When kRecvImm arrives, the payload of that write is already in the target's memory.
TEST_P(TransportConformance, ImmediateArrivesOnlyAfterItsData) {
  ASSERT_NO_FATAL_FAILURE(Connect(256, 64));
  const size_t kSlot = 256 << 10;
  const int kOps = 120;
  auto remote = Alloc(target_.get(), kSlot * 8, Access::kRemoteWrite);
  ASSERT_NE(remote, nullptr);
  auto src = Alloc(initiator_.get(), kSlot * 8, Access::kLocalOnly);
  ASSERT_NE(src, nullptr);
  const RegionDescriptor rd = remote->descriptor();
  auto* rbytes = static_cast<uint8_t*>(remote->data());
  auto* sbytes = static_cast<uint8_t*>(src->data());
  std::vector<uint8_t> expect(kSlot);

  int posted = 0, initiator_done = 0, checked = 0;
  const auto deadline = Clock::now() + seconds(120);
  Completion wc[32];
  while (checked < kOps && Clock::now() < deadline) {
    // Keep at most 8 in flight, each in its own slot, so a slot is reused only after the
    // target consumed its immediate.
    while (posted < kOps && posted - checked < 8) {
      const int slot = posted % 8;
      const size_t len = 1 + (static_cast<size_t>(posted) * 7919) % kSlot;
      FillPattern(sbytes + slot * kSlot, len, 5000 + posted);
      ASSERT_TRUE(iep_->PostWriteImm({src.get(), slot * kSlot, len}, AtOffset(rd, slot * kSlot),
                                     0xC0DE0000u + posted, posted)
                      .ok());
      ++posted;
    }
    const int k = tcq_->Poll(wc, 32);
    for (int j = 0; j < k; ++j) {
      ASSERT_TRUE(wc[j].ok()) << WcStatusName(wc[j].status);
      ASSERT_EQ(wc[j].op, OpType::kRecvImm);
      ASSERT_EQ(wc[j].endpoint_id, kTargetId);
      ASSERT_EQ(wc[j].imm, 0xC0DE0000u + checked) << "immediates out of order";
      const int slot = checked % 8;
      const size_t len = 1 + (static_cast<size_t>(checked) * 7919) % kSlot;
      ASSERT_EQ(wc[j].byte_len, len);
      // Check the data right away, before anything else can run.
      FillPattern(expect.data(), len, 5000 + checked);
      ASSERT_EQ(FirstMismatch(rbytes + slot * kSlot, expect.data(), len), -1)
          << "immediate " << checked << " arrived before its data";
      ++checked;
    }
    initiator_done += std::max(icq_->Poll(wc, 32), 0);
  }
  EXPECT_EQ(checked, kOps);
  while (initiator_done < kOps && Clock::now() < deadline) {
    initiator_done += std::max(icq_->Poll(wc, 32), 0);
  }
  EXPECT_EQ(initiator_done, kOps);
}

// A read posted right behind a write on the same endpoint sees that write.
TEST_P(TransportConformance, ReadAfterWriteSeesTheWrite) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 64 << 10;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && src && dst);
  const RegionDescriptor rd = remote->descriptor();
  for (int round = 0; round < 50; ++round) {
    const size_t len = 1 + (round * 1237) % n;
    FillPattern(src->data(), len, 900 + round);
    std::memset(dst->data(), 0, n);
    ASSERT_TRUE(iep_->PostWrite({src.get(), 0, len}, AtOffset(rd, 0), 2 * round).ok());
    ASSERT_TRUE(iep_->PostRead({dst.get(), 0, len}, AtOffset(rd, 0), 2 * round + 1).ok());
    auto cs = WaitInitiator(2);
    ASSERT_EQ(cs.size(), 2u);
    EXPECT_EQ(cs[0].context, 2u * round);
    EXPECT_EQ(cs[1].context, 2u * round + 1);
    ASSERT_TRUE(cs[0].ok() && cs[1].ok());
    ASSERT_EQ(FirstMismatch(dst->data(), src->data(), len), -1) << "round " << round;
  }
}

// Many read lists in flight at once, small-piece lists (which tcp answers from one gathered
// copy) mixed with large-piece ones (answered from the region): every list gets its own bytes,
// in post order.
TEST_P(TransportConformance, ReadListsInFlightTogetherEachGetTheirBytes) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 4u << 20;
  auto remote = Alloc(target_.get(), n, Access::kRemoteRead);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  FillPattern(remote->data(), n, 91);
  const RegionDescriptor rd = remote->descriptor();
  constexpr int kLists = 16;  // at most 160 pieces in flight: within the send depth (256) of a
                              // provider that reads per piece
  std::vector<std::vector<std::pair<size_t, size_t>>> want(kLists);  // (remote offset, length)
  std::vector<size_t> at(kLists);
  size_t next = 0;
  for (int k = 0; k < kLists; ++k) {
    const bool large = k % 4 == 3;
    const size_t count = large ? 4 : 6 + k % 5;
    std::vector<ReadPiece> pieces;
    size_t total = 0;
    for (size_t i = 0; i < count; ++i) {
      const size_t len = large ? (40u << 10) + i : 200 + (i * 37 + k) % 120;
      const size_t off = (i * 104729 + k * 7919) % (n - len);
      pieces.push_back(ReadPiece{AtOffset(rd, off), len});
      want[k].emplace_back(off, len);
      total += len;
    }
    at[k] = next;
    ASSERT_LE(next + total, n);
    ASSERT_TRUE(iep_->PostReadList({dst.get(), next, total}, pieces.data(), pieces.size(), 500 + k,
                                   transport::kSignaled)
                    .ok());
    next += total;
  }
  auto cs = WaitInitiator(kLists);
  ASSERT_EQ(cs.size(), static_cast<size_t>(kLists));
  for (int k = 0; k < kLists; ++k) {
    EXPECT_EQ(cs[k].context, 500u + k);
    ASSERT_TRUE(cs[k].ok()) << WcStatusName(cs[k].status);
    size_t a = at[k];
    for (const auto& [off, len] : want[k]) {
      ASSERT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + a,
                              static_cast<char*>(remote->data()) + off, len),
                -1)
          << "list " << k << " piece at " << off;
      a += len;
    }
  }
  EXPECT_TRUE(iep_->status().ok());
}

// kMore (transport.h): writes, reads and read lists posted with it, signaled or not, complete
// as without it once a post without it follows, and alone once the owner polls; every byte
// arrives, in post order. A list of kMaxReadPieces pieces is one credit where the provider
// gathers read lists (gathers_read_lists), so it fits any send depth there.
TEST_P(TransportConformance, PostsWithMoreCompleteWithTheirBytes) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1u << 20;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && src && dst);
  FillPattern(src->data(), n, 17);
  FillPattern(remote->data(), n, 3);
  const RegionDescriptor rd = remote->descriptor();
  // A write with kMore, a read of what it wrote with kMore (in order: it sees the write), a
  // list with kMore, then a signaled read without it.
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 4096}, AtOffset(rd, 8192), 1,
                              transport::kMore | transport::kUnsignaled).ok());
  ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 4096}, AtOffset(rd, 8192), 2, transport::kMore).ok());
  std::vector<ReadPiece> pieces;
  for (size_t i = 0; i < 8; ++i) pieces.push_back(ReadPiece{AtOffset(rd, 65536 + i * 1000), 300});
  ASSERT_TRUE(iep_->PostReadList({dst.get(), 4096, 2400}, pieces.data(), pieces.size(), 3,
                                 transport::kMore).ok());
  ASSERT_TRUE(iep_->PostRead({dst.get(), 8192, 512}, AtOffset(rd, 0), 4).ok());
  auto cs = WaitInitiator(3);
  ASSERT_EQ(cs.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(cs[i].context, 2u + i);
    ASSERT_TRUE(cs[i].ok()) << WcStatusName(cs[i].status);
  }
  EXPECT_EQ(FirstMismatch(dst->data(), src->data(), 4096), -1) << "the read missed the write";
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + 4096 + i * 300,
                            static_cast<char*>(remote->data()) + 65536 + i * 1000, 300),
              -1)
        << "piece " << i;
  }
  EXPECT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + 8192, remote->data(), 512), -1);
  // kMore with nothing after it: the owner's polls send it.
  ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 777}, AtOffset(rd, 100000), 5, transport::kMore).ok());
  cs = WaitInitiator(1);
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].context, 5u);
  EXPECT_EQ(FirstMismatch(dst->data(), static_cast<char*>(remote->data()) + 100000, 777), -1);
  // The largest list: one credit where lists are gathered.
  if (iep_->gathers_read_lists()) {
    pieces.clear();
    for (size_t i = 0; i < transport::kMaxReadPieces; ++i) {
      pieces.push_back(ReadPiece{AtOffset(rd, (i * 7919) % (n - 256)), 256});
    }
    ASSERT_TRUE(iep_->PostReadList({dst.get(), 0, 256 * pieces.size()}, pieces.data(),
                                   pieces.size(), 6, transport::kMore).ok());
    EXPECT_EQ(iep_->outstanding(), 1);
    cs = WaitInitiator(1);
    ASSERT_EQ(cs.size(), 1u);
    ASSERT_TRUE(cs[0].ok()) << WcStatusName(cs[0].status);
    for (size_t i = 0; i < pieces.size(); ++i) {
      ASSERT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + i * 256,
                              static_cast<char*>(remote->data()) + (i * 7919) % (n - 256), 256),
                -1)
          << "piece " << i;
    }
  }
  // An unknown flag is still refused.
  EXPECT_EQ(iep_->PostRead({dst.get(), 0, 8}, AtOffset(rd, 0), 7, 1u << 7).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(iep_->status().ok());
}

// Writes-with-immediate past the target's receive depth wait (transport.h) while the target
// does not poll; a write and a read list posted behind them wait in order too: the list returns
// the bytes of the write posted before it, and every completion comes in post order once the
// target polls again. (shm keeps such posts in a backlog, a read list with its pieces.)
TEST_P(TransportConformance, AReadListBehindWaitingImmediatesSeesTheWriteBeforeIt) {
  constexpr int kRecvDepth = 4, kImms = 7;
  ASSERT_NO_FATAL_FAILURE(Connect(256, kRecvDepth));
  const size_t n = 1 << 16;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && src && dst);
  const RegionDescriptor rd = remote->descriptor();
  FillPattern(src->data(), n, 4242);
  // kImms immediates of 8 bytes each, more than the target may hold unpolled.
  for (int i = 0; i < kImms; ++i) {
    ASSERT_TRUE(iep_->PostWriteImm({src.get(), 8u * i, 8}, AtOffset(rd, 8u * i), 0xABC0u + i, i)
                    .ok());
  }
  // Then 16 KiB written at 32 KiB, and a list reading it back in 37 scattered pieces, last
  // piece first.
  const size_t w_off = 32 << 10, w_len = 16 << 10;
  ASSERT_TRUE(iep_->PostWrite({src.get(), w_off, w_len}, AtOffset(rd, w_off), kImms).ok());
  std::vector<ReadPiece> pieces;
  std::vector<std::pair<size_t, size_t>> want;  // (remote offset, length)
  size_t total = 0;
  for (size_t i = 0; i < 37; ++i) {
    const size_t len = 64 + (i * 97) % 300;
    const size_t off = w_off + ((36 - i) * 431) % (w_len - len);
    pieces.push_back(ReadPiece{AtOffset(rd, off), len});
    want.emplace_back(off, len);
    total += len;
  }
  ASSERT_TRUE(iep_->PostReadList({dst.get(), 0, total}, pieces.data(), pieces.size(), kImms + 1)
                  .ok());
  auto cs = WaitInitiator(kImms + 2);
  ASSERT_EQ(cs.size(), static_cast<size_t>(kImms + 2));
  for (int i = 0; i < kImms + 2; ++i) {
    ASSERT_TRUE(cs[i].ok()) << i << " " << WcStatusName(cs[i].status);
    EXPECT_EQ(cs[i].context, static_cast<uint64_t>(i)) << "out of post order";
  }
  size_t at = 0;
  for (const auto& [off, len] : want) {
    ASSERT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + at,
                            static_cast<char*>(src->data()) + off, len),
              -1)
        << "the piece at " << off << " missed the write posted before the list";
    at += len;
  }
  // Every immediate arrived, in order, after its bytes.
  const auto deadline = Clock::now() + env_.op_timeout;
  while (target_events_.size() < static_cast<size_t>(kImms) && Clock::now() < deadline) {
    DrainTarget();
  }
  ASSERT_EQ(target_events_.size(), static_cast<size_t>(kImms));
  for (int i = 0; i < kImms; ++i) EXPECT_EQ(target_events_[i].imm, 0xABC0u + i);
  EXPECT_EQ(FirstMismatch(remote->data(), src->data(), 8 * kImms), -1);
  EXPECT_TRUE(iep_->status().ok());
}

// A read, then a read list behind it on the same endpoint, against memory a target thread keeps
// rewriting (rows first, then a header word, like a server publishing a version): every row the
// list returns is at least as new as the header the read returned. A provider that took the
// list's bytes earlier than the read's (tcp once gathered a list when it executed but sent a
// read from the region when the socket took it) lets a row lag behind its header.
TEST_P(TransportConformance, AReadListIsNoOlderThanTheReadBeforeIt) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  constexpr size_t kRows = 64, kStride = 256;
  const size_t n = 4096 + kRows * kStride;
  auto remote = Alloc(target_.get(), n, Access::kRemoteRead);
  auto dst = Alloc(initiator_.get(), 4096 + kRows * 8, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  auto* words = static_cast<volatile uint64_t*>(remote->data());
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint64_t v = 1; !stop.load(std::memory_order_relaxed); ++v) {
      for (size_t r = 0; r < kRows; ++r) words[(4096 + r * kStride) / 8] = v;
      std::atomic_thread_fence(std::memory_order_release);
      words[0] = v;  // the header, last
    }
  });
  const RegionDescriptor rd = remote->descriptor();
  std::vector<ReadPiece> pieces;
  for (size_t r = 0; r < kRows; ++r) pieces.push_back(ReadPiece{AtOffset(rd, 4096 + r * kStride), 8});
  int lagging = 0, rounds = 0;
  const auto until = Clock::now() + seconds(3);
  for (; rounds < 3000 && Clock::now() < until; ++rounds) {
    ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 8}, AtOffset(rd, 0), 1, transport::kUnsignaled).ok());
    ASSERT_TRUE(iep_->PostReadList({dst.get(), 4096, kRows * 8}, pieces.data(), pieces.size(), 2,
                                   transport::kSignaled)
                    .ok());
    auto cs = WaitInitiator(1);
    ASSERT_EQ(cs.size(), 1u);
    ASSERT_TRUE(cs[0].ok()) << WcStatusName(cs[0].status);
    const auto* got = static_cast<const uint64_t*>(dst->data());
    for (size_t r = 0; r < kRows; ++r) {
      if (got[(4096 / 8) + r] < got[0] && lagging++ < 3) {
        ADD_FAILURE() << "round " << rounds << ": row " << r << " holds version "
                      << got[(4096 / 8) + r] << ", older than the header's " << got[0]
                      << " read before it";
      }
    }
  }
  stop = true;
  writer.join();
  EXPECT_EQ(lagging, 0) << "of " << rounds << " rounds";
  EXPECT_GT(rounds, 50);
}

// Registered memory is populated at registration (transport/populate.h): once a region has
// been used, moving every byte of it again, both ways, takes no page fault in this process
// (which holds both ends). Demand paging took one per 4 KiB page here: ~8 k for these 32 MiB.
TEST_P(TransportConformance, RegisteredMemoryTakesNoPageFaultOnTheDataPath) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 16u << 20, piece = 1u << 20;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && src && dst);
  FillPattern(src->data(), n, 77);
  const RegionDescriptor rd = remote->descriptor();
  // First use of the remote region (a provider may map a peer's region then), 8 bytes each way.
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, AtOffset(rd, 0), 1).ok());
  ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 8}, AtOffset(rd, 0), 2).ok());
  ASSERT_EQ(WaitInitiator(2).size(), 2u);
  auto faults = [] {
    rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt + ru.ru_majflt;
  };
  const long before = faults();
  uint64_t ctx = 100;
  for (size_t off = 0; off < n; off += piece) {
    ASSERT_TRUE(iep_->PostWrite({src.get(), off, piece}, AtOffset(rd, off), ctx++).ok());
  }
  for (size_t off = 0; off < n; off += piece) {
    ASSERT_TRUE(iep_->PostRead({dst.get(), off, piece}, AtOffset(rd, off), ctx++).ok());
  }
  auto cs = WaitInitiator(2 * n / piece);
  const long taken = faults() - before;
  ASSERT_EQ(cs.size(), 2 * n / piece);
  for (const Completion& c : cs) ASSERT_TRUE(c.ok()) << WcStatusName(c.status);
  ASSERT_EQ(FirstMismatch(dst->data(), src->data(), n), -1);
  EXPECT_LT(taken, 64) << "page faults while moving 2 x " << n << " bytes through regions "
                       << "registered before (one per page would be " << 3 * n / 4096 << ")";
}

// A gathered read (PostReadList): scattered pieces of the peer's memory, of odd sizes and in
// any order, arrive concatenated; one completion for the list (the last piece's on providers
// that post one read per piece), in post order with the reads around it; every byte checked.
TEST_P(TransportConformance, ReadListGathersPiecesInOrder) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1 << 18;
  auto remote = Alloc(target_.get(), n, Access::kRemoteRead);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  FillPattern(remote->data(), n, 77);
  const RegionDescriptor rd = remote->descriptor();
  for (int round = 0; round < 20; ++round) {
    std::vector<ReadPiece> pieces;
    std::vector<std::pair<size_t, size_t>> want;  // (remote offset, length)
    size_t total = 0;
    const size_t count = 1 + (round * 37) % 120;  // within any provider's send depth
    for (size_t i = 0; i < count; ++i) {
      const size_t len = 1 + (i * 131 + round * 17) % 700;
      const size_t off = (i * 7919 + round * 104729) % (n - len);
      pieces.push_back(ReadPiece{AtOffset(rd, off), len});
      want.emplace_back(off, len);
      total += len;
    }
    std::memset(dst->data(), 0, n);
    ASSERT_TRUE(iep_->PostReadList({dst.get(), 64, total}, pieces.data(), pieces.size(),
                                   100 + round, transport::kSignaled)
                    .ok());
    auto cs = WaitInitiator(1);
    ASSERT_EQ(cs.size(), 1u);
    EXPECT_EQ(cs[0].context, 100u + round);
    ASSERT_TRUE(cs[0].ok()) << WcStatusName(cs[0].status);
    size_t at = 64;
    for (const auto& [off, len] : want) {
      ASSERT_EQ(FirstMismatch(static_cast<char*>(dst->data()) + at,
                              static_cast<char*>(remote->data()) + off, len),
                -1)
          << "round " << round << " piece at " << off;
      at += len;
    }
  }
  // Refused before anything is posted: no pieces, a total that is not the slice's, too many.
  ReadPiece one{AtOffset(rd, 0), 8};
  EXPECT_EQ(iep_->PostReadList({dst.get(), 0, 8}, &one, 0, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(iep_->PostReadList({dst.get(), 0, 9}, &one, 1, 1).code(), StatusCode::kInvalidArgument);
  std::vector<ReadPiece> many(kMaxReadPieces + 1, one);
  EXPECT_EQ(iep_->PostReadList({dst.get(), 0, 8 * many.size()}, many.data(), many.size(), 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(iep_->status().ok());
}

// A read list with one piece outside the region fails as a whole with a remote access error.
TEST_P(TransportConformance, ReadListWithABadPieceIsRejected) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1 << 16;
  auto remote = Alloc(target_.get(), n, Access::kRemoteRead);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  FillPattern(remote->data(), n, 9);
  RemoteSlice bad = AtOffset(remote->descriptor(), n - 16);
  const ReadPiece pieces[3] = {{AtOffset(remote->descriptor(), 0), 64},
                               {AtOffset(remote->descriptor(), 128), 64},
                               {bad, 64}};  // runs past the end
  ASSERT_TRUE(iep_->PostReadList({dst.get(), 0, 192}, pieces, 3, 5).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_FALSE(iep_->status().ok());
}

// Hundreds of operations outstanding; completions in post order; the send queue refuses the
// post past its depth without queueing it.
TEST_P(TransportConformance, HundredsOutstandingCompleteInOrder) {
  const int kDepth = 512;
  ASSERT_NO_FATAL_FAILURE(Connect(kDepth, 16));
  const size_t kChunk = 4096;
  auto remote = Alloc(target_.get(), kChunk * kDepth, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), kChunk * kDepth, Access::kLocalOnly);
  auto back = Alloc(initiator_.get(), kChunk * kDepth, Access::kLocalOnly);
  ASSERT_TRUE(remote && src && back);
  FillPattern(src->data(), kChunk * kDepth, 77);
  const RegionDescriptor rd = remote->descriptor();
  for (int i = 0; i < kDepth; ++i) {
    ASSERT_TRUE(iep_->PostWrite({src.get(), i * kChunk, kChunk}, AtOffset(rd, i * kChunk), i).ok())
        << i;
  }
  EXPECT_EQ(iep_->outstanding(), kDepth);
  Status over = iep_->PostWrite({src.get(), 0, kChunk}, AtOffset(rd, 0), 9999);
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over;
  auto cs = WaitInitiator(kDepth);
  ASSERT_EQ(cs.size(), static_cast<size_t>(kDepth));
  for (int i = 0; i < kDepth; ++i) {
    ASSERT_TRUE(cs[i].ok()) << i << " " << WcStatusName(cs[i].status);
    ASSERT_EQ(cs[i].context, static_cast<uint64_t>(i)) << "out of order";
  }
  EXPECT_EQ(FirstMismatch(remote->data(), src->data(), kChunk * kDepth), -1);
  // The refused post left nothing behind.
  Completion extra;
  EXPECT_EQ(icq_->Poll(&extra, 1), 0);
  for (int i = 0; i < kDepth; ++i) {
    ASSERT_TRUE(iep_->PostRead({back.get(), i * kChunk, kChunk}, AtOffset(rd, i * kChunk), i).ok());
  }
  cs = WaitInitiator(kDepth);
  ASSERT_EQ(cs.size(), static_cast<size_t>(kDepth));
  EXPECT_EQ(FirstMismatch(back->data(), src->data(), kChunk * kDepth), -1);
  EXPECT_EQ(iep_->outstanding(), 0);
}

// Unsignaled operations produce no completion; a later signaled one returns their credits.
TEST_P(TransportConformance, SelectiveSignaling) {
  ASSERT_NO_FATAL_FAILURE(Connect(64, 16));
  const size_t kChunk = 512;
  const int kOps = 1000;
  auto remote = Alloc(target_.get(), kChunk * kOps, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kChunk * kOps, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  FillPattern(src->data(), kChunk * kOps, 31);
  const RegionDescriptor rd = remote->descriptor();
  int signaled = 0, completions = 0;
  Completion wc[64];
  const auto deadline = Clock::now() + seconds(120);
  for (int i = 0; i < kOps && Clock::now() < deadline;) {
    const bool sig = (i % 16 == 15) || i == kOps - 1;
    Status s = iep_->PostWrite({src.get(), i * kChunk, kChunk}, AtOffset(rd, i * kChunk), i,
                               sig ? kSignaled : kUnsignaled);
    if (s.code() == StatusCode::kResourceExhausted) {
      const int k = icq_->Poll(wc, 64);
      for (int j = 0; j < k; ++j) {
        ASSERT_TRUE(wc[j].ok());
        ASSERT_EQ(wc[j].context % 16 == 15 || wc[j].context == kOps - 1, true)
            << "completion for unsignaled op " << wc[j].context;
      }
      completions += std::max(k, 0);
      DrainTarget();
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    signaled += sig;
    ++i;
  }
  while (completions < signaled && Clock::now() < deadline) {
    completions += std::max(icq_->Poll(wc, 64), 0);
    DrainTarget();
  }
  EXPECT_EQ(completions, signaled);
  EXPECT_EQ(iep_->outstanding(), 0);
  EXPECT_EQ(FirstMismatch(remote->data(), src->data(), kChunk * kOps), -1);
}

TEST_P(TransportConformance, WrongRkeyIsRejectedAndTouchesNothing) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 1 << 16, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), 1 << 16, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  FillPattern(src->data(), 1 << 16, 5);
  RemoteSlice bad = AtOffset(remote->descriptor(), 0);
  bad.rkey ^= 0x5a5a00;
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 4096}, bad, 1).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.context, 1u);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(remote->data(), 1 << 16)) << "a rejected write touched the region";
  ExpectErroredAndFlushes(src.get(), AtOffset(remote->descriptor(), 0));
  EXPECT_TRUE(AllZero(remote->data(), 1 << 16)) << "a flushed write touched the region";
}

TEST_P(TransportConformance, OutOfBoundsWriteIsRejectedWhole) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1 << 16;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  FillPattern(src->data(), n, 6);
  // Straddles the end: even the in-bounds part must not land.
  ASSERT_TRUE(
      iep_->PostWrite({src.get(), 0, 4096}, AtOffset(remote->descriptor(), n - 100), 1).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(remote->data(), n));
  EXPECT_FALSE(iep_->status().ok());
}

TEST_P(TransportConformance, OutOfBoundsReadIsRejected) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1 << 16;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto dst = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  FillPattern(remote->data(), n, 8);
  RemoteSlice before = AtOffset(remote->descriptor(), 0);
  before.addr -= 64;  // starts before the region
  ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 128}, before, 1).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(dst->data(), n)) << "a rejected read delivered bytes";
  EXPECT_FALSE(iep_->status().ok());
}

TEST_P(TransportConformance, WriteToReadOnlyRegionIsRejected) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 8192, Access::kRemoteRead);
  auto src = Alloc(initiator_.get(), 8192, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  FillPattern(src->data(), 8192, 9);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8192}, AtOffset(remote->descriptor(), 0), 1).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(remote->data(), 8192));
}

TEST_P(TransportConformance, ReadFromWriteOnlyRegionIsRejected) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 8192, Access::kRemoteWrite);
  auto dst = Alloc(initiator_.get(), 8192, Access::kLocalOnly);
  ASSERT_TRUE(remote && dst);
  FillPattern(remote->data(), 8192, 10);
  ASSERT_TRUE(iep_->PostRead({dst.get(), 0, 8192}, AtOffset(remote->descriptor(), 0), 1).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(dst->data(), 8192));
}

TEST_P(TransportConformance, DeregisteredRegionIsRejected) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto keep = Alloc(target_.get(), 8192, Access::kRemoteReadWrite);
  auto gone = Alloc(target_.get(), 8192, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), 8192, Access::kLocalOnly);
  ASSERT_TRUE(keep && gone && src);
  const RegionDescriptor gd = gone->descriptor();
  // Prove the region worked before deregistration.
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, AtOffset(gd, 0), 1).ok());
  ASSERT_TRUE(WaitOne().ok());
  gone.reset();
  FillPattern(src->data(), 8192, 11);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 4096}, AtOffset(gd, 0), 2).ok());
  Completion c = WaitOne(env_.peer_death_bound);
  EXPECT_EQ(c.context, 2u);
  EXPECT_EQ(c.status, WcStatus::kRemoteAccessError) << WcStatusName(c.status);
  EXPECT_TRUE(AllZero(keep->data(), 8192)) << "the write landed in another region";
}

// After an error the endpoint stays in the error state; other endpoints on the same fabrics
// and CQs keep working.
TEST_P(TransportConformance, ErrorIsConfinedToItsEndpoint) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 8192, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), 8192, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  RemoteSlice bad = AtOffset(remote->descriptor(), 0);
  bad.rkey ^= 1u << 20;
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 64}, bad, 1).ok());
  EXPECT_EQ(WaitOne(env_.peer_death_bound).status, WcStatus::kRemoteAccessError);
  // A second connection between the same fabrics works.
  auto listener = target_->Listen(env_.listen_address);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EndpointOptions eo;
  eo.endpoint_id = 303;
  eo.send_depth = 16;
  eo.recv_depth = 16;
  StatusOr<std::unique_ptr<Endpoint>> second = InternalError("not connected");
  std::thread t([&] { second = initiator_->Connect((*listener)->address(), icq_.get(), eo); });
  auto accepted = (*listener)->Accept(tcq_.get(), eo, milliseconds(30000));
  t.join();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  FillPattern(src->data(), 8192, 12);
  ASSERT_TRUE(
      (*second)->PostWrite({src.get(), 0, 8192}, AtOffset(remote->descriptor(), 0), 5).ok());
  Completion c = WaitOne();
  EXPECT_TRUE(c.ok()) << WcStatusName(c.status);
  EXPECT_EQ(c.endpoint_id, 303u);
  EXPECT_EQ(FirstMismatch(remote->data(), src->data(), 8192), -1);
  EXPECT_FALSE(iep_->status().ok());
}

// A peer process killed in the middle of a stream of large writes: the initiator gets an error
// completion within the provider's bound: no hang, no crash, and the endpoint says why.
TEST_P(TransportConformance, PeerKilledMidTransferGivesErrorCompletion) {
  auto cq = initiator_->CreateCompletionQueue(1024);
  ASSERT_TRUE(cq.ok()) << cq.status();
  PeerProcess peer;
  const size_t kRegion = 8u << 20;
  ASSERT_TRUE(peer.Start(GetParam(), kRegion).ok());
  EndpointOptions eo;
  eo.endpoint_id = 9;
  eo.send_depth = 64;
  eo.recv_depth = 16;
  auto ep = initiator_->Connect(peer.address(), cq->get(), eo);
  ASSERT_TRUE(ep.ok()) << ep.status();
  auto src = Alloc(initiator_.get(), 1 << 20, Access::kLocalOnly);
  ASSERT_TRUE(src);
  FillPattern(src->data(), 1 << 20, 13);
  const RegionDescriptor rd = peer.region();

  Completion wc[64];
  uint64_t posted = 0, ok = 0;
  bool killed = false, errored = false;
  Clock::time_point killed_at;
  const auto hard_deadline = Clock::now() + seconds(120);
  while (!errored && Clock::now() < hard_deadline) {
    if (!killed && ok >= 8) {
      peer.Kill();
      killed = true;
      killed_at = Clock::now();
    }
    while ((*ep)->outstanding() < 16) {
      const uint64_t off = (posted % 8) * (1 << 20);
      Status s = (*ep)->PostWrite({src.get(), 0, 1 << 20}, AtOffset(rd, off), posted);
      if (!s.ok()) break;  // an errored endpoint may refuse posts; completions still come
      ++posted;
    }
    const int k = (*cq)->Poll(wc, 64);
    for (int j = 0; j < k; ++j) {
      if (wc[j].ok()) {
        ASSERT_FALSE(killed && Clock::now() - killed_at > env_.peer_death_bound)
            << "successes long after the peer died";
        ++ok;
      } else {
        errored = true;
        EXPECT_NE(wc[j].status, WcStatus::kRemoteAccessError);
      }
    }
  }
  ASSERT_TRUE(killed) << "peer was never killed: only " << ok << " writes completed";
  ASSERT_TRUE(errored) << "no error completion within the bound";
  const auto detect = Clock::now() - killed_at;
  EXPECT_LE(detect, env_.peer_death_bound)
      << "detection took " << std::chrono::duration_cast<milliseconds>(detect).count() << " ms";
  EXPECT_FALSE((*ep)->status().ok());
  std::cerr << "[ info ] " << GetParam() << ": peer death detected after "
            << std::chrono::duration_cast<milliseconds>(detect).count() << " ms (bound "
            << env_.peer_death_bound.count() << " s); " << ok << " writes succeeded\n";
  // Every outstanding operation completes (in error); nothing hangs.
  const auto drain_deadline = Clock::now() + env_.peer_death_bound;
  while ((*ep)->outstanding() > 0 && Clock::now() < drain_deadline) (*cq)->Poll(wc, 64);
  EXPECT_EQ((*ep)->outstanding(), 0);
}

TEST_P(TransportConformance, ConnectToNobodyFailsWithinTimeout) {
  auto cq = initiator_->CreateCompletionQueue(256);
  ASSERT_TRUE(cq.ok());
  // Listen, learn the address, close the listener: the address now has nobody behind it.
  std::string address;
  {
    auto l = target_->Listen(env_.listen_address);
    ASSERT_TRUE(l.ok()) << l.status();
    address = (*l)->address();
  }
  EndpointOptions eo;
  eo.connect_timeout = milliseconds(3000);
  const auto t0 = Clock::now();
  auto ep = initiator_->Connect(address, cq->get(), eo);
  EXPECT_FALSE(ep.ok());
  EXPECT_LE(Clock::now() - t0, seconds(10));
}

TEST_P(TransportConformance, CompletionQueueQuotaIsEnforced) {
  auto cq = initiator_->CreateCompletionQueue(100);
  ASSERT_TRUE(cq.ok()) << cq.status();
  auto l = target_->Listen(env_.listen_address);
  ASSERT_TRUE(l.ok());
  EndpointOptions eo;
  eo.send_depth = 256;  // 256 + 256 > 100 slots
  eo.recv_depth = 256;
  eo.connect_timeout = milliseconds(3000);
  auto ep = initiator_->Connect((*l)->address(), cq->get(), eo);
  ASSERT_FALSE(ep.ok());
  EXPECT_EQ(ep.status().code(), StatusCode::kResourceExhausted) << ep.status();
}

// Endpoint::PostWrite/PostWriteImm/PostRead refuse bad arguments synchronously, with the
// code transport.h names, before the provider sees them: no credit taken, nothing queued, no
// completion, the endpoint still healthy (the next valid post moves the right bytes).
TEST_P(TransportConformance, RefusedPostsReturnTheirErrorAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 8192;
  auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto local = Alloc(initiator_.get(), n, Access::kLocalOnly);
  auto foreign = Alloc(target_.get(), n, Access::kLocalOnly);  // another fabric's region
  ASSERT_TRUE(remote && local && foreign);
  const RemoteSlice at = AtOffset(remote->descriptor(), 0);
  const uint64_t too_long = iep_->max_operation_bytes() + 1;
  ASSERT_GT(too_long, iep_->max_operation_bytes()) << "max_operation_bytes() must be < 2^64";
  struct Case {
    const char* what;
    LocalSlice local;
    RemoteSlice remote;
    uint32_t flags;
    StatusCode code;
  };
  const Case cases[] = {
      {"no local region", {nullptr, 0, 8}, at, kSignaled, StatusCode::kInvalidArgument},
      {"another fabric's region",
       {foreign.get(), 0, 8},
       at,
       kSignaled,
       StatusCode::kInvalidArgument},
      {"unknown flags", {local.get(), 0, 8}, at, 1u << 7, StatusCode::kInvalidArgument},
      {"over max_operation_bytes",
       {local.get(), 0, too_long},
       at,
       kSignaled,
       StatusCode::kInvalidArgument},
      {"local slice past the end",
       {local.get(), n - 8, 16},
       at,
       kSignaled,
       StatusCode::kOutOfRange},
      {"local offset past the end",
       {local.get(), n + 1, 0},
       at,
       kSignaled,
       StatusCode::kOutOfRange},
      {"local offset + length overflows",
       {local.get(), UINT64_MAX - 4, 16},
       at,
       kSignaled,
       StatusCode::kOutOfRange},
      {"remote slice wraps",
       {local.get(), 0, 4096},
       {UINT64_MAX - 100, at.rkey},
       kSignaled,
       StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    for (OpType op : {OpType::kWrite, OpType::kWriteImm, OpType::kRead}) {
      SCOPED_TRACE(std::string(c.what) + ", " + OpTypeName(op));
      Status s = op == OpType::kWrite      ? iep_->PostWrite(c.local, c.remote, 7, c.flags)
                 : op == OpType::kWriteImm ? iep_->PostWriteImm(c.local, c.remote, 5, 7, c.flags)
                                           : iep_->PostRead(c.local, c.remote, 7, c.flags);
      EXPECT_EQ(s.code(), c.code) << s;
      EXPECT_EQ(iep_->outstanding(), 0);
      EXPECT_TRUE(iep_->status().ok()) << iep_->status();
    }
  }
  Completion wc[4];
  EXPECT_EQ(icq_->Poll(wc, 4), 0) << "a refused post produced a completion";
  DrainTarget();
  EXPECT_TRUE(target_events_.empty()) << "a refused write-imm reached the target";
  EXPECT_TRUE(AllZero(remote->data(), n)) << "a refused post touched the target";
  // A zero-length post at the very end of the local region is valid (and names no remote).
  ASSERT_TRUE(iep_->PostWrite({local.get(), n, 0}, at, 8).ok());
  Completion z = WaitOne();
  EXPECT_EQ(z.context, 8u);
  EXPECT_TRUE(z.ok()) << WcStatusName(z.status);
  // The endpoint still moves bytes.
  FillPattern(local->data(), n, 12);
  ASSERT_TRUE(iep_->PostWrite({local.get(), 0, n}, at, 9).ok());
  Completion c = WaitOne();
  EXPECT_EQ(c.context, 9u);
  EXPECT_TRUE(c.ok()) << WcStatusName(c.status);
  EXPECT_EQ(std::memcmp(remote->data(), local->data(), n), 0);
}

TEST_P(TransportConformance, WaitTimesOutAndWakesUp) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Completion c;
  const auto t0 = Clock::now();
  EXPECT_EQ(icq_->Wait(&c, 1, std::chrono::microseconds(50000)), 0);
  const auto waited = Clock::now() - t0;
  EXPECT_GE(waited, milliseconds(40));
  EXPECT_LE(waited, seconds(2));
  auto remote = Alloc(target_.get(), 4096, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 4096, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 4096}, AtOffset(remote->descriptor(), 0), 42).ok());
  int got = 0;
  const auto deadline = Clock::now() + seconds(30);
  while (got == 0 && Clock::now() < deadline) {
    got = icq_->Wait(&c, 1, std::chrono::microseconds(100000));
    DrainTarget();
  }
  ASSERT_EQ(got, 1);
  EXPECT_EQ(c.context, 42u);
}

INSTANTIATE_TEST_SUITE_P(Providers, TransportConformance, ::testing::Values("tcp", "shm", "verbs"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace shardps::transport::conformance
