// `shardps doctor`: the command line around tools/doctor.h. Modes:
//   shardps doctor [--coordinator H:P] [--peer A,B] [--model M] ...   checks and probes
//   shardps doctor --serve [--serve_port P] [--address_file F]        a probe responder
//   mpirun -np N shardps doctor --mpi --rendezvous_dir DIR             every rank serves and
//       probes every other rank (in N-1 rounds, one prober per responder per round); rank 0
//       prints all ranks' checks and the N x N table.
// Exit status: 0 nothing would stop training, 1 something would, 2 usage error.
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "common/version.h"
#include "tools/doctor.h"
#include "tools/subcommands.h"
#include "transport/flags.h"

DEFINE_string(coordinator, "", "Coordinator to check (host:port); empty: not checked");
DEFINE_string(peer, "", "Probe responders to probe (host:port[,host:port...])");
DEFINE_int32(timeout_ms, 3000, "Bound on every connect and every wait");
DEFINE_bool(json, false, "Print JSON (docs/doctor.md) instead of the table");
DEFINE_string(json_out, "", "Also write the JSON report to this file");
DEFINE_string(probe_out, "", "Write the pair probe results (the link model shardps plan reads)");
DEFINE_string(model, "", "Model whose registrations the memlock check computes: a size "
                         "(268435456, 256MiB) or a file with one `name dim0 dim1 ...` or `embedding NAME ROWS DIM [max_ids=N]` per line");
DEFINE_int32(num_servers, 1, "Servers of the configuration (memlock)");
DEFINE_int32(num_workers, 1, "Workers of the configuration (memlock)");
DEFINE_int32(max_workers, 0, "Inbox slots per server (memlock; 0: num_workers)");
DEFINE_uint64(partition_bytes, 4u << 20, "Chunk size of the configuration (memlock)");
DEFINE_string(assume_transport, "",
              "Transport the memlock and fork checks assume (empty: the one opened here)");
DEFINE_string(thp_dir, "/sys/kernel/mm/transparent_hugepage",
              "Where the huge pages check reads the THP settings (enabled, shmem_enabled)");
DEFINE_bool(serve, false, "Run a probe responder until SIGINT/SIGTERM (or --serve_ms)");
DEFINE_int32(serve_port, 0, "--serve/--mpi: control port of the responder (0: pick one)");
DEFINE_string(address_file, "", "--serve: write the responder's address here");
DEFINE_int32(serve_ms, 0, "--serve: exit after this many ms (0: until a signal)");
DEFINE_int32(probe_iters, 200, "Small ops per latency probe");
DEFINE_int32(probe_ms, 500, "Duration of each bandwidth probe (ms)");
DEFINE_uint64(probe_bytes, 1u << 20, "Size of a bandwidth probe op");
DEFINE_uint64(probe_small_bytes, 8, "Size of a latency probe op");
DEFINE_bool(mpi, false, "Run under mpirun: every rank serves and probes every other rank");
DEFINE_string(rendezvous_dir, "", "--mpi: a directory every rank can read and write");
DEFINE_int32(rendezvous_timeout_ms, 60000, "--mpi: bound on waiting for the other ranks");

namespace shardps::tools {
namespace {

using Clock = std::chrono::steady_clock;

// gflags exits 1 on an unknown flag; a usage error here is 2.
bool KnownFlags(int argc, char** argv, std::string* bad) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.rfind("-", 0) != 0) {
      *bad = "unexpected argument '" + a + "'";
      return false;
    }
    a = a.substr(a.rfind("--", 0) == 0 ? 2 : 1);
    const bool has_value = a.find('=') != std::string::npos;
    a = a.substr(0, a.find('='));
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(a.c_str(), &info)) {
      if (!has_value && info.type != "bool") ++i;  // "--flag value"
      continue;
    }
    if (a.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(a.substr(2).c_str(), &info)) {
      continue;
    }
    if (a == "help" || a == "h" || a == "helpshort" || a == "helpfull" || a == "version") {
      continue;
    }
    *bad = "unknown flag --" + a;
    return false;
  }
  return true;
}

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string p;
  while (std::getline(ss, p, ',')) {
    if (!p.empty()) out.push_back(p);
  }
  return out;
}

