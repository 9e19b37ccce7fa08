// The verbs provider over a real RDMA device (SoftRoCE in the test guest), through the public
// transport API. Two fabrics live in one process: the initiator on rxe0 (bind_ip 192.168.77.1)
// and the target on rxe1 (bind_ip 192.168.77.2), joined by a veth, so every byte crosses a wire.
// Without an RDMA device (a plain host) the device tests skip with the reason.
//
// Run in the guest:
//   run-in-guest.sh --rw "$PWD/build-verbs" -- sh -c 'softroce-up.sh 2 &&
//       ./build-verbs/tests/unit_tests --gtest_filter=Verbs*'
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_testing.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace shardps::transport {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr const char* kInitiatorIp = "192.168.77.1";
constexpr const char* kTargetIp = "192.168.77.2";

int RdmaDeviceCount() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list) ibv_free_device_list(list);
  return list ? n : 0;
}

uint64_t ReadCounter(const std::string& dev, const std::string& name) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/1/hw_counters/" + name);
  uint64_t v = 0;
  f >> v;
  return v;
}

void Fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) ^ seed);
}

FabricOptions Options(const char* ip, int retry_count) {
  FabricOptions o;
  o.provider = "verbs";
  o.bind_ip = ip;
  o.rdma_timeout = 14;  // 67 ms per attempt
  o.rdma_retry_count = retry_count;
  return o;
}

// A connected initiator/target pair plus one region on each side.
class VerbsTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (RdmaDeviceCount() == 0) {
      GTEST_SKIP() << "no RDMA device (ibv_get_device_list is empty); run in the SoftRoCE guest";
    }
    auto t = Fabric::Open(Options(kTargetIp, retry_count_));
    ASSERT_TRUE(t.ok()) << t.status() << " (is softroce-up.sh 2 running?)";
    target_ = std::move(t).value();
    auto i = Fabric::Open(Options(kInitiatorIp, retry_count_));
    ASSERT_TRUE(i.ok()) << i.status();
    initiator_ = std::move(i).value();
    auto tcq = target_->CreateCompletionQueue(4096);
    ASSERT_TRUE(tcq.ok()) << tcq.status();
    target_cq_ = std::move(tcq).value();
    auto icq = initiator_->CreateCompletionQueue(4096);
    ASSERT_TRUE(icq.ok()) << icq.status();
    initiator_cq_ = std::move(icq).value();
    auto l = target_->Listen(std::string(kTargetIp) + ":0");
    ASSERT_TRUE(l.ok()) << l.status();
    listener_ = std::move(l).value();
  }

  // Connects a new pair of endpoints; the initiator connects from a helper thread.
  void Connect(EndpointOptions iopts = {}, EndpointOptions topts = {}) {
    iopts.endpoint_id = 11;
    topts.endpoint_id = 22;
    StatusOr<std::unique_ptr<Endpoint>> conn = UnavailableError("not run");
    std::thread th([&] { conn = initiator_->Connect(listener_->address(), initiator_cq_.get(), iopts); });
    auto acc = listener_->Accept(target_cq_.get(), topts, milliseconds(10000));
    th.join();
    ASSERT_TRUE(acc.ok()) << acc.status();
    ASSERT_TRUE(conn.ok()) << conn.status();
    target_ep_ = std::move(acc).value();
    initiator_ep_ = std::move(conn).value();
  }

  std::unique_ptr<MemoryRegion> Alloc(Fabric* f, size_t n, Access a) {
    auto r = f->AllocateMemory(n, a);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(r).value() : nullptr;
  }

  // Polls cq until n completions arrived or the timeout passed.
  static std::vector<Completion> Collect(CompletionQueue* cq, size_t n,
                                         milliseconds timeout = milliseconds(20000)) {
    std::vector<Completion> out;
    Completion buf[64];
    const auto deadline = Clock::now() + timeout;
    while (out.size() < n && Clock::now() < deadline) {
      int k = cq->Wait(buf, 64, std::chrono::microseconds(10000));
      out.insert(out.end(), buf, buf + k);
    }
    return out;
  }

  Completion One(CompletionQueue* cq) {
    auto v = Collect(cq, 1);
    EXPECT_EQ(v.size(), 1u);
    return v.empty() ? Completion{} : v[0];
  }

  int retry_count_ = 7;  // the default; on rxe 7 means "retry forever"
  std::unique_ptr<Fabric> target_, initiator_;
  std::unique_ptr<CompletionQueue> target_cq_, initiator_cq_;
  std::unique_ptr<Listener> listener_;
  std::unique_ptr<Endpoint> target_ep_, initiator_ep_;
};

