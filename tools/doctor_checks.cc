// The local checks of shardps doctor (devices, transport, memlock, huge pages, fork safety) and
// the coordinator check. The probe lives in doctor_probe.cc, the output in doctor_report.cc.
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "common/net.h"
#include "proto/framing.h"
#include "tools/doctor.h"
#include "tools/model_spec.h"
#include "wire/region_layout.h"
#ifdef SHARDPS_HAVE_VERBS
#include <infiniband/verbs.h>

#include "transport/verbs/verbs_device.h"
#endif

namespace shardps::tools {
namespace {

using Clock = std::chrono::steady_clock;

std::string Mib(uint64_t bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  if (bytes >= (1ull << 30)) {
    os << static_cast<double>(bytes) / (1ull << 30) << " GiB";
  } else if (bytes >= (1ull << 20)) {
    os << static_cast<double>(bytes) / (1ull << 20) << " MiB";
  } else {
    os << static_cast<double>(bytes) / 1024.0 << " KiB";
  }
  return os.str();
}

uint64_t PageUp(uint64_t n) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

std::string ShortReason(const Status& s, std::chrono::milliseconds timeout) {
  if (s.code() == StatusCode::kDeadlineExceeded) {
    return "no answer within " + std::to_string(timeout.count()) + " ms";
  }
  std::string m = s.message();
  const size_t colon = m.rfind(": ");
  if (colon != std::string::npos) m = m.substr(colon + 2);
  if (!m.empty()) m[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(m[0])));
  return m;
}

namespace {

bool HaveCapIpcLock() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> 14) & 1;  // CAP_IPC_LOCK
    }
  }
  return false;
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

}  // namespace

