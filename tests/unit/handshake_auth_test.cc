// Data-path authentication (transport/handshake_auth.h) through the public transport API, on
// every provider: tcp and shm on any host, verbs over SoftRoCE in the test guest (the "Verbs"
// instantiation; it skips with the reason where no RDMA device exists, and fails instead under
// SHARDPS_REQUIRE_VERBS=1). Before this, a listener handed regions, memfds and queue pairs to
// any peer that sent a well-formed hello, and Accept waited on a silent peer for up to a second
// on the caller's (the server's apply) thread.
#include <arpa/inet.h>
#include <poll.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crypto.h"
#include "common/thread_annotations.h"
#include "transport/transport.h"

#ifdef SHARDPS_HAVE_VERBS
#include <infiniband/verbs.h>
#endif

namespace shardps::transport {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr char kIdentity[] = "2:7:3";

// Knows one identity: kIdentity, whose key is key_.
class OneMemberAuthenticator final : public Authenticator {
 public:
  explicit OneMemberAuthenticator(std::string key) : key_(std::move(key)) {}
  StatusOr<std::string> KeyFor(std::string_view identity) const override {
    if (identity != kIdentity) return PermissionDeniedError("not a member");
    return key_;
  }

 private:
  const std::string key_;
};

bool HaveRdmaDevice() {
#ifdef SHARDPS_HAVE_VERBS
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list) ibv_free_device_list(list);
  return list != nullptr && n > 0;
#else
  return false;
#endif
}

// A raw client that connects and then does nothing (or what the test sends).
int RawConnect(const std::string& provider, const std::string& address) {
  if (provider == "shm") {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path + 1, address.data() + 1, address.size() - 1);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa),
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size())) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }
  const size_t colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

class HandshakeAuthTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    provider_ = GetParam();
    if (provider_ == "verbs" && !HaveRdmaDevice()) {
      if (std::getenv("SHARDPS_REQUIRE_VERBS") != nullptr) {
        FAIL() << "SHARDPS_REQUIRE_VERBS is set but there is no RDMA device";
      }
      GTEST_SKIP() << "no RDMA device (ibv_get_device_list is empty); run in the SoftRoCE guest";
    }
    auto target = Fabric::Open(Options(true));
    ASSERT_TRUE(target.ok()) << target.status();
    target_ = std::move(*target);
    auto initiator = Fabric::Open(Options(false));
    ASSERT_TRUE(initiator.ok()) << initiator.status();
    initiator_ = std::move(*initiator);
    auto tcq = target_->CreateCompletionQueue(1024);
    auto icq = initiator_->CreateCompletionQueue(1024);
    ASSERT_TRUE(tcq.ok() && icq.ok());
    tcq_ = std::move(*tcq);
    icq_ = std::move(*icq);
    auto key = crypto::RandomBytes(32);
    ASSERT_TRUE(key.ok());
    key_ = *key;
    auto l = target_->Listen(provider_ == "shm"     ? ""
                             : provider_ == "verbs" ? "192.168.77.2:0"
                                                    : "127.0.0.1:0");
    ASSERT_TRUE(l.ok()) << l.status();
    listener_ = std::move(*l);
    listener_->set_authenticator(std::make_shared<OneMemberAuthenticator>(key_));
  }

  FabricOptions Options(bool target) const {
    FabricOptions o;
    o.provider = provider_;
    if (provider_ == "tcp") o.bind_ip = "127.0.0.1";
    if (provider_ == "verbs") o.bind_ip = target ? "192.168.77.2" : "192.168.77.1";
    return o;
  }

  EndpointOptions Eo(std::string identity, std::string key) const {
    EndpointOptions eo;
    eo.send_depth = 16;
    eo.recv_depth = 16;
    eo.connect_timeout = milliseconds(10000);
    eo.auth_identity = std::move(identity);
    eo.auth_key = std::move(key);
    return eo;
  }

  // Connects from a thread while this thread accepts; returns both results.
  void ConnectAndAccept(const EndpointOptions& eo, StatusOr<std::unique_ptr<Endpoint>>* connected,
                        StatusOr<std::unique_ptr<Endpoint>>* accepted) {
    std::thread t([&] { *connected = initiator_->Connect(listener_->address(), icq_.get(), eo); });
    *accepted = listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(10000));
    t.join();
  }

  std::string provider_;
  std::unique_ptr<Fabric> target_, initiator_;
  std::unique_ptr<CompletionQueue> tcq_, icq_;
  std::unique_ptr<Listener> listener_;
  std::string key_;
};