TEST_F(VerbsTransportTest, VerbsWriteReadByteExactAtOddOffsets) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const size_t kMax = 3 * 1024 * 1024 + 64;
  auto remote = Alloc(target_.get(), kMax + 4096, Access::kRemoteReadWrite);
  auto src = Alloc(initiator_.get(), kMax + 4096, Access::kLocalOnly);
  std::vector<uint8_t> sink_mem(kMax + 4096);  // caller-owned memory: RegisterMemory path
  auto sink_r = initiator_->RegisterMemory(sink_mem.data(), sink_mem.size(), Access::kLocalOnly,
                                           MemoryKind::kHost);
  ASSERT_TRUE(sink_r.ok()) << sink_r.status();
  auto sink = std::move(sink_r).value();
  const RegionDescriptor d = remote->descriptor();
  EXPECT_EQ(d.provider, "verbs");
  EXPECT_EQ(d.addr, reinterpret_cast<uint64_t>(remote->data()));

  auto* rbytes = static_cast<uint8_t*>(remote->data());
  auto* sbytes = static_cast<uint8_t*>(src->data());
  uint32_t seed = 1;
  for (size_t len : {size_t{1}, size_t{3}, size_t{17}, size_t{127}, size_t{128}, size_t{129},
                     size_t{4095}, size_t{65537}, size_t{1024 * 1024 + 3}, size_t{3 * 1024 * 1024 + 5}}) {
    const uint64_t soff = 1 + (seed * 7) % 13, doff = 3 + (seed * 11) % 29, roff = 5;
    std::memset(rbytes, 0xEE, remote->length());
    Fill(sbytes + soff, len, seed);
    ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), soff, len}, AtOffset(d, doff), 100 + seed).ok());
    Completion c = One(initiator_cq_.get());
    ASSERT_TRUE(c.ok()) << WcStatusName(c.status);
    EXPECT_EQ(c.op, OpType::kWrite);
    EXPECT_EQ(c.context, 100 + seed);
    EXPECT_EQ(c.endpoint_id, 11u);
    ASSERT_EQ(std::memcmp(rbytes + doff, sbytes + soff, len), 0) << "write of " << len;
    EXPECT_EQ(rbytes[doff - 1], 0xEE) << "byte before the write touched";
    EXPECT_EQ(rbytes[doff + len], 0xEE) << "byte after the write touched";
    // Read back into caller-registered memory at another odd offset.
    std::memset(sink_mem.data(), 0, sink_mem.size());
    ASSERT_TRUE(initiator_ep_->PostRead({sink.get(), roff, len}, AtOffset(d, doff), 200 + seed).ok());
    c = One(initiator_cq_.get());
    ASSERT_TRUE(c.ok()) << WcStatusName(c.status);
    EXPECT_EQ(c.op, OpType::kRead);
    EXPECT_EQ(c.byte_len, len);
    ASSERT_EQ(std::memcmp(sink_mem.data() + roff, sbytes + soff, len), 0) << "read of " << len;
    EXPECT_EQ(sink_mem[roff - 1], 0);
    EXPECT_EQ(sink_mem[roff + len], 0);
    ++seed;
  }
  EXPECT_EQ(initiator_ep_->outstanding(), 0);
  EXPECT_TRUE(initiator_ep_->status().ok());
}

