// The coordinator against real sockets: auth, membership epochs, heartbeats, hostile input.
#include <sys/socket.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "common/stall_point.h"
#include "proto/control_client.h"
#include "proto/credentials.h"
#include "server/coordinator.h"

namespace shardps::control {
namespace {

using std::chrono::milliseconds;

constexpr char kToken[] = "s3cret";

CoordinatorOptions Options(int hb_ms = 50, int timeout_ms = 400) {
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.cluster_token = kToken;
  o.config.set_mode(SSP);
  o.config.set_staleness(2);
  o.config.set_heartbeat_interval_ms(hb_ms);
  o.config.set_heartbeat_timeout_ms(timeout_ms);
  o.handshake_timeout = milliseconds(500);
  return o;
}

std::unique_ptr<Coordinator> StartCoordinator(const CoordinatorOptions& o) {
  auto c = Coordinator::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

std::unique_ptr<Coordinator> StartCoordinator(int hb_ms = 50, int timeout_ms = 400) {
  return StartCoordinator(Options(hb_ms, timeout_ms));
}

ControlClientOptions ClientOptions(const Coordinator& c, Role role, const std::string& token) {
  ControlClientOptions o;
  o.coordinator_address = c.address();
  o.cluster_token = token;
  o.join.set_role(role);
  o.join.set_hostname("test");
  o.join.set_pid(42);
  o.join.set_requested_rank(-1);
  o.connect_timeout = milliseconds(3000);
  return o;
}

TEST(CoordinatorTest, JoinWithWrongTokenIsRefused) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  auto bad = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, "guess"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(bad.status().message().find("token"), std::string::npos);
  EXPECT_EQ(c->counters().joins_refused, 1u);
  EXPECT_EQ(c->membership().members_size(), 0);
}

TEST(CoordinatorTest, MembersGetRanksConfigAndEpochs) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  auto s0 = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  ASSERT_TRUE(s0.ok()) << s0.status();
  auto w0 = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  auto w1 = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  ASSERT_TRUE(w0.ok() && w1.ok());
  EXPECT_EQ((*s0)->reply().rank(), 0u);
  EXPECT_EQ((*w0)->reply().rank(), 0u);
  EXPECT_EQ((*w1)->reply().rank(), 1u);
  EXPECT_EQ((*w1)->reply().config().mode(), SSP);
  EXPECT_EQ((*w1)->reply().config().staleness(), 2u);
  auto m =
      (*s0)->WaitFor([](const Membership& m) { return m.members_size() == 3; }, milliseconds(3000));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->epoch(), 3u);  // one epoch per join
  EXPECT_EQ(c->epoch(), 3u);
}

// A member that joins and then goes silent without closing its socket (a hung or stopped
// process): its host still acknowledges, so it is only suspected at the heartbeat timeout and
// declared dead when its lease (3 x 400 ms) runs out.
TEST(CoordinatorTest, AHungMemberIsSuspectedThenDeclaredDeadAtItsLease) {
  auto c = StartCoordinator(50, 400);
  ASSERT_TRUE(c);
  auto s0 = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  ASSERT_TRUE(s0.ok());
  auto fd = net::ConnectTcp(c->address(), "", milliseconds(2000));
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(SendMagic(fd->get(), milliseconds(1000)).ok());
  Envelope e;
  e.mutable_join()->set_cluster_token(kToken);
  e.mutable_join()->set_role(ROLE_WORKER);
  // Before the join is sent: the coordinator hears the member last when it reads the join, so
  // the lease cannot run out before t0 + lease whatever thread is descheduled.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(SendEnvelope(fd->get(), e, milliseconds(1000)).ok());
  ASSERT_TRUE(
      (*s0)
          ->WaitFor([](const Membership& m) { return m.members_size() == 2; }, milliseconds(3000))
          .ok());
  auto after =
      (*s0)->WaitFor([](const Membership& m) { return m.members_size() == 1; }, milliseconds(8000));
  ASSERT_TRUE(after.ok()) << after.status();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, milliseconds(1200)) << "not before its lease";
  EXPECT_LE(took, milliseconds(1200 + 5000)) << "bound: lease + slack for a loaded host";
  EXPECT_EQ(after->departed_size(), 1);
  const CoordinatorCounters k = c->counters();
  EXPECT_EQ(k.heartbeat_timeouts, 1u);
  EXPECT_EQ(k.suspicions, 1u) << "suspected first";
  EXPECT_EQ(k.unreachable, 0u) << "its host (loopback) acknowledged the probes";
  // The live member kept heartbeating and was never suspected.
  EXPECT_TRUE((*s0)->status().ok());
  EXPECT_EQ(k.suspicions_cleared, 0u);
}

