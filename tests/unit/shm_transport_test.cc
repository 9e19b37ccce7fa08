// Tests of the shm provider through the public transport API: two fabrics in one process. The
// uid tests also fork a child that becomes `nobody` and, besides Fabric::Connect, speaks the
// handshake over a raw socket with shm_layout.h's structs, to see exactly which fds come back.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/byte_pattern.h"

#include "transport/shm/shm_layout.h"
#include "transport/transport.h"

namespace shardps::transport {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool AllZero(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

std::unique_ptr<Fabric> OpenShm(uint64_t arena = 0) {
  FabricOptions o;
  o.provider = "shm";
  o.shm_arena_bytes = arena;
  auto f = Fabric::Open(o);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

class ShmTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    target_ = OpenShm();
    initiator_ = OpenShm();
    ASSERT_TRUE(target_ && initiator_);
  }

  void Connect(int send_depth = 64, int recv_depth = 64, const std::string& address = "") {
    auto tcq = target_->CreateCompletionQueue(4096);
    auto icq = initiator_->CreateCompletionQueue(4096);
    ASSERT_TRUE(tcq.ok() && icq.ok());
    tcq_ = std::move(*tcq);
    icq_ = std::move(*icq);
    auto l = target_->Listen(address);
    ASSERT_TRUE(l.ok()) << l.status();
    address_ = (*l)->address();
    EndpointOptions to;
    to.endpoint_id = 1;
    to.send_depth = send_depth;
    to.recv_depth = recv_depth;
    EndpointOptions io = to;
    io.endpoint_id = 2;
    StatusOr<std::unique_ptr<Endpoint>> iep = InternalError("not run");
    std::thread t([&] { iep = initiator_->Connect(address_, icq_.get(), io); });
    auto tep = (*l)->Accept(tcq_.get(), to, milliseconds(10000));
    t.join();
    ASSERT_TRUE(tep.ok()) << tep.status();
    ASSERT_TRUE(iep.ok()) << iep.status();
    tep_ = std::move(*tep);
    iep_ = std::move(*iep);
  }

  std::unique_ptr<MemoryRegion> Alloc(Fabric* f, size_t n, Access a) {
    auto r = f->AllocateMemory(n, a);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }

  // Polls the initiator CQ (and the target's, discarding) until n completions arrived.
  std::vector<Completion> Collect(size_t n, milliseconds timeout = milliseconds(10000)) {
    std::vector<Completion> got;
    Completion wc[64];
    const auto deadline = Clock::now() + timeout;
    while (got.size() < n && Clock::now() < deadline) {
      const int k = icq_->Poll(wc, 64);
      got.insert(got.end(), wc, wc + k);
    }
    EXPECT_EQ(got.size(), n);
    return got;
  }

  std::unique_ptr<Fabric> target_, initiator_;
  std::unique_ptr<CompletionQueue> tcq_, icq_;
  std::unique_ptr<Endpoint> tep_, iep_;
  std::string address_;
};

TEST_F(ShmTransportTest, WriteAndReadAreByteExactAtOddOffsets) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t kRegion = 3u << 20;
  auto remote = Alloc(target_.get(), kRegion, Access::kRemoteReadWrite);
  ASSERT_TRUE(remote);
  ASSERT_TRUE(AllZero(remote->data(), kRegion));
  std::vector<uint8_t> src(kRegion), dst(kRegion);
  auto s =
      initiator_->RegisterMemory(src.data(), src.size(), Access::kLocalOnly, MemoryKind::kHost);
  auto d =
      initiator_->RegisterMemory(dst.data(), dst.size(), Access::kLocalOnly, MemoryKind::kHost);
  ASSERT_TRUE(s.ok() && d.ok());
  const RegionDescriptor rd = remote->descriptor();
  EXPECT_EQ(rd.provider, "shm");
  auto* rb = static_cast<uint8_t*>(remote->data());
  uint64_t ctx = 0;
  for (size_t n :
       {size_t{1}, size_t{3}, size_t{63}, size_t{4097}, size_t{1} << 20, (size_t{2} << 20) + 5}) {
    SCOPED_TRACE(n);
    const size_t loff = 7, roff = 4093;
    std::memset(rb, 0, kRegion);
    FillPattern(src.data() + loff, n, n);
    Status ps = iep_->PostWrite({s->get(), loff, n}, AtOffset(rd, roff), ++ctx);
    ASSERT_TRUE(ps.ok()) << ps;
    auto c = Collect(1);
    ASSERT_TRUE(c[0].ok());
    EXPECT_EQ(c[0].op, OpType::kWrite);
    EXPECT_EQ(c[0].context, ctx);
    EXPECT_EQ(c[0].endpoint_id, 2u);
    ASSERT_EQ(std::memcmp(rb + roff, src.data() + loff, n), 0);
    EXPECT_TRUE(AllZero(rb, roff));
    EXPECT_TRUE(AllZero(rb + roff + n, kRegion - roff - n));
    std::memset(dst.data(), 0xEE, dst.size());
    ASSERT_TRUE(iep_->PostRead({d->get(), 11, n}, AtOffset(rd, roff), ++ctx).ok());
    c = Collect(1);
    ASSERT_TRUE(c[0].ok());
    EXPECT_EQ(c[0].op, OpType::kRead);
    EXPECT_EQ(c[0].byte_len, n);
    ASSERT_EQ(std::memcmp(dst.data() + 11, src.data() + loff, n), 0);
    EXPECT_EQ(dst[10], 0xEE);
    EXPECT_EQ(dst[11 + n], 0xEE);
  }
  EXPECT_EQ(iep_->outstanding(), 0);
}

