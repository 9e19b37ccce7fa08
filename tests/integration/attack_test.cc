// Attacks on the data path of a real local cluster (docs/security.md): shardps_coordinator,
// shardps_server and ps_test_worker processes over tcp, attacked from this test process.
//
//   * Floods of silent, hello-only and bogus-answer connections against every server's data
//     port do not change training: the BSP weights are bit-identical to an unattacked run (and
//     to the one-process reference), every worker exits 0, and the servers evicted, timed out
//     and refused the strangers. Before the data-path authentication commit a server accepted
//     on its apply thread and waited for each peer's hello, so 200 silent connections stalled
//     training (docs/security.md, "Availability").
//   * A stranger holding leaked region descriptors (rkey and address, from a shard map) cannot
//     connect: Fabric::Connect without a key, or with a wrong key and a valid-looking identity,
//     fails with PERMISSION_DENIED, and a raw socket that skips the challenge and sends a tcp
//     READ frame gets the 40-byte challenge and then EOF, never a byte of the region. Before,
//     the tcp handshake was a bare hello and a leaked rkey read and wrote the weights.
//   * A member's real credential cannot claim another worker's rank: a hello as rank 0 on an
//     endpoint authenticated as rank 3 is refused and the endpoint closed while training goes
//     on. Before, the server took the rank from the hello.
//
// For the broke-checks (a deliberately broken server, built elsewhere) the server binary can be
// replaced with SHARDPS_ATTACK_SERVER_BIN; the other binaries are the build's.
//
// Every wait is bounded; every child is SIGKILLed and reaped in TearDown.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/net.h"
#include "proto/control.pb.h"
#include "proto/control_client.h"
#include "proto/credentials.h"
#include "tests/integration/process_test_base.h"
#include "transport/handshake_auth.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"
#include "wire/region_layout.h"

namespace shardps {
namespace {

using namespace proc_test;  // NOLINT(build/namespaces): the shared fixtures

// A non-blocking TCP connect to ip:port (not waited for); an invalid fd if socket() failed.
UniqueFd OpenNonBlocking(const std::string& address) {
  auto hp = net::ParseHostPort(address);
  if (!hp.ok()) return UniqueFd();
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fd;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp->port);
  inet_pton(AF_INET, hp->host.c_str(), &sa.sin_addr);
  ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
  return fd;
}

// Reads what the peer sends until EOF or an error (true) or the deadline (false).
bool ReadUntilClosed(int fd, std::string* got, Clock::time_point deadline) {
  for (;;) {
    char buf[4096];
    auto n = net::RecvSome(fd, buf, sizeof(buf), "attack read");
    if (!n.ok()) return true;  // EOF or reset
    if (*n > 0) {
      got->append(buf, *n);
      continue;
    }
    if (Clock::now() >= deadline) return false;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 20);
  }
}

class AttackTest : public ProcessTestBase {
 protected:
  // The servers, like ProcessTestBase::StartServers, with logs named <prefix>server<i>.log and
  // the binary replaceable for broke-checks.
  void StartAttackServers(const ClusterSpec& spec, const std::string& prefix,
                          const std::vector<std::string>& extra = {}) {
    const std::string bin = EnvOr("SHARDPS_ATTACK_SERVER_BIN", SHARDPS_SERVER_BIN);
    servers_.clear();
    for (int i = 0; i < spec.servers * spec.replicas; ++i) {
      std::vector<std::string> argv = {bin, "--coordinator=" + coordinator_address_,
                                       std::string("--cluster_token=") + kToken,
                                       "--transport=" + spec.transport, "--bind_ip=127.0.0.1",
                                       "--rank=" + std::to_string(i),
                                       "--optimizer=" + spec.optimizer, LrFlag(spec.lr),
                                       "--aggregation=" + spec.aggregation};
      argv.insert(argv.end(), extra.begin(), extra.end());
      servers_.push_back(Spawn(argv, prefix + "server" + std::to_string(i) + ".log"));
    }
  }