// A member silent for twice the heartbeat timeout but less than its lease (a process
// descheduled on a busy host) is suspected, speaks again, and stays a member: slow, not dead.
TEST(CoordinatorTest, ASlowMemberIsSuspectedButNotDeclaredDead) {
  // Heartbeats every 100 ms, suspected after 1 s of silence, lease 3 s; the test thread is the
  // member, so a second of descheduling on a loaded host is still neither a second suspicion
  // nor a departure.
  auto c = StartCoordinator(100, 1000);
  ASSERT_TRUE(c);
  auto fd = net::ConnectTcp(c->address(), "", milliseconds(2000));
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(SendMagic(fd->get(), milliseconds(1000)).ok());
  Envelope join;
  join.mutable_join()->set_cluster_token(kToken);
  join.mutable_join()->set_role(ROLE_WORKER);
  ASSERT_TRUE(SendEnvelope(fd->get(), join, milliseconds(1000)).ok());
  FrameDecoder decoder;
  auto reply = ReceiveEnvelope(fd->get(), &decoder, milliseconds(2000));
  ASSERT_TRUE(reply.ok() && reply->has_join_reply() && reply->join_reply().accepted());
  const uint32_t id = reply->join_reply().member_id();
  uint64_t seq = 0;
  auto beat = [&](int n) {
    for (int i = 0; i < n; ++i) {
      Envelope hb;
      hb.mutable_heartbeat()->set_member_id(id);
      hb.mutable_heartbeat()->set_seq(++seq);
      ASSERT_TRUE(SendEnvelope(fd->get(), hb, milliseconds(1000)).ok());
      std::this_thread::sleep_for(milliseconds(100));
    }
  };
  beat(10);
  std::this_thread::sleep_for(milliseconds(2000));  // 2 x the timeout, 2/3 of the lease
  beat(10);
  const CoordinatorCounters k = c->counters();
  EXPECT_EQ(k.suspicions, 1u);
  EXPECT_EQ(k.suspicions_cleared, 1u);
  EXPECT_EQ(k.heartbeat_timeouts, 0u);
  EXPECT_EQ(k.departures, 0u);
  EXPECT_EQ(c->membership().members_size(), 1);
  // Every heartbeat was acknowledged with the lease (and the suspicion sent probes, seq 0).
  int acks = 0, probes = 0;
  const auto drain_until = std::chrono::steady_clock::now() + milliseconds(5000);
  // Until all 20 came (bounded), then 200 ms more: no acknowledgement beyond the 20.
  while (std::chrono::steady_clock::now() < drain_until) {
    auto e = ReceiveEnvelope(fd->get(), &decoder, milliseconds(200));
    if (!e.ok()) {
      if (acks >= 20 || e.status().code() != StatusCode::kDeadlineExceeded) break;
      continue;
    }
    if (!e->has_heartbeat_ack()) continue;
    if (e->heartbeat_ack().seq() == 0) {
      ++probes;
    } else {
      ++acks;
      EXPECT_EQ(e->heartbeat_ack().lease_ms(), 3000u);
    }
  }
  EXPECT_EQ(acks, 20);
  EXPECT_GE(probes, 1);
}