// With recv_depth 4 at the target, 32 write-with-immediates: only 4 fit the doorbell ring, the
// rest wait at the initiator (and so does a plain write posted behind them). Nothing is lost,
// the order holds, and each payload is present when its immediate arrives.
TEST_F(ShmTransportTest, WriteImmBackpressureKeepsOrderAndVisibility) {
  ASSERT_NO_FATAL_FAILURE(Connect(64, 4));
  const int kOps = 32;
  const size_t kSlot = 8192;
  auto remote = Alloc(target_.get(), kSlot * (kOps + 1), Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kSlot * (kOps + 1), Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  auto* sb = static_cast<uint8_t*>(src->data());
  auto* rb = static_cast<uint8_t*>(remote->data());
  const RegionDescriptor rd = remote->descriptor();
  for (int i = 0; i < kOps; ++i) {
    const size_t len = 100 + i * 37;
    FillPattern(sb + i * kSlot, len, 1000 + i);
    ASSERT_TRUE(
        iep_->PostWriteImm({src.get(), i * kSlot, len}, AtOffset(rd, i * kSlot), 0xA000 + i, i)
            .ok());
  }
  // A plain write behind the blocked write-imms must not be executed ahead of them.
  FillPattern(sb + kOps * kSlot, kSlot, 77);
  ASSERT_TRUE(
      iep_->PostWrite({src.get(), kOps * kSlot, kSlot}, AtOffset(rd, kOps * kSlot), 999).ok());
  EXPECT_EQ(iep_->outstanding(), kOps + 1);
  Completion wc[64];
  int k = 0;
  for (int spin = 0; spin < 100; ++spin) k += icq_->Poll(wc + k, 64 - k);
  EXPECT_EQ(k, 4) << "only recv_depth write-imms can complete while the target is not polling";
  EXPECT_TRUE(AllZero(rb + kOps * kSlot, kSlot)) << "a later write overtook blocked write-imms";

  std::vector<uint8_t> expect(kSlot);
  int received = 0, completed = k;
  std::vector<uint64_t> contexts;
  for (int i = 0; i < k; ++i) contexts.push_back(wc[i].context);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while ((received < kOps || completed < kOps + 1) && Clock::now() < deadline) {
    Completion t[3];
    const int n = tcq_->Poll(t, 3);  // reap slowly
    for (int j = 0; j < n; ++j) {
      ASSERT_EQ(t[j].op, OpType::kRecvImm);
      ASSERT_EQ(t[j].endpoint_id, 1u);
      ASSERT_EQ(t[j].imm, 0xA000u + received);
      const size_t len = 100 + received * 37;
      ASSERT_EQ(t[j].byte_len, len);
      FillPattern(expect.data(), len, 1000 + received);
      ASSERT_EQ(std::memcmp(rb + received * kSlot, expect.data(), len), 0);
      ++received;
    }
    const int m = icq_->Poll(wc, 64);
    for (int j = 0; j < m; ++j) {
      ASSERT_TRUE(wc[j].ok());
      contexts.push_back(wc[j].context);
    }
    completed += m;
  }
  EXPECT_EQ(received, kOps);
  ASSERT_EQ(completed, kOps + 1);
  for (int i = 0; i < kOps; ++i) EXPECT_EQ(contexts[i], static_cast<uint64_t>(i));
  EXPECT_EQ(contexts[kOps], 999u);
  EXPECT_EQ(std::memcmp(rb + kOps * kSlot, sb + kOps * kSlot, kSlot), 0);
  EXPECT_EQ(iep_->outstanding(), 0);
}

struct BadAccessCase {
  const char* name;
  int kind;  // 0 wrong rkey, 1 past the end, 2 address wraps, 3 no remote access, 4 deregistered
};

class ShmAccessErrorTest : public ShmTransportTest,
                           public ::testing::WithParamInterface<BadAccessCase> {};

TEST_P(ShmAccessErrorTest, RejectedTouchesNothingAndFlushesLaterOps) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t n = 1 << 16;
  auto remote =
      Alloc(target_.get(), n, GetParam().kind == 3 ? Access::kLocalOnly : Access::kRemoteReadWrite);
  auto other = Alloc(target_.get(), n, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), n, Access::kLocalOnly);
  ASSERT_TRUE(remote && other && src);
  FillPattern(src->data(), n, 3);
  RemoteSlice dst = AtOffset(remote->descriptor(), 0);
  uint64_t len = 4096;
  switch (GetParam().kind) {
    case 0:
      dst.rkey += 1u << 16;
      break;  // right slot, wrong generation
    case 1:
      dst.addr += n - 10;
      break;
    case 2:
      dst.addr = std::numeric_limits<uint64_t>::max() - 100;
      len = 4096;
      break;
    case 3:
      break;
    case 4: {
      const RegionDescriptor d = remote->descriptor();
      remote.reset();
      remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);  // likely reuses the slot
      ASSERT_TRUE(remote);
      dst = AtOffset(d, 0);
      break;
    }
  }
  if (GetParam().kind == 2) {
    // A remote slice that wraps past 2^64 fits no region: Endpoint::PostWrite refuses it before
    // the provider sees it (transport.h, "Checked posts"), and the endpoint stays healthy.
    const Status s = iep_->PostWrite({src.get(), 0, len}, dst, 1);
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
    EXPECT_TRUE(iep_->status().ok());
    EXPECT_EQ(iep_->outstanding(), 0);
    EXPECT_TRUE(AllZero(remote->data(), n));
    return;
  }
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, len}, dst, 1).ok());
  // Later posts of every kind flush, in order.
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, AtOffset(other->descriptor(), 0), 2).ok());
  ASSERT_TRUE(iep_->PostRead({src.get(), 0, 8}, AtOffset(other->descriptor(), 0), 3).ok());
  ASSERT_TRUE(
      iep_->PostWriteImm({src.get(), 0, 8}, AtOffset(other->descriptor(), 0), 5, 4, kUnsignaled)
          .ok());
  auto c = Collect(4);
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0].context, 1u);
  EXPECT_EQ(c[0].status, WcStatus::kRemoteAccessError) << WcStatusName(c[0].status);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(c[i].context, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(c[i].status, WcStatus::kFlushed) << WcStatusName(c[i].status);
  }
  EXPECT_FALSE(iep_->status().ok());
  EXPECT_EQ(iep_->outstanding(), 0);
  EXPECT_TRUE(AllZero(remote->data(), n));
  EXPECT_TRUE(AllZero(other->data(), n));
  Completion t;
  EXPECT_EQ(tcq_->Poll(&t, 1), 0) << "a flushed write-imm reached the target";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ShmAccessErrorTest,
    ::testing::Values(BadAccessCase{"WrongRkey", 0}, BadAccessCase{"PastTheEnd", 1},
                      BadAccessCase{"AddressWraps", 2}, BadAccessCase{"NoRemoteAccess", 3},
                      BadAccessCase{"Deregistered", 4}),
    [](const ::testing::TestParamInfo<BadAccessCase>& i) { return std::string(i.param.name); });