// The member with the right key gets an endpoint that carries the identity it proved, and bytes
// written through it arrive.
TEST_P(HandshakeAuthTest, ProvenIdentityReachesTheEndpointAndDataFlows) {
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  StatusOr<std::unique_ptr<Endpoint>> a = InternalError("not run");
  ConnectAndAccept(Eo(kIdentity, key_), &c, &a);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->peer_identity(), kIdentity);
  EXPECT_EQ((*c)->peer_identity(), "");

  auto remote = target_->AllocateMemory(4096, Access::kRemoteReadWrite);
  auto local = initiator_->AllocateMemory(4096, Access::kLocalOnly);
  ASSERT_TRUE(remote.ok() && local.ok());
  auto* src = static_cast<uint8_t*>((*local)->data());
  for (int i = 0; i < 4096; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE((*c)->PostWrite({local->get(), 0, 4096}, AtOffset((*remote)->descriptor(), 0), 9).ok());
  Completion wc[4];
  int got = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (got == 0 && Clock::now() < deadline) got = icq_->Wait(wc, 4, std::chrono::microseconds(1000));
  ASSERT_EQ(got, 1);
  ASSERT_TRUE(wc[0].ok());
  EXPECT_EQ(std::memcmp((*remote)->data(), src, 4096), 0);
  EXPECT_EQ(listener_->gate_stats().passed, 1u);
}

// A wrong key, an identity the authenticator does not know, and no key at all are each refused
// before any endpoint exists; both sides see PERMISSION_DENIED; the member still gets in after.
TEST_P(HandshakeAuthTest, WrongKeyUnknownIdentityAndNoKeyAreRefused) {
  auto other = crypto::RandomBytes(32);
  ASSERT_TRUE(other.ok());
  const EndpointOptions attempts[] = {
      Eo(kIdentity, *other),  // the member's identity, a guessed key
      Eo("2:8:3", key_),      // a leaked key under another identity
      Eo("", ""),             // no credential at all
  };
  for (const EndpointOptions& eo : attempts) {
    SCOPED_TRACE(eo.auth_identity);
    StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
    StatusOr<std::unique_ptr<Endpoint>> a = InternalError("not run");
    ConnectAndAccept(eo, &c, &a);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status();
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kPermissionDenied) << a.status();
  }
  EXPECT_EQ(listener_->gate_stats().refused, 3u);
  EXPECT_EQ(listener_->gate_stats().passed, 0u);
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  StatusOr<std::unique_ptr<Endpoint>> a = InternalError("not run");
  ConnectAndAccept(Eo(kIdentity, key_), &c, &a);
  EXPECT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->peer_identity(), kIdentity);
}

// A connector that holds a key refuses a listener that authenticates nobody: a stranger who
// took the server's address cannot pose as the server by skipping the check.
TEST_P(HandshakeAuthTest, AConnectorWithAKeyRefusesAListenerThatProvesNothing) {
  auto open = target_->Listen(provider_ == "shm"     ? ""
                              : provider_ == "verbs" ? "192.168.77.2:0"
                                                     : "127.0.0.1:0");
  ASSERT_TRUE(open.ok()) << open.status();
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  std::thread t([&] { c = initiator_->Connect((*open)->address(), icq_.get(), Eo(kIdentity, key_)); });
  auto a = (*open)->Accept(tcq_.get(), Eo("", ""), milliseconds(3000));
  t.join();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status();
  EXPECT_FALSE(a.ok());
}

