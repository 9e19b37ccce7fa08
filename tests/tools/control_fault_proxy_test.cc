// control_fault_proxy (tests/tools/fault_proxy.h) on real sockets: byte-identical passthrough,
// delays that keep order, seeded drops, dropped heartbeats getting a member declared dead by a
// real coordinator, malformed input, the blackhole, and the binary itself.
#include "tests/tools/fault_proxy.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "proto/control_client.h"
#include "server/coordinator.h"
#include "tests/integration/child_process.h"

namespace shardps::tools {
namespace {

using control::EncodeFrame;
using control::Envelope;
using control::kMagic;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::string Frame(const Envelope& e) {
  auto f = EncodeFrame(e);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : std::string();
}

Envelope Heartbeat(uint64_t seq) {
  Envelope e;
  e.mutable_heartbeat()->set_member_id(1);
  e.mutable_heartbeat()->set_epoch(seq);
  return e;
}

Envelope ErrorMsg(const std::string& m) {
  Envelope e;
  e.mutable_error()->set_message(m);
  return e;
}

// Reads one side of a connection on its own thread, so arrival times are taken when the bytes
// arrive: the raw bytes, and each whole frame with its arrival time.
class Recorder {
 public:
  struct Arrival {
    Clock::time_point at;
    Envelope env;
  };
  Recorder(int fd, bool expect_magic) : fd_(fd), magic_left_(expect_magic ? kMagic.size() : 0) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Recorder() {
    stop_ = true;
    thread_.join();
  }
  // Waits until at least n frames arrived (or EOF, or the timeout); returns a copy.
  std::vector<Arrival> WaitFrames(size_t n, milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, timeout, [&] { return frames_.size() >= n || eof_; });
    return frames_;
  }
  bool WaitEof(milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] { return eof_; });
  }
  std::string raw() {
    std::lock_guard<std::mutex> l(mu_);
    return raw_;
  }
  size_t frames() {
    std::lock_guard<std::mutex> l(mu_);
    return frames_.size();
  }

 private:
  void Run() {
    control::FrameDecoder d;
    char buf[64 << 10];
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const ssize_t k = recv(fd_, buf, sizeof(buf), 0);
      const auto now = Clock::now();
      std::lock_guard<std::mutex> l(mu_);
      if (k <= 0) {
        eof_ = true;
        cv_.notify_all();
        return;
      }
      raw_.append(buf, static_cast<size_t>(k));
      size_t off = std::min<size_t>(magic_left_, static_cast<size_t>(k));
      magic_left_ -= off;
      d.Feed(buf + off, static_cast<size_t>(k) - off);
      Envelope e;
      while (true) {
        auto got = d.Next(&e);
        if (!got.ok() || !*got) break;
        frames_.push_back({now, e});
      }
      cv_.notify_all();
    }
  }

  const int fd_;
  size_t magic_left_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::string raw_;
  std::vector<Arrival> frames_;
  bool eof_ = false;
  std::thread thread_;
};

// A stand-in coordinator: accepts the proxy's upstream connection.
struct FakeUpstream {
  UniqueFd listen;
  std::string address;
  FakeUpstream() {
    auto l = net::ListenTcp("127.0.0.1:0", &address);
    EXPECT_TRUE(l.ok()) << l.status();
    if (l.ok()) listen = std::move(*l);
  }
  UniqueFd Accept() {
    auto fd = net::AcceptTcp(listen.get(), milliseconds(3000));
    EXPECT_TRUE(fd.ok()) << fd.status();
    return fd.ok() ? std::move(*fd) : UniqueFd();
  }
};