TEST_F(VerbsTransportTest, VerbsWriteImmIsVisibleWhenRecvImmArrives) {
  EndpointOptions topts;
  topts.recv_depth = 8;  // fewer receives than writes: exercises repost and RNR waiting
  ASSERT_NO_FATAL_FAILURE(Connect({}, topts));
  const size_t kChunk = 64 * 1024 + 1;
  const int kCount = 40;
  auto remote = Alloc(target_.get(), kChunk * kCount, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kChunk * kCount, Access::kLocalOnly);
  auto* sbytes = static_cast<uint8_t*>(src->data());
  auto* rbytes = static_cast<uint8_t*>(remote->data());
  Fill(sbytes, kChunk * kCount, 9);
  const RegionDescriptor d = remote->descriptor();
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(initiator_ep_->PostWriteImm({src.get(), i * kChunk, kChunk},
                                            AtOffset(d, i * kChunk), 0xA0000000u + i, i)
                    .ok());
  }
  int got = 0;
  Completion buf[16];
  const auto deadline = Clock::now() + milliseconds(30000);
  while (got < kCount && Clock::now() < deadline) {
    int k = target_cq_->Wait(buf, 16, std::chrono::microseconds(10000));
    for (int j = 0; j < k; ++j) {
      const Completion& c = buf[j];
      ASSERT_TRUE(c.ok()) << WcStatusName(c.status);
      ASSERT_EQ(c.op, OpType::kRecvImm);
      EXPECT_EQ(c.endpoint_id, 22u);
      EXPECT_EQ(c.imm, 0xA0000000u + got) << "in order, host byte order";
      EXPECT_EQ(c.byte_len, kChunk);
      // Visible when the completion is seen.
      ASSERT_EQ(std::memcmp(rbytes + got * kChunk, sbytes + got * kChunk, kChunk), 0);
      ++got;
    }
  }
  EXPECT_EQ(got, kCount);
  auto ic = Collect(initiator_cq_.get(), kCount);
  ASSERT_EQ(ic.size(), static_cast<size_t>(kCount));
  for (int i = 0; i < kCount; ++i) {
    EXPECT_TRUE(ic[i].ok());
    EXPECT_EQ(ic[i].op, OpType::kWriteImm);
    EXPECT_EQ(ic[i].imm, 0xA0000000u + i);
    EXPECT_EQ(ic[i].context, static_cast<uint64_t>(i));
  }
  EXPECT_EQ(initiator_ep_->outstanding(), 0);
}

TEST_F(VerbsTransportTest, VerbsInlineAndSelectiveSignaling) {
  EndpointOptions iopts;
  iopts.send_depth = 16;  // smaller than signal_interval: forced signals must still reap
  ASSERT_NO_FATAL_FAILURE(Connect(iopts));
  const int kOps = 1000;
  const size_t kLen = 24;  // <= max_inline: posted inline
  auto remote = Alloc(target_.get(), kOps * kLen, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kOps * kLen, Access::kLocalOnly);
  Fill(static_cast<uint8_t*>(src->data()), kOps * kLen, 5);
  const RegionDescriptor d = remote->descriptor();
  int user_completions = 0, busy = 0;
  Completion buf[32];
  for (int i = 0; i < kOps; ++i) {
    const uint32_t flags = (i == kOps - 1) ? kSignaled : kUnsignaled;
    for (;;) {
      Status s = initiator_ep_->PostWrite({src.get(), i * kLen, kLen}, AtOffset(d, i * kLen), i, flags);
      if (s.ok()) break;
      ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      ++busy;
      user_completions += initiator_cq_->Poll(buf, 32);
    }
    ASSERT_LE(initiator_ep_->outstanding(), 16);
  }
  auto last = Collect(initiator_cq_.get(), 1);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(user_completions, 0) << "unsignaled successes produce no completion";
  EXPECT_EQ(last[0].context, static_cast<uint64_t>(kOps - 1));
  EXPECT_TRUE(last[0].ok());
  EXPECT_EQ(initiator_ep_->outstanding(), 0);
  EXPECT_GT(busy, 0) << "16 credits for 1000 posts: the send queue must have filled";
  EXPECT_EQ(std::memcmp(remote->data(), src->data(), kOps * kLen), 0);

  // Inline sources may be reused as soon as the post returns; a 1-byte and a max_inline write.
  auto* s = static_cast<uint8_t*>(src->data());
  s[0] = 0x5A;
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 1}, AtOffset(d, 7), 1).ok());
  s[0] = 0x00;
  ASSERT_TRUE(One(initiator_cq_.get()).ok());
  EXPECT_EQ(static_cast<uint8_t*>(remote->data())[7], 0x5A);
}