// Silent strangers never hold a zero-timeout Accept (the server's apply thread calls it every
// iteration), are evicted beyond the per-source limit, and do not keep the member out. Before,
// each silent connection held Accept for a second: 100 of them, 100 s.
TEST_P(HandshakeAuthTest, SilentStrangersNeverHoldAZeroTimeoutAccept) {
  constexpr int kSilent = 100;
  std::vector<int> silent;
  for (int i = 0; i < kSilent; ++i) {
    const int fd = RawConnect(provider_, listener_->address());
    ASSERT_GE(fd, 0) << "raw connect " << i;
    silent.push_back(fd);
  }
  const auto t0 = Clock::now();
  for (int i = 0; i < 20; ++i) {
    auto a = listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(0));
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kDeadlineExceeded) << a.status();
  }
  const double ms =
      std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::printf("[          ] %s: 20 zero-timeout Accepts with %d silent peers took %.1f ms\n",
              provider_.c_str(), kSilent, ms);
  EXPECT_LT(ms, 2000.0) << "Accept waited on silent peers";
  EXPECT_GE(listener_->gate_stats().evicted, static_cast<uint64_t>(kSilent - 8));

  // The member connects while the listener is polled the way a server polls it.
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  std::thread t([&] {
    c = initiator_->Connect(listener_->address(), icq_.get(), Eo(kIdentity, key_));
  });
  StatusOr<std::unique_ptr<Endpoint>> a = DeadlineExceededError("never accepted");
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    a = listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(0));
    if (a.ok()) break;
    std::this_thread::sleep_for(milliseconds(1));
  }
  t.join();
  for (int fd : silent) close(fd);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->peer_identity(), kIdentity);
}

// A member whose answer has arrived is never evicted to make room for newcomers, however many
// arrive from its own source before the listener is next polled: the gate reads what has
// answered before it admits anything, and reads a candidate once more before evicting it.
// Before, a burst of 8 connections from the member's source between its answer and the next
// Accept evicted it (the attacker review measured 18 of 20 member handshakes lost to 16
// sources).
TEST_P(HandshakeAuthTest, AnAnsweredMemberSurvivesABurstFromItsOwnSource) {
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  std::thread t([&] {
    c = initiator_->Connect(listener_->address(), icq_.get(), Eo(kIdentity, key_));
  });
  // Admit the member (its challenge goes out), then let it answer while nobody polls.
  StatusOr<std::unique_ptr<Endpoint>> first = DeadlineExceededError("not yet");
  const auto admitted_by = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < admitted_by) {
    first = listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(0));
    if (first.ok() || first.status().message().find("(1 pending)") != std::string::npos) break;
    std::this_thread::sleep_for(milliseconds(1));
  }
  std::this_thread::sleep_for(milliseconds(200));  // the member's answer is in its socket now
  std::vector<int> burst;
  for (int i = 0; i < 40; ++i) burst.push_back(RawConnect(provider_, listener_->address()));
  StatusOr<std::unique_ptr<Endpoint>> a = std::move(first);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!a.ok() && Clock::now() < deadline) {
    a = listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(0));
    if (!a.ok()) std::this_thread::sleep_for(milliseconds(1));
  }
  t.join();
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->peer_identity(), kIdentity);
  // The burst itself is held to the per-source limit (16 newcomers per call at most).
  for (int i = 0; i < 4; ++i) (void)listener_->Accept(tcq_.get(), Eo("", ""), milliseconds(0));
  for (int fd : burst) {
    if (fd >= 0) close(fd);
  }
  EXPECT_EQ(listener_->gate_stats().evicted, 32u) << "the burst was not held to 8 per source";
}