// Each acknowledged heartbeat renews the member's lease, counted from its sending; with the
// coordinator gone the lease runs out after lease_ms, not before.
TEST(CoordinatorTest, TheLeaseIsRenewedByHeartbeatsAndLapsesWithoutTheCoordinator) {
  auto c = StartCoordinator(50, 400);
  ASSERT_TRUE(c);
  ControlClientOptions o = ClientOptions(*c, ROLE_SERVER, kToken);
  auto s0 = ControlClient::Join(o);
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ((*s0)->reply().config().lease_ms(), 1200u);
  const auto until = std::chrono::steady_clock::now() + milliseconds(2000);
  while (!(*s0)->LeaseHeld() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE((*s0)->LeaseHeld());
  // Renewed meanwhile: 600 ms in, at least 10 acknowledgements, and the lease again almost
  // whole (polled: a descheduled heartbeat thread renews late, not never).
  std::this_thread::sleep_for(milliseconds(600));
  const auto renew_by = std::chrono::steady_clock::now() + milliseconds(5000);
  while (((*s0)->counters().heartbeat_acks < 10 || (*s0)->LeaseLeft() <= milliseconds(1000)) &&
         std::chrono::steady_clock::now() < renew_by) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE((*s0)->LeaseHeld());
  EXPECT_GT((*s0)->LeaseLeft(), milliseconds(1000));
  EXPECT_LE((*s0)->LeaseLeft(), milliseconds(1200));
  EXPECT_GE((*s0)->counters().heartbeat_acks, 10u);
  // stopped before left: the lease cannot lapse before stopped + left, however this thread is
  // scheduled between the two reads.
  const auto stopped = std::chrono::steady_clock::now();
  const milliseconds left =
      std::chrono::duration_cast<milliseconds>((*s0)->LeaseLeft());
  c.reset();  // the coordinator is gone: no more renewals
  const auto gone = std::chrono::steady_clock::now();
  while ((*s0)->LeaseHeld()) std::this_thread::sleep_for(milliseconds(5));
  const auto now = std::chrono::steady_clock::now();
  // Not before what was left when the coordinator went (a renewal in flight may add to it)...
  EXPECT_GE(now - stopped, left) << "the lease lapsed early";
  // ...and not held past a whole lease after the last possible renewal (plus room for a
  // descheduled poll).
  EXPECT_LE(now - gone, milliseconds(1200 + 1000)) << "the lease outlived the coordinator";
}

TEST(CoordinatorTest, ClosedConnectionLeavesImmediately) {
  auto c = StartCoordinator(50, 10000);
  ASSERT_TRUE(c);
  auto s0 = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  ASSERT_TRUE(s0.ok());
  {
    auto w = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(
        (*s0)
            ->WaitFor([](const Membership& m) { return m.members_size() == 2; }, milliseconds(3000))
            .ok());
  }  // destroyed: socket closed, as when a process dies
  auto after =
      (*s0)->WaitFor([](const Membership& m) { return m.members_size() == 1; }, milliseconds(2000));
  ASSERT_TRUE(after.ok()) << "heartbeat timeout is 10 s: EOF must be enough";
}

TEST(CoordinatorTest, HostileBytesCloseOnlyThatConnection) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  auto s0 = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  ASSERT_TRUE(s0.ok());
  const std::string attacks[] = {
      "GET / HTTP/1.1\r\n\r\n",                                      // bad magic
      std::string("SHPSCTL1") + std::string("\xff\xff\xff\x7f", 4),  // 2 GiB frame
      std::string("SHPSCTL1") + std::string("\x05\x00\x00\x00\xff\xff\xff\xff\xff", 9),
  };
  for (const std::string& a : attacks) {
    auto fd = net::ConnectTcp(c->address(), "", milliseconds(2000));
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(net::SendAll(fd->get(), a.data(), a.size(), milliseconds(1000)).ok());
    char b;
    // The coordinator closes the connection: recv sees EOF (or a reset).
    auto r = net::RecvAll(fd->get(), &b, 1, milliseconds(3000));
    EXPECT_EQ(r.code(), StatusCode::kUnavailable) << r;
  }
  // A heartbeat before join is a protocol error too.
  {
    auto fd = net::ConnectTcp(c->address(), "", milliseconds(2000));
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(SendMagic(fd->get(), milliseconds(1000)).ok());
    Envelope hb;
    hb.mutable_heartbeat()->set_member_id(1);
    ASSERT_TRUE(SendEnvelope(fd->get(), hb, milliseconds(1000)).ok());
    char b;
    EXPECT_FALSE(net::RecvAll(fd->get(), &b, 1, milliseconds(3000)).ok());
  }
  // A silent connection is dropped after the handshake timeout.
  {
    auto fd = net::ConnectTcp(c->address(), "", milliseconds(2000));
    ASSERT_TRUE(fd.ok());
    char b;
    auto r = net::RecvAll(fd->get(), &b, 1, milliseconds(3000));
    EXPECT_EQ(r.code(), StatusCode::kUnavailable) << r;
  }
  EXPECT_GE(c->counters().protocol_errors, 5u);
  // The coordinator still works, and the good member is untouched.
  auto w = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE((*s0)->status().ok());
  // The reply can reach the worker before the coordinator's snapshot is updated: wait for it.
  auto m =
      (*s0)->WaitFor([](const Membership& m) { return m.members_size() == 2; }, milliseconds(3000));
  EXPECT_TRUE(m.ok()) << m.status();
}