// A completion queue that overruns loses completions: rxe drops those that do not fit and
// raises IBV_EVENT_CQ_ERR; hardware puts the CQ in error. The operations whose completions
// were lost must still complete (failed, the event named in the endpoint's status) instead of
// leaving their caller waiting forever, and those that completed carried their bytes.
TEST_F(VerbsTransportTest, VerbsCqOverrunFailsTheLostOperationsInsteadOfHanging) {
  EndpointOptions iopts;
  iopts.send_depth = 128;
  ASSERT_NO_FATAL_FAILURE(Connect(iopts));
  // Far below the 96 completions about to be generated (rxe keeps 15 of them).
  ASSERT_TRUE(verbs::ResizeCqForTesting(initiator_cq_.get(), 8).ok());
  const int kOps = 96;
  const size_t kLen = 64;
  auto remote = Alloc(target_.get(), kOps * kLen, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kOps * kLen, Access::kLocalOnly);
  Fill(static_cast<uint8_t*>(src->data()), kOps * kLen, 9);
  const RegionDescriptor d = remote->descriptor();
  const uint64_t events_before = verbs::AsyncEventsSeenForTesting(initiator_cq_.get());
  for (int i = 0; i < kOps; ++i) {
    ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), i * kLen, kLen}, AtOffset(d, i * kLen), i,
                                         kSignaled)
                    .ok());
  }
  // Nobody polls while the device executes them all: the CQ fills and the rest are lost. The
  // writes execute in order, so all have once the last one's bytes are there (awaited: an
  // emulated device on a loaded guest may take seconds); then time for their acknowledgements.
  const auto landed_by = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::memcmp(static_cast<uint8_t*>(remote->data()) + (kOps - 1) * kLen,
                     static_cast<uint8_t*>(src->data()) + (kOps - 1) * kLen, kLen) != 0 &&
         std::chrono::steady_clock::now() < landed_by) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  std::this_thread::sleep_for(milliseconds(1500));
  const auto got = Collect(initiator_cq_.get(), kOps);
  ASSERT_EQ(got.size(), static_cast<size_t>(kOps))
      << "operations whose completions the overrun lost never completed";
  int succeeded = 0, failed = 0;
  for (int i = 0; i < kOps; ++i) {
    ASSERT_EQ(got[i].context, static_cast<uint64_t>(i)) << "completions out of post order";
    if (got[i].ok()) {
      ASSERT_EQ(failed, 0) << "a success after a failure: " << i;
      ++succeeded;
      EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(remote->data()) + i * kLen,
                            static_cast<uint8_t*>(src->data()) + i * kLen, kLen),
                0)
          << "write " << i << " reported success without its bytes";
    } else {
      ++failed;
    }
  }
  std::cerr << "[ info ] CQ overrun: " << succeeded << " completed, " << failed
            << " failed after the async event; endpoint: " << initiator_ep_->status() << "\n";
  EXPECT_GT(succeeded, 0);
  EXPECT_GT(failed, 0) << "the CQ did not overrun: the test no longer tests anything";
  EXPECT_NE(initiator_ep_->status().message().find("overrun"), std::string::npos)
      << initiator_ep_->status();
  EXPECT_GT(verbs::AsyncEventsSeenForTesting(initiator_cq_.get()), events_before);
  EXPECT_EQ(initiator_ep_->outstanding(), 0);
  // The CQ stays unusable: an endpoint on it now would never see its completions, so Connect
  // refuses at once, naming why (it checks the CQ before any handshake).
  EndpointOptions again;
  again.endpoint_id = 12;
  auto late = initiator_->Connect(listener_->address(), initiator_cq_.get(), again);
  ASSERT_FALSE(late.ok());
  EXPECT_NE(late.status().message().find("overrun"), std::string::npos) << late.status();
}