// The target polls on its own thread (its CQ belongs to that thread): every immediate it sees
// must find its payload complete, across cores, under a ring that is often full.
TEST_F(ShmTransportTest, WriteImmVisibilityAcrossThreads) {
  ASSERT_NO_FATAL_FAILURE(Connect(64, 16));
  const int kOps = 5000, kSlots = 64;
  const size_t kSlot = 16384;
  auto remote = Alloc(target_.get(), kSlot * kSlots, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kSlot * kSlots, Access::kLocalOnly);
  ASSERT_TRUE(remote && src);
  auto len_of = [](int i) { return size_t{1} + (static_cast<size_t>(i) * 7919) % 16384; };
  std::atomic<int> bad{-1};
  std::atomic<int> seen{0};
  std::thread target([&] {
    std::vector<uint8_t> expect(kSlot);
    Completion wc[8];
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    int next = 0;
    while (next < kOps && Clock::now() < deadline && bad.load() < 0) {
      // Small batches (a slot is reused 64 ops later); Wait, so that two spinning threads do
      // not starve each other on a loaded machine.
      const int k = tcq_->Wait(wc, 8, std::chrono::microseconds(200));
      for (int j = 0; j < k; ++j) {
        const size_t len = len_of(next);
        FillPattern(expect.data(), len, next);
        if (wc[j].imm != static_cast<uint32_t>(next) || wc[j].byte_len != len ||
            std::memcmp(static_cast<uint8_t*>(remote->data()) + (next % kSlots) * kSlot,
                        expect.data(), len) != 0) {
          bad.store(next);
        }
        ++next;
      }
      seen.store(next);
    }
  });
  auto* sb = static_cast<uint8_t*>(src->data());
  const RegionDescriptor rd = remote->descriptor();
  Completion wc[64];
  int posted = 0, done = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (done < kOps && Clock::now() < deadline && bad.load() < 0) {
    // A slot is rewritten only when the target is at most 32 ops behind (ring 16 + batch 8 +
    // the one memcpy'd op waiting for ring space), well inside the 64-slot distance.
    while (posted < kOps && posted - seen.load() < 32 && iep_->outstanding() < 64) {
      const size_t off = (posted % kSlots) * kSlot;
      FillPattern(sb + off, len_of(posted), posted);
      ASSERT_TRUE(iep_->PostWriteImm({src.get(), off, len_of(posted)}, AtOffset(rd, off),
                                     static_cast<uint32_t>(posted), posted,
                                     posted % 4 == 3 ? kSignaled : kUnsignaled)
                      .ok());
      ++posted;
    }
    const int k = icq_->Wait(wc, 64, std::chrono::microseconds(200));
    for (int j = 0; j < k; ++j) ASSERT_TRUE(wc[j].ok());
    done += 4 * k;
  }
  target.join();
  EXPECT_EQ(bad.load(), -1) << "immediate " << bad.load() << " arrived before its payload";
  EXPECT_EQ(seen.load(), kOps);
  EXPECT_EQ(done, kOps);
}

TEST_F(ShmTransportTest, RegisterMemoryRefusesRemoteAccessAndCuda) {
  std::vector<uint8_t> buf(4096);
  for (Access a : {Access::kRemoteRead, Access::kRemoteWrite, Access::kRemoteReadWrite}) {
    auto r = target_->RegisterMemory(buf.data(), buf.size(), a, MemoryKind::kHost);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("AllocateMemory"), std::string::npos) << r.status();
  }
  auto cuda =
      target_->RegisterMemory(buf.data(), buf.size(), Access::kLocalOnly, MemoryKind::kCuda);
  EXPECT_EQ(cuda.status().code(), StatusCode::kUnimplemented);
  auto ok = target_->RegisterMemory(buf.data(), buf.size(), Access::kLocalOnly, MemoryKind::kHost);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->data(), buf.data());
}

TEST_F(ShmTransportTest, ArenaReusesFreedMemoryZeroFilled) {
  auto f = OpenShm(64u << 20);
  ASSERT_TRUE(f);
  auto big = f->AllocateMemory(100u << 20, Access::kRemoteWrite);
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  uint32_t last_rkey = 0;
  for (int round = 0; round < 8; ++round) {
    auto a = f->AllocateMemory(40u << 20, Access::kRemoteReadWrite);
    ASSERT_TRUE(a.ok()) << "round " << round << ": " << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data()) % (2u << 20), 0u);
    ASSERT_TRUE(AllZero((*a)->data(), (*a)->length()));
    std::memset((*a)->data(), 0x5c, (*a)->length());
    EXPECT_NE((*a)->descriptor().rkey, last_rkey) << "a reused slot needs a new generation";
    last_rkey = (*a)->descriptor().rkey;
  }
  auto small = f->AllocateMemory(10, Access::kRemoteRead);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*small)->data()) % 4096, 0u);
  EXPECT_EQ((*small)->length(), 10u);
}

