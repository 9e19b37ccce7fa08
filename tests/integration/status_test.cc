// `shardps status` against a real cluster (coordinator, servers and training workers as
// processes): the real binary's --json output, parsed back into a StatusReply, must describe the
// cluster the test started (members by role, the shard map the pure plan gives, worker clocks
// and their lag, bytes/s during training, the checkpoint), a stranger without the token is
// refused and changes nothing, and malformed or repeated status requests do not hurt the
// coordinator.
#include <sys/socket.h>

#include <google/protobuf/util/json_util.h>

#include "proto/control.pb.h"
#include "proto/framing.h"
#include "proto/shard_plan.h"
#include "tests/integration/process_test_base.h"

namespace shardps::proc_test {
namespace {

struct StatusRun {
  int exit_code = -1;
  std::string out, err;
};

class ShardpsStatusTest : public ProcessClusterTest {
 protected:
  // Runs `shardps status --coordinator ... <extra>` with the token in a file; stdout and stderr
  // apart (sh redirects them).
  StatusRun RunStatus(const std::vector<std::string>& extra, const std::string& token = kToken) {
    static int n = 0;
    const std::string tag = "status" + std::to_string(++n);
    const std::string token_file = Path(tag + ".token");
    {
      std::ofstream f(token_file);
      f << token << "\n";
    }
    std::string cmd = std::string("exec '") + SHARDPS_BIN + "' status --coordinator " +
                      coordinator_address_ + " --cluster_token_file '" + token_file + "'";
    for (const std::string& e : extra) cmd += " " + e;
    cmd += " > '" + Path(tag + ".out") + "' 2> '" + Path(tag + ".err") + "'";
    StatusRun r;
    ChildProcess* c = Spawn({"/bin/sh", "-c", cmd}, tag + ".log");
    if (c == nullptr) return r;
    r.exit_code = ExitCode(c, milliseconds(20000));
    auto out = ReadFile(Path(tag + ".out"));
    auto err = ReadFile(Path(tag + ".err"));
    r.out = out.ok() ? *out : "";
    r.err = err.ok() ? *err : "";
    return r;
  }