// One endpoint per error case: the endpoint stays in the error state.
class VerbsErrorTest : public VerbsTransportTest,
                       public ::testing::WithParamInterface<const char*> {};

TEST_P(VerbsErrorTest, VerbsRemoteAccessErrorFlushesAndSurvives) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const std::string kase = GetParam();
  const size_t kLen = 4096;
  auto rw = Alloc(target_.get(), kLen, Access::kRemoteReadWrite);
  auto ro = Alloc(target_.get(), kLen, Access::kRemoteRead);
  auto src = Alloc(initiator_.get(), kLen, Access::kLocalOnly);
  std::memset(rw->data(), 0x11, kLen);
  std::memset(ro->data(), 0x22, kLen);
  std::memset(src->data(), 0x99, kLen);
  RemoteSlice bad = AtOffset(rw->descriptor(), 0);
  if (kase == "wrong_rkey") bad.rkey ^= 0x5a5a00;
  if (kase == "out_of_bounds") bad = AtOffset(rw->descriptor(), kLen - 100);
  if (kase == "read_only") bad = AtOffset(ro->descriptor(), 0);
  const RemoteSlice good = AtOffset(rw->descriptor(), 0);

  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 64}, good, 1).ok());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, kase == "out_of_bounds" ? 200u : 2048u}, bad, 2).ok());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 64}, good, 3, kUnsignaled).ok());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 64}, good, 4).ok());
  auto v = Collect(initiator_cq_.get(), 4);
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0].context, 1u);
  EXPECT_TRUE(v[0].ok());
  EXPECT_EQ(v[1].context, 2u);
  EXPECT_EQ(v[1].status, WcStatus::kRemoteAccessError) << WcStatusName(v[1].status);
  EXPECT_EQ(v[2].context, 3u) << "a failed unsignaled op still completes";
  EXPECT_EQ(v[2].status, WcStatus::kFlushed);
  EXPECT_EQ(v[3].context, 4u);
  EXPECT_EQ(v[3].status, WcStatus::kFlushed);
  EXPECT_FALSE(initiator_ep_->status().ok());
  EXPECT_NE(initiator_ep_->status().message().find("remote access"), std::string::npos)
      << initiator_ep_->status();

  // Posts after the error complete with kFlushed, in order; credits come back.
  ASSERT_TRUE(initiator_ep_->PostRead({src.get(), 0, 8}, good, 5).ok());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 8}, good, 6, kUnsignaled).ok());
  v = Collect(initiator_cq_.get(), 2);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].context, 5u);
  EXPECT_EQ(v[0].status, WcStatus::kFlushed);
  EXPECT_EQ(v[1].context, 6u);
  EXPECT_EQ(v[1].status, WcStatus::kFlushed);
  EXPECT_EQ(initiator_ep_->outstanding(), 0);

  // The target's bytes: only the first good 64-byte write landed.
  auto* r = static_cast<uint8_t*>(rw->data());
  for (size_t i = 0; i < kLen; ++i) ASSERT_EQ(r[i], i < 64 ? 0x99 : 0x11) << "byte " << i;
  auto* o = static_cast<uint8_t*>(ro->data());
  for (size_t i = 0; i < kLen; ++i) ASSERT_EQ(o[i], 0x22) << "read-only byte " << i;

  // Still alive: a fresh connection on the same fabrics works.
  target_ep_.reset();
  initiator_ep_.reset();
  ASSERT_NO_FATAL_FAILURE(Connect());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 64}, AtOffset(rw->descriptor(), 64), 7).ok());
  EXPECT_TRUE(One(initiator_cq_.get()).ok());
}

INSTANTIATE_TEST_SUITE_P(Verbs, VerbsErrorTest,
                         ::testing::Values("wrong_rkey", "out_of_bounds", "read_only"));

