// shardps doctor, as real processes: each failure the issue names is caused for real and the
// diagnosis (status, detail, fix) asserted from the JSON report, which is also checked against
// the table. Probes between two doctors assert on the figures and on the verified bytes.
// The verbs test runs inside the SoftRoCE guest (scripts/test.sh) and skips elsewhere.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "common/fd.h"
#include "tests/integration/child_process.h"

namespace shardps {
namespace {

using testing_util::ChildProcess;
using Clock = std::chrono::steady_clock;

struct Check {
  std::string status, detail, fix;
};
struct Pair {
  std::string to, transport, from;
  bool ok = false;
  double w_alpha = 0, w_beta = 0, r_alpha = 0, r_beta = 0;
  uint64_t verified = 0, small = 0, large = 0;
};
struct Parsed {
  int exit_status = -1;
  std::map<std::string, Check> checks;
  std::vector<Pair> pairs;
  std::vector<std::vector<std::string>> ports;
  int table_match = -1;
};

std::string ReadFile(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> SplitTabs(const std::string& l) {
  std::vector<std::string> f;
  std::stringstream ss(l);
  std::string x;
  while (std::getline(ss, x, '\t')) f.push_back(x);
  return f;
}

class DoctorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::string(DOCTOR_TEST_DIR) + "/" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::string cmd = "rm -rf '" + dir_ + "' && mkdir -p '" + dir_ + "'";
    ASSERT_EQ(system(cmd.c_str()), 0);
  }

  // Runs argv to completion (bounded); returns the exit code, output in *log.
  int Run(const std::vector<std::string>& argv, const std::string& name, std::string* log,
          std::chrono::seconds bound = std::chrono::seconds(60)) {
    const std::string path = dir_ + "/" + name + ".log";
    auto c = ChildProcess::Spawn(argv, path, bound + std::chrono::seconds(5));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return -1;
    auto code = (*c)->Wait(std::chrono::duration_cast<std::chrono::milliseconds>(bound));
    *log = ReadFile(path);
    EXPECT_TRUE(code.has_value()) << name << " did not finish: " << *log;
    return code.value_or(-1);
  }

  std::vector<std::string> Doctor(std::vector<std::string> args) {
    std::vector<std::string> a = {SHARDPS_BIN, "doctor"};
    a.insert(a.end(), args.begin(), args.end());
    return a;
  }

  Parsed Parse(const std::string& json, const std::string& table = "") {
    std::vector<std::string> a = {"/usr/bin/python3", DOCTOR_JSON_PY, json};
    if (!table.empty()) {
      a.push_back("--table");
      a.push_back(table);
    }
    std::string out;
    const int rc = Run(a, "parse" + std::to_string(++parses_), &out);
    EXPECT_EQ(rc, 0) << "the JSON does not parse: " << out << "\n" << ReadFile(json);
    Parsed p;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line)) {
      auto f = SplitTabs(line);
      if (f.size() == 2 && f[0] == "exit_status") p.exit_status = std::stoi(f[1]);
      if (f.size() == 2 && f[0] == "table_match") p.table_match = std::stoi(f[1]);
      if (f.size() >= 4 && f[0] == "check") {
        p.checks[f[1]] = Check{f[2], f[3], f.size() > 4 ? f[4] : ""};
      }
      if (f.size() >= 12 && f[0] == "pair") {
        Pair q;
        q.to = f[1];
        q.ok = f[2] == "1";
        q.transport = f[3];
        q.w_alpha = std::stod(f[4]);
        q.w_beta = std::stod(f[5]);
        q.r_alpha = std::stod(f[6]);
        q.r_beta = std::stod(f[7]);
        q.verified = std::stoull(f[8]);
        q.small = std::stoull(f[9]);
        q.large = std::stoull(f[10]);
        q.from = f[11];
        p.pairs.push_back(q);
      }
      if (f.size() >= 4 && f[0] == "port") p.ports.push_back(f);
    }
    return p;
  }

  // Starts a probe responder; returns its address.
  std::string Serve(const std::string& transport, const std::string& bind_ip,
                    std::unique_ptr<ChildProcess>* child, const std::string& name = "serve") {
    const std::string af = dir_ + "/" + name + ".addr";
    auto c = ChildProcess::Spawn(Doctor({"--serve", "--transport", transport, "--bind_ip",
                                         bind_ip, "--address_file", af, "--serve_ms", "60000"}),
                                 dir_ + "/" + name + ".log", std::chrono::seconds(70));
    EXPECT_TRUE(c.ok());
    if (!c.ok()) return "";
    *child = std::move(*c);
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    struct stat st{};
    while (stat(af.c_str(), &st) != 0 && Clock::now() < deadline && (*child)->Running()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string addr;
    std::istringstream(ReadFile(af)) >> addr;
    EXPECT_FALSE(addr.empty()) << (*child)->LogTail();
    return addr;
  }

  std::string dir_;
  int parses_ = 0;
};