TEST_F(ShmTransportTest, FilesystemPathAddressWorks) {
  const std::string path = "/tmp/shardps-shm-test-" + std::to_string(getpid()) + ".sock";
  ASSERT_NO_FATAL_FAILURE(Connect(16, 16, path));
  EXPECT_EQ(address_, path);
  auto remote = Alloc(target_.get(), 4096, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 4096, Access::kLocalOnly);
  FillPattern(src->data(), 4096, 9);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 4096}, AtOffset(remote->descriptor(), 0), 1).ok());
  ASSERT_TRUE(Collect(1)[0].ok());
  EXPECT_EQ(std::memcmp(remote->data(), src->data(), 4096), 0);
}

// The peer's endpoint goes away while a write-imm waits for ring space: that op completes with
// kRemoteDisconnected, everything behind it and everything posted later with kFlushed.
TEST_F(ShmTransportTest, PeerGoneFailsPendingAndFlushesLater) {
  ASSERT_NO_FATAL_FAILURE(Connect(16, 1));
  auto remote = Alloc(target_.get(), 4096, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 4096, Access::kLocalOnly);
  const RegionDescriptor rd = remote->descriptor();
  ASSERT_TRUE(iep_->PostWriteImm({src.get(), 0, 8}, AtOffset(rd, 0), 1, 1).ok());  // fits
  ASSERT_TRUE(iep_->PostWriteImm({src.get(), 0, 8}, AtOffset(rd, 0), 2, 2).ok());  // blocked
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, AtOffset(rd, 0), 3).ok());        // behind
  tep_.reset();
  const auto t0 = Clock::now();
  auto c = Collect(3, milliseconds(2000));
  ASSERT_EQ(c.size(), 3u);
  EXPECT_LT(Clock::now() - t0, milliseconds(500));
  EXPECT_TRUE(c[0].ok());
  EXPECT_EQ(c[1].status, WcStatus::kRemoteDisconnected) << WcStatusName(c[1].status);
  EXPECT_EQ(c[2].status, WcStatus::kFlushed);
  EXPECT_EQ(iep_->status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, AtOffset(rd, 0), 4).ok());
  c = Collect(1);
  EXPECT_EQ(c[0].status, WcStatus::kFlushed);
  EXPECT_EQ(iep_->outstanding(), 0);
}

// Finds every doorbell mapping of this process (a hostile peer maps the same memfd read-write)
// and fills its rings with garbage, indices included. Neither side may crash or read out of
// bounds; the endpoints go to the error state.
TEST_F(ShmTransportTest, HostileDoorbellScribblesDoNotCrash) {
  ASSERT_NO_FATAL_FAILURE(Connect(16, 8));
  auto remote = Alloc(target_.get(), 1 << 20, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 1 << 20, Access::kLocalOnly);
  int scribbled = 0;
  FILE* maps = fopen("/proc/self/maps", "r");
  ASSERT_NE(maps, nullptr);
  char line[512];
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  while (fgets(line, sizeof(line), maps) != nullptr) {
    if (strstr(line, "shardps-shm-doorbell") == nullptr) continue;
    unsigned long lo = 0, hi = 0;
    ASSERT_EQ(sscanf(line, "%lx-%lx", &lo, &hi), 2);
    ranges.emplace_back(lo, hi);
  }
  fclose(maps);
  for (auto [lo, hi] : ranges) {
    // Leave the header alone; garbage everywhere in the rings.
    FillPattern(reinterpret_cast<uint8_t*>(lo) + 64, hi - lo - 64, 4242 + scribbled);
    ++scribbled;
  }
  ASSERT_EQ(scribbled, 2) << "both sides map the connection's doorbell";
  Completion wc[16];
  for (int i = 0; i < 50; ++i) {
    tcq_->Poll(wc, 16);
    icq_->Poll(wc, 16);
  }
  EXPECT_FALSE(tep_->status().ok()) << "the target must notice the corrupt inbound ring";
  Status s = iep_->PostWriteImm({src.get(), 0, 64}, AtOffset(remote->descriptor(), 0), 1, 1);
  ASSERT_TRUE(s.ok()) << s;
  auto c = Collect(1);
  EXPECT_FALSE(c[0].ok()) << "a write-imm into a corrupt ring must not report success";
  EXPECT_FALSE(iep_->status().ok());
}

// A corrupt region table at the target (an entry pointing outside the target's arena) is
// refused by the initiator as a remote access error instead of being followed.
TEST_F(ShmTransportTest, CorruptRegionTableEntryIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 8192, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), 8192, Access::kLocalOnly);
  const RegionDescriptor rd = remote->descriptor();
  // The table: 64-byte header, then 32-byte entries {state, va, offset, length}. Find the
  // owner's writable mapping whose entry for rd's slot names rd's address.
  FILE* maps = fopen("/proc/self/maps", "r");
  ASSERT_NE(maps, nullptr);
  char line[512];
  uint64_t* entry = nullptr;
  while (fgets(line, sizeof(line), maps) != nullptr) {
    if (strstr(line, "shardps-shm-regions") == nullptr || strstr(line, " rw") == nullptr) {
      continue;
    }
    unsigned long lo = 0, hi = 0;
    ASSERT_EQ(sscanf(line, "%lx-%lx", &lo, &hi), 2);
    auto* e = reinterpret_cast<uint64_t*>(lo + 64 + 32 * (rd.rkey & 0xffff));
    if (e[1] == rd.addr) entry = e;
  }
  fclose(maps);
  ASSERT_NE(entry, nullptr);
  entry[2] = ~0ull - 4096;  // arena offset far outside the arena
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 64}, AtOffset(rd, 0), 1).ok());
  auto c = Collect(1);
  EXPECT_EQ(c[0].status, WcStatus::kRemoteAccessError) << WcStatusName(c[0].status);
  EXPECT_FALSE(iep_->status().ok());
}