  // Workers 0..W-1 of a linreg BSP run, each writing <prefix>worker<r>.out and
  // <prefix>progress<r>.
  // hold_at: if > 0, the workers hold before that step until ReleaseHold(prefix + "hold").
  std::vector<ChildProcess*> StartWorkers(const ClusterSpec& spec, const std::string& prefix,
                                          int steps, int step_delay_ms, int hold_at = 0) {
    std::vector<ChildProcess*> workers;
    for (int r = 0; r < spec.workers; ++r) {
      const std::string tag = prefix + "worker" + std::to_string(r);
      std::vector<std::string> flags = {
          "--steps=" + std::to_string(steps), "--step_delay_ms=" + std::to_string(step_delay_ms),
          "--out=" + Path(tag + ".out"),
          "--progress_file=" + Path(prefix + "progress" + std::to_string(r))};
      if (hold_at > 0) {
        for (const std::string& f : HoldFlags(hold_at, prefix + "hold")) flags.push_back(f);
      }
      workers.push_back(SpawnWorker(WorkerArgs(spec, r), tag + ".log", flags));
    }
    return workers;
  }

  // The data addresses of the servers, as the coordinator's members list has them.
  std::vector<std::string> DataAddresses(int servers) {
    std::vector<std::string> out;
    for (int i = 0; i < servers; ++i) {
      const std::string log = servers_[i]->LogTail(1 << 20);
      // "... data path tcp at 127.0.0.1:PORT, mode ..." (ShardServer::Setup)
      const size_t at = log.find("data path tcp at ");
      if (at == std::string::npos) return {};
      const size_t b = at + std::strlen("data path tcp at ");
      out.push_back(log.substr(b, log.find_first_of(", \n", b) - b));
    }
    return out;
  }
  // Waits (bounded) until every server has joined and logged its data address.
  std::vector<std::string> WaitDataAddresses(int servers) {
    const auto until = Clock::now() + seconds(20);
    while (Clock::now() < until) {
      auto a = DataAddresses(servers);
      if (!a.empty()) return a;
      std::this_thread::sleep_for(milliseconds(20));
    }
    return {};
  }

  // A member that leaks: joins with the token as worker `rank`, registers the linreg model and
  // takes its copy of the shard map (server data addresses, region descriptors, and its own peer
  // keys), then leaves before the job's workers start, so the job trains without it.
  struct Leak {
    control::ShardMap map;
    uint32_t member_id = 0;
    uint32_t rank = 0;
    std::unique_ptr<control::ControlClient> client;  // set when the member stays joined
  };
  StatusOr<Leak> JoinAndLeak(uint32_t rank, bool stay = false) {
    control::ControlClientOptions co;
    co.coordinator_address = coordinator_address_;
    co.cluster_token = kToken;
    co.join.set_role(control::ROLE_WORKER);
    co.join.set_hostname("stranger");
    co.join.set_pid(static_cast<uint32_t>(getpid()));
    co.join.set_transport("tcp");
    co.join.set_requested_rank(static_cast<int>(rank));
    co.rejoin_window = milliseconds(0);
    ASSIGN_OR_RETURN(auto client, control::ControlClient::Join(co));
    control::Envelope reg;
    auto* w = reg.mutable_register_model()->add_tensors();
    w->set_name("W");
    w->set_dtype(0);
    w->add_shape(64);
    w->add_shape(8);
    auto* b = reg.mutable_register_model()->add_tensors();
    b->set_name("b");
    b->set_dtype(0);
    b->add_shape(8);
    RETURN_IF_ERROR(client->Send(reg));
    ASSIGN_OR_RETURN(control::Envelope env,
                     client->WaitMessage(control::Envelope::kShardMap, milliseconds(20000)));
    Leak leak;
    leak.map = env.shard_map();
    leak.member_id = client->member_id();
    leak.rank = client->reply().rank();
    if (stay) {
      leak.client = std::move(client);  // still a member: its credential stays valid
    } else {
      RETURN_IF_ERROR(client->Leave("the stranger has what it came for"));
    }
    return leak;
  }

  static StatusOr<transport::RegionDescriptor> RegionOf(const control::ServerEntry& s,
                                                        const std::string& name) {
    for (const auto& r : s.regions()) {
      if (r.name() == name) return transport::RegionDescriptor::Decode(r.encoded_descriptor());
    }
    return NotFoundError("no region '" + name + "'");
  }

  // Every worker exited 0, ran all steps, and holds the one-process reference's weights bit for
  // bit.
  void ExpectTrainedCorrectly(const std::vector<ChildProcess*>& workers, ChildProcess* standalone,
                              const std::string& prefix, int steps) {
    for (ChildProcess* w : workers) ASSERT_EQ(ExitCode(w), 0) << Tail(w);
    auto ref = StandaloneResult(standalone, kProcessBound);
    ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
    for (size_t r = 0; r < workers.size(); ++r) {
      auto res = ParseResult(Path(prefix + "worker" + std::to_string(r) + ".out"));
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("steps"), steps);
      ExpectSameWeights(*res, *ref, static_cast<int>(r));
    }
  }
};