TEST_F(VerbsTransportTest, VerbsPeerCloseIsAnErrorCompletionQuickly) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 1 << 20, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 1 << 20, Access::kLocalOnly);
  const RegionDescriptor d = remote->descriptor();
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 1 << 20}, AtOffset(d, 0), 1).ok());
  ASSERT_TRUE(One(initiator_cq_.get()).ok());
  target_ep_.reset();  // closes the QP and the bootstrap socket
  const auto t0 = Clock::now();
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 1 << 20}, AtOffset(d, 0), 2).ok());
  Completion c = One(initiator_cq_.get());
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.context, 2u);
  EXPECT_LT(ms, 3000) << "peer death must be noticed within seconds";
  EXPECT_FALSE(initiator_ep_->status().ok());
  std::cout << "[          ] peer close -> " << WcStatusName(c.status) << " after " << ms
            << " ms; status: " << initiator_ep_->status() << "\n";
}

// Without the liveness socket, the QP's own ACK timeout bounds detection: rdma_timeout 14
// (67 ms) x (1 + 6 retries) ~ 0.47 s nominal. retry 6, because rxe treats 7 as infinite.
class VerbsRetryTest : public VerbsTransportTest {
 protected:
  void SetUp() override {
    retry_count_ = 6;
    VerbsTransportTest::SetUp();
  }
};

TEST_F(VerbsRetryTest, VerbsDeadPeerWithoutFinIsRetryExceeded) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 1 << 16, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 1 << 16, Access::kLocalOnly);
  const RegionDescriptor d = remote->descriptor();
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 4096}, AtOffset(d, 0), 1).ok());
  ASSERT_TRUE(One(initiator_cq_.get()).ok());
  ASSERT_TRUE(verbs::DropLivenessChannelForTesting(initiator_ep_.get()).ok());
  target_ep_.reset();  // its QP is gone: rxe1 drops the packets silently
  const auto t0 = Clock::now();
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 4096}, AtOffset(d, 0), 2).ok());
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 4096}, AtOffset(d, 0), 3, kUnsignaled).ok());
  auto v = Collect(initiator_cq_.get(), 2, milliseconds(30000));
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].context, 2u);
  EXPECT_EQ(v[0].status, WcStatus::kRetryExceeded) << WcStatusName(v[0].status);
  EXPECT_EQ(v[1].context, 3u);
  EXPECT_EQ(v[1].status, WcStatus::kFlushed) << WcStatusName(v[1].status);
  EXPECT_NE(initiator_ep_->status().message().find("retry exceeded"), std::string::npos)
      << initiator_ep_->status();
  EXPECT_EQ(initiator_ep_->outstanding(), 0);
  EXPECT_LT(ms, 10000);
  std::cout << "[          ] dead peer without FIN -> " << WcStatusName(v[0].status) << " after "
            << ms << " ms (rdma_timeout 14, retry 6)\n";
}

// A malformed handshake fails that accept only; the listener keeps working.
TEST_F(VerbsTransportTest, VerbsMalformedHandshakeFailsOnlyThatAccept) {
  const std::string addr = listener_->address();
  const auto colon = addr.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))));
  inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  // As long as the listener's answer to its challenge (auth::Response), so that it is judged
  // at once rather than held until the gate's timeout.
  char junk[sizeof(auth::Response)];
  std::memset(junk, 0x41, sizeof(junk));
  ASSERT_EQ(write(fd, junk, sizeof(junk)), static_cast<ssize_t>(sizeof(junk)));
  EndpointOptions eo;
  eo.connect_timeout = milliseconds(3000);
  auto bad = listener_->Accept(target_cq_.get(), eo, milliseconds(5000));
  close(fd);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kPermissionDenied) << bad.status();
  EXPECT_NE(bad.status().message().find("malformed"), std::string::npos) << bad.status();
  ASSERT_NO_FATAL_FAILURE(Connect());
  auto remote = Alloc(target_.get(), 4096, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 4096, Access::kLocalOnly);
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 64}, AtOffset(remote->descriptor(), 0), 1).ok());
  EXPECT_TRUE(One(initiator_cq_.get()).ok());
}