std::unique_ptr<FaultProxy> StartProxy(FaultProxyOptions o) {
  auto p = FaultProxy::Start(o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

UniqueFd Dial(const std::string& address) {
  auto fd = net::ConnectTcp(address, "", milliseconds(3000));
  EXPECT_TRUE(fd.ok()) << fd.status();
  return fd.ok() ? std::move(*fd) : UniqueFd();
}

void Send(int fd, const std::string& bytes) {
  ASSERT_TRUE(net::SendAll(fd, bytes.data(), bytes.size(), milliseconds(3000)).ok());
}

TEST(ControlFaultProxyTest, ZeroPercentForwardsEverythingByteIdentical) {
  FakeUpstream up;
  FaultProxyOptions o;
  o.upstream = up.address;
  auto proxy = StartProxy(o);
  ASSERT_TRUE(proxy);
  UniqueFd member = Dial(proxy->address());
  UniqueFd coord = up.Accept();
  ASSERT_TRUE(member.valid() && coord.valid());
  Recorder at_coord(coord.get(), true), at_member(member.get(), false);

  // Up: the magic, 200 heartbeats, a 1 MiB frame, a join; sent in odd-sized pieces.
  std::string stream(kMagic);
  for (int i = 0; i < 200; ++i) stream += Frame(Heartbeat(i));
  stream += Frame(ErrorMsg(std::string(1 << 20, 'x')));
  Envelope join;
  join.mutable_join()->set_cluster_token("t");
  join.mutable_join()->set_hostname("h");
  stream += Frame(join);
  for (size_t off = 0; off < stream.size(); off += 777) {
    Send(member.get(), stream.substr(off, 777));
  }
  // Down: membership and a shard map.
  Envelope m;
  m.mutable_membership()->set_epoch(3);
  m.mutable_membership()->add_members()->set_member_id(1);
  Envelope sm;
  sm.mutable_shard_map()->set_epoch(3);
  sm.mutable_shard_map()->add_chunks()->set_bytes(4096);
  const std::string down = Frame(m) + Frame(sm);
  Send(coord.get(), down);

  EXPECT_EQ(at_coord.WaitFrames(202, milliseconds(5000)).size(), 202u);
  EXPECT_EQ(at_member.WaitFrames(2, milliseconds(5000)).size(), 2u);
  EXPECT_EQ(at_coord.raw(), stream);
  EXPECT_EQ(at_member.raw(), down);
  const FaultProxyCounters c = proxy->counters();
  EXPECT_EQ(c.by_body.at("heartbeat").forwarded, 200u);
  EXPECT_EQ(c.by_body.at("error").forwarded, 1u);
  EXPECT_EQ(c.by_body.at("join").forwarded, 1u);
  EXPECT_EQ(c.by_body.at("membership").forwarded, 1u);
  EXPECT_EQ(c.by_body.at("shard_map").forwarded, 1u);
  EXPECT_EQ(c.Total().dropped + c.Total().delayed + c.Total().blackholed, 0u);
  EXPECT_EQ(c.connections, 1u);
  EXPECT_EQ(c.malformed, 0u);
}

TEST(ControlFaultProxyTest, DelayKeepsOrderAndDelaysByAtLeastTheDelay) {
  // Long enough that "the first error was not delayed" (below) holds with a second of room for
  // a descheduled proxy thread; the delays of the 4 heartbeats overlap, so the test takes ~1 s.
  constexpr int kDelayMs = 1000;
  FakeUpstream up;
  FaultProxyOptions o;
  o.upstream = up.address;
  o.delay_ms = kDelayMs;
  o.delay_percent = 100;
  o.only = "heartbeat";
  auto proxy = StartProxy(o);
  ASSERT_TRUE(proxy);
  UniqueFd member = Dial(proxy->address());
  UniqueFd coord = up.Accept();
  Recorder at_coord(coord.get(), true);
  Send(member.get(), std::string(kMagic));
  // error 0, heartbeat 1, error 2, heartbeat 3, ...: only heartbeats are delayed, but an error
  // behind a delayed heartbeat waits for it.
  constexpr int kFrames = 8;
  std::vector<Clock::time_point> sent;
  for (int i = 0; i < kFrames; ++i) {
    sent.push_back(Clock::now());
    Send(member.get(), Frame(i % 2 ? Heartbeat(i) : ErrorMsg(std::to_string(i))));
    std::this_thread::sleep_for(milliseconds(10));
  }
  auto got = at_coord.WaitFrames(kFrames, milliseconds(5000));
  ASSERT_EQ(got.size(), static_cast<size_t>(kFrames));
  for (int i = 0; i < kFrames; ++i) {
    const Envelope& e = got[i].env;
    // In order.
    if (i % 2) {
      ASSERT_TRUE(e.has_heartbeat()) << i;
      EXPECT_EQ(e.heartbeat().epoch(), static_cast<uint64_t>(i));
      EXPECT_GE(got[i].at - sent[i], milliseconds(kDelayMs)) << "heartbeat " << i;
    } else {
      ASSERT_TRUE(e.has_error()) << i;
      EXPECT_EQ(e.error().message(), std::to_string(i));
    }
    if (i > 0) {
      EXPECT_GE(got[i].at, got[i - 1].at);
    }
  }
  // The first error had nothing delayed before it: not delayed.
  EXPECT_LT(got[0].at - sent[0], milliseconds(kDelayMs));
  const FaultProxyCounters c = proxy->counters();
  EXPECT_EQ(c.by_body.at("heartbeat").delayed, 4u);
  EXPECT_EQ(c.by_body.at("heartbeat").forwarded, 4u);
  EXPECT_EQ(c.by_body.at("error").delayed, 0u);
  EXPECT_EQ(c.by_body.at("error").forwarded, 4u);
}

// 50% drops with a seed: some but not all arrive, in order, and the same seed drops the same
// frames again.
TEST(ControlFaultProxyTest, SeededDropsAreReproducible) {
  auto run = [](uint64_t seed) {
    FakeUpstream up;
    FaultProxyOptions o;
    o.upstream = up.address;
    o.drop_percent = 50;
    o.seed = seed;
    auto proxy = StartProxy(o);
    UniqueFd member = Dial(proxy->address());
    UniqueFd coord = up.Accept();
    Recorder at_coord(coord.get(), true);
    std::string s(kMagic);
    for (int i = 0; i < 100; ++i) s += Frame(Heartbeat(i));
    Send(member.get(), s);
    // Wait until the proxy has counted all 100, then for the forwarded ones to arrive.
    const auto deadline = Clock::now() + milliseconds(5000);
    FaultProxyCounters c;
    do {
      c = proxy->counters();
      if (c.by_body.count("heartbeat") &&
          c.by_body["heartbeat"].forwarded + c.by_body["heartbeat"].dropped == 100) {
        break;
      }
      std::this_thread::sleep_for(milliseconds(10));
    } while (Clock::now() < deadline);
    const auto got = at_coord.WaitFrames(c.by_body["heartbeat"].forwarded, milliseconds(3000));
    std::vector<uint64_t> seqs;
    for (const auto& a : got) seqs.push_back(a.env.heartbeat().epoch());
    EXPECT_EQ(seqs.size(), c.by_body["heartbeat"].forwarded);
    EXPECT_EQ(c.by_body["heartbeat"].dropped, 100 - seqs.size());
    return seqs;
  };
  const auto a = run(7), b = run(7), other = run(8);
  EXPECT_GT(a.size(), 25u);
  EXPECT_LT(a.size(), 75u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
}

// A real coordinator: with every heartbeat dropped, the member is declared dead after the
// heartbeat timeout (not before); through a clean proxy it stays.
TEST(ControlFaultProxyTest, DroppedHeartbeatsGetTheMemberDeclaredDead) {
  constexpr int kTimeoutMs = 600;
  control::CoordinatorOptions co;
  co.listen_address = "127.0.0.1:0";
  co.cluster_token = "tok";
  co.config.set_heartbeat_interval_ms(100);
  co.config.set_heartbeat_timeout_ms(kTimeoutMs);
  for (const double drop : {0.0, 100.0}) {
    SCOPED_TRACE("drop " + std::to_string(drop));
    auto coord = control::Coordinator::Start(co);
    ASSERT_TRUE(coord.ok()) << coord.status();
    FaultProxyOptions o;
    o.upstream = (*coord)->address();
    o.drop_percent = drop;
    o.only = "heartbeat";
    o.direction = ProxyDirection::kUp;
    auto proxy = StartProxy(o);
    ASSERT_TRUE(proxy);
    control::ControlClientOptions cl;
    cl.coordinator_address = proxy->address();
    cl.cluster_token = "tok";
    cl.join.set_role(control::ROLE_WORKER);
    cl.join.set_hostname("h");
    cl.join.set_requested_rank(-1);
    // Declared dead is final here: no rejoin attempt (a rejoin would be refused anyway, but it
    // would be one more join through the proxy).
    cl.rejoin_window = milliseconds(0);
    const auto joined_at = Clock::now();
    auto member = control::ControlClient::Join(cl);
    ASSERT_TRUE(member.ok()) << member.status();
    for (int i = 0; i < 200 && (*coord)->membership().members_size() != 1; ++i) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    ASSERT_EQ((*coord)->membership().members_size(), 1);
    if (drop == 0) {
      // Heartbeats through the proxy keep the member alive: at least 5 forwarded (polled, not
      // assumed after a fixed sleep: a loaded host may deschedule the client), none missed.
      std::this_thread::sleep_for(milliseconds(2 * kTimeoutMs));
      for (int i = 0; i < 2000 && proxy->counters().by_body["heartbeat"].forwarded < 5; ++i) {
        std::this_thread::sleep_for(milliseconds(5));
      }
      EXPECT_EQ((*coord)->counters().heartbeat_timeouts, 0u);
      EXPECT_EQ((*coord)->membership().members_size(), 1);
      EXPECT_GE(proxy->counters().by_body["heartbeat"].forwarded, 5u);
      continue;
    }
    // The member is declared dead at its lease (3 x the timeout here, as the join reply says),
    // counted from the last frame the coordinator had from it, which came after joined_at.
    const milliseconds lease((*member)->reply().config().lease_ms());
    ASSERT_GE(lease, milliseconds(kTimeoutMs));
    while ((*coord)->counters().heartbeat_timeouts == 0 &&
           Clock::now() - joined_at < lease + milliseconds(6000)) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    const auto dead_after = Clock::now() - joined_at;
    // The timeout is counted first; the departure and the new membership follow on the
    // coordinator's loop thread a moment later.
    for (int i = 0; i < 200 && ((*coord)->counters().departures == 0 ||
                                (*coord)->membership().members_size() != 0);
         ++i) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    const control::CoordinatorCounters cc = (*coord)->counters();
    EXPECT_EQ(cc.heartbeat_timeouts, 1u);
    EXPECT_EQ(cc.departures, 1u);
    EXPECT_GE(dead_after, lease);
    // Bounded, with room for a descheduled coordinator loop (the test polls every 5 ms).
    EXPECT_LT(dead_after, lease + milliseconds(5000));
    EXPECT_EQ((*coord)->membership().members_size(), 0);
    FaultProxyCounters pc = proxy->counters();
    EXPECT_EQ(pc.by_body["heartbeat"].forwarded, 0u);
    EXPECT_GE(pc.by_body["heartbeat"].dropped, 3u);
    EXPECT_EQ(pc.by_body["join"].forwarded, 1u);
    EXPECT_EQ(pc.by_body["join_reply"].forwarded, 1u);  // downstream untouched
  }
}

TEST(ControlFaultProxyTest, MalformedInputClosesThatPairOnly) {
  FakeUpstream up;
  FaultProxyOptions o;
  o.upstream = up.address;
  auto proxy = StartProxy(o);
  ASSERT_TRUE(proxy);
  // A bad magic from a member.
  UniqueFd bad = Dial(proxy->address());
  UniqueFd bad_up = up.Accept();
  Recorder bad_member(bad.get(), false), bad_coord(bad_up.get(), true);
  Send(bad.get(), "SHPSCTL2" + Frame(Heartbeat(1)));
  EXPECT_TRUE(bad_member.WaitEof(milliseconds(3000)));
  EXPECT_TRUE(bad_coord.WaitEof(milliseconds(3000)));
  EXPECT_EQ(bad_coord.raw(), "");  // nothing of it was forwarded
  // A zero-length frame from the coordinator side.
  UniqueFd m2 = Dial(proxy->address());
  UniqueFd u2 = up.Accept();
  Recorder r2(m2.get(), false);
  Send(u2.get(), Frame(ErrorMsg("ok")) + std::string(4, '\0'));
  EXPECT_TRUE(r2.WaitEof(milliseconds(3000)));
  EXPECT_EQ(r2.raw(), Frame(ErrorMsg("ok")));  // the good frame before it went through
  // The proxy still serves a new pair.
  UniqueFd m3 = Dial(proxy->address());
  UniqueFd u3 = up.Accept();
  Recorder r3(u3.get(), true);
  Send(m3.get(), std::string(kMagic) + Frame(Heartbeat(5)));
  auto got = r3.WaitFrames(1, milliseconds(3000));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].env.heartbeat().epoch(), 5u);
  EXPECT_EQ(proxy->counters().malformed, 2u);
  EXPECT_EQ(proxy->counters().connections, 3u);
}

TEST(ControlFaultProxyTest, BlackholeStopsForwardingBothWaysAndHeals) {
  FakeUpstream up;
  FaultProxyOptions o;
  o.upstream = up.address;
  auto proxy = StartProxy(o);
  ASSERT_TRUE(proxy);
  UniqueFd member = Dial(proxy->address());
  UniqueFd coord = up.Accept();
  Recorder at_coord(coord.get(), true), at_member(member.get(), false);
  Send(member.get(), std::string(kMagic) + Frame(Heartbeat(1)));
  ASSERT_EQ(at_coord.WaitFrames(1, milliseconds(3000)).size(), 1u);

  proxy->SetBlackhole(true);
  Send(member.get(), Frame(Heartbeat(2)));
  Send(coord.get(), Frame(ErrorMsg("lost")));
  // Both frames reached the proxy and were swallowed (polled: the proxy thread may be late),
  // and neither came out.
  for (int i = 0; i < 1000 && proxy->counters().Total().blackholed < 2; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(proxy->counters().Total().blackholed, 2u);
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(at_coord.frames(), 1u);
  EXPECT_EQ(at_member.frames(), 0u);

  proxy->SetBlackhole(false);
  Send(member.get(), Frame(Heartbeat(3)));
  Send(coord.get(), Frame(ErrorMsg("after")));
  auto up_frames = at_coord.WaitFrames(2, milliseconds(3000));
  auto down_frames = at_member.WaitFrames(1, milliseconds(3000));
  ASSERT_EQ(up_frames.size(), 2u);
  EXPECT_EQ(up_frames[1].env.heartbeat().epoch(), 3u);  // 2 was lost in the blackhole
  ASSERT_EQ(down_frames.size(), 1u);
  EXPECT_EQ(down_frames[0].env.error().message(), "after");
}

// The binary: flags, --port_file, forwarding, the counters printed on SIGTERM, --help.
TEST(ControlFaultProxyTest, BinaryForwardsAndPrintsCountersOnSigterm) {
  FakeUpstream up;
  const std::string dir = ::testing::TempDir() + "cfp-" + std::to_string(getpid());
  ASSERT_EQ(system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  auto child = testing_util::ChildProcess::Spawn(
      {CONTROL_FAULT_PROXY_BIN, "--upstream=" + up.address, "--port_file=" + dir + "/port",
       "--drop_percent=100", "--only=heartbeat", "--seed=3"},
      dir + "/log", std::chrono::seconds(30));
  ASSERT_TRUE(child.ok()) << child.status();
  auto addr = testing_util::WaitForFile(dir + "/port", milliseconds(5000), child->get());
  ASSERT_TRUE(addr.ok()) << addr.status() << (*child)->LogTail();
  while (!addr->empty() && addr->back() == '\n') addr->pop_back();
  UniqueFd member = Dial(*addr);
  UniqueFd coord = up.Accept();
  Recorder at_coord(coord.get(), true);
  Send(member.get(),
       std::string(kMagic) + Frame(Heartbeat(1)) + Frame(ErrorMsg("e")) + Frame(Heartbeat(2)));
  auto got = at_coord.WaitFrames(1, milliseconds(3000));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].env.error().message(), "e");
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(at_coord.frames(), 1u);
  // `timeout` (the child's wrapper) passes SIGTERM on to the proxy.
  ASSERT_EQ(kill((*child)->pid(), SIGTERM), 0);
  auto code = (*child)->Wait(milliseconds(5000));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << (*child)->LogTail();
  const std::string log = (*child)->LogTail(100000);
  EXPECT_NE(log.find("[final]"), std::string::npos) << log;
  EXPECT_NE(log.find("heartbeat: forwarded 0 dropped 2 delayed 0 blackholed 0"), std::string::npos)
      << log;
  EXPECT_NE(log.find("error: forwarded 1 dropped 0"), std::string::npos) << log;

  auto help = testing_util::ChildProcess::Spawn({CONTROL_FAULT_PROXY_BIN, "--help"}, dir + "/help",
                                                std::chrono::seconds(10));
  ASSERT_TRUE(help.ok());
  const std::optional<int> help_code = (*help)->Wait(milliseconds(5000));
  ASSERT_TRUE(help_code.has_value());
  EXPECT_EQ(*help_code, 0);
  const std::string h = (*help)->LogTail(100000);
  for (const char* flag : {"--drop_percent", "--delay_ms", "--delay_percent", "--seed", "--only",
                           "--direction", "--blackhole_after_ms", "--stats"}) {
    EXPECT_NE(h.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace shardps::tools