// ---- 1. Floods ------------------------------------------------------------------------------

// What one flood connection does after connecting.
enum class FloodKind { kSilent, kOldHello, kBogusAnswer, kForgedAnswer, kCount };

// Opens one flood connection of `kind` to `address` and leaves it open in *held (silent and
// hello-only ones hold a gate slot until evicted or timed out).
void FloodOne(const std::string& address, FloodKind kind, std::mt19937* rng,
              std::vector<UniqueFd>* held) {
  UniqueFd fd = OpenNonBlocking(address);
  if (!fd.valid()) return;
  if (kind != FloodKind::kSilent) {
    // Wait (briefly) for the connect to finish, then send without reading the challenge.
    pollfd p{fd.get(), POLLOUT, 0};
    poll(&p, 1, 200);
    std::string bytes;
    if (kind == FloodKind::kOldHello) {
      transport::tcp::Hello h{};
      h.magic = transport::tcp::kHelloMagic;
      h.version = transport::tcp::kWireVersion;
      h.header_size = transport::tcp::kHeaderSize;
      h.send_depth = 16;
      h.recv_depth = 16;
      bytes.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    } else {
      transport::auth::Response r{};
      uint8_t* raw = reinterpret_cast<uint8_t*>(&r);
      for (size_t i = 0; i < sizeof(r); ++i) raw[i] = static_cast<uint8_t>((*rng)());
      if (kind == FloodKind::kForgedAnswer) {
        // Well formed, a valid-looking worker identity, a random proof.
        r.magic = transport::auth::kMagic;
        r.version = transport::auth::kVersion;
        const std::string id = "2:999:0";
        r.identity_len = static_cast<uint16_t>(id.size());
        std::memcpy(r.identity, id.data(), id.size());
      }
      bytes.assign(reinterpret_cast<const char*>(&r), sizeof(r));
    }
    static_assert(sizeof(transport::auth::Response) == 136);
    (void)send(fd.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  }
  held->push_back(std::move(fd));
}

// An unattacked BSP run, then the same run while this process floods every server's data port:
// 200 silent connections before the workers start, then, while they train, connections that
// send the old tcp hello, a bogus 136-byte answer, a well-formed answer with a forged proof, or
// nothing (at most 500 in all, bounded in time). The attacked run's weights are bit-identical to
// the unattacked run's and to the one-process reference; the servers evicted and refused the
// strangers; the step time is printed for both runs.
TEST_F(AttackTest, FloodsOfSilentAndBogusConnectionsDoNotChangeTraining) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.servers = 2;
  spec.workers = 3;
  const int kSteps = 40;
  const int kStepDelayMs = 10;
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);

  struct RunResult {
    double train_s = 0;  // first step done -> every worker exited
    double total_s = 0;  // workers spawned -> every worker exited (setup included)
    std::vector<std::vector<float>> w, b;
  };
  auto run = [&](const std::string& prefix, bool attack, RunResult* out) {
    ASSERT_FALSE(StartCoordinator(spec).empty());
    StartAttackServers(spec, prefix);
    const std::vector<std::string> addrs = WaitDataAddresses(spec.servers);
    ASSERT_EQ(addrs.size(), static_cast<size_t>(spec.servers))
        << "servers did not log their data addresses:\n"
        << Tail(servers_[0]);
    std::vector<UniqueFd> held;
    std::mt19937 rng(1234);
    if (attack) {
      // (a) 200 silent connections, spread over the servers, before the workers start.
      for (int i = 0; i < 200; ++i) {
        FloodOne(addrs[i % addrs.size()], FloodKind::kSilent, &rng, &held);
      }
    }
    const auto t0 = Clock::now();
    std::vector<ChildProcess*> workers = StartWorkers(spec, prefix, kSteps, kStepDelayMs);
    for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
    const int first = WaitProgress(Path(prefix + "progress0"), 1, kProcessBound, workers[0]);
    ASSERT_GE(first, 1) << Tail(workers[0]);
    const auto t1 = Clock::now();
    // (b) mid-run: round-robin over servers and kinds, bounded in count and time.
    std::atomic<bool> stop{false};
    std::atomic<int> flooded{0};
    std::thread flooder;
    std::vector<UniqueFd> mine;  // held open until the workers are done
    if (attack) {
      flooder = std::thread([&] {
        std::mt19937 frng(99);
        const auto until = Clock::now() + seconds(20);
        for (int i = 0; i < 300 && !stop.load() && Clock::now() < until; ++i) {
          const auto kind = static_cast<FloodKind>(i % static_cast<int>(FloodKind::kCount));
          FloodOne(addrs[(i / static_cast<int>(FloodKind::kCount)) % addrs.size()], kind, &frng,
                   &mine);
          flooded.fetch_add(1);
          std::this_thread::sleep_for(milliseconds(2));
        }
      });
    }
    for (ChildProcess* w : workers) EXPECT_EQ(ExitCode(w), 0) << Tail(w);
    const auto t_end = Clock::now();
    stop.store(true);
    if (flooder.joinable()) flooder.join();
    mine.clear();
    out->train_s = std::chrono::duration<double>(t_end - t1).count();
    out->total_s = std::chrono::duration<double>(t_end - t0).count();
    for (int r = 0; r < spec.workers; ++r) {
      auto res = ParseResult(Path(prefix + "worker" + std::to_string(r) + ".out"));
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_EQ(res->Int("steps"), kSteps);
      out->w.push_back(res->tensors["W"]);
      out->b.push_back(res->tensors["b"]);
    }
    if (attack) {
      EXPECT_GT(flooded.load(), 0);
      std::cerr << "[          ] flood: 200 silent connections before the workers, "
                << flooded.load() << " more while they trained\n";
      // Each server evicted silent strangers (200 > 8 per source) and refused bogus answers.
      for (int i = 0; i < spec.servers; ++i) {
        const std::string log = servers_[i]->LogTail(1 << 22);
        EXPECT_NE(log.find("unauthenticated connection(s) evicted so far"), std::string::npos)
            << "server " << i << " evicted nothing:\n"
            << servers_[i]->LogTail();
        EXPECT_NE(log.find("data-path connection(s) refused so far"), std::string::npos)
            << "server " << i << " refused nothing:\n"
            << servers_[i]->LogTail();
      }
    }
    held.clear();
    // This run's processes go; the next run starts a fresh cluster.
    for (ChildProcess* s : servers_) s->Kill();
    coordinator_->Kill();
  };

  RunResult quiet, attacked;
  run("quiet_", false, &quiet);
  if (HasFatalFailure()) return;
  run("attacked_", true, &attacked);
  if (HasFatalFailure()) return;

  auto ref = StandaloneResult(standalone, kProcessBound);
  ASSERT_TRUE(ref.ok()) << ref.status() << Tail(standalone);
  for (int r = 0; r < spec.workers; ++r) {
    EXPECT_EQ(attacked.w[r], quiet.w[r]) << "worker " << r << ": W differs from the quiet run";
    EXPECT_EQ(attacked.b[r], quiet.b[r]) << "worker " << r << ": b differs from the quiet run";
    EXPECT_EQ(attacked.w[r], ref->tensors["W"]) << "worker " << r << ": W differs (reference)";
    EXPECT_EQ(attacked.b[r], ref->tensors["b"]) << "worker " << r << ": b differs (reference)";
  }
  const double per_step_quiet = 1000.0 * quiet.train_s / (kSteps - 1);
  const double per_step_attacked = 1000.0 * attacked.train_s / (kSteps - 1);
  const double ratio = per_step_attacked / per_step_quiet;
  const double total_ratio = attacked.total_s / quiet.total_s;
  std::cerr << "[          ] step time (steps 2.." << kSteps << " + exit, incl. "
            << kStepDelayMs << " ms sleep): unattacked " << per_step_quiet << " ms, attacked "
            << per_step_attacked << " ms, ratio " << ratio << "; whole run (setup included): "
            << quiet.total_s << " s vs " << attacked.total_s << " s, ratio " << total_ratio
            << "\n";
  // Timing alone fails the test only when grossly off: this host is a loaded 2-core VM.
  EXPECT_LT(ratio, 3.0) << "the flood slowed training more than 3x";
  EXPECT_LT(total_ratio, 3.0) << "the flood slowed the run (setup included) more than 3x";
}