TEST(CoordinatorTest, LeaveIsPublished) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  auto s0 = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  auto w = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  ASSERT_TRUE(s0.ok() && w.ok());
  const uint32_t wid = (*w)->member_id();
  ASSERT_TRUE((*w)->Leave("done").ok());
  auto m = (*s0)->WaitFor(
      [&](const Membership& m) { return m.departed_size() == 1 && m.departed(0) == wid; },
      milliseconds(3000));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(m->reason().find("done"), std::string::npos);
}

TEST(CoordinatorTest, ClientSeesCoordinatorLoss) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  // It tries to rejoin a restarted coordinator for rejoin_window, then reports the loss.
  ControlClientOptions o = ClientOptions(*c, ROLE_WORKER, kToken);
  o.rejoin_window = milliseconds(500);
  auto w = ControlClient::Join(o);
  ASSERT_TRUE(w.ok());
  const auto t0 = std::chrono::steady_clock::now();  // the loss cannot be seen before this
  c.reset();
  auto r = (*w)->WaitFor([](const Membership&) { return false; }, milliseconds(3000));
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("unreachable for 500 ms"), std::string::npos) << r.status();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(450));
  EXPECT_FALSE((*w)->status().ok());
}

// A coordinator that did not restart from a state listing the member refuses to take it back:
// the member learns it is no longer part of the cluster (a server then fences itself).
TEST(CoordinatorTest, RejoinOfAnUnknownMemberIsRefused) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  const std::string addr = (*c).address();
  auto w = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  ASSERT_TRUE(w.ok());
  c.reset();
  CoordinatorOptions o;
  o.listen_address = addr;
  o.cluster_token = kToken;
  auto again = Coordinator::Start(o);  // no state file: it knows nobody
  ASSERT_TRUE(again.ok()) << again.status();
  auto r = (*w)->WaitFor([](const Membership&) { return false; }, milliseconds(5000));
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("not a member of this cluster any more"), std::string::npos)
      << r.status();
}

// A coordinator that saves its state in a fresh file named by `tag` (restartable: start it
// again with the same options, listen_address set to the first one's).
CoordinatorOptions RestartableOptions(const std::string& tag, std::string* state) {
  *state = ::testing::TempDir() + tag + std::to_string(getpid());
  std::remove(state->c_str());
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.cluster_token = kToken;
  o.state_file = *state;
  o.rejoin_grace = milliseconds(10000);
  return o;
}