int FreePort() {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return -1;
  socklen_t len = sizeof(a);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);  // closed on return: nothing listens there
}

bool HaveRdmaDevice() {
  struct stat st{};
  return stat("/sys/class/infiniband", &st) == 0 &&
         system("test -n \"$(ls -A /sys/class/infiniband 2>/dev/null)\"") == 0;
}

TEST_F(DoctorTest, LowMemlockFailsWithTheFix) {
  // 64 MiB on 1 server (16 chunks of 4 MiB, max_workers 1): weights 16*(64 + 2*4 MiB) and inbox
  // 16*2*(64 + 4 MiB), each 128 MiB + 1 KiB rounded up to a page, plus a page each for acks
  // and clocks. The worker needs less (128 MiB + staging).
  const uint64_t need = 2 * ((128ull << 20) + 4096) + 2 * 4096;
  std::vector<std::string> a;
  if (geteuid() == 0) {
    // Root has CAP_IPC_LOCK, which exempts it from the limit: drop it, as a user lacks it.
    a = {"/usr/bin/setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"};
  }
  a.insert(a.end(), {"/usr/bin/prlimit", "--memlock=65536:65536", SHARDPS_BIN, "doctor",
                     "--transport", "tcp", "--assume_transport", "verbs", "--model", "64MiB",
                     "--json_out", dir_ + "/low.json"});
  std::string log;
  const auto t0 = Clock::now();
  EXPECT_EQ(Run(a, "low", &log), 1) << log;
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  Parsed p = Parse(dir_ + "/low.json", dir_ + "/low.log");
  ASSERT_TRUE(p.checks.count("memlock")) << log;
  const Check& m = p.checks["memlock"];
  EXPECT_EQ(m.status, "fail") << m.detail;
  EXPECT_NE(m.detail.find("RLIMIT_MEMLOCK 65536 bytes"), std::string::npos) << m.detail;
  EXPECT_NE(m.detail.find("needs " + std::to_string(need) + " bytes"), std::string::npos)
      << m.detail;
  EXPECT_NE(m.detail.find("ibv_reg_mr"), std::string::npos) << m.detail;
  for (const char* fix : {"ulimit -l unlimited", "/etc/security/limits.conf",
                          "LimitMEMLOCK=infinity", "--ulimit memlock=-1"}) {
    EXPECT_NE(m.fix.find(fix), std::string::npos) << "fix lacks " << fix << ": " << m.fix;
  }
  EXPECT_EQ(p.exit_status, 1);
  EXPECT_EQ(p.table_match, 1) << log;

  // A model that fits the same limit passes (4 KiB: the server's four regions take 3+3+1+1
  // pages, 32 KiB < 64 KiB); over tcp the low limit only warns.
  a.erase(a.end() - 4, a.end());
  a.insert(a.end(), {"--model", "4KiB", "--json_out", dir_ + "/fits.json"});
  EXPECT_EQ(Run(a, "fits", &log), 0) << log;
  const Check fits = Parse(dir_ + "/fits.json").checks["memlock"];
  EXPECT_EQ(fits.status, "ok") << fits.detail;
  EXPECT_NE(fits.detail.find("needs 32768 bytes"), std::string::npos) << fits.detail;
  a = {"/usr/bin/prlimit", "--memlock=65536:65536", SHARDPS_BIN, "doctor", "--transport",
       "tcp", "--model", "64MiB", "--json_out", dir_ + "/tcp.json"};
  EXPECT_EQ(Run(a, "tcp", &log), 0) << log;
  const Check t = Parse(dir_ + "/tcp.json").checks["memlock"];
  EXPECT_EQ(t.status, "warn") << t.detail;
  EXPECT_NE(t.detail.find("matters only for verbs"), std::string::npos) << t.detail;
}