// ---- 2. A stranger with leaked descriptors ----------------------------------------------------

// With the servers' data addresses and region descriptors (rkey, address) from a leaked shard
// map, a stranger cannot connect: no key and a wrong key (a valid-looking identity) are both
// PERMISSION_DENIED, so nothing can be posted; a raw socket that skips the challenge and sends a
// tcp READ frame (after the old hello) gets the challenge, then a refusal or EOF within the gate's
// 5 s, never a byte of the region. The job trains to the reference weights meanwhile.
TEST_F(AttackTest, AStrangerWithLeakedRkeysCannotReadOrWrite) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.servers = 2;
  spec.workers = 3;
  spec.max_workers = 4;  // the leaking member takes rank 3, then leaves
  const int kSteps = 100;
  ASSERT_FALSE(StartCoordinator(spec).empty());
  StartAttackServers(spec, "");
  auto leak = JoinAndLeak(3);
  ASSERT_TRUE(leak.ok()) << leak.status() << Tail(coordinator_);
  ASSERT_EQ(leak->map.servers_size(), spec.servers);
  std::vector<ChildProcess*> workers = StartWorkers(spec, "", kSteps, 10);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 2, kProcessBound, workers[0]), 2) << Tail(workers[0]);

  transport::FabricOptions fo;
  fo.provider = "tcp";
  fo.bind_ip = "127.0.0.1";
  auto fabric = transport::Fabric::Open(fo);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  auto cq = (*fabric)->CreateCompletionQueue(64);
  ASSERT_TRUE(cq.ok()) << cq.status();
  std::mt19937 rng(7);
  for (const control::ServerEntry& s : leak->map.servers()) {
    auto weights = RegionOf(s, "weights");
    ASSERT_TRUE(weights.ok()) << weights.status();
    ASSERT_NE(weights->rkey, 0u);
    // No key at all, and a wrong key under a valid-looking identity.
    std::string wrong(32, '\0');
    for (char& c : wrong) c = static_cast<char>(rng());
    const std::pair<std::string, std::string> attempts[] = {{"", ""}, {"2:999:0", wrong}};
    for (const auto& [identity, key] : attempts) {
      transport::EndpointOptions eo;
      eo.send_depth = 4;
      eo.recv_depth = 4;
      eo.connect_timeout = milliseconds(8000);
      eo.auth_identity = identity;
      eo.auth_key = key;
      auto ep = (*fabric)->Connect(s.data_address(), cq->get(), eo);
      ASSERT_FALSE(ep.ok()) << "a stranger (identity '" << identity << "', "
                            << (key.empty() ? "no key" : "wrong key") << ") connected to "
                            << s.data_address();
      EXPECT_EQ(ep.status().code(), StatusCode::kPermissionDenied) << ep.status();
    }

    // A hand-rolled connector (it need not check the server's proof, as Fabric::Connect does):
    // answers the challenge as "2:999:0" with a proof under a wrong key; if it were accepted it
    // would go on with the tcp hello and a READ of the weights. It must get a refusal and EOF.
    {
      auto fd = net::ConnectTcp(s.data_address(), "127.0.0.1", milliseconds(3000));
      ASSERT_TRUE(fd.ok()) << fd.status();
      transport::auth::Challenge c{};
      ASSERT_TRUE(net::RecvAll(fd->get(), &c, sizeof(c), milliseconds(5000)).ok());
      ASSERT_EQ(c.magic, transport::auth::kMagic);
      const std::string id = "2:999:0";
      const std::string nonce_a(reinterpret_cast<const char*>(c.nonce), sizeof(c.nonce));
      transport::auth::Response r{};
      r.magic = transport::auth::kMagic;
      r.version = transport::auth::kVersion;
      r.identity_len = static_cast<uint16_t>(id.size());
      std::memcpy(r.identity, id.data(), id.size());
      for (uint8_t& b : r.nonce) b = static_cast<uint8_t>(rng());
      const std::string nonce_c(reinterpret_cast<const char*>(r.nonce), sizeof(r.nonce));
      const std::string proof = transport::auth::ConnectorProof(wrong, c.flags, nonce_a, nonce_c, id);
      std::memcpy(r.proof, proof.data(), sizeof(r.proof));
      ASSERT_TRUE(net::SendAll(fd->get(), &r, sizeof(r), milliseconds(3000)).ok());
      transport::auth::Verdict v{};
      ASSERT_TRUE(net::RecvAll(fd->get(), &v, sizeof(v), milliseconds(5000)).ok());
      EXPECT_EQ(v.accepted, 0) << "a proof under a wrong key was accepted";
      transport::tcp::Hello h{};
      h.magic = transport::tcp::kHelloMagic;
      h.version = transport::tcp::kWireVersion;
      h.header_size = transport::tcp::kHeaderSize;
      transport::tcp::FrameHeader rd{};
      rd.magic = transport::tcp::kFrameMagic;
      rd.opcode = transport::tcp::kOpReadReq;
      rd.rkey = weights->rkey;
      rd.addr = weights->addr;
      rd.length = 64;
      rd.seq = 1;
      std::string after(reinterpret_cast<const char*>(&h), sizeof(h));
      after.append(reinterpret_cast<const char*>(&rd), sizeof(rd));
      (void)send(fd->get(), after.data(), after.size(), MSG_NOSIGNAL);
      std::string got;
      EXPECT_TRUE(ReadUntilClosed(fd->get(), &got, Clock::now() + seconds(9)));
      EXPECT_EQ(got.size(), 0u) << "the server sent " << got.size()
                                << " bytes (its hello, the weights) to a forged proof";
    }

    // A raw socket: skip the challenge, send a READ of the weights region.
    transport::tcp::FrameHeader read{};
    read.magic = transport::tcp::kFrameMagic;
    read.opcode = transport::tcp::kOpReadReq;
    read.rkey = weights->rkey;
    read.addr = weights->addr;
    read.length = 64;
    read.seq = 1;
    transport::tcp::Hello hello{};
    hello.magic = transport::tcp::kHelloMagic;
    hello.version = transport::tcp::kWireVersion;
    hello.header_size = transport::tcp::kHeaderSize;
    const std::string frame(reinterpret_cast<const char*>(&read), sizeof(read));
    const std::string hello_bytes(reinterpret_cast<const char*>(&hello), sizeof(hello));
    // (i) the READ frame alone: shorter than an answer, so the gate waits for the rest and
    // closes the connection at its 5 s timeout. (ii) the old hello and READ frames, 136 bytes
    // and more: read as a malformed answer and refused at once.
    const std::string payloads[] = {frame, hello_bytes + frame + frame + frame + frame};
    for (const std::string& payload : payloads) {
      auto fd = net::ConnectTcp(s.data_address(), "127.0.0.1", milliseconds(3000));
      ASSERT_TRUE(fd.ok()) << fd.status();
      ASSERT_TRUE(net::SendAll(fd->get(), payload.data(), payload.size(), milliseconds(3000)).ok());
      std::string got;
      const auto t0 = Clock::now();
      const bool closed = ReadUntilClosed(fd->get(), &got, t0 + seconds(9));
      const double took = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_TRUE(closed) << "the server kept a stranger's connection open for 9 s ("
                          << payload.size() << "-byte payload)";
      ASSERT_GE(got.size(), sizeof(transport::auth::Challenge));
      transport::auth::Challenge c{};
      std::memcpy(&c, got.data(), sizeof(c));
      EXPECT_EQ(c.magic, transport::auth::kMagic);
      EXPECT_NE(c.flags & transport::auth::kFlagRequired, 0) << "the server requires no proof";
      if (payload.size() < sizeof(transport::auth::Response)) {
        EXPECT_EQ(got.size(), sizeof(c)) << "more than the challenge came back";
      } else {
        // The challenge and one refusal, nothing else.
        ASSERT_EQ(got.size(), sizeof(c) + sizeof(transport::auth::Verdict));
        transport::auth::Verdict v{};
        std::memcpy(&v, got.data() + sizeof(c), sizeof(v));
        EXPECT_EQ(v.magic, transport::auth::kMagic);
        EXPECT_EQ(v.accepted, 0) << "a malformed answer was accepted";
      }
      std::cerr << "[          ] raw " << payload.size() << "-byte payload to "
                << s.data_address() << ": " << got.size() << " bytes back, closed after " << took
                << " s\n";
    }
  }
  ExpectTrainedCorrectly(workers, standalone, "", kSteps);
  for (int i = 0; i < spec.servers; ++i) {
    EXPECT_NE(servers_[i]->LogTail(1 << 22).find("data-path connection(s) refused so far"),
              std::string::npos)
        << "server " << i << ":\n"
        << servers_[i]->LogTail();
  }
}