// After a coordinator restart, a process that holds the cluster token but not the member's
// credential cannot rejoin as that member (it would take over its rank and the real member,
// refused, would fence itself). The real member then rejoins as itself.
TEST(CoordinatorTest, RejoinUnderAnotherMembersIdNeedsItsCredential) {
  std::string state;
  CoordinatorOptions o = RestartableOptions("coord-cred-", &state);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  o.listen_address = (*c)->address();
  ControlClientOptions vo = ClientOptions(**c, ROLE_SERVER, kToken);
  vo.rejoin_window = milliseconds(10000);
  auto victim = ControlClient::Join(vo);
  ASSERT_TRUE(victim.ok()) << victim.status();
  auto worker = ControlClient::Join(ClientOptions(**c, ROLE_WORKER, kToken));
  ASSERT_TRUE(worker.ok()) << worker.status();
  const uint32_t id = (*victim)->member_id();
  const std::string credential = (*victim)->reply().credential();
  ASSERT_EQ(credential.size(), 32u);
  EXPECT_NE(credential, (*worker)->reply().credential());
  c->reset();
  auto again = Coordinator::Start(o);  // same address and state file
  ASSERT_TRUE(again.ok()) << again.status();
  auto attempt = [&](const std::string& proof) {
    ControlClientOptions a = ClientOptions(**again, ROLE_SERVER, kToken);
    a.join.set_previous_member_id(id);
    a.join.set_previous_credential(proof);
    a.connect_timeout = milliseconds(2000);
    return ControlClient::Join(a);
  };
  auto none = attempt("");
  ASSERT_FALSE(none.ok()) << "a token holder rejoined as member " << id << " with no credential";
  EXPECT_EQ(none.status().code(), StatusCode::kPermissionDenied) << none.status();
  auto other = attempt((*worker)->reply().credential());  // another member's credential
  ASSERT_FALSE(other.ok()) << "another member's credential was accepted for member " << id;
  auto forged = attempt(std::string(32, 'x'));
  ASSERT_FALSE(forged.ok());
  // The real member is still expected, and comes back as itself.
  const auto until = std::chrono::steady_clock::now() + milliseconds(8000);
  while ((*again)->counters().rejoins < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ((*again)->counters().rejoins, 2u);
  EXPECT_TRUE((*victim)->status().ok()) << (*victim)->status();
  EXPECT_EQ((*victim)->member_id(), id);
  std::remove(state.c_str());
}

// Each worker's shard map carries, per server, its own data-path peer key, which the server
// derives from its credential and the worker's identity alone (proto/credentials.h); no two
// workers get the same key, and the key is not derivable from the cluster token.
TEST(CoordinatorTest, ShardMapCarriesPerWorkerPeerKeysTheServerCanDerive) {
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.cluster_token = kToken;
  o.config.set_mode(BSP);
  o.config.set_num_servers(1);
  o.config.set_num_workers(2);
  o.config.set_partition_bytes(1024);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto server = ControlClient::Join(ClientOptions(**c, ROLE_SERVER, kToken));
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<std::unique_ptr<ControlClient>> workers;
  for (int i = 0; i < 2; ++i) {
    auto w = ControlClient::Join(ClientOptions(**c, ROLE_WORKER, kToken));
    ASSERT_TRUE(w.ok()) << w.status();
    Envelope reg;
    TensorSpecProto* t = reg.mutable_register_model()->add_tensors();
    t->set_name("w");
    t->add_shape(64);
    ASSERT_TRUE((*w)->Send(reg).ok());
    workers.push_back(std::move(*w));
  }
  auto assign = (*server)->WaitMessage(Envelope::kAssignShards, milliseconds(5000));
  ASSERT_TRUE(assign.ok()) << assign.status();
  Envelope ready;
  ready.mutable_shards_ready()->set_plan_fingerprint(assign->assign_shards().plan_fingerprint());
  for (const char* name : {"weights", "inbox", "acks", "clocks"}) {
    Region* r = ready.mutable_shards_ready()->add_regions();
    r->set_name(name);
  }
  ASSERT_TRUE((*server)->Send(ready).ok());
  const std::string server_credential = (*server)->reply().credential();
  std::vector<std::string> keys;
  for (auto& w : workers) {
    auto map = w->WaitMessage(Envelope::kShardMap, milliseconds(5000));
    ASSERT_TRUE(map.ok()) << map.status();
    ASSERT_EQ(map->shard_map().servers_size(), 1);
    const ServerEntry& se = map->shard_map().servers(0);
    ASSERT_EQ(se.peer_key().size(), 32u);
    EXPECT_EQ(se.peer_key(),
              PeerKey(server_credential, {w->member_id(), ROLE_WORKER, w->reply().rank()}));
    // A key proves one identity: the other worker's identity gives another key.
    EXPECT_NE(se.peer_key(),
              PeerKey(server_credential, {w->member_id() + 1, ROLE_WORKER, w->reply().rank()}));
    keys.push_back(se.peer_key());
  }
  EXPECT_NE(keys[0], keys[1]);
  EXPECT_NE(server_credential, workers[0]->reply().credential());
}

// Launchers start members and the coordinator together: a join retries a refused coordinator
// until connect_timeout, and succeeds once it listens.
TEST(CoordinatorTest, JoinRetriesUntilTheCoordinatorListens) {
  std::string bound;
  auto probe = net::ListenTcp("127.0.0.1:0", &bound);  // a port nobody listens on once closed
  ASSERT_TRUE(probe.ok()) << probe.status();
  probe->reset();
  std::unique_ptr<Coordinator> c;
  const auto t0 = std::chrono::steady_clock::now();  // before the coordinator's thread exists
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(600));
    CoordinatorOptions o;
    o.listen_address = bound;
    o.cluster_token = kToken;
    auto started = Coordinator::Start(o);
    ASSERT_TRUE(started.ok()) << started.status();
    c = std::move(*started);
  });
  ControlClientOptions o;
  o.coordinator_address = bound;
  o.cluster_token = kToken;
  o.join.set_role(ROLE_WORKER);
  o.connect_timeout = milliseconds(5000);
  auto w = ControlClient::Join(o);
  const auto waited = std::chrono::steady_clock::now() - t0;
  late.join();
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_GE(waited, milliseconds(500));
}