// A model file with a row table: the memlock need counts the table as its servers register it
// (RowHeader records, one inbox slot of max_ids entries per worker and parity). Server 0 holds
// fc (100x10 float32: 64 + 2 x 4032 B of weights, 2 x (128 + 4032) B of inbox) and items
// (100000 rows x 64: 64 + 100000 x 272 B of records (a 16-byte RowHeader and 256 B); 2 x (128
// + 1024 x 264) B of inbox): weights 27,208,192 B -> 27,209,728 (pages), inbox 549,248 ->
// 552,960, acks and clocks a page each: 27,770,880 bytes.
TEST_F(DoctorTest, MemlockCountsRowTablesAsTheServersRegisterThem) {
  {
    std::ofstream f(dir_ + "/model.txt");
    f << "fc 100 10\nembedding items 100000 64 max_ids=1024\n";
  }
  std::string log;
  EXPECT_EQ(Run({"/usr/bin/prlimit", "--memlock=65536:65536", SHARDPS_BIN, "doctor",
                 "--transport", "tcp", "--model", dir_ + "/model.txt", "--json_out",
                 dir_ + "/rows.json"},
                "rows", &log),
            0)
      << log;
  const Check m = Parse(dir_ + "/rows.json").checks["memlock"];
  EXPECT_NE(m.detail.find("needs 27770880 bytes"), std::string::npos) << m.detail;
  {
    std::ofstream f(dir_ + "/bad.txt");
    f << "embedding items 100000\n";
  }
  EXPECT_EQ(Run({SHARDPS_BIN, "doctor", "--transport", "tcp", "--model", dir_ + "/bad.txt",
                 "--json_out", dir_ + "/bad.json"},
                "bad", &log),
            1)
      << log;
  const Check b = Parse(dir_ + "/bad.json").checks["memlock"];
  EXPECT_NE(b.detail.find("bad.txt:1"), std::string::npos) << b.detail;
}

// The huge pages check reads both THP selectors and answers for the transport's memory: shm
// regions are a memfd, on 2 MiB pages only when shmem_enabled allows it (Debian's default,
// never, leaves them at 4 KiB whatever `enabled` says); tcp and verbs regions follow `enabled`.
TEST_F(DoctorTest, HugePagesAnswerForTheTransportsMemory) {
  struct Case {
    const char* transport;
    const char* enabled;
    const char* shmem;
    const char* status;
    const char* says;  // in the detail
    const char* fix;   // in the fix ("" = no fix)
  };
  const Case cases[] = {
      {"shm", "always [madvise] never", "always within_size advise [never] deny force", "warn",
       "shm regions 4 KiB pages", "echo advise > "},
      {"shm", "always [madvise] never", "always within_size [advise] never deny force", "ok",
       "shm regions 2 MiB pages", ""},
      {"tcp", "always [madvise] never", "always within_size advise [never] deny force", "ok",
       "tcp and verbs regions use 2 MiB pages", ""},
      {"tcp", "always madvise [never]", "always within_size [advise] never deny force", "warn",
       "tcp and verbs regions use 4 KiB pages", "echo madvise > "},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string thp = dir_ + "/thp" + std::to_string(k);
    ASSERT_EQ(system(("mkdir -p '" + thp + "'").c_str()), 0);
    std::ofstream(thp + "/enabled") << c.enabled << "\n";
    std::ofstream(thp + "/shmem_enabled") << c.shmem << "\n";
    const std::string json = dir_ + "/case" + std::to_string(k) + ".json";
    std::string log;
    EXPECT_EQ(Run(Doctor({"--transport", "tcp", "--assume_transport", c.transport, "--thp_dir",
                          thp, "--json_out", json}),
                  "case" + std::to_string(k), &log),
              0)
        << log;
    const Check h = Parse(json).checks["huge pages"];
    EXPECT_EQ(h.status, c.status) << k << ": " << h.detail;
    EXPECT_NE(h.detail.find(c.says), std::string::npos) << k << ": " << h.detail;
    if (*c.fix != '\0') {
      EXPECT_NE(h.fix.find(std::string(c.fix) + thp), std::string::npos) << k << ": " << h.fix;
    } else {
      EXPECT_EQ(h.fix, "") << k;
    }
    ++k;
  }
}