// ---- 3. A forged rank ---------------------------------------------------------------------------

// A member's own credential (worker rank 3, which joined and left) authenticates, but its hello
// claiming rank 0 is refused and the endpoint closed, while the job trains to the reference
// weights. (The hello names rank 0; its payload goes to rank 3's own clock slot.)
TEST_F(AttackTest, AMembersCredentialCannotClaimAnotherRank) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.servers = 2;
  spec.workers = 3;
  spec.max_workers = 4;
  const int kSteps = 30;
  ASSERT_FALSE(StartCoordinator(spec).empty());
  StartAttackServers(spec, "");
  // The member connects while it is one (a departed member's key opens nothing: below), then
  // leaves, so that the job trains without it; its endpoint stays open.
  auto leak = JoinAndLeak(3, /*stay=*/true);
  ASSERT_TRUE(leak.ok()) << leak.status() << Tail(coordinator_);
  ASSERT_EQ(leak->rank, 3u);

  transport::FabricOptions fo;
  fo.provider = "tcp";
  fo.bind_ip = "127.0.0.1";
  auto fabric = transport::Fabric::Open(fo);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  auto cq = (*fabric)->CreateCompletionQueue(64);
  ASSERT_TRUE(cq.ok()) << cq.status();
  auto local = (*fabric)->AllocateMemory(4096, transport::Access::kLocalOnly);
  ASSERT_TRUE(local.ok()) << local.status();
  const control::ServerEntry& s = leak->map.servers(0);
  auto weights = RegionOf(s, "weights");
  auto clocks = RegionOf(s, "clocks");
  ASSERT_TRUE(weights.ok() && clocks.ok());

  transport::EndpointOptions eo;
  eo.send_depth = 8;
  eo.recv_depth = 4;
  eo.connect_timeout = milliseconds(8000);
  eo.auth_identity =
      control::IdentityString({leak->member_id, static_cast<int>(control::ROLE_WORKER), 3});
  eo.auth_key = s.peer_key();
  auto ep = (*fabric)->Connect(s.data_address(), cq->get(), eo);
  ASSERT_TRUE(ep.ok()) << "the member's real credential was refused: " << ep.status();
  ASSERT_TRUE(leak->client->Leave("the member has its endpoint").ok());
  leak->client.reset();
  std::vector<ChildProcess*> workers = StartWorkers(spec, "", kSteps, 10);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 3, kProcessBound, workers[0]), 3) << Tail(workers[0]);
  // Now that it has left (and the servers have seen newer members), its own credential opens
  // no new connection.
  {
    auto again = (*fabric)->Connect(s.data_address(), cq->get(), eo);
    EXPECT_FALSE(again.ok()) << "a departed member's credential still opened a connection";
    if (!again.ok()) {
      EXPECT_EQ(again.status().code(), StatusCode::kPermissionDenied) << again.status();
    }
  }

  // The hello, as a worker sends it, but naming rank 0.
  auto* hello = static_cast<layout::Hello*>((*local)->data());
  hello->clock = 0;
  hello->incarnation = leak->member_id;
  hello->magic = layout::kHelloMagic;
  const uint64_t clock_off = 64ull * 3;  // rank 3's own slot (layout::kAlign * rank)
  ASSERT_TRUE((*ep)->PostWriteImm({local->get(), 0, sizeof(layout::Hello)},
                                  transport::AtOffset(*clocks, clock_off),
                                  layout::MakeImm(layout::ImmKind::kHello, 0), 1)
                  .ok());
  // Then reads of the weights until the endpoint fails: the server must close it.
  const auto until = Clock::now() + seconds(8);
  int reads_ok = 0;
  bool closed = false;
  while (Clock::now() < until && !closed) {
    if (!(*ep)->status().ok()) {
      closed = true;
      break;
    }
    if ((*ep)->outstanding() == 0) {
      (void)(*ep)->PostRead({local->get(), 1024, 64}, transport::AtOffset(*weights, 0), 2);
    }
    transport::Completion c[8];
    const int n = (*cq)->Wait(c, 8, std::chrono::microseconds(20000));
    for (int i = 0; i < n; ++i) {
      if (!c[i].ok()) closed = true;
      if (c[i].ok() && c[i].op == transport::OpType::kRead) ++reads_ok;
    }
  }
  EXPECT_TRUE(closed) << "the server kept serving an endpoint whose hello claimed another rank ("
                      << reads_ok << " reads served)";
  ep->reset();
  ExpectTrainedCorrectly(workers, standalone, "", kSteps);
  const std::string log = servers_[0]->LogTail(1 << 22);
  EXPECT_NE(log.find("hello as worker rank 0"), std::string::npos) << servers_[0]->LogTail();
  std::cerr << "[          ] forged hello as rank 0: endpoint closed after " << reads_ok
            << " reads\n";
}