TEST(CoordinatorTest, JoinGivesUpOnAnUnreachableCoordinatorAfterTheBound) {
  std::string bound;
  auto probe = net::ListenTcp("127.0.0.1:0", &bound);
  ASSERT_TRUE(probe.ok()) << probe.status();
  probe->reset();
  ControlClientOptions o;
  o.coordinator_address = bound;
  o.cluster_token = kToken;
  o.join.set_role(ROLE_WORKER);
  o.connect_timeout = milliseconds(800);
  const auto t0 = std::chrono::steady_clock::now();
  auto w = ControlClient::Join(o);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kUnavailable) << w.status();
  EXPECT_GE(waited, milliseconds(500));
  EXPECT_LT(waited, milliseconds(3000));
}



Envelope BarrierAt(uint64_t generation) {
  Envelope e;
  e.mutable_barrier()->set_generation(generation);
  return e;
}

// The barrier survives a coordinator restart: the members' repeated arrivals rebuild it. Worker
// A waits at barrier 2, B passed barrier 1; after the restart A is still not released by B's
// repeat of 1, only once B and a worker that joined after the restart (numbering its barriers
// on from the generation released, 1) arrived at 2. Without A's repeat (a client that forgot
// its arrival once released) A would wait for ever.
TEST(CoordinatorTest, BarriersAreRebuiltAfterACoordinatorRestart) {
  std::string state;
  CoordinatorOptions o = RestartableOptions("coord-barrier-", &state);
  o.config.set_num_workers(2);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  o.listen_address = (*c)->address();
  ControlClientOptions wo = ClientOptions(**c, ROLE_WORKER, kToken);
  wo.rejoin_window = milliseconds(10000);
  auto a = ControlClient::Join(wo);
  auto b = ControlClient::Join(wo);
  ASSERT_TRUE(a.ok() && b.ok());
  auto arrive = [](ControlClient& w, uint64_t g) {
    w.Forget(Envelope::kBarrier);
    return w.SendAndRepeatOnRejoin(BarrierAt(g));
  };
  ASSERT_TRUE(arrive(**a, 1).ok());
  EXPECT_EQ((*a)->WaitMessage(Envelope::kBarrierRelease, milliseconds(300)).status().code(),
            StatusCode::kDeadlineExceeded) << "released before B arrived";
  ASSERT_TRUE(arrive(**b, 1).ok());
  for (auto* w : {&*a, &*b}) {
    auto r = (*w)->WaitMessage(Envelope::kBarrierRelease, milliseconds(3000));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->barrier_release().generation(), 1u);
    EXPECT_EQ(r->barrier_release().workers(), 2u);
  }
  ASSERT_TRUE(arrive(**a, 2).ok());
  c->reset();
  auto again = Coordinator::Start(o);  // same address and state file
  ASSERT_TRUE(again.ok()) << again.status();
  const auto until = std::chrono::steady_clock::now() + milliseconds(8000);
  while ((*again)->counters().rejoins < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  ASSERT_EQ((*again)->counters().rejoins, 2u);
  // B's repeat of barrier 1 may earn it a stale release of 1; A must not be released.
  auto early = (*a)->WaitMessage(Envelope::kBarrierRelease, milliseconds(500));
  EXPECT_EQ(early.status().code(), StatusCode::kDeadlineExceeded)
      << "A released from barrier 2 before B arrived: " << early->DebugString();
  // A worker new to the restarted coordinator counts on from the saved generation (1): its
  // first barrier is 2, and A and B wait for it there.
  auto late = ControlClient::Join(wo);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ((*late)->reply().barrier_generation(), 1u);
  ASSERT_TRUE(arrive(**b, 2).ok());
  auto waiting = (*a)->WaitMessage(Envelope::kBarrierRelease, milliseconds(300));
  EXPECT_EQ(waiting.status().code(), StatusCode::kDeadlineExceeded)
      << "A released before the new worker arrived";
  ASSERT_TRUE(arrive(**late, (*late)->reply().barrier_generation() + 1).ok());
  auto rl = (*late)->WaitMessage(Envelope::kBarrierRelease, milliseconds(3000));
  ASSERT_TRUE(rl.ok()) << rl.status();
  EXPECT_EQ(rl->barrier_release().generation(), 2u);
  EXPECT_EQ(rl->barrier_release().workers(), 3u);
  auto ra = (*a)->WaitMessage(Envelope::kBarrierRelease, milliseconds(3000));
  ASSERT_TRUE(ra.ok()) << ra.status();
  EXPECT_EQ(ra->barrier_release().generation(), 2u);
  bool b_released = false;
  for (int i = 0; i < 2 && !b_released; ++i) {  // a stale release of 1 may come first
    auto rb = (*b)->WaitMessage(Envelope::kBarrierRelease, milliseconds(3000));
    ASSERT_TRUE(rb.ok()) << rb.status();
    b_released = rb->barrier_release().generation() == 2;
  }
  EXPECT_TRUE(b_released);
  std::remove(state.c_str());
}