bool WriteFileAtomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp);
    if (!f) return false;
    f << text;
    if (!f) return false;
  }
  return rename(tmp.c_str(), path.c_str()) == 0;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool Exists(const std::string& path) {
  struct stat st{};
  return stat(path.c_str(), &st) == 0;
}

// Waits until DIR/<prefix>.<r> exists for every rank r < n.
Status WaitAll(const std::string& dir, const std::string& prefix, int n,
               std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    int missing = -1;
    for (int r = 0; r < n && missing < 0; ++r) {
      if (!Exists(dir + "/" + prefix + "." + std::to_string(r))) missing = r;
    }
    if (missing < 0) return Status::OK();
    if (Clock::now() > deadline) {
      return DeadlineExceededError("rank " + std::to_string(missing) + " never wrote " + dir +
                                   "/" + prefix + "." + std::to_string(missing));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string Flat(std::string s) {
  for (char& c : s) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

int EnvInt(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (const char* v = getenv(n)) return atoi(v);
  }
  return -1;
}

void Emit(const Report& r) {
  if (FLAGS_json) {
    std::cout << FormatJson(r);
  } else {
    std::cout << FormatTable(r);
  }
  std::cout.flush();
  if (!FLAGS_json_out.empty() && !WriteFileAtomic(FLAGS_json_out, FormatJson(r))) {
    std::cerr << "shardps doctor: cannot write " << FLAGS_json_out << "\n";
  }
  if (!FLAGS_probe_out.empty() && !WriteFileAtomic(FLAGS_probe_out, FormatProbeFile(r.pairs))) {
    std::cerr << "shardps doctor: cannot write " << FLAGS_probe_out << "\n";
  }
}

int Serve(const DoctorOptions& o) {
  const std::string ip = o.fabric.bind_ip.empty() ? "0.0.0.0" : o.fabric.bind_ip;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before the responder's thread starts
  auto r = ProbeResponder::Start(o, ip + ":" + std::to_string(FLAGS_serve_port));
  if (!r.ok()) {
    Report rep;
    rep.host = HostName();
    rep.transport_asked = o.fabric.provider;
    rep.checks.push_back({"probe responder", CheckStatus::kFail,
                          "cannot serve probes over " + o.fabric.provider + ": " +
                              r.status().message(),
                          "fix the transport (see `shardps doctor --transport " +
                              o.fabric.provider + "`) or serve another one"});
    Emit(rep);
    return 1;
  }
  std::cout << "shardps doctor: serving probes at " << (*r)->address() << " over "
            << (*r)->transport() << std::endl;
  if (!FLAGS_address_file.empty() && !WriteFileAtomic(FLAGS_address_file, (*r)->address() + "\n")) {
    std::cerr << "shardps doctor: cannot write " << FLAGS_address_file << "\n";
    return 1;
  }
  timespec ts{FLAGS_serve_ms / 1000, (FLAGS_serve_ms % 1000) * 1000000L};
  if (FLAGS_serve_ms > 0) {
    sigtimedwait(&set, nullptr, &ts);
  } else {
    int sig = 0;
    sigwait(&set, &sig);
  }
  std::cout << "shardps doctor: served " << (*r)->probes_served() << " probe(s)" << std::endl;
  return 0;
}

int Mpi(DoctorOptions o) {
  const int rank = EnvInt({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"});
  const int size = EnvInt({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  if (rank < 0 || size < 1) {
    std::cerr << "shardps doctor --mpi: no rank in the environment (OMPI_COMM_WORLD_RANK, "
                 "PMI_RANK); start it with mpirun\n";
    return 2;
  }
  if (FLAGS_rendezvous_dir.empty()) {
    std::cerr << "shardps doctor --mpi needs --rendezvous_dir (a directory all ranks share)\n";
    return 2;
  }
  std::string dir = FLAGS_rendezvous_dir;
  const char* job = getenv("OMPI_MCA_ess_base_jobid");
  dir += std::string("/job-") + (job ? job : "0");
  mkdir(FLAGS_rendezvous_dir.c_str(), 0777);
  mkdir(dir.c_str(), 0777);
  const auto rv_timeout = std::chrono::milliseconds(FLAGS_rendezvous_timeout_ms);
  const std::string me = "rank " + std::to_string(rank);
  o.self_name = me + " (" + HostName() + ")";

  Report local = RunDoctor(o);  // local checks (no peers yet)
  const std::string ip = o.fabric.bind_ip.empty() ? "0.0.0.0" : o.fabric.bind_ip;
  auto responder = ProbeResponder::Start(o, ip + ":" + std::to_string(FLAGS_serve_port));
  if (!responder.ok()) {
    local.checks.push_back({"probe responder", CheckStatus::kFail, responder.status().message(),
                            "fix the transport check above"});
  }
  const std::string addr = responder.ok() ? (*responder)->address() : "-";
  WriteFileAtomic(dir + "/addr." + std::to_string(rank), addr + "\n");
  Status s = WaitAll(dir, "addr", size, rv_timeout);
  std::vector<std::string> addrs(size);
  for (int r = 0; r < size && s.ok(); ++r) {
    std::istringstream in(ReadFile(dir + "/addr." + std::to_string(r)));
    in >> addrs[r];
  }
  FabricCache cache;
  std::vector<std::pair<int, PairResult>> mine;
  for (int k = 1; k < size && s.ok(); ++k) {
    const int to = (rank + k) % size;
    PairResult p;
    if (addrs[to] == "-") {
      p.from = o.self_name;
      p.to = "rank " + std::to_string(to);
      p.error = "rank " + std::to_string(to) + " could not start its probe responder";
    } else {
      p = ProbePeer(o, addrs[to], &cache);
      p.to = "rank " + std::to_string(to) + " " + addrs[to];
    }
    mine.emplace_back(to, p);
    WriteFileAtomic(dir + "/round" + std::to_string(k) + "." + std::to_string(rank), "done\n");
    s = WaitAll(dir, "round" + std::to_string(k), size, rv_timeout);
  }
  if (!s.ok()) local.checks.push_back({"rendezvous", CheckStatus::kFail, s.message(),
                                       "start every rank (mpirun -np N) with the same "
                                       "--rendezvous_dir on a shared file system"});
  // Results for rank 0: checks and pairs, one tab-separated line each.
  std::ostringstream out;
  for (const CheckResult& c : local.checks) {
    out << "C\t" << CheckStatusName(c.status) << "\t" << Flat(c.name) << "\t" << Flat(c.detail)
        << "\t" << Flat(c.fix) << "\n";
  }
  for (auto& [to, p] : mine) {
    CheckResult c = PairCheck(p, o.timeout);
    out << "C\t" << CheckStatusName(c.status) << "\tpair " << rank << "->" << to << "\t"
        << Flat(c.detail) << "\t" << Flat(c.fix) << "\n";
    char buf[256];
    snprintf(buf, sizeof(buf), "%d\t%d\t%d\t%.6g\t%.6g\t%.6g\t%.6g\t%.6g\t%.6g\t%llu\t%llu\t%llu",
             rank, to, p.ok ? 1 : 0, p.write.alpha_us, p.write.p99_us, p.write.beta_Bps,
             p.read.alpha_us, p.read.p99_us, p.read.beta_Bps,
             static_cast<unsigned long long>(p.verified_bytes),
             static_cast<unsigned long long>(p.write.small_bytes),
             static_cast<unsigned long long>(p.write.large_bytes));
    out << "P\t" << buf << "\t" << Flat(p.transport) << "\t" << Flat(p.to_host) << "\t"
        << Flat(p.why) << "\t" << Flat(p.error) << "\n";
  }
  WriteFileAtomic(dir + "/result." + std::to_string(rank), out.str());
  int code = local.exit_code();
  for (auto& [to, p] : mine) code |= p.ok ? 0 : 1;
  if (rank != 0) {
    // Keep serving until rank 0 has read everything (every round already finished).
    (void)WaitAll(dir, "collected", 1, rv_timeout);
    return code;
  }
  Status all = WaitAll(dir, "result", size, rv_timeout);
  Report merged;
  merged.host = HostName();
  merged.transport_asked = o.fabric.provider;
  merged.transport_effective = local.transport_effective;
  merged.ports = local.ports;
  std::vector<std::vector<std::string>> cell(size, std::vector<std::string>(size, "-"));
  for (int r = 0; r < size; ++r) {
    std::istringstream in(ReadFile(dir + "/result." + std::to_string(r)));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f;
      std::stringstream ls(line);
      std::string x;
      while (std::getline(ls, x, '\t')) f.push_back(x);
      if (f.size() >= 4 && f[0] == "C") {
        CheckStatus st = f[1] == "fail" ? CheckStatus::kFail
                         : f[1] == "warn" ? CheckStatus::kWarn
                                          : CheckStatus::kOk;
        merged.checks.push_back({"rank " + std::to_string(r) + ": " + f[2], st, f[3],
                                 f.size() > 4 ? f[4] : ""});
      } else if (f.size() >= 16 && f[0] == "P") {  // a trailing empty error is dropped
        PairResult p;
        const int from = atoi(f[1].c_str()), to = atoi(f[2].c_str());
        if (from < 0 || from >= size || to < 0 || to >= size) continue;
        p.from = "rank " + f[1];
        p.to = "rank " + f[2];
        p.ok = f[3] == "1";
        p.write.alpha_us = atof(f[4].c_str());
        p.write.p99_us = atof(f[5].c_str());
        p.write.beta_Bps = atof(f[6].c_str());
        p.read.alpha_us = atof(f[7].c_str());
        p.read.p99_us = atof(f[8].c_str());
        p.read.beta_Bps = atof(f[9].c_str());
        p.verified_bytes = strtoull(f[10].c_str(), nullptr, 10);
        p.write.small_bytes = p.read.small_bytes = strtoull(f[11].c_str(), nullptr, 10);
        p.write.large_bytes = p.read.large_bytes = strtoull(f[12].c_str(), nullptr, 10);
        p.transport = f[13];
        p.to_host = f[14];
        p.why = f[15];
        p.error = f.size() > 16 ? f[16] : "";
        char c[96];
        if (p.ok) {
          snprintf(c, sizeof(c), "%s %.0fus %.0fMB/s", p.transport.c_str(), p.write.alpha_us,
                   p.write.beta_Bps / 1e6);
        } else {
          snprintf(c, sizeof(c), "FAIL");
        }
        cell[from][to] = c;
        merged.pairs.push_back(p);
      }
    }
  }
  if (!all.ok()) merged.checks.push_back({"rendezvous", CheckStatus::kFail, all.message(), ""});
  WriteFileAtomic(dir + "/collected.0", "done\n");
  Emit(merged);
  if (!FLAGS_json) {
    std::cout << "\nwrite alpha (p50 latency) and beta (bandwidth), row = prober, column = "
                 "responder:\n";
    size_t w = 8;
    for (auto& row : cell) {
      for (auto& c : row) w = std::max(w, c.size() + 2);
    }
    std::string head = "from\\to";
    head.resize(9, ' ');
    for (int c = 0; c < size; ++c) {
      std::string h = "rank " + std::to_string(c);
      h.resize(w, ' ');
      head += h;
    }
    std::cout << head << "\n";
    for (int r = 0; r < size; ++r) {
      std::string line = "rank " + std::to_string(r);
      line.resize(9, ' ');
      for (int c = 0; c < size; ++c) {
        std::string v = cell[r][c];
        v.resize(w, ' ');
        line += v;
      }
      std::cout << line << "\n";
    }
  }
  return merged.exit_code();
}

}  // namespace

int DoctorMain(int argc, char** argv) {
  std::string bad;
  if (!KnownFlags(argc, argv, &bad)) {
    std::cerr << "shardps doctor: " << bad << " (shardps doctor --help)\n";
    return 2;
  }
  shardps::ParseCommandLine(
      &argc, &argv,
      "shardps doctor [--transport verbs|tcp|shm|auto] [--coordinator HOST:PORT] "
      "[--peer HOST:PORT,...] [--model SIZE|FILE] [--json] [--probe_out FILE]\n"
      "  shardps doctor --serve [--serve_port P] [--address_file F]\n"
      "  mpirun -np N shardps doctor --mpi --rendezvous_dir DIR",
      __FILE__);
  if (argc > 1) {
    std::cerr << "shardps doctor: unexpected argument '" << argv[1] << "'\n";
    return 2;
  }
  google::InitGoogleLogging("shardps");
  FLAGS_logtostderr = true;
  gflags::CommandLineFlagInfo info;
  if (gflags::GetCommandLineFlagInfo("minloglevel", &info) && info.is_default) {
    FLAGS_minloglevel = 1;  // the transports' INFO lines would drown the report
  }
  DoctorOptions o;
  o.fabric = transport::FabricOptionsFromFlags();
  const std::string& t = o.fabric.provider;
  if (t != "verbs" && t != "tcp" && t != "shm" && t != "auto") {
    std::cerr << "shardps doctor: --transport must be verbs, tcp, shm or auto\n";
    return 2;
  }
  if (!FLAGS_assume_transport.empty() && FLAGS_assume_transport != "verbs" &&
      FLAGS_assume_transport != "tcp" && FLAGS_assume_transport != "shm") {
    std::cerr << "shardps doctor: --assume_transport must be verbs, tcp or shm\n";
    return 2;
  }
  if (FLAGS_timeout_ms <= 0 || FLAGS_num_servers <= 0 || FLAGS_num_workers <= 0 ||
      FLAGS_max_workers < 0 || FLAGS_probe_iters <= 0 || FLAGS_probe_ms <= 0 ||
      FLAGS_probe_bytes == 0 || FLAGS_partition_bytes == 0) {
    std::cerr << "shardps doctor: timeouts, counts and sizes must be positive\n";
    return 2;
  }
  o.assume_transport = FLAGS_assume_transport;
  o.thp_dir = FLAGS_thp_dir;
  o.coordinator = FLAGS_coordinator;
  o.peers = SplitCommas(FLAGS_peer);
  o.timeout = std::chrono::milliseconds(FLAGS_timeout_ms);
  o.model = FLAGS_model;
  o.num_servers = static_cast<uint32_t>(FLAGS_num_servers);
  o.num_workers = static_cast<uint32_t>(FLAGS_num_workers);
  o.max_workers = static_cast<uint32_t>(FLAGS_max_workers);
  o.partition_bytes = FLAGS_partition_bytes;
  o.probe_iters = FLAGS_probe_iters;
  o.probe_time = std::chrono::milliseconds(FLAGS_probe_ms);
  o.large_bytes = FLAGS_probe_bytes;
  o.small_bytes = FLAGS_probe_small_bytes;
  if (FLAGS_serve) return Serve(o);
  if (FLAGS_mpi) return Mpi(o);
  Report r = RunDoctor(o);
  Emit(r);
  return r.exit_code();
}

}  // namespace shardps::tools