int CountMappings(const char* name) {
  FILE* maps = fopen("/proc/self/maps", "r");
  if (maps == nullptr) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof(line), maps) != nullptr) n += strstr(line, name) != nullptr;
  fclose(maps);
  return n;
}

// A raw client that speaks garbage: Accept fails with an error (no crash, no hang past its
// timeout), and the listener still accepts a real peer afterwards.
TEST_F(ShmTransportTest, HostileHandshakeIsAnErrorNotACrash) {
  auto tcq = target_->CreateCompletionQueue(1024);
  auto icq = initiator_->CreateCompletionQueue(1024);
  ASSERT_TRUE(tcq.ok() && icq.ok());
  auto l = target_->Listen("");
  ASSERT_TRUE(l.ok());
  const std::string addr = (*l)->address();
  ASSERT_EQ(addr[0], '@');
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path + 1, addr.data() + 1, addr.size() - 1);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa),
                      offsetof(sockaddr_un, sun_path) + addr.size()),
              0);
    std::vector<uint8_t> junk(variant == 0 ? 56 : variant == 1 ? 7 : 4096);
    FillPattern(junk.data(), junk.size(), variant);
    if (variant == 0) {  // right size and magic, but no fds attached
      const uint64_t magic = 0x3130484c50485353ull;
      std::memcpy(junk.data(), &magic, 8);
    }
    ASSERT_EQ(send(fd, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
    auto ep = (*l)->Accept(tcq->get(), eo, milliseconds(2000));
    EXPECT_FALSE(ep.ok());
    close(fd);
  }
  StatusOr<std::unique_ptr<Endpoint>> iep = InternalError("not run");
  std::thread t([&] { iep = initiator_->Connect(addr, icq->get(), eo); });
  auto tep = (*l)->Accept(tcq->get(), eo, milliseconds(10000));
  t.join();
  EXPECT_TRUE(tep.ok()) << tep.status();
  EXPECT_TRUE(iep.ok()) << iep.status();
}

// What the child of PeerOfAnotherUidIsRefusedBeforeAnyFdIsSent saw, sent back over a pipe.
struct NobodyReport {
  int setup_errno = 0;        // 0: the child became uid 65534 and reached the listener
  int raw_fds_received = -1;  // SCM_RIGHTS fds the server sent after a well-formed hello
  int raw_recv_result = 1;    // recvmsg's result: <= 0 means EOF or error, nothing sent
  int connect_ok = 1;         // Fabric::Connect as nobody: 1 if it succeeded
};

// What a listener sent back to a raw peer's hello.
struct RawHelloReply {
  int setup_errno = 0;   // the raw peer's own set-up failed
  int recv_result = 1;   // recvmsg's result: <= 0 means EOF or error, nothing sent
  std::vector<int> fds;  // SCM_RIGHTS fds received (the caller closes them)
};

// A raw peer's hello over an authenticated shm socket: the layout's Hello with a valid 2 MiB
// arena, read-only arena and region table (so that a listener that checks nothing goes on to
// send its own fds), then whatever comes back within 10 s.
RawHelloReply RawShmHello(int fd) {
  RawHelloReply r;
  constexpr uint64_t kArena = 2ull << 20;
  const int arena = memfd_create("nobody-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  const int ro_arena = memfd_create("nobody-ro-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  const int table = memfd_create("nobody-table", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (arena < 0 || ro_arena < 0 || table < 0 || ftruncate(arena, kArena) != 0 ||
      ftruncate(ro_arena, kArena) != 0 || ftruncate(table, shm::kTableBytes) != 0) {
    r.setup_errno = errno;
    return r;
  }
  void* t = mmap(nullptr, shm::kTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, table, 0);
  if (t == MAP_FAILED) {
    r.setup_errno = errno;
    return r;
  }
  auto* th = static_cast<shm::TableHeader*>(t);
  th->version.store(shm::kLayoutVersion);
  th->capacity.store(shm::kTableCapacity);
  th->arena_size.store(kArena);
  th->magic.store(shm::kTableMagic);
  munmap(t, shm::kTableBytes);
  fcntl(arena, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  fcntl(ro_arena, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  fcntl(table, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  shm::Hello hello{};
  hello.magic = shm::kHelloMagic;
  hello.version = shm::kLayoutVersion;
  hello.pid = static_cast<uint32_t>(getpid());
  hello.recv_depth = 8;
  hello.table_capacity = shm::kTableCapacity;
  hello.arena_size = kArena;
  const int out[3] = {arena, ro_arena, table};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  iovec iov{&hello, sizeof(hello)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(out));
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(out));
  std::memcpy(CMSG_DATA(c), out, sizeof(out));
  const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
  close(arena);
  close(ro_arena);
  close(table);
  if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) {
    r.recv_result = 0;  // refused before the hello: nothing came back
    return r;
  }
  if (sent != static_cast<ssize_t>(sizeof(hello))) {
    r.setup_errno = errno;
    return r;
  }
  pollfd p{fd, POLLIN, 0};
  poll(&p, 1, 10000);
  shm::Hello reply{};
  std::memset(control, 0, sizeof(control));
  iov = iovec{&reply, sizeof(reply)};
  msg = msghdr{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  r.recv_result = static_cast<int>(recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC));
  if (r.recv_result >= 0) {
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
      if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
        const size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
          r.fds.push_back(f);
        }
      }
    }
  }
  return r;
}