const char* CheckStatusName(CheckStatus s) {
  switch (s) {
    case CheckStatus::kOk: return "ok";
    case CheckStatus::kWarn: return "warn";
    case CheckStatus::kFail: return "fail";
  }
  return "?";
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

// ---------------------------------------------------------------------------------------------
// RDMA devices

std::vector<CheckResult> CheckRdmaDevices(const DoctorOptions& o, bool want_verbs,
                                          std::vector<PortSummary>* ports) {
  std::vector<CheckResult> out;
#ifdef SHARDPS_HAVE_VERBS
  namespace v = transport::verbs;
  std::vector<v::DeviceInfo> devs = v::InspectDevices(o.fabric.bind_ip);
  if (devs.empty()) {
    out.push_back({"rdma devices", want_verbs ? CheckStatus::kFail : CheckStatus::kWarn,
                   "no RDMA device (ibv_get_device_list found none); verbs cannot run here",
                   "load the HCA driver (mlx5_ib, ...) or SoftRoCE (modprobe rdma_rxe; rdma link "
                   "add rxe0 type rxe netdev IFACE) and check with `ibv_devices`; without RDMA "
                   "use --transport tcp (or shm on one host)"});
    return out;
  }
  for (const v::DeviceInfo& d : devs) {
    if (!d.error.empty()) {
      out.push_back({"rdma " + d.name, CheckStatus::kWarn, "cannot open: " + d.error,
                     "check permissions on /dev/infiniband/uverbs* and that ib_uverbs is "
                     "loaded"});
      continue;
    }
    for (const v::PortInfo& p : d.ports) {
      PortSummary s;
      s.device = d.name;
      s.port = p.port;
      s.state = p.state;
      s.active = p.active;
      s.link = p.roce ? "ethernet (RoCE)" : "infiniband";
      s.mtu = p.active_mtu;
      for (const v::GidEntry& g : p.gids) {
        s.gids.push_back({g.index, v::GidTypeName(g.type), v::GidToString(g.raw.data())});
      }
      std::ostringstream det;
      det << p.state << ", " << s.link << ", MTU " << p.active_mtu << ", GIDs:";
      for (const GidSummary& g : s.gids) det << " [" << g.index << "] " << g.gid << " " << g.type << ";";
      if (s.gids.empty()) det << " none;";
      CheckResult c{"rdma " + d.name + ":" + std::to_string(p.port), CheckStatus::kOk, "", ""};
      if (p.auto_gid_error.empty()) {
        s.auto_gid = p.auto_gid.index;
        s.auto_gid_reason = p.auto_gid.reason;
        det << " auto GID index " << p.auto_gid.index << ": " << p.auto_gid.reason;
        if (o.fabric.rdma_gid_index >= 0 && o.fabric.rdma_gid_index != p.auto_gid.index) {
          det << "; but --rdma_gid_index=" << o.fabric.rdma_gid_index << " overrides it";
          c.status = CheckStatus::kWarn;
          c.fix = "drop --rdma_gid_index (automatic selection picks the RoCEv2 IPv4 GID), or "
                  "make sure both sides use a GID of the same RoCE version and subnet";
        }
      } else {
        s.auto_gid_reason = p.auto_gid_error;
        det << " no GID can be chosen: " << p.auto_gid_error;
        c.status = CheckStatus::kWarn;
        c.fix = "configure an IPv4 address on the netdev under " + d.name +
                " (ip addr add ... dev IFACE; see `rdma link`), then RoCEv2 GIDs appear";
      }
      if (!p.active) {
        c.status = CheckStatus::kWarn;
        c.fix = "bring the link up (ip link set IFACE up; check cable/switch port; `ibstat`)";
      }
      c.detail = det.str();
      s.auto_gid_reason = s.auto_gid_reason.empty() ? "" : s.auto_gid_reason;
      ports->push_back(std::move(s));
      out.push_back(std::move(c));
    }
  }
#else
  out.push_back({"rdma devices", want_verbs ? CheckStatus::kFail : CheckStatus::kWarn,
                 "this binary was built without verbs support",
                 "install libibverbs-dev and librdmacm-dev and configure with "
                 "-DSHARDPS_WITH_VERBS=ON"});
  (void)o;
  (void)ports;
#endif
  return out;
}

// ---------------------------------------------------------------------------------------------
// Transport

CheckResult CheckTransport(const DoctorOptions& o, std::string* effective) {
  effective->clear();
  const std::string& asked = o.fabric.provider;
  CheckResult c{"transport", CheckStatus::kOk, "", ""};
  auto f = transport::Fabric::Open(o.fabric);
  if (!f.ok()) {
    c.status = CheckStatus::kFail;
    c.detail = "transport '" + asked + "' was asked for and cannot start: " +
               f.status().message() + " (doctor does not fall back to another transport)";
    if (asked == "verbs") {
      c.fix = "check `ibv_devices` / `rdma link` and that the port is ACTIVE; pick the NIC with "
              "--rdma_device or --bind_ip; on a host without RDMA run with --transport tcp";
    } else if (asked == "shm") {
      c.fix = "shm needs memfd_create and a writable /dev/shm-like mapping; check the error above";
    } else {
      c.fix = "check --bind_ip names an address of this host";
    }
    return c;
  }
  *effective = (*f)->name();
  if (asked == "auto") {
    if (*effective == "verbs") {
      c.detail = "auto picked verbs because an active RDMA port was found: " + (*f)->DebugString();
    } else {
      std::string why = "built without verbs support";
#ifdef SHARDPS_HAVE_VERBS
      transport::FabricOptions vo = o.fabric;
      vo.provider = "verbs";
      auto v = transport::Fabric::Open(vo);
      why = v.ok() ? "verbs opened on a second try" : v.status().message();
#endif
      c.status = CheckStatus::kWarn;
      c.detail = "auto picked " + *effective + " because verbs is not usable (" + why + "): " +
                 (*f)->DebugString();
      c.fix = "if this host should use RDMA, fix what the reason names; otherwise pass "
              "--transport tcp so the choice is explicit";
    }
  } else {
    c.detail = asked + " opened as asked: " + (*f)->DebugString();
    if (asked == "shm") c.detail += " (shm reaches only processes on this host)";
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Memlock

StatusOr<MemlockNeed> ComputeMemlockNeed(const std::vector<TensorSpec>& tensors,
                                         uint32_t num_servers, uint32_t max_workers,
                                         uint64_t partition_bytes) {
  if (num_servers == 0) return InvalidArgumentError("num_servers must be at least 1");
  if (max_workers == 0) max_workers = 1;
  ASSIGN_OR_RETURN(ShardPlan plan, PlanShards(tensors, num_servers, partition_bytes));
  MemlockNeed need;
  // Server: as ShardServer registers them (each region at least kAlign, page-rounded by mmap).
  std::vector<std::vector<uint64_t>> per_server(num_servers);
  std::vector<std::vector<layout::RowGeometry>> rows_of(num_servers);
  std::vector<uint32_t> shards(tensors.size(), 0);
  for (const ChunkPlan& c : plan.chunks) ++shards[c.tensor];
  uint64_t table_staging = 0;  // workers: row tables' push, header and pull staging
  for (const ChunkPlan& c : plan.chunks) {
    per_server[c.server].push_back(c.bytes);
    layout::RowGeometry g;
    const TensorSpec& t = plan.tensors[c.tensor];
    if (t.embedding) {
      // As the server registers a row shard: its records (RowHeader + values, 16-aligned) and
      // an inbox slot of max_ids entries per worker and parity (wire/region_layout.h).
      g.table_rows = static_cast<uint64_t>(t.shape[0]);
      g.shards = shards[c.tensor];
      g.shard = static_cast<uint32_t>(c.offset);
      g.hashed = t.hashed;
      g.rows = layout::RowGeometry::ShardRows(g.table_rows, g.shards, g.shard, g.hashed);
      g.dim = static_cast<uint32_t>(t.shape[1]);
      g.elem_bytes = static_cast<uint32_t>(DTypeSize(t.dtype));
      g.max_ids = t.max_ids;
      table_staging += 2 * layout::AlignUp(uint64_t{g.max_ids} * g.entry_bytes()) +
                       layout::kAlign + uint64_t{g.max_ids} * g.row_stride();
    }
    rows_of[c.server].push_back(g);
  }
  auto at_least = [](uint64_t n) { return PageUp(std::max<uint64_t>(n, layout::kAlign)); };
  for (uint32_t s = 0; s < num_servers; ++s) {
    layout::ServerLayout l(per_server[s], max_workers, rows_of[s]);
    const uint64_t w = at_least(l.weights_bytes()), i = at_least(l.inbox_bytes()),
                   a = at_least(l.acks_bytes()), k = at_least(l.clocks_bytes());
    if (w + i + a + k > need.server_bytes) {
      need.server_bytes = w + i + a + k;
      need.server_detail = "server " + std::to_string(s) + " (" + std::to_string(l.slots()) +
                           " chunks, max_workers " + std::to_string(max_workers) +
                           "): weights " + Mib(w) + " + inbox " + Mib(i) + " + acks " + Mib(a) +
                           " + clocks " + Mib(k);
    }
  }
  // Worker: weights and gradients of every tensor, then the staging region (worker/client_impl.cc:
  // 4 cache lines per chunk, acks rows and a clock line per server, small-push copies).
  uint64_t tensors_bytes = 0;
  for (const TensorSpec& t : tensors) {
    if (!t.embedding) tensors_bytes += 2 * PageUp(t.bytes());  // a table's rows stay remote
  }
  uint64_t staging = layout::AlignUp(plan.chunks.size() * 4 * layout::kAlign + layout::kAlign);
  for (uint32_t s = 0; s < num_servers; ++s) {
    staging += layout::AlignUp(sizeof(uint64_t) * per_server[s].size());
  }
  staging += layout::kAlign * num_servers;
  for (const ChunkPlan& c : plan.chunks) {
    if (c.bytes <= 16 * 1024 && !plan.tensors[c.tensor].embedding) {
      staging += 2 * (layout::kAlign + layout::AlignUp(c.bytes));
    }
  }
  staging = PageUp(staging) + PageUp(table_staging);
  need.worker_bytes = tensors_bytes + staging;
  need.worker_detail = "worker: " + std::to_string(tensors.size()) +
                       " tensors (weights + gradients) " + Mib(tensors_bytes) + " + staging " +
                       Mib(staging);
  return need;
}

CheckResult CheckMemlock(const DoctorOptions& o, const std::string& transport) {
  CheckResult c{"memlock", CheckStatus::kOk, "", ""};
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  const bool unlimited = rl.rlim_cur == RLIM_INFINITY;
  const std::string limit =
      unlimited ? "unlimited" : std::to_string(rl.rlim_cur) + " bytes (" + Mib(rl.rlim_cur) + ")";
  const bool verbs = transport == "verbs";
  const bool cap = HaveCapIpcLock();
  const std::string fix =
      "raise the locked-memory limit of every shardps process: `ulimit -l unlimited` in the "
      "launching shell; /etc/security/limits.conf: `* soft memlock unlimited` and "
      "`* hard memlock unlimited` (then log in again); systemd unit: `LimitMEMLOCK=infinity`; "
      "docker: `docker run --ulimit memlock=-1 ...`; under mpirun the limit of the remote "
      "shell/orted applies on every host";
  std::string need_text;
  uint64_t need = 0;
  if (!o.model.empty()) {
    auto tensors = LoadModelSpec(o.model);
    if (!tensors.ok()) {
      c.status = CheckStatus::kFail;
      c.detail = "cannot read the model: " + tensors.status().message();
      c.fix = "--model takes a size (256MiB) or a file with one `name dim0 dim1 ...` or `embedding NAME ROWS DIM [max_ids=N]` per line";
      return c;
    }
    const uint32_t mw = std::max(o.max_workers, o.num_workers);
    auto n = ComputeMemlockNeed(*tensors, o.num_servers, mw, o.partition_bytes);
    if (!n.ok()) {
      c.status = CheckStatus::kFail;
      c.detail = "cannot plan the model: " + n.status().message();
      return c;
    }
    need = n->max();
    need_text = "needs " + std::to_string(need) + " bytes (" + Mib(need) + ") per process [" +
                n->server_detail + "; " + n->worker_detail + "]";
  } else {
    need_text = "no --model given, so the need is not computed";
  }
  const bool short_of = !unlimited && need > 0 && rl.rlim_cur < need;
  c.detail = "RLIMIT_MEMLOCK " + limit + "; " + need_text;
  if (!verbs) {
    c.detail += "; transport " + (transport.empty() ? std::string("(none)") : transport) +
                " does not pin memory, so the limit matters only for verbs";
    if (short_of) {
      c.status = CheckStatus::kWarn;
      c.detail += " (verbs would fail to register)";
      c.fix = fix;
    }
    return c;
  }
  if (short_of && cap) {
    c.detail += "; below the need, but this process has CAP_IPC_LOCK, which exempts it";
    c.status = CheckStatus::kWarn;
    c.fix = "processes without CAP_IPC_LOCK need the limit raised: " + fix;
    return c;
  }
  if (short_of) {
    c.status = CheckStatus::kFail;
    c.detail += "; memory registration (ibv_reg_mr) will fail with ENOMEM";
    c.fix = fix;
    return c;
  }
  if (!unlimited && need == 0 && rl.rlim_cur < (64ull << 20) && !cap) {
    c.status = CheckStatus::kWarn;
    c.detail += "; a limit this low fails registering any sizeable model";
    c.fix = fix;
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Huge pages

namespace {

// The bracketed choice of a sysfs selector line ("always [madvise] never" -> "madvise"), or
// "unknown" (no such file: a kernel without THP, or another layout).
std::string SelectedMode(const std::string& line) {
  const size_t l = line.find('['), r = line.find(']');
  if (l == std::string::npos || r == std::string::npos || r <= l) return "unknown";
  return line.substr(l + 1, r - l - 1);
}

}  // namespace

CheckResult CheckHugePages(const DoctorOptions& o, const std::string& transport) {
  CheckResult c{"huge pages", CheckStatus::kOk, "", ""};
  std::map<std::string, uint64_t> mi;
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    if (ls >> key >> value) mi[key] = value;
  }
  const std::string anon = SelectedMode(ReadFirstLine(o.thp_dir + "/enabled"));
  const std::string shmem = SelectedMode(ReadFirstLine(o.thp_dir + "/shmem_enabled"));
  // What MADV_HUGEPAGE gets: anonymous memory at always or madvise; shmem (a memfd) at always,
  // within_size, advise or force (never and deny refuse it).
  const bool anon_huge = anon == "always" || anon == "madvise";
  const bool shmem_huge =
      shmem == "always" || shmem == "within_size" || shmem == "advise" || shmem == "force";
  std::ostringstream os;
  os << "HugePages_Total " << mi["HugePages_Total:"] << ", HugePages_Free " << mi["HugePages_Free:"]
     << ", Hugepagesize " << mi["Hugepagesize:"] << " kB; transparent huge pages [" << anon
     << "], shmem [" << shmem << "]: tcp and verbs regions use "
     << (anon_huge ? "2 MiB" : "4 KiB") << " pages, shm regions " << (shmem_huge ? "2 MiB" : "4 KiB")
     << " pages";
  const bool shm = transport == "shm";
  if (shm && !shmem_huge) {
    os << "; the shm transport's regions (weights, row tables) are on 4 KiB pages: every row of "
          "a large embedding table misses the TLB (measured here: 4,096-row pulls from a "
          "1 M-row table at half the speed of 2 MiB pages)";
    c.status = CheckStatus::kWarn;
    c.fix = "echo advise > " + o.thp_dir + "/shmem_enabled (persist it: `kernel/mm/"
            "transparent_hugepage/shmem_enabled = advise` in /etc/sysfs.conf (sysfsutils), or "
            "a systemd-tmpfiles `w` line)";
  } else if (!shm && !anon_huge && mi["HugePages_Total:"] == 0) {
    os << "; more NIC translation entries, slower registration, TLB misses on row gathers";
    c.status = CheckStatus::kWarn;
    c.fix = "echo madvise > " + o.thp_dir + "/enabled (or always); or reserve huge pages: "
            "sysctl -w vm.nr_hugepages=N";
  }
  c.detail = os.str();
  return c;
}

// ---------------------------------------------------------------------------------------------
// Fork safety

CheckResult CheckForkSafety(const std::string& transport) {
  CheckResult c{"fork safety", CheckStatus::kOk, "", ""};
  const char* e1 = getenv("RDMAV_FORK_SAFE");
  const char* e2 = getenv("IBV_FORK_SAFE");
  utsname u{};
  uname(&u);
  std::string env = std::string("RDMAV_FORK_SAFE=") + (e1 ? e1 : "(unset)") +
                    ", IBV_FORK_SAFE=" + (e2 ? e2 : "(unset)") + ", kernel " + u.release;
#ifdef SHARDPS_HAVE_VERBS
  {
    // Initialise libibverbs first (ibv_get_device_list), as a daemon would, so the answer is
    // the one it would get.
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list) ibv_free_device_list(list);
  }
  const ibv_fork_status fs = ibv_is_fork_initialized();
  const char* name = fs == IBV_FORK_UNNEEDED  ? "UNNEEDED"
                     : fs == IBV_FORK_ENABLED ? "ENABLED"
                                              : "DISABLED";
  c.detail = std::string("ibv_is_fork_initialized() = ") + name + "; " + env;
  if (fs == IBV_FORK_UNNEEDED) {
    c.detail += ": the kernel copies pinned pages on fork, so fork after RDMA init is safe";
  } else if (fs == IBV_FORK_ENABLED) {
    c.detail += ": ibv_fork_init is in effect (registered pages are MADV_DONTFORK)";
  } else if (transport == "verbs") {
    c.status = CheckStatus::kWarn;
    c.detail += ": a fork() after memory registration (DataLoader workers, system()) can "
                "corrupt registered memory or crash the child";
    c.fix = "export RDMAV_FORK_SAFE=1 before starting the trainer (rdma-core then calls "
            "ibv_fork_init), or run a kernel >= 5.13 (copy-on-fork of pinned pages)";
  } else {
    c.detail += "; transport " + (transport.empty() ? std::string("(none)") : transport) +
                " registers nothing with an HCA, so fork is safe";
  }
#else
  c.detail = "built without verbs: no memory is pinned, fork is safe; " + env;
  (void)transport;
#endif
  return c;
}

// ---------------------------------------------------------------------------------------------
// Coordinator

CheckResult CheckCoordinator(const DoctorOptions& o) {
  CheckResult c{"coordinator", CheckStatus::kOk, "", ""};
  const std::string& addr = o.coordinator;
  const auto t0 = Clock::now();
  auto fd = net::ConnectTcp(addr, "", o.timeout);
  if (!fd.ok()) {
    c.status = CheckStatus::kFail;
    c.detail = "cannot reach coordinator at " + addr + " (" + ShortReason(fd.status(), o.timeout) +
               ")";
    c.fix = "start shardps_coordinator --listen=" + addr +
            " (or fix --coordinator); check that the host is up, the port is right and no "
            "firewall drops it (nc -zv HOST PORT)";
    return c;
  }
  control::Envelope env;
  control::JoinRequest* j = env.mutable_join();
  // A token no cluster has: the coordinator refuses the join, which proves it speaks v1.
  j->set_cluster_token("shardps-doctor-probe-" + std::to_string(getpid()) + "-" +
                       std::to_string(Clock::now().time_since_epoch().count()));
  j->set_role(control::ROLE_UNSPECIFIED);
  j->set_hostname(HostName());
  j->set_pid(static_cast<uint32_t>(getpid()));
  j->set_requested_rank(-1);
  control::FrameDecoder decoder;
  auto exchange = [&]() -> StatusOr<control::Envelope> {
    RETURN_IF_ERROR(control::SendMagic(fd->get(), o.timeout));
    RETURN_IF_ERROR(control::SendEnvelope(fd->get(), env, o.timeout));
    return control::ReceiveEnvelope(fd->get(), &decoder, o.timeout);
  };
  StatusOr<control::Envelope> reply = exchange();
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  if (!reply.ok() || !reply->has_join_reply()) {
    c.status = CheckStatus::kFail;
    c.detail = "a TCP listener answers at " + addr + ", but it does not speak the ShardPS "
               "control protocol (" +
               (reply.ok() ? std::string("unexpected ") + control::BodyName(*reply)
                           : ShortReason(reply.status(), o.timeout)) +
               ")";
    c.fix = "point --coordinator at shardps_coordinator's --listen address (not a server's data "
            "port or another service)";
    return c;
  }
  const control::JoinReply& r = reply->join_reply();
  c.detail = "reachable at " + addr + " in " + std::to_string(ms) +
             " ms, speaks ShardPS control protocol v1 (a probe join with a wrong token was " +
             (r.accepted() ? "accepted?" : "refused: \"" + r.error() + "\"") + ")";
  if (r.accepted()) c.status = CheckStatus::kWarn;
  return c;
}

// ---------------------------------------------------------------------------------------------

int Report::exit_code() const {
  for (const CheckResult& c : checks) {
    if (c.status == CheckStatus::kFail) return 1;
  }
  return 0;
}

Report RunDoctor(const DoctorOptions& o) {
  Report r;
  r.host = HostName();
  r.transport_asked = o.fabric.provider;
  const bool want_verbs = o.fabric.provider == "verbs";
  for (CheckResult& c : CheckRdmaDevices(o, want_verbs, &r.ports)) r.checks.push_back(std::move(c));
  r.checks.push_back(CheckTransport(o, &r.transport_effective));
  const std::string mem_transport =
      o.assume_transport.empty() ? r.transport_effective : o.assume_transport;
  r.checks.push_back(CheckMemlock(o, mem_transport));
  r.checks.push_back(CheckHugePages(o, mem_transport));
  r.checks.push_back(CheckForkSafety(mem_transport));
  if (!o.coordinator.empty()) r.checks.push_back(CheckCoordinator(o));
  if (!o.peers.empty()) {
    FabricCache cache;
    for (const std::string& p : o.peers) {
      r.pairs.push_back(ProbePeer(o, p, &cache));
      r.checks.push_back(PairCheck(r.pairs.back(), o.timeout));
    }
  }
  return r;
}

}  // namespace shardps::tools