// Several endpoints share one CQ per side: completions carry the right endpoint id, and the
// death of one peer puts only its endpoint into the error state (the CQ watches every bootstrap
// socket in one epoll set).
TEST_F(VerbsTransportTest, VerbsManyEndpointsShareOneCqAndFailAlone) {
  constexpr int kEps = 8;
  std::vector<std::unique_ptr<Endpoint>> ini, tgt;
  for (int i = 0; i < kEps; ++i) {
    EndpointOptions io, to;
    io.endpoint_id = 1000 + i;
    to.endpoint_id = 2000 + i;
    io.send_depth = to.send_depth = 32;
    io.recv_depth = to.recv_depth = 32;
    StatusOr<std::unique_ptr<Endpoint>> conn = UnavailableError("not run");
    std::thread th([&] { conn = initiator_->Connect(listener_->address(), initiator_cq_.get(), io); });
    auto acc = listener_->Accept(target_cq_.get(), to, milliseconds(10000));
    th.join();
    ASSERT_TRUE(acc.ok()) << acc.status();
    ASSERT_TRUE(conn.ok()) << conn.status();
    ini.push_back(std::move(conn).value());
    tgt.push_back(std::move(acc).value());
  }
  const size_t kChunk = 4096;
  auto remote = Alloc(target_.get(), kChunk * kEps, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), kChunk * kEps, Access::kLocalOnly);
  Fill(static_cast<uint8_t*>(src->data()), kChunk * kEps, 77);
  const RegionDescriptor d = remote->descriptor();
  for (int i = 0; i < kEps; ++i) {
    ASSERT_TRUE(ini[i]->PostWriteImm({src.get(), i * kChunk, kChunk}, AtOffset(d, i * kChunk),
                                     500 + i, 300 + i).ok());
  }
  auto ic = Collect(initiator_cq_.get(), kEps);
  auto tc = Collect(target_cq_.get(), kEps);
  ASSERT_EQ(ic.size(), static_cast<size_t>(kEps));
  ASSERT_EQ(tc.size(), static_cast<size_t>(kEps));
  std::vector<int> seen(kEps, 0);
  for (const Completion& c : ic) {
    ASSERT_TRUE(c.ok());
    ASSERT_GE(c.endpoint_id, 1000u);
    ASSERT_LT(c.endpoint_id, 1000u + kEps);
    EXPECT_EQ(c.context, 300 + (c.endpoint_id - 1000));
    ++seen[c.endpoint_id - 1000];
  }
  for (const Completion& c : tc) {
    ASSERT_TRUE(c.ok());
    ASSERT_EQ(c.op, OpType::kRecvImm);
    EXPECT_EQ(c.imm, 500 + (c.endpoint_id - 2000));
  }
  for (int v : seen) EXPECT_EQ(v, 1);
  EXPECT_EQ(std::memcmp(remote->data(), src->data(), kChunk * kEps), 0);

  // Initiator endpoint 3 goes away: target endpoint 3, and only it, notices from Poll.
  ini[3].reset();
  const auto t0 = Clock::now();
  Completion buf[8];
  while (tgt[3]->status().ok() && Clock::now() - t0 < milliseconds(5000)) {
    target_cq_->Wait(buf, 8, std::chrono::microseconds(10000));
  }
  EXPECT_FALSE(tgt[3]->status().ok());
  std::cout << "[          ] target noticed the initiator's close after "
            << std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count() << " ms\n";
  for (int i = 0; i < kEps; ++i) {
    if (i != 3) {
      EXPECT_TRUE(tgt[i]->status().ok()) << i;
    }
  }
  ASSERT_TRUE(ini[5]->PostWrite({src.get(), 0, 64}, AtOffset(d, 0), 9).ok());
  Completion c = One(initiator_cq_.get());
  EXPECT_TRUE(c.ok());
  EXPECT_EQ(c.endpoint_id, 1005u);
}