// The second half of NobodyTriesToConnect: a real Fabric::Connect as the same (other) uid.
NobodyReport ConnectAsFabric(const std::string& addr, NobodyReport r) {
  FabricOptions o;
  o.provider = "shm";
  o.shm_allowed_uids = {0};  // the connector checks the listener's uid too: root's is fine here
  o.shm_arena_bytes = 64ull << 20;
  auto f = Fabric::Open(o);
  if (!f.ok()) {
    r.setup_errno = EIO;
    return r;
  }
  auto cq = (*f)->CreateCompletionQueue(64);
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  eo.connect_timeout = milliseconds(10000);
  r.connect_ok = cq.ok() && (*f)->Connect(addr, cq->get(), eo).ok();
  return r;
}

// In the forked child, as `nobody`: a well-formed handshake over a raw socket, with a valid
// arena and region table (so that a server that checks nothing goes on to send its own fds),
// counting what comes back; then a real Fabric::Connect.
NobodyReport NobodyTriesToConnect(const std::string& addr) {
  NobodyReport r;
  if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) {
    r.setup_errno = errno;
    return r;
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, addr.data() + 1, addr.size() - 1);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&sa),
                        offsetof(sockaddr_un, sun_path) + addr.size()) != 0) {
    r.setup_errno = errno;
    return r;
  }
  // Through the listener's challenge (no credential: these listeners require none). A listener
  // that refuses this uid closes before it sends a challenge: nothing came back.
  if (!auth::ConnectorHandshake(fd, "", "",
                                std::chrono::steady_clock::now() + std::chrono::seconds(10))
           .ok()) {
    r.raw_recv_result = 0;
    r.raw_fds_received = 0;
    close(fd);
    return ConnectAsFabric(addr, r);
  }
  const RawHelloReply h = RawShmHello(fd);
  close(fd);
  if (h.setup_errno != 0) {
    r.setup_errno = h.setup_errno;
    return r;
  }
  r.raw_recv_result = h.recv_result;
  r.raw_fds_received = static_cast<int>(h.fds.size());
  for (int f : h.fds) close(f);
  return ConnectAsFabric(addr, r);
}

// The listener checks the connecting process's uid with SO_PEERCRED before it reads the hello:
// a process of another uid (here `nobody`) is refused before any memfd is mapped or sent. Before
// this check any local uid could map a server's arena read-write.
TEST_F(ShmTransportTest, PeerOfAnotherUidIsRefusedBeforeAnyFdIsSent) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to fork a child that becomes nobody (65534)";
  auto tcq = target_->CreateCompletionQueue(1024);
  auto icq = initiator_->CreateCompletionQueue(1024);
  ASSERT_TRUE(tcq.ok() && icq.ok());
  auto l = target_->Listen("");
  ASSERT_TRUE(l.ok()) << l.status();
  const std::string addr = (*l)->address();
  ASSERT_EQ(addr[0], '@');
  int report_pipe[2];
  ASSERT_EQ(pipe(report_pipe), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(report_pipe[0]);
    const NobodyReport r = NobodyTriesToConnect(addr);
    (void)!write(report_pipe[1], &r, sizeof(r));
    _exit(0);
  }
  close(report_pipe[1]);
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  // Two connections come: the raw handshake, then Fabric::Connect. One Accept call refuses
  // every foreign connection waiting at once and reports one of them, so a loaded host, where
  // the child's second connect lands before the first Accept call has returned, sees both
  // refused in one call: count refusals in the listener's stats, not Accept calls.
  int accepted = 0;
  int denied = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((*l)->gate_stats().refused < 2 && std::chrono::steady_clock::now() < until) {
    auto ep = (*l)->Accept(tcq->get(), eo, milliseconds(1000));
    if (ep.ok()) {
      ++accepted;
      continue;
    }
    if (ep.status().code() == StatusCode::kDeadlineExceeded) continue;  // not yet connected
    ++denied;
    EXPECT_EQ(ep.status().code(), StatusCode::kPermissionDenied) << ep.status();
    EXPECT_NE(ep.status().message().find("uid 65534"), std::string::npos) << ep.status();
  }
  EXPECT_EQ((*l)->gate_stats().refused, 2u) << "both of the child's connections refused";
  EXPECT_GE(denied, 1) << "Accept reported no refusal";
  EXPECT_EQ(accepted, 0) << "the listener made endpoints for a peer of another uid";
  NobodyReport r;
  const ssize_t got = read(report_pipe[0], &r, sizeof(r));
  close(report_pipe[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof(r)));
  ASSERT_EQ(r.setup_errno, 0) << strerror(r.setup_errno);
  EXPECT_EQ(r.raw_fds_received, 0) << "the server sent fds to a peer of another uid";
  EXPECT_LE(r.raw_recv_result, 0) << "the server answered the hello of a peer of another uid";
  EXPECT_EQ(r.connect_ok, 0) << "Fabric::Connect as nobody succeeded";
  // Nothing of the child's was mapped here, and no doorbell was made for it.
  EXPECT_EQ(CountMappings("shardps-shm-arena"), 2);  // target_'s and initiator_'s own
  EXPECT_EQ(CountMappings("nobody-arena"), 0);
  EXPECT_EQ(CountMappings("shardps-shm-doorbell"), 0);
  // A peer of this uid is still served.
  StatusOr<std::unique_ptr<Endpoint>> iep = InternalError("not run");
  std::thread t([&] { iep = initiator_->Connect(addr, icq->get(), eo); });
  auto tep = (*l)->Accept(tcq->get(), eo, milliseconds(10000));
  t.join();
  EXPECT_TRUE(tep.ok()) << tep.status();
  EXPECT_TRUE(iep.ok()) << iep.status();
}