// A TCP relay between a connector and a listener that records what crosses it and may rewrite
// the listener's first bytes (its challenge): a wire tap and a man in the middle.
class Relay {
 public:
  explicit Relay(std::string target, bool strip_tls_flag = false)
      : target_(std::move(target)), strip_(strip_tls_flag) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    listen(fd_, 4);
    socklen_t len = sizeof(sa);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    address_ = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
    thread_ = std::thread([this] { Run(); });
  }
  ~Relay() {
    stop_ = true;
    thread_.join();
    close(fd_);
  }
  const std::string& address() const { return address_; }
  // What the connector sent (after the relay is destroyed, or when the test is done with it).
  std::string upstream() const {
    MutexLock l(&mu_);
    return up_;
  }

 private:
  void Run() {
    pollfd p{fd_, POLLIN, 0};
    while (!stop_ && poll(&p, 1, 50) <= 0) {
    }
    if (stop_) return;
    const int a = accept(fd_, nullptr, nullptr);
    const int b = RawConnect("tcp", target_);
    size_t down = 0;  // bytes relayed listener -> connector
    char buf[65536];
    while (!stop_ && a >= 0 && b >= 0) {
      pollfd ps[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(ps, 2, 50) <= 0) continue;
      if (ps[0].revents) {
        const ssize_t n = recv(a, buf, sizeof(buf), 0);
        if (n <= 0) break;
        {
          MutexLock l(&mu_);
          up_.append(buf, static_cast<size_t>(n));
        }
        if (send(b, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
      }
      if (ps[1].revents) {
        const ssize_t n = recv(b, buf, sizeof(buf), 0);
        if (n <= 0) break;
        // The challenge's flags are bytes 6..7 of the stream: clear kFlagTcpTls.
        if (strip_ && down <= 6 && down + static_cast<size_t>(n) > 6) {
          buf[6 - down] = static_cast<char>(buf[6 - down] & ~auth::kFlagTcpTls);
        }
        down += static_cast<size_t>(n);
        if (send(a, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
      }
    }
    if (a >= 0) close(a);
    if (b >= 0) close(b);
  }

  const std::string target_;
  const bool strip_;
  int fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable Mutex mu_;
  std::string up_ GUARDED_BY(mu_);
};

// The tcp data path with TLS on (FabricOptions::tcp_tls on the listener; the connector follows
// the listener's authenticated requirement).
class TcpTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto key = crypto::RandomBytes(32);
    ASSERT_TRUE(key.ok());
    key_ = *key;
  }
  // A listener fabric (TLS as given) with the one-member authenticator, and a connector fabric.
  void Open(bool listener_tls, bool connector_tls) {
    FabricOptions o;
    o.provider = "tcp";
    o.bind_ip = "127.0.0.1";
    o.tcp_tls = listener_tls;
    auto t = Fabric::Open(o);
    ASSERT_TRUE(t.ok()) << t.status();
    target_ = std::move(*t);
    o.tcp_tls = connector_tls;
    auto i = Fabric::Open(o);
    ASSERT_TRUE(i.ok()) << i.status();
    initiator_ = std::move(*i);
    auto tcq = target_->CreateCompletionQueue(1024);
    auto icq = initiator_->CreateCompletionQueue(1024);
    ASSERT_TRUE(tcq.ok() && icq.ok());
    tcq_ = std::move(*tcq);
    icq_ = std::move(*icq);
    auto l = target_->Listen("127.0.0.1:0");
    ASSERT_TRUE(l.ok()) << l.status();
    listener_ = std::move(*l);
    listener_->set_authenticator(std::make_shared<OneMemberAuthenticator>(key_));
  }
  EndpointOptions Eo(bool keyed) const {
    EndpointOptions eo;
    eo.send_depth = 16;
    eo.recv_depth = 16;
    eo.connect_timeout = milliseconds(10000);
    if (keyed) {
      eo.auth_identity = kIdentity;
      eo.auth_key = key_;
    }
    return eo;
  }
  void ConnectAndAccept(const std::string& address, StatusOr<std::unique_ptr<Endpoint>>* c,
                        StatusOr<std::unique_ptr<Endpoint>>* a) {
    std::thread t([&] { *c = initiator_->Connect(address, icq_.get(), Eo(true)); });
    *a = listener_->Accept(tcq_.get(), Eo(false), milliseconds(10000));
    t.join();
  }
  // Writes `n` patterned bytes through c into a fresh target region, reads them back, and
  // checks both; returns the pattern.
  std::string WriteAndReadBack(Endpoint* c, size_t n) {
    auto remote = target_->AllocateMemory(n, Access::kRemoteReadWrite);
    auto local = initiator_->AllocateMemory(2 * n, Access::kLocalOnly);
    EXPECT_TRUE(remote.ok() && local.ok());
    if (!remote.ok() || !local.ok()) return "";
    auto* src = static_cast<uint8_t*>((*local)->data());
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>("SHARDPS-PLAINTEXT-"[i % 18]);
    EXPECT_TRUE(c->PostWrite({local->get(), 0, n}, AtOffset((*remote)->descriptor(), 0), 1).ok());
    EXPECT_TRUE(c->PostRead({local->get(), n, n}, AtOffset((*remote)->descriptor(), 0), 2).ok());
    Completion wc[4];
    int got = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (got < 2 && Clock::now() < deadline) {
      const int k = icq_->Wait(wc + got, 4 - got, std::chrono::microseconds(1000));
      for (int i = got; i < got + k; ++i) EXPECT_TRUE(wc[i].ok()) << WcStatusName(wc[i].status);
      got += k;
    }
    EXPECT_EQ(got, 2);
    EXPECT_EQ(std::memcmp((*remote)->data(), src, n), 0) << "the write did not arrive intact";
    EXPECT_EQ(std::memcmp(src + n, src, n), 0) << "the read did not return the bytes";
    return std::string(reinterpret_cast<const char*>(src), 64);
  }

  std::string key_;
  std::unique_ptr<Fabric> target_, initiator_;
  std::unique_ptr<CompletionQueue> tcq_, icq_;
  std::unique_ptr<Listener> listener_;
};

// With TLS the bytes arrive intact and what crosses the wire is ciphertext; without it, the same
// tap sees the plaintext (so the tap would have caught a leak).
TEST_F(TcpTlsTest, DataArrivesAndTheWireCarriesOnlyCiphertext) {
  for (bool tls : {false, true}) {
    SCOPED_TRACE(tls ? "tls" : "plain");
    ASSERT_NO_FATAL_FAILURE(Open(tls, false));
    std::string pattern, wire;
    {
      Relay tap(listener_->address());
      StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
      StatusOr<std::unique_ptr<Endpoint>> a = InternalError("not run");
      ConnectAndAccept(tap.address(), &c, &a);
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ((*c)->DebugString().rfind(tls ? "tcp+tls:" : "tcp:", 0), 0u)
          << (*c)->DebugString();
      pattern = WriteAndReadBack(c->get(), 1 << 20);
      wire = tap.upstream();
    }
    EXPECT_GT(wire.size(), size_t{1} << 20);
    const bool visible = wire.find(pattern) != std::string::npos;
    EXPECT_EQ(visible, !tls) << (tls ? "plaintext crossed the wire under TLS"
                                     : "the tap did not see the plaintext (a broken tap)");
  }
}

// A man in the middle that clears the listener's TLS requirement in the challenge makes both
// proofs fail (the flags are in the MACs): the connection is refused, never downgraded.
TEST_F(TcpTlsTest, TheTlsRequirementCannotBeStripped) {
  ASSERT_NO_FATAL_FAILURE(Open(true, false));
  Relay mitm(listener_->address(), /*strip_tls_flag=*/true);
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  StatusOr<std::unique_ptr<Endpoint>> a = InternalError("not run");
  ConnectAndAccept(mitm.address(), &c, &a);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status();
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kPermissionDenied) << a.status();
}

// A connector that requires TLS refuses a listener without it, with the reason.
TEST_F(TcpTlsTest, AConnectorThatRequiresTlsRefusesAPlainListener) {
  ASSERT_NO_FATAL_FAILURE(Open(false, true));
  StatusOr<std::unique_ptr<Endpoint>> c = InternalError("not run");
  std::thread t([&] { c = initiator_->Connect(listener_->address(), icq_.get(), Eo(true)); });
  auto a = listener_->Accept(tcq_.get(), Eo(false), milliseconds(3000));
  t.join();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status();
  EXPECT_NE(c.status().message().find("TLS"), std::string::npos) << c.status();
}

INSTANTIATE_TEST_SUITE_P(Providers, HandshakeAuthTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });
#ifdef SHARDPS_HAVE_VERBS
INSTANTIATE_TEST_SUITE_P(Verbs, HandshakeAuthTest, ::testing::Values("verbs"),
                         [](const auto& info) { return info.param; });
#endif

}  // namespace
}  // namespace shardps::transport