// The generation released is saved with the coordinator's state: after a restart with no
// member left to repeat an arrival, a new worker still numbers its barriers on from it (with
// 0 it would be at barrier 1 while the others' next is 2, and pass theirs alone).
TEST(CoordinatorTest, ANewWorkerAfterARestartCountsBarriersOnFromTheSavedGeneration) {
  std::string state;
  CoordinatorOptions o = RestartableOptions("coord-barrier-gen-", &state);
  o.config.set_num_workers(2);
  auto c = Coordinator::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  o.listen_address = (*c)->address();
  const ControlClientOptions wo = ClientOptions(**c, ROLE_WORKER, kToken);
  {
    auto a = ControlClient::Join(wo);
    auto b = ControlClient::Join(wo);
    ASSERT_TRUE(a.ok() && b.ok());
    for (int g = 1; g <= 3; ++g) {
      ASSERT_TRUE((*a)->Send(BarrierAt(g)).ok());
      ASSERT_TRUE((*b)->Send(BarrierAt(g)).ok());
      for (auto* w : {&*a, &*b}) {
        auto r = (*w)->WaitMessage(Envelope::kBarrierRelease, milliseconds(3000));
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->barrier_release().generation(), static_cast<uint64_t>(g));
      }
    }
    ASSERT_TRUE((*a)->Leave("done").ok());
    ASSERT_TRUE((*b)->Leave("done").ok());
  }
  c->reset();
  auto again = Coordinator::Start(o);
  ASSERT_TRUE(again.ok()) << again.status();
  auto w = ControlClient::Join(wo);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->reply().barrier_generation(), 3u);
  std::remove(state.c_str());
}