// ---- 3b. A flood during a failover ------------------------------------------------------------

// A primary is killed mid-run while this process floods every server, the backup that is about
// to be promoted included, with silent, hello-only, bogus and forged connections from the
// workers' own source (127/8, the harshest case for the per-source limit). Every worker
// reconnects through the gate to the promoted backup, nothing is lost, and the weights are the
// reference's bit for bit. (Before the gate, ~130 hello-only connections filled the CQ and a
// failover under such a flood was impossible.)
TEST_F(AttackTest, AFloodDuringAFailoverLosesNothing) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.servers = 2;
  spec.replicas = 2;
  spec.workers = 3;
  const int kSteps = 30;
  ASSERT_FALSE(StartCoordinator(spec).empty());
  StartAttackServers(spec, "");
  const std::vector<std::string> addrs = WaitDataAddresses(spec.servers * spec.replicas);
  ASSERT_EQ(addrs.size(), static_cast<size_t>(spec.servers * spec.replicas)) << Tail(servers_[0]);
  // Held two thirds in until the kill: the flood's build-up may take the test thread long
  // on a loaded host, and training must not be over by then.
  std::vector<ChildProcess*> workers = StartWorkers(spec, "", kSteps, 15, 2 * kSteps / 3);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ASSERT_GE(WaitProgress(Path("progress0"), 3, kProcessBound, workers[0]), 3) << Tail(workers[0]);

  std::atomic<bool> stop{false};
  std::atomic<int> flooded{0};
  std::vector<UniqueFd> held;
  std::thread flooder([&] {
    std::mt19937 rng(4242);
    const auto until = Clock::now() + seconds(20);
    for (int i = 0; i < 400 && !stop.load() && Clock::now() < until; ++i) {
      const auto kind = static_cast<FloodKind>(i % static_cast<int>(FloodKind::kCount));
      FloodOne(addrs[(i / static_cast<int>(FloodKind::kCount)) % addrs.size()], kind, &rng,
               &held);
      flooded.fetch_add(1);
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  // Let the flood build up, then kill group 0's primary (its backup is rank 2).
  const auto flood_up_by = Clock::now() + seconds(5);
  while (flooded.load() < 60 && Clock::now() < flood_up_by) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  const int at_kill = WaitProgress(Path("progress0"), 0, milliseconds(1), nullptr);
  ASSERT_LT(at_kill, kSteps) << "training ended before the kill";
  servers_[0]->Kill();
  ASSERT_TRUE(ReleaseHold());
  for (ChildProcess* w : workers) EXPECT_EQ(ExitCode(w), 0) << Tail(w);
  stop.store(true);
  flooder.join();
  held.clear();
  ExpectTrainedCorrectly(workers, standalone, "", kSteps);
  int64_t failovers = 0;
  for (int r = 0; r < spec.workers; ++r) {
    auto res = ParseResult(Path("worker" + std::to_string(r) + ".out"));
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->Int("pushes_lost"), 0) << "worker " << r;
    failovers += res->Int("failovers");
  }
  EXPECT_EQ(failovers, spec.workers) << "every worker moves to the promoted backup once";
  EXPECT_NE(servers_[2]->LogTail(1 << 22).find("PROMOTED"), std::string::npos)
      << servers_[2]->LogTail();
  std::cerr << "[          ] killed primary 0 after step " << at_kill << " during a flood of "
            << flooded.load() << " connections; " << failovers << " failovers, nothing lost\n";
}

// ---- 4. TLS ---------------------------------------------------------------------------------

// With --tcp_tls on the servers, the whole job (workers to primaries, primaries to their
// backups) runs over TLS 1.3, the workers following the servers' authenticated requirement
// without a flag of their own, and trains to the reference weights bit for bit.
TEST_F(AttackTest, ATlsClusterWithBackupsTrainsToTheReference) {
  ClusterSpec spec;
  spec.transport = "tcp";
  spec.servers = 2;
  spec.workers = 3;
  spec.replicas = 2;
  const int kSteps = 20;
  ASSERT_FALSE(StartCoordinator(spec).empty());
  StartAttackServers(spec, "", {"--tcp_tls"});
  std::vector<ChildProcess*> workers = StartWorkers(spec, "", kSteps, 0);
  ChildProcess* standalone = SpawnStandalone(spec, kSteps);
  ExpectTrainedCorrectly(workers, standalone, "", kSteps);
  int tls_logs = 0;
  for (ChildProcess* s : servers_) {
    tls_logs += s->LogTail(1 << 22).find("TLSv1.3") != std::string::npos ? 1 : 0;
  }
  // Every primary took TLS connections (workers, and its backup took the primary's stream).
  EXPECT_EQ(tls_logs, spec.servers * spec.replicas) << Tail(servers_[0]);
}

}  // namespace
}  // namespace shardps