// An allow-listed uid is served: FabricOptions::shm_allowed_uids admits a peer of another uid.
TEST_F(ShmTransportTest, AllowListedUidIsServed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to fork a child that becomes nobody (65534)";
  FabricOptions o;
  o.provider = "shm";
  o.shm_allowed_uids = {65534};
  auto server = Fabric::Open(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto tcq = (*server)->CreateCompletionQueue(1024);
  ASSERT_TRUE(tcq.ok());
  auto l = (*server)->Listen("");
  ASSERT_TRUE(l.ok()) << l.status();
  const std::string addr = (*l)->address();
  int report_pipe[2];
  ASSERT_EQ(pipe(report_pipe), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(report_pipe[0]);
    const NobodyReport r = NobodyTriesToConnect(addr);
    (void)!write(report_pipe[1], &r, sizeof(r));
    _exit(0);
  }
  close(report_pipe[1]);
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  // The raw handshake never acknowledges, so that Accept fails after the fds were sent.
  auto raw = (*l)->Accept(tcq->get(), eo, milliseconds(10000));
  EXPECT_FALSE(raw.ok());
  auto ep = (*l)->Accept(tcq->get(), eo, milliseconds(10000));
  EXPECT_TRUE(ep.ok()) << ep.status();
  NobodyReport r;
  const ssize_t got = read(report_pipe[0], &r, sizeof(r));
  close(report_pipe[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof(r)));
  ASSERT_EQ(r.setup_errno, 0) << strerror(r.setup_errno);
  EXPECT_EQ(r.raw_fds_received, 4);  // arena, read-only arena, table, doorbell
  EXPECT_EQ(r.connect_ok, 1);
}

// A region peers may only read reaches them as a read-only mapping, so a member cannot write it
// even by hand: the kernel refuses a writable mapping of the read-only arena (sealed
// FUTURE_WRITE), an mprotect to writable, a write through the fd, and a writable mapping of the
// fd reopened through /proc. Before, every region lived in one arena that peers mapped
// read-write: a process that connected overwrote the remote-read-only weights region.
TEST_F(ShmTransportTest, ReadOnlyRegionsReachPeersAsReadOnlyMappings) {
  constexpr size_t kBytes = 1 << 16;
  auto tcq = target_->CreateCompletionQueue(1024);
  ASSERT_TRUE(tcq.ok());
  auto l = target_->Listen("");
  ASSERT_TRUE(l.ok()) << l.status();
  auto weights = target_->AllocateMemory(kBytes, Access::kRemoteRead);
  auto inbox = target_->AllocateMemory(kBytes, Access::kRemoteWrite);
  ASSERT_TRUE(weights.ok() && inbox.ok());
  auto* w = static_cast<uint8_t*>((*weights)->data());
  for (size_t i = 0; i < kBytes; ++i) w[i] = static_cast<uint8_t>(i * 13 + 5);

  // A raw member: connects, passes the challenge (this listener requires no credential), says
  // hello and takes the fds; it never acknowledges, so the Accept below fails afterwards.
  RawHelloReply reply;
  const std::string addr = (*l)->address();
  std::thread raw([&] {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path + 1, addr.data() + 1, addr.size() - 1);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa),
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + addr.size())) != 0 ||
        !auth::ConnectorHandshake(fd, "", "",
                                  std::chrono::steady_clock::now() + std::chrono::seconds(10))
             .ok()) {
      reply.setup_errno = EIO;
    } else {
      reply = RawShmHello(fd);
    }
    close(fd);
  });
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  auto ep = (*l)->Accept(tcq->get(), eo, milliseconds(10000));
  raw.join();
  EXPECT_FALSE(ep.ok());
  ASSERT_EQ(reply.setup_errno, 0) << strerror(reply.setup_errno);
  ASSERT_EQ(reply.fds.size(), 4u);
  const int rw_fd = reply.fds[0], ro_fd = reply.fds[1], table_fd = reply.fds[2];

  // Where the region table says the two regions are.
  void* t = mmap(nullptr, shm::kTableBytes, PROT_READ, MAP_SHARED, table_fd, 0);
  ASSERT_NE(t, MAP_FAILED);
  const auto* th = static_cast<const shm::TableHeader*>(t);
  const uint64_t arena_size = th->arena_size.load();
  const auto* entries = reinterpret_cast<const shm::TableEntry*>(
      static_cast<const uint8_t*>(t) + sizeof(shm::TableHeader));
  const uint64_t w_offset =
      entries[(*weights)->descriptor().rkey & shm::kRkeySlotMask].offset.load();
  const uint64_t i_offset = entries[(*inbox)->descriptor().rkey & shm::kRkeySlotMask].offset.load();
  munmap(t, shm::kTableBytes);
  ASSERT_GE(w_offset, arena_size) << "a remote-read-only region must be in the read-only arena";
  EXPECT_LT(i_offset, arena_size) << "a remote-writable region belongs in the read-write arena";
  const uint64_t off = w_offset - arena_size;

  errno = 0;
  void* writable = mmap(nullptr, arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, ro_fd, 0);
  EXPECT_EQ(writable, MAP_FAILED) << "a peer mapped the read-only arena writable";
  EXPECT_EQ(errno, EPERM);
  if (writable != MAP_FAILED) munmap(writable, arena_size);
  void* ro = mmap(nullptr, arena_size, PROT_READ, MAP_SHARED, ro_fd, 0);
  ASSERT_NE(ro, MAP_FAILED) << strerror(errno);
  EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(ro) + off, w, kBytes), 0)
      << "the peer does not see the region's live bytes";
  EXPECT_NE(mprotect(ro, arena_size, PROT_READ | PROT_WRITE), 0)
      << "a peer made its read-only mapping writable";
  munmap(ro, arena_size);
  const char x = 'x';
  EXPECT_LT(pwrite(ro_fd, &x, 1, static_cast<off_t>(off)), 0) << "a peer wrote through the fd";
  const int reopened = open(("/proc/self/fd/" + std::to_string(ro_fd)).c_str(), O_RDWR);
  if (reopened >= 0) {
    void* again = mmap(nullptr, arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0);
    EXPECT_EQ(again, MAP_FAILED) << "a peer mapped the reopened read-only arena writable";
    if (again != MAP_FAILED) munmap(again, arena_size);
    close(reopened);
  }
  // A local-only allocation is in neither arena: no rkey names it, no peer maps it.
  auto private_mem = target_->AllocateMemory(kBytes, Access::kLocalOnly);
  ASSERT_TRUE(private_mem.ok()) << private_mem.status();
  EXPECT_EQ((*private_mem)->descriptor().rkey, 0u);
  std::memset((*private_mem)->data(), 0x5a, kBytes);
  // The owner's bytes are as it wrote them.
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(w[i], static_cast<uint8_t>(i * 13 + 5)) << "byte " << i;
  }
  (void)rw_fd;
  for (int f : reply.fds) close(f);
}