  // `shardps status --json`, parsed with protobuf's JSON support.
  control::StatusReply Json() {
    control::StatusReply reply;
    const StatusRun r = RunStatus({"--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const auto st = google::protobuf::util::JsonStringToMessage(r.out, &reply);
    EXPECT_TRUE(st.ok()) << st.ToString() << "\n" << r.out;
    return reply;
  }

  static int Count(const control::StatusReply& r, control::Role role) {
    int n = 0;
    for (const auto& m : r.members()) n += m.joined() && m.role() == role;
    return n;
  }
};

// A training SSP cluster with periodic checkpoints, as `shardps status --json` reports it.
TEST_P(ShardpsStatusTest, ReportsTheRunningCluster) {
  ClusterSpec spec = Spec();
  spec.consistency = "ssp";
  spec.staleness = 1;
  spec.servers = 2;
  spec.workers = 3;
  spec.heartbeat_interval_ms = 50;  // a worker's clock in a heartbeat is <= 50 ms old
  spec.checkpoint_dir = Path("ckpt");
  spec.checkpoint_every = 4;
  // 200 ms per step, heartbeats every 50 ms: a worker's clock in the reply is about one step
  // old at most, so the lag it shows is within the staleness bound + 1 (on an idle host).
  const int kSteps = 40, kStepDelayMs = 200;
  ASSERT_TRUE(StartCluster(spec));
  std::vector<ChildProcess*> workers = SpawnWorkers(
      spec,
      {"--steps=" + std::to_string(kSteps), "--step_delay_ms=" + std::to_string(kStepDelayMs)});
  for (ChildProcess* w : workers) ASSERT_NE(w, nullptr);
  // Past a rate window (1 s) of training, and past two checkpoints.
  for (int r = 0; r < spec.workers; ++r) {
    ASSERT_GE(WaitProgress(Path("progress" + std::to_string(r)), 12, ProcessBound(), workers[r]),
              12)
        << Tail(workers[r]);
  }

  // The checkpoint is complete once every group's primary reported it: poll (bounded).
  control::StatusReply st;
  const auto until = Clock::now() + milliseconds(10000);
  do {
    st = Json();
    if (HasFailure()) return;
    if (st.has_checkpoint() && st.checkpoint().complete()) break;
    std::this_thread::sleep_for(milliseconds(100));
  } while (Clock::now() < until);
  for (ChildProcess* w : workers) ASSERT_TRUE(w->Running()) << "training ended too early";

  // Configuration.
  EXPECT_EQ(st.config().mode(), control::SSP);
  EXPECT_EQ(st.config().staleness(), 1u);
  EXPECT_EQ(st.config().num_servers(), 2u);
  EXPECT_EQ(st.config().num_workers(), 3u);
  EXPECT_EQ(st.config().replicas(), 1u);
  EXPECT_EQ(st.config().transport(), spec.transport);
  // Members by role, as started; every one alive and heard from within the lease.
  EXPECT_EQ(st.servers(), 2u);
  EXPECT_EQ(st.workers(), 3u);
  EXPECT_EQ(Count(st, control::ROLE_SERVER), 2);
  EXPECT_EQ(Count(st, control::ROLE_WORKER), 3);
  EXPECT_GT(st.epoch(), 0u);
  std::set<uint32_t> worker_ranks;
  for (const auto& m : st.members()) {
    EXPECT_TRUE(m.alive()) << m.ShortDebugString();
    EXPECT_LT(m.heartbeat_age_ms(), 3000u) << m.ShortDebugString();
    EXPECT_GT(m.pid(), 0u);
    if (m.role() == control::ROLE_WORKER) worker_ranks.insert(m.rank());
  }
  EXPECT_EQ(worker_ranks, (std::set<uint32_t>{0, 1, 2}));

  // The shard map: the coordinator's is the pure plan of the workers' model.
  auto plan =
      PlanShards({TensorSpec{"W", DType::kFloat32, {64, 8}}, TensorSpec{"b", DType::kFloat32, {8}}},
                 spec.servers, spec.partition_bytes);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(st.shard_map_ready());
  EXPECT_EQ(st.plan_fingerprint(), plan->Fingerprint());
  EXPECT_EQ(st.chunks(), plan->chunks.size());
  ASSERT_EQ(st.groups_size(), 2);
  uint64_t total = 0;
  for (int g = 0; g < 2; ++g) {
    uint32_t chunks = 0;
    for (const ChunkPlan& c : plan->chunks) chunks += c.server == static_cast<uint32_t>(g);
    const control::StatusGroup& sg = st.groups(g);
    EXPECT_EQ(sg.group(), static_cast<uint32_t>(g));
    EXPECT_EQ(sg.primary_rank(), g);
    EXPECT_EQ(sg.backup_rank(), -1);
    EXPECT_FALSE(sg.lost());
    EXPECT_EQ(sg.chunks(), chunks) << "group " << g;
    EXPECT_EQ(sg.bytes(), plan->server_bytes[g]) << "group " << g;
    EXPECT_EQ(sg.row_shards(), 0u);
    total += sg.bytes();
  }
  EXPECT_EQ(st.model_bytes(), total);

  // Live numbers: every server applies bytes, every worker moves bytes, clocks within the
  // staleness bound (+1 for the heartbeat's age).
  EXPECT_GT(st.max_clock(), 0u);
  for (const auto& m : st.members()) {
    ASSERT_TRUE(m.has_stats()) << m.ShortDebugString();
    if (m.role() == control::ROLE_SERVER) {
      EXPECT_GE(m.group(), 0) << m.ShortDebugString();
      EXPECT_GT(m.stats().pushes_applied(), 0u) << m.ShortDebugString();
      EXPECT_GT(m.stats().bytes_applied(), 0u) << m.ShortDebugString();
      EXPECT_GT(m.bytes_per_second(), 0.0) << m.ShortDebugString();
      EXPECT_GT(m.stats().max_applied_clock(), 0u) << m.ShortDebugString();
      EXPECT_LE(m.stats().min_applied_clock(), m.stats().max_applied_clock());
    } else {
      EXPECT_GT(m.stats().clock(), 0u) << m.ShortDebugString();
      EXPECT_LE(m.stats().clock(), static_cast<uint64_t>(kSteps));
      EXPECT_EQ(m.clock_lag(), st.max_clock() - m.stats().clock());
      // SSP keeps the true lag within the staleness bound; the clock in a heartbeat is as old
      // as the heartbeat, at most one step (200 ms) on an idle host, more on a loaded one.
      const uint64_t stale_steps =
          std::max<uint64_t>(1, (m.heartbeat_age_ms() + kStepDelayMs - 1) / kStepDelayMs);
      EXPECT_LE(m.clock_lag(), spec.staleness + stale_steps) << m.ShortDebugString();
      EXPECT_GT(m.bytes_per_second(), 0.0) << m.ShortDebugString();
      EXPECT_GT(m.stats().bytes_pushed(), 0u);
      EXPECT_GT(m.stats().bytes_pulled(), 0u);
    }
  }

  // The checkpoint: complete, a multiple of checkpoint_every, in the cluster's directory, and
  // there on disk.
  ASSERT_TRUE(st.has_checkpoint()) << st.ShortDebugString();
  EXPECT_TRUE(st.checkpoint().complete()) << st.checkpoint().ShortDebugString();
  EXPECT_EQ(st.checkpoint().groups(), 2u);
  EXPECT_EQ(st.checkpoint().groups_written(), 2u);
  EXPECT_GE(st.checkpoint().clock(), 4u);
  EXPECT_EQ(st.checkpoint().clock() % 4, 0u);
  EXPECT_EQ(st.checkpoint().dir(), spec.checkpoint_dir);
  EXPECT_GT(st.checkpoint().unix_ms(), 0u);
  char name[64];
  std::snprintf(name, sizeof(name), "/ckpt-%012llu",
                static_cast<unsigned long long>(st.checkpoint().clock()));
  EXPECT_TRUE(std::filesystem::exists(spec.checkpoint_dir + name)) << spec.checkpoint_dir + name;

  // The table names every member and group.
  const StatusRun table = RunStatus({});
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("2 servers, 3 workers joined"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("checkpoint clock "), std::string::npos) << table.out;
  // (A newer checkpoint may be half reported by now: complete or not, it counts both groups.)
  EXPECT_NE(table.out.find("/2 groups)"), std::string::npos) << table.out;

  // A stranger: refused with a one-line reason, exit 1; the membership is unchanged.
  const control::StatusReply before = Json();
  const StatusRun stranger = RunStatus({"--json"}, "not-the-token");
  EXPECT_EQ(stranger.exit_code, 1);
  EXPECT_NE(stranger.err.find("wrong cluster token"), std::string::npos) << stranger.err;
  EXPECT_EQ(stranger.out, "");
  const control::StatusReply after = Json();
  EXPECT_EQ(after.epoch(), before.epoch());
  EXPECT_EQ(after.members_size(), before.members_size());
  // The reply holds no secret: not the token, no region descriptor.
  const StatusRun raw = RunStatus({"--json"});
  EXPECT_EQ(raw.out.find(kToken), std::string::npos);
  EXPECT_EQ(raw.out.find("encoded_descriptor"), std::string::npos);
  EXPECT_EQ(raw.out.find("credential"), std::string::npos);

  for (ChildProcess* w : workers) EXPECT_EQ(ExitCode(w, ProcessBound()), 0) << Tail(w);
}

// Malformed status requests, a second request on the same connection, a burst of askers (rate
// limited) and an unreachable coordinator: the coordinator survives them all, nobody joins, and
// the tool says why.
TEST_P(ShardpsStatusTest, SurvivesMalformedAndRepeatedRequests) {
  ClusterSpec spec = Spec();
  spec.workers = 1;
  ASSERT_TRUE(StartCluster(spec));
  // Bounded: the servers have joined once both are members.
  control::StatusReply st;
  const auto until = Clock::now() + milliseconds(20000);
  do {
    st = Json();
    if (HasFailure()) return;
    if (st.servers() == 2) break;
    std::this_thread::sleep_for(milliseconds(50));
  } while (Clock::now() < until);
  ASSERT_EQ(st.servers(), 2u);
  const uint64_t epoch = st.epoch();

  auto exchange = [&](const std::string& bytes) -> std::string {
    auto fd = net::ConnectTcp(coordinator_address_, "", milliseconds(3000));
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (!fd.ok()) return "";
    timeval tv{5, 0};
    setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    EXPECT_EQ(send(fd->get(), bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
    std::string got;
    char buf[4096];
    while (true) {  // until the coordinator closes (bounded by SO_RCVTIMEO)
      const ssize_t k = recv(fd->get(), buf, sizeof(buf), 0);
      if (k <= 0) break;
      got.append(buf, static_cast<size_t>(k));
    }
    return got;
  };
  auto frame = [](const std::string& payload) {
    std::string f(4, '\0');
    const uint32_t n = static_cast<uint32_t>(payload.size());
    std::memcpy(f.data(), &n, 4);
    return f + payload;
  };
  const std::string magic(control::kMagic);
  // Field 16 (status_request), length 5, holding a string field whose length runs past its end.
  const std::string bad_request = std::string("\x82\x01\x05\x0a\x7f", 5) + "abc";
  EXPECT_TRUE(exchange(magic + frame(bad_request)).empty());
  // A status request with a 1 MiB token: answered with a refusal, not a crash.
  {
    control::Envelope e;
    e.mutable_status_request()->set_cluster_token(std::string(1 << 20, 'x'));
    const std::string got = exchange(magic + *control::EncodeFrame(e));
    control::FrameDecoder d;
    d.Feed(got.data(), got.size());
    control::Envelope reply;
    auto ok = d.Next(&reply);
    ASSERT_TRUE(ok.ok() && *ok) << "no reply";
    EXPECT_TRUE(reply.has_error()) << reply.ShortDebugString();
  }
  // A right request followed by a second one on the same connection: one reply, then closed.
  {
    control::Envelope e;
    e.mutable_status_request()->set_cluster_token(kToken);
    const std::string one = *control::EncodeFrame(e);
    const std::string got = exchange(magic + one + one);
    control::FrameDecoder d;
    d.Feed(got.data(), got.size());
    control::Envelope reply;
    auto ok = d.Next(&reply);
    ASSERT_TRUE(ok.ok() && *ok);
    EXPECT_TRUE(reply.has_status_reply());
    ok = d.Next(&reply);
    ASSERT_TRUE(ok.ok());
    EXPECT_FALSE(*ok) << "a second reply on one connection";
  }
  // A status reply sent to the coordinator is not a request.
  {
    control::Envelope e;
    e.mutable_status_reply()->set_epoch(99);
    EXPECT_TRUE(exchange(magic + *control::EncodeFrame(e)).empty());
  }
  // A burst of 30 askers at once: at most kMaxStatusPerSecond (20) answered within a second,
  // the others told to retry; every one gets exactly one reply.
  {
    control::Envelope e;
    e.mutable_status_request()->set_cluster_token(kToken);
    const std::string request = magic + *control::EncodeFrame(e);
    std::vector<UniqueFd> fds;
    for (int i = 0; i < 30; ++i) {
      auto fd = net::ConnectTcp(coordinator_address_, "", milliseconds(3000));
      ASSERT_TRUE(fd.ok()) << fd.status();
      timeval tv{5, 0};
      setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      fds.push_back(std::move(*fd));
    }
    for (UniqueFd& fd : fds) {
      ASSERT_EQ(send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL),
                static_cast<ssize_t>(request.size()));
    }
    int answered = 0, retry = 0;
    for (UniqueFd& fd : fds) {
      std::string got;
      char buf[4096];
      for (ssize_t k; (k = recv(fd.get(), buf, sizeof(buf), 0)) > 0;) {
        got.append(buf, static_cast<size_t>(k));
      }
      control::FrameDecoder d;
      d.Feed(got.data(), got.size());
      control::Envelope reply;
      auto ok = d.Next(&reply);
      ASSERT_TRUE(ok.ok() && *ok) << "no reply";
      answered += reply.has_status_reply();
      retry += reply.has_error() &&
               reply.error().message().find("retry later") != std::string::npos;
    }
    EXPECT_LE(answered, 20);
    EXPECT_GE(retry, 10);
    EXPECT_EQ(answered + retry, 30);
  }
  std::this_thread::sleep_for(milliseconds(1100));  // the rate window passes

  ASSERT_TRUE(coordinator_->Running()) << coordinator_->LogTail();
  const control::StatusReply again = Json();
  EXPECT_EQ(again.epoch(), epoch);
  EXPECT_EQ(again.servers(), 2u);
  EXPECT_EQ(again.workers(), 0u);

  // Nothing listening: exit 1 with the reason, within the timeout.
  coordinator_->Kill();
  const auto t0 = Clock::now();
  const StatusRun down = RunStatus({"--timeout_ms", "2000"});
  EXPECT_EQ(down.exit_code, 1);
  // Refused at connect, or (the killed process's socket not closed yet) no reply: one line
  // naming the address.
  EXPECT_TRUE(down.err.find("cannot reach the coordinator") != std::string::npos ||
              down.err.find("no status reply") != std::string::npos)
      << down.err;
  EXPECT_NE(down.err.find(coordinator_address_), std::string::npos) << down.err;
  EXPECT_EQ(std::count(down.err.begin(), down.err.end(), '\n'), 1) << down.err;
  EXPECT_LT(Clock::now() - t0, milliseconds(10000));
}

INSTANTIATE_TEST_SUITE_P(Transports, ShardpsStatusTest, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace shardps::proc_test