TEST_F(DoctorTest, CoordinatorDownIsDiagnosedWithinTheTimeout) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  std::string log;
  const auto t0 = Clock::now();
  EXPECT_EQ(Run(Doctor({"--transport", "tcp", "--coordinator", addr, "--timeout_ms", "2000",
                        "--json_out", dir_ + "/down.json"}),
                "down", &log),
            1)
      << log;
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000 + 3000));
  Parsed p = Parse(dir_ + "/down.json", dir_ + "/down.log");
  const Check& c = p.checks["coordinator"];
  EXPECT_EQ(c.status, "fail");
  EXPECT_EQ(c.detail, "cannot reach coordinator at " + addr + " (connection refused)");
  EXPECT_NE(c.fix.find("start shardps_coordinator --listen=" + addr), std::string::npos) << c.fix;
  EXPECT_EQ(p.table_match, 1) << log;
}

TEST_F(DoctorTest, LiveCoordinatorSpeaksTheControlProtocol) {
  const std::string af = dir_ + "/coord.addr";
  auto coord = ChildProcess::Spawn({SHARDPS_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                    "--cluster_token=doctor-test", "--address_file=" + af},
                                   dir_ + "/coord.log", std::chrono::seconds(60));
  ASSERT_TRUE(coord.ok());
  struct stat st{};
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (stat(af.c_str(), &st) != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string addr;
  std::istringstream(ReadFile(af)) >> addr;
  ASSERT_FALSE(addr.empty()) << (*coord)->LogTail();
  std::string log;
  EXPECT_EQ(Run(Doctor({"--transport", "tcp", "--coordinator", addr, "--json_out",
                        dir_ + "/up.json"}),
                "up", &log),
            0)
      << log;
  const Check c = Parse(dir_ + "/up.json").checks["coordinator"];
  EXPECT_EQ(c.status, "ok") << c.detail;
  EXPECT_NE(c.detail.find("reachable at " + addr), std::string::npos) << c.detail;
  EXPECT_NE(c.detail.find("speaks ShardPS control protocol v1"), std::string::npos) << c.detail;
  EXPECT_NE(c.detail.find("refused: \"wrong cluster token\""), std::string::npos) << c.detail;
  EXPECT_TRUE((*coord)->Running()) << "the probe join must not hurt the coordinator";
}

TEST_F(DoctorTest, UnreachablePeerFailsWithinTheTimeout) {
  // A listening socket whose accept queue is full: the kernel drops further SYNs, so a connect
  // hangs exactly like one to a host that does not answer.
  UniqueFd lfd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd.get(), 0), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  std::vector<UniqueFd> fillers;
  bool full = false;
  for (int i = 0; i < 16 && !full; ++i) {
    UniqueFd c(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    connect(c.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
    pollfd p{c.get(), POLLOUT, 0};
    full = poll(&p, 1, 300) == 0;
    fillers.push_back(std::move(c));
  }
  ASSERT_TRUE(full) << "could not fill the accept queue";
  const std::string addr = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  std::string log;
  const auto t0 = Clock::now();
  EXPECT_EQ(Run(Doctor({"--transport", "tcp", "--peer", addr, "--timeout_ms", "1500",
                        "--json_out", dir_ + "/peer.json", "--probe_out", dir_ + "/probe.json"}),
                "peer", &log),
            1)
      << log;
  const auto took = Clock::now() - t0;
  EXPECT_GE(took, std::chrono::milliseconds(1400));
  EXPECT_LT(took, std::chrono::milliseconds(1500 + 3000));
  Parsed p = Parse(dir_ + "/peer.json", dir_ + "/peer.log");
  const Check& c = p.checks["peer " + addr];
  EXPECT_EQ(c.status, "fail");
  EXPECT_EQ(c.detail, "cannot reach peer " + addr + " (no answer within 1500 ms)");
  EXPECT_NE(c.fix.find("shardps doctor --serve"), std::string::npos) << c.fix;
  EXPECT_EQ(p.table_match, 1);
  Parsed probe = Parse(dir_ + "/probe.json");
  ASSERT_EQ(probe.pairs.size(), 1u);
  EXPECT_FALSE(probe.pairs[0].ok);
}

TEST_F(DoctorTest, SilentPeerFailsWithinTheTimeout) {
  // Accepts TCP (the kernel completes the handshake) but never speaks.
  UniqueFd lfd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd.get(), 16), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  const std::string addr = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  std::string log;
  EXPECT_EQ(Run(Doctor({"--transport", "tcp", "--peer", addr, "--timeout_ms", "1000",
                        "--json_out", dir_ + "/silent.json"}),
                "silent", &log),
            1)
      << log;
  const Check c = Parse(dir_ + "/silent.json").checks["peer " + addr];
  EXPECT_EQ(c.status, "fail");
  EXPECT_EQ(c.detail, "peer " + addr +
                          " accepted a connection but sent no probe greeting (no answer within "
                          "1000 ms)");
}

TEST_F(DoctorTest, MissingTransportFailsAndNeverFallsBack) {
  if (HaveRdmaDevice()) GTEST_SKIP() << "this host has an RDMA device: verbs is not missing";
  std::unique_ptr<ChildProcess> server;
  const std::string addr = Serve("tcp", "127.0.0.1", &server);
  ASSERT_FALSE(addr.empty());
  std::string log;
  EXPECT_EQ(Run(Doctor({"--transport", "verbs", "--peer", addr, "--json_out",
                        dir_ + "/verbs.json"}),
                "verbs", &log),
            1)
      << log;
  Parsed p = Parse(dir_ + "/verbs.json", dir_ + "/verbs.log");
  const Check& t = p.checks["transport"];
  EXPECT_EQ(t.status, "fail");
  EXPECT_NE(t.detail.find("transport 'verbs' was asked for and cannot start"), std::string::npos);
  // The provider's own reason.
  EXPECT_TRUE(t.detail.find("no RDMA device found") != std::string::npos ||
              t.detail.find("built without verbs support") != std::string::npos)
      << t.detail;
  EXPECT_NE(t.fix.find("--transport tcp"), std::string::npos) << t.fix;
  EXPECT_EQ(p.checks["rdma devices"].status, "fail");
  // The pair is not probed over tcp instead.
  const Check& c = p.checks["peer " + addr];
  EXPECT_EQ(c.status, "fail");
  EXPECT_EQ(c.detail, "this side asked for verbs, the peer serves tcp; both ends of a pair must "
                      "use the same transport");
  EXPECT_EQ(log.find("auto picked"), std::string::npos);
  EXPECT_EQ(p.table_match, 1);
}

class DoctorProbeTest : public DoctorTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(DoctorProbeTest, TwoDoctorsMeasureAndVerify) {
  const std::string transport = GetParam();
  std::unique_ptr<ChildProcess> server;
  const std::string addr = Serve(transport, "127.0.0.1", &server);
  ASSERT_FALSE(addr.empty());
  std::string log;
  EXPECT_EQ(Run(Doctor({"--transport", transport, "--peer", addr, "--probe_ms", "200",
                        "--probe_iters", "50", "--json_out", dir_ + "/r.json", "--probe_out",
                        dir_ + "/probe.json"}),
                "probe", &log),
            0)
      << log;
  Parsed r = Parse(dir_ + "/r.json", dir_ + "/probe.log");
  EXPECT_EQ(r.table_match, 1);
  EXPECT_EQ(r.checks["peer " + addr].status, "ok") << r.checks["peer " + addr].detail;
  Parsed p = Parse(dir_ + "/probe.json");
  ASSERT_EQ(p.pairs.size(), 1u);
  const Pair& q = p.pairs[0];
  EXPECT_TRUE(q.ok);
  EXPECT_EQ(q.to, addr);
  EXPECT_EQ(q.transport, transport);
  for (double v : {q.w_alpha, q.w_beta, q.r_alpha, q.r_beta}) {
    EXPECT_TRUE(std::isfinite(v) && v > 0) << v;
  }
  EXPECT_LT(q.w_alpha, 1e6);  // microseconds: under a second
  EXPECT_EQ(q.small, 8u);
  EXPECT_EQ(q.large, 1u << 20);
  // The responder's pattern read back, then a written pattern read back here and hashed there.
  EXPECT_EQ(q.verified, 3u << 20);
  server->Kill();
}

INSTANTIATE_TEST_SUITE_P(Transports, DoctorProbeTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

TEST_F(DoctorTest, MpiRunProbesEveryPair) {
  if (system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  std::string log;
  EXPECT_EQ(Run({"/bin/sh", "-c",
                 "exec mpirun --allow-run-as-root --oversubscribe -np 3 " SHARDPS_BIN
                 " doctor --mpi --rendezvous_dir '" + dir_ + "/rv' --transport tcp --bind_ip "
                 "127.0.0.1 --probe_ms 100 --probe_iters 20 --json_out '" + dir_ +
                 "/mpi.json'"},
                "mpi", &log, std::chrono::seconds(90)),
            0)
      << log;
  Parsed p = Parse(dir_ + "/mpi.json");
  ASSERT_EQ(p.pairs.size(), 6u) << log;
  std::map<std::string, int> seen;
  for (const Pair& q : p.pairs) {
    EXPECT_TRUE(q.ok) << q.from << " -> " << q.to;
    EXPECT_GT(q.w_beta, 0);
    EXPECT_EQ(q.verified, 3u << 20);
    ++seen[q.from + ">" + q.to];
  }
  EXPECT_EQ(seen.size(), 6u);  // every ordered pair once
  EXPECT_NE(log.find("row = prober, column = responder"), std::string::npos) << log;
}

// Inside the SoftRoCE guest (softroce-up.sh 2: rxe0 192.168.77.1, rxe1 192.168.77.2).
TEST(DoctorVerbs, ProbeBetweenRxe0AndRxe1) {
  struct stat st{};
  if (stat("/sys/class/infiniband/rxe0", &st) != 0) {
    if (getenv("SHARDPS_REQUIRE_VERBS")) FAIL() << "SHARDPS_REQUIRE_VERBS=1 but no rxe0";
    GTEST_SKIP() << "no rxe0 (runs inside the SoftRoCE guest; scripts/test.sh)";
  }
  class Fixture : public DoctorTest {
   public:
    void TestBody() override {}
    using DoctorTest::Doctor;
    using DoctorTest::Parse;
    using DoctorTest::Run;
    using DoctorTest::Serve;
    using DoctorTest::SetUp;
  } f;
  f.SetUp();
  std::unique_ptr<ChildProcess> server;
  const std::string addr = f.Serve("verbs", "192.168.77.2", &server);
  ASSERT_FALSE(addr.empty());
  const std::string dir = std::string(DOCTOR_TEST_DIR) + "/ProbeBetweenRxe0AndRxe1";
  std::string log;
  const int rc = f.Run(f.Doctor({"--transport", "verbs", "--bind_ip", "192.168.77.1", "--peer",
                                 addr, "--probe_ms", "300", "--probe_iters", "50",
                                 "--timeout_ms", "10000", "--json_out", dir + "/v.json",
                                 "--probe_out", dir + "/probe.json"}),
                       "verbs", &log, std::chrono::seconds(120));
  std::cout << log;  // the device/GID table and the probe line, for the record
  Parsed r = f.Parse(dir + "/v.json", dir + "/verbs.log");
  EXPECT_EQ(r.table_match, 1);
  EXPECT_EQ(r.checks["transport"].status, "ok") << r.checks["transport"].detail;
  bool rxe0 = false;
  for (const auto& port : r.ports) {
    if (port[1] != "rxe0:1") continue;
    rxe0 = true;
    EXPECT_EQ(port[2], "active");  // ibv_port_state_str
    EXPECT_GE(std::stoi(port[3]), 0);
    EXPECT_NE(port[4].find("RoCEv2 IPv4-mapped GID ::ffff:192.168.77.1"), std::string::npos)
        << port[4];
  }
  EXPECT_TRUE(rxe0) << log;
  const Check& c = r.checks["peer " + addr];
  EXPECT_EQ(c.status, "ok") << c.detail;
  Parsed p = f.Parse(dir + "/probe.json");
  ASSERT_EQ(p.pairs.size(), 1u);
  EXPECT_TRUE(p.pairs[0].ok);
  EXPECT_EQ(p.pairs[0].transport, "verbs");
  EXPECT_GT(p.pairs[0].w_beta, 0);
  EXPECT_GT(p.pairs[0].r_alpha, 0);
  EXPECT_EQ(p.pairs[0].verified, 3u << 20);
  EXPECT_NE(rc, 2);
}

}  // namespace
}  // namespace shardps