// Two connections between the same two fabrics map each peer arena once per side.
TEST_F(ShmTransportTest, PeerArenaIsMappedOncePerFabricPair) {
  ASSERT_NO_FATAL_FAILURE(Connect(8, 8));
  EXPECT_EQ(CountMappings("shardps-shm-arena"), 4);  // 2 own + 2 peer
  auto l = target_->Listen("");
  ASSERT_TRUE(l.ok());
  EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 8;
  StatusOr<std::unique_ptr<Endpoint>> iep = InternalError("not run");
  std::thread t([&] { iep = initiator_->Connect((*l)->address(), icq_.get(), eo); });
  auto tep = (*l)->Accept(tcq_.get(), eo, milliseconds(10000));
  t.join();
  ASSERT_TRUE(tep.ok() && iep.ok());
  EXPECT_EQ(CountMappings("shardps-shm-arena"), 4);
  EXPECT_EQ(CountMappings("shardps-shm-doorbell"), 4);  // one per connection per side
  iep_.reset();
  tep_.reset();
  (*iep).reset();
  (*tep).reset();
  EXPECT_EQ(CountMappings("shardps-shm-arena"), 2) << "peer arenas must be unmapped";
  EXPECT_EQ(CountMappings("shardps-shm-doorbell"), 0);
}

TEST_F(ShmTransportTest, UnsignaledOpsReturnCreditsWithNextSignaled) {
  ASSERT_NO_FATAL_FAILURE(Connect(8, 8));
  auto remote = Alloc(target_.get(), 4096, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 4096, Access::kLocalOnly);
  const RemoteSlice dst = AtOffset(remote->descriptor(), 0);
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, dst, i, kUnsignaled).ok());
  }
  Completion wc[8];
  EXPECT_EQ(icq_->Poll(wc, 8), 0);
  EXPECT_EQ(iep_->outstanding(), 7);
  ASSERT_TRUE(iep_->PostWrite({src.get(), 0, 8}, dst, 7).ok());
  EXPECT_EQ(iep_->PostWrite({src.get(), 0, 8}, dst, 8).code(), StatusCode::kResourceExhausted);
  auto c = Collect(1);
  EXPECT_EQ(c[0].context, 7u);
  EXPECT_EQ(iep_->outstanding(), 0);
}

TEST_F(ShmTransportTest, DestructionInAnyOrderIsSafe) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 1 << 20, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), 1 << 20, Access::kLocalOnly);
  ASSERT_TRUE(
      iep_->PostWriteImm({src.get(), 0, 100}, AtOffset(remote->descriptor(), 0), 1, 1).ok());
  // Fabrics first, then CQs, then endpoints, then regions.
  target_.reset();
  initiator_.reset();
  tcq_.reset();
  icq_.reset();
  tep_.reset();
  iep_.reset();
  remote.reset();
  src.reset();
}

// Not a pass/fail benchmark (the machine may be shared): reports the best of several
// interleaved rounds of write/read bandwidth next to a plain memcpy of the same size, and only
// fails on a pathology (e.g. page faults on every operation).
TEST_F(ShmTransportTest, BandwidthVersusMemcpy) {
  ASSERT_NO_FATAL_FAILURE(Connect(64, 64));
  for (size_t n : {size_t{1} << 20, size_t{16} << 20}) {
    auto remote = Alloc(target_.get(), n, Access::kRemoteReadWrite);
    auto local = Alloc(initiator_.get(), n, Access::kLocalOnly);
    std::vector<uint8_t> a(n, 1), b(n, 2);
    std::memset(remote->data(), 3, n);
    std::memset(local->data(), 4, n);
    const RemoteSlice at = AtOffset(remote->descriptor(), 0);
    const int iters = n >= (16u << 20) ? 10 : 100;
    auto gbps = [&](auto&& fn) {
      fn();  // warm up (page faults)
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) fn();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      return static_cast<double>(n) * iters / s / 1e9;
    };
    auto op = [&](bool write) {
      Status s = write ? iep_->PostWrite({local.get(), 0, n}, at, 0)
                       : iep_->PostRead({local.get(), 0, n}, at, 0);
      EXPECT_TRUE(s.ok());
      Completion c;
      while (icq_->Poll(&c, 1) == 0) {
      }
      EXPECT_TRUE(c.ok());
    };
    double mc = 0, w = 0, r = 0;
    for (int round = 0; round < 7; ++round) {
      mc = std::max(mc, gbps([&] { std::memcpy(b.data(), a.data(), n); }));
      w = std::max(w, gbps([&] { op(true); }));
      r = std::max(r, gbps([&] { op(false); }));
    }
    std::cerr << "[ bw ] " << (n >> 20) << " MiB, best of 7: memcpy " << mc << " GB/s, write " << w
              << " GB/s (" << w / mc << "x), read " << r << " GB/s (" << r / mc << "x)\n";
    EXPECT_GT(w, 0.2 * mc);
    EXPECT_GT(r, 0.2 * mc);
  }
}

}  // namespace
}  // namespace shardps::transport