// A barrier from a server, or a generation of 0 or beyond 2^40, is a protocol error: that
// connection is closed and the coordinator goes on.
TEST(CoordinatorTest, ABadBarrierIsAProtocolError) {
  auto c = StartCoordinator();
  ASSERT_TRUE(c);
  auto s = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
  auto w0 = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  auto w1 = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  ASSERT_TRUE(s.ok() && w0.ok() && w1.ok());
  ASSERT_TRUE((*s)->Send(BarrierAt(1)).ok());
  ASSERT_TRUE((*w0)->Send(BarrierAt(0)).ok());
  ASSERT_TRUE((*w1)->Send(BarrierAt(uint64_t{1} << 41)).ok());
  const auto until = std::chrono::steady_clock::now() + milliseconds(3000);
  while (c->counters().protocol_errors < 3 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(c->counters().protocol_errors, 3u);
  EXPECT_EQ(c->counters().barriers_released, 0u);
  auto late = ControlClient::Join(ClientOptions(*c, ROLE_WORKER, kToken));
  EXPECT_TRUE(late.ok()) << "the coordinator still serves: " << late.status();
}

// Busy hosts: the coordinator's own thread stopped at any point of its loop for longer than
// the lease (descheduled on a loaded host, a disk stalling its state file) declares nobody
// dead. Its members were not silent, it was not listening: the pause is measured and forgiven
// before anyone's silence is judged, wherever in the pass it landed. (A stop between the pause
// check and the liveness check once declared every member dead: PrimariesFenceThemselves...
// failed so in the SoftRoCE guest, where a pass is slow enough for a SIGSTOP to land there.)
// "coordinator.after_poll" is the stop the old check already caught (in poll, or just after).
class CoordinatorStallTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CoordinatorStallTest, AStallPastTheLeaseDeclaresNoLiveMemberDead) {
  const std::string point = GetParam();
  CoordinatorOptions o = Options(50, 400);  // lease 1200 ms
  const std::string state = ::testing::TempDir() + "coordinator-stall-" +
                            std::to_string(getpid()) + "-" + point + ".state";
  std::remove(state.c_str());
  o.state_file = state;
  auto c = StartCoordinator(o);
  ASSERT_TRUE(c);
  std::vector<std::unique_ptr<ControlClient>> members;
  for (int i = 0; i < 2; ++i) {
    auto m = ControlClient::Join(ClientOptions(*c, ROLE_SERVER, kToken));
    ASSERT_TRUE(m.ok()) << m.status();
    members.push_back(std::move(*m));
  }
  const auto held = [&] {
    for (auto& m : members) {
      if (!m->LeaseHeld()) return false;
    }
    return true;
  };
  auto until = std::chrono::steady_clock::now() + milliseconds(3000);
  while (!held() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(held());
  // And one member that really is dead: joined, then silent (its socket open, as a hung
  // process's is). Forgiving the coordinator's pause must not hide it: it is declared dead at
  // its lease, counted from when it was last heard plus the pause.
  auto silent = net::ConnectTcp(c->address(), "", milliseconds(2000));
  ASSERT_TRUE(silent.ok());
  ASSERT_TRUE(SendMagic(silent->get(), milliseconds(1000)).ok());
  {
    Envelope join;
    join.mutable_join()->set_cluster_token(kToken);
    join.mutable_join()->set_role(ROLE_WORKER);
    ASSERT_TRUE(SendEnvelope(silent->get(), join, milliseconds(1000)).ok());
    FrameDecoder decoder;
    auto reply = ReceiveEnvelope(silent->get(), &decoder, milliseconds(2000));
    ASSERT_TRUE(reply.ok() && reply->has_join_reply() && reply->join_reply().accepted());
  }
  const auto silent_since = std::chrono::steady_clock::now();
  const milliseconds stall(2000);  // the lease (1200 ms) and its margin, and more
  const long long served = StallPointsServed();
  ArmStallPointForTest(point, 1, stall);
  if (point == "coordinator.save_state") {
    // A change to save: a third member joins (its reply waits for the save).
    ControlClientOptions late = ClientOptions(*c, ROLE_WORKER, kToken);
    late.connect_timeout = milliseconds(10000);
    auto m = ControlClient::Join(late);
    ASSERT_TRUE(m.ok()) << m.status();
    members.push_back(std::move(*m));
  }
  until = std::chrono::steady_clock::now() + stall + milliseconds(8000);
  while (StallPointsServed() == served && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ArmStallPointForTest("", 1, milliseconds(0));
  ASSERT_GT(StallPointsServed(), served) << point << " was never reached";
  // The silent member is declared dead: not before its lease plus the pause, not much after.
  until = std::chrono::steady_clock::now() + milliseconds(8000);
  while (c->counters().departures == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  const auto dead_after = std::chrono::steady_clock::now() - silent_since;
  EXPECT_EQ(c->counters().departures, 1u) << "the silent member was never declared dead";
  EXPECT_GE(dead_after, milliseconds(1200)) << "declared dead before its lease";
  EXPECT_LE(dead_after, stall + milliseconds(1200 + 1500)) << "lease + pause + slack";
  // Several passes after the resume: the old loop closed the members in the pass it resumed in.
  std::this_thread::sleep_for(milliseconds(600));
  const CoordinatorCounters k = c->counters();
  EXPECT_EQ(k.heartbeat_timeouts, 1u) << "a live member was declared dead for the pause";
  EXPECT_EQ(k.departures, 1u);
  EXPECT_GE(k.coordinator_pauses, 1u) << "the pause was not measured";
  EXPECT_EQ(c->membership().members_size(), static_cast<int>(members.size()));
  // Every member is still one, and its lease (lapsed during the stall) is renewed.
  until = std::chrono::steady_clock::now() + milliseconds(3000);
  while (!held() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_TRUE(held()) << "a lease was not renewed after the pause";
  for (auto& m : members) EXPECT_TRUE(m->status().ok()) << m->status();
  c.reset();
  std::remove(state.c_str());
}

INSTANTIATE_TEST_SUITE_P(Points, CoordinatorStallTest,
                         ::testing::Values("coordinator.after_poll", "coordinator.mid_pass",
                                           "coordinator.before_timeouts",
                                           "coordinator.save_state"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string n = info.param;
                           n = n.substr(n.find('.') + 1);
                           return n;
                         });

}  // namespace
}  // namespace shardps::control