TEST_F(VerbsTransportTest, VerbsGidAutoSelectionPicksIpv4MappedRoceV2) {
  const std::string ds = initiator_->DebugString();
  EXPECT_NE(ds.find("device=rxe0"), std::string::npos) << ds;
  EXPECT_NE(ds.find("gid_index=1 "), std::string::npos) << ds;
  EXPECT_NE(ds.find("gid=::ffff:192.168.77.1"), std::string::npos) << ds;
  const std::string ts = target_->DebugString();
  EXPECT_NE(ts.find("device=rxe1"), std::string::npos) << ts;
  EXPECT_NE(ts.find("gid_index=1 "), std::string::npos) << ts;
  std::cout << "[          ] " << ds << "\n";
}

TEST_F(VerbsTransportTest, VerbsTrafficCrossesTheWire) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  const uint64_t sent0 = ReadCounter("rxe0", "sent_pkts");
  const uint64_t rcvd1 = ReadCounter("rxe1", "rcvd_pkts");
  auto remote = Alloc(target_.get(), 1 << 20, Access::kRemoteWrite);
  auto src = Alloc(initiator_.get(), 1 << 20, Access::kLocalOnly);
  ASSERT_TRUE(initiator_ep_->PostWrite({src.get(), 0, 1 << 20}, AtOffset(remote->descriptor(), 0), 1).ok());
  ASSERT_TRUE(One(initiator_cq_.get()).ok());
  const uint64_t sent = ReadCounter("rxe0", "sent_pkts") - sent0;
  const uint64_t rcvd = ReadCounter("rxe1", "rcvd_pkts") - rcvd1;
  EXPECT_GE(sent, 256u) << "1 MiB at MTU <= 4096 is at least 256 packets from rxe0";
  EXPECT_GE(rcvd, 256u) << "and rxe1 received them";
  std::cout << "[          ] rxe0 sent_pkts +" << sent << ", rxe1 rcvd_pkts +" << rcvd << "\n";
}

TEST(VerbsFabricOpen, VerbsNamedMissingDeviceIsAClearError) {
  FabricOptions o;
  o.provider = "verbs";
  o.rdma_device = "no_such_hca9";
  auto f = Fabric::Open(o);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable) << f.status();
  if (RdmaDeviceCount() > 0) {
    EXPECT_NE(f.status().message().find("no_such_hca9"), std::string::npos) << f.status();
  }
  o.rdma_device.clear();
  o.bind_ip = "203.0.113.77";  // TEST-NET-3: owned by nobody
  f = Fabric::Open(o);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable) << f.status();
}

// Automatic GID choice as a pure function (runs without a device).
TEST(VerbsGidChoice, VerbsPrefersRoceV2Ipv4MappedMatchingBindIp) {
  using verbs::GidEntry;
  using verbs::GidType;
  auto v4 = [](int idx, GidType t, uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
    GidEntry e;
    e.index = idx;
    e.type = t;
    e.raw[10] = e.raw[11] = 0xff;
    e.raw[12] = a;
    e.raw[13] = b;
    e.raw[14] = c;
    e.raw[15] = d;
    return e;
  };
  GidEntry link_local;
  link_local.index = 0;
  link_local.type = GidType::kRoceV2;
  link_local.raw[0] = 0xfe;
  link_local.raw[1] = 0x80;
  std::vector<GidEntry> table = {link_local, v4(1, GidType::kIb, 10, 0, 0, 1),
                                 v4(2, GidType::kRoceV2, 10, 0, 0, 1),
                                 v4(3, GidType::kRoceV2, 192, 168, 77, 1)};
  auto c = verbs::ChooseAutoGid(table, "192.168.77.1");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->index, 3) << c->reason;
  c = verbs::ChooseAutoGid(table, "");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->index, 2) << c->reason;
  c = verbs::ChooseAutoGid(table, "172.16.0.9");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->index, 2) << c->reason;
  EXPECT_NE(c->reason.find("no RoCEv2 GID matches"), std::string::npos) << c->reason;
  c = verbs::ChooseAutoGid({link_local}, "");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->index, 0);
  EXPECT_FALSE(verbs::ChooseAutoGid({}, "").ok());
}

}  // namespace
}  // namespace shardps::transport
