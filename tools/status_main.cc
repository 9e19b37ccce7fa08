// `shardps status --coordinator HOST:PORT [--json] [--watch SEC]`: who is in a running cluster
// and how it is doing, asked of its coordinator without joining (a StatusRequest carrying the
// cluster token; docs/operations.md "Status", docs/control-protocol.md "Status").
//
// The token comes from --cluster_token_file, else $SHARDPS_CLUSTER_TOKEN, else --cluster_token
// (visible in `ps`: prefer the other two). Every connect and read is bounded by --timeout_ms.
// Exit status: 0 answered, 1 refused or unreachable (one line on stderr says why), 2 usage.
//
// The flags are parsed here rather than with gflags: `shardps doctor` in the same binary
// already defines --coordinator, --json and --timeout_ms with other help texts.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "common/net.h"
#include "common/version.h"
#include "proto/control.pb.h"
#include "proto/framing.h"
#include "tools/subcommands.h"

namespace shardps::tools {
namespace {

// Text from the wire, made safe for a terminal: control bytes (ESC included) become '?'.
std::string Printable(const std::string& s) {
  std::string out = s;
  for (char& ch : out) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (u < 0x20 || u == 0x7f) ch = '?';
  }
  return out;
}

using control::StatusReply;

struct StatusOptions {
  std::string coordinator;
  std::string token;
  bool json = false;
  double watch_s = 0;  // 0: once
  std::chrono::milliseconds timeout{3000};
};

constexpr char kUsage[] =
    "usage: shardps status --coordinator HOST:PORT [--json] [--watch SEC] [--timeout_ms MS]\n"
    "                      [--cluster_token_file FILE | --cluster_token TOKEN]\n"
    "Asks a running cluster's coordinator who is in it and how it is doing, without joining.\n"
    "The cluster token: --cluster_token_file, else $SHARDPS_CLUSTER_TOKEN, else --cluster_token.\n"
    "  --json        print the coordinator's StatusReply as JSON (protobuf's JSON mapping)\n"
    "  --watch SEC   ask again every SEC seconds until interrupted\n"
    "  --timeout_ms  bound on the connect and on the reply (default 3000)\n"
    "Exit status: 0 answered, 1 refused or unreachable, 2 usage error.\n";

int UsageError(const std::string& why) {
  std::fprintf(stderr, "shardps status: %s\n\n%s", why.c_str(), kUsage);
  return 2;
}

// Parses `--name=value` and `--name value`. Returns 0 to go on, else the exit status.
int ParseArgs(int argc, char** argv, StatusOptions* o) {
  std::string token_flag, token_file;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "--helpfull") {
      std::fputs(kUsage, stdout);
      return -1;
    }
    if (a == "--version") {
      std::printf("shardps status %s\n", BuildVersion());
      return -1;
    }
    if (a.rfind("--", 0) != 0) return UsageError("unexpected argument '" + a + "'");
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (name == "json" || name == "nojson") {
      o->json = name == "json" && (!has_value || value == "true" || value == "1");
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) return UsageError("--" + name + " needs a value");
      value = argv[++i];
    }
    if (name == "coordinator") {
      o->coordinator = value;
    } else if (name == "cluster_token") {
      token_flag = value;
    } else if (name == "cluster_token_file") {
      token_file = value;
    } else if (name == "watch") {
      char* end = nullptr;
      o->watch_s = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(o->watch_s > 0) || o->watch_s > 86400) {
        return UsageError("--watch takes seconds in (0, 86400]");
      }
    } else if (name == "timeout_ms") {
      char* end = nullptr;
      const long ms = std::strtol(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || ms <= 0 || ms > 600000) {
        return UsageError("--timeout_ms takes milliseconds in (0, 600000]");
      }
      o->timeout = std::chrono::milliseconds(ms);
    } else {
      return UsageError("unknown flag --" + name);
    }
  }
  if (o->coordinator.empty()) return UsageError("--coordinator HOST:PORT is required");
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in) {
      std::fprintf(stderr, "shardps status: cannot read --cluster_token_file %s\n",
                   token_file.c_str());
      return 1;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    o->token = ss.str();
    while (!o->token.empty() &&
           (o->token.back() == '\n' || o->token.back() == '\r' || o->token.back() == ' ')) {
      o->token.pop_back();
    }
  } else if (const char* env = std::getenv("SHARDPS_CLUSTER_TOKEN"); env != nullptr && *env) {
    o->token = env;
  } else {
    o->token = token_flag;
  }
  if (o->token.empty()) {
    return UsageError(
        "no cluster token (--cluster_token_file, $SHARDPS_CLUSTER_TOKEN or "
        "--cluster_token)");
  }
  return 0;
}

// One request on a fresh connection. The error's message is the one-line reason.
StatusOr<StatusReply> Ask(const StatusOptions& o) {
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  StatusOr<UniqueFd> fd = net::ConnectTcp(o.coordinator, "", o.timeout);
  if (!fd.ok()) {
    return UnavailableError("cannot reach the coordinator at " + o.coordinator + ": " +
                            std::string(fd.status().message()));
  }
  control::Envelope req;
  req.mutable_status_request()->set_cluster_token(o.token);
  RETURN_IF_ERROR(control::SendMagic(fd->get(), left()));
  RETURN_IF_ERROR(control::SendEnvelope(fd->get(), req, left()));
  control::FrameDecoder decoder;
  StatusOr<control::Envelope> reply = control::ReceiveEnvelope(fd->get(), &decoder, left());
  if (!reply.ok()) {
    return UnavailableError("no status reply from " + o.coordinator + " within " +
                            std::to_string(o.timeout.count()) + " ms (" +
                            std::string(reply.status().message()) +
                            "); is it a shardps_coordinator new enough to answer status?");
  }
  if (reply->has_error()) {
    return PermissionDeniedError("the coordinator at " + o.coordinator +
                                 " refused: " + reply->error().message());
  }
  if (!reply->has_status_reply()) {
    return UnavailableError(std::string("the coordinator at ") + o.coordinator + " answered with " +
                            control::BodyName(*reply) + ", not a status reply");
  }
  return std::move(*reply->mutable_status_reply());
}

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::string Mode(control::ConsistencyMode m) {
  std::string s = control::ConsistencyMode_Name(m);
  return s.empty() ? "mode" + std::to_string(static_cast<int>(m)) : s;
}

std::string UtcTime(uint64_t unix_ms) {
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  tm tmv{};
  gmtime_r(&t, &tmv);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tmv);
  return buf;
}

// The joined members of `role`, by rank.
std::vector<control::StatusMember> ByRank(const StatusReply& r, control::Role role) {
  std::vector<control::StatusMember> v;
  for (const control::StatusMember& m : r.members()) {
    if (m.role() == role && m.joined()) v.push_back(m);
  }
  std::sort(v.begin(), v.end(), [](const control::StatusMember& a, const control::StatusMember& b) {
    return a.rank() < b.rank();
  });
  return v;
}

void PrintTable(const StatusReply& r, const std::string& coordinator) {
  const control::StatusConfig& c = r.config();
  std::printf("cluster    %s  %s", coordinator.c_str(), Mode(c.mode()).c_str());
  if (c.mode() == control::SSP || c.mode() == control::VSGD) {
    std::printf(" staleness %u", c.staleness());
  }
  std::printf(", %u groups x %u replicas, %u workers expected, transport %s, epoch %" PRIu64
              ", up %.1f s\n",
              c.num_servers(), c.replicas(), c.num_workers(),
              c.transport().empty() ? "(any)" : Printable(c.transport()).c_str(), r.epoch(),
              static_cast<double>(r.uptime_ms()) / 1000.0);
  if (!r.startup_failure().empty()) {
    std::printf("STARTUP FAILED: %s\n", Printable(r.startup_failure()).c_str());
  }

  std::printf("\nmembers    %u servers, %u workers joined%s\n", r.servers(), r.workers(),
              r.members_truncated() ? " (list truncated)" : "");
  std::printf("  %-4s %-6s %-4s %-16s %-8s %-6s %-22s %-9s %s\n", "ID", "ROLE", "RANK", "HOST",
              "PID", "TRANS", "DATA ADDRESS", "STATE", "HB AGE");
  for (const control::StatusMember& m : r.members()) {
    const char* state = !m.joined() ? "expected" : m.suspected() ? "SUSPECT" : "alive";
    std::string role =
        m.role() == control::ROLE_SERVER ? (m.spare() ? "spare" : "server") : "worker";
    std::printf("  %-4u %-6s %-4u %-16s %-8u %-6s %-22s %-9s %s\n", m.member_id(), role.c_str(),
                m.rank(), Printable(m.hostname().substr(0, 16)).c_str(), m.pid(),
                Printable(m.transport()).c_str(),
                m.data_address().empty() ? "-" : Printable(m.data_address()).c_str(), state,
                m.joined() ? (std::to_string(m.heartbeat_age_ms()) + " ms").c_str() : "-");
  }

  if (r.shard_map_ready()) {
    std::printf("\nshard map  epoch %" PRIu64 ", %u chunks, %s\n", r.shard_map_epoch(), r.chunks(),
                Bytes(static_cast<double>(r.model_bytes())).c_str());
    std::printf("  %-5s %-7s %-7s %-7s %-6s %-10s %s\n", "GROUP", "PRIMARY", "BACKUP", "SYNCED",
                "CHUNKS", "BYTES", "ROW SHARDS");
    for (const control::StatusGroup& g : r.groups()) {
      const std::string primary = g.lost()               ? "LOST"
                                  : g.primary_rank() < 0 ? "-"
                                                         : std::to_string(g.primary_rank());
      const std::string backup = g.backup_rank() < 0 ? "-" : std::to_string(g.backup_rank());
      std::printf("  %-5u %-7s %-7s %-7s %-6u %-10s %u\n", g.group(), primary.c_str(),
                  backup.c_str(),
                  g.backup_rank() < 0  ? "-"
                  : g.backup_in_sync() ? "yes"
                                       : "NO",
                  g.chunks(), Bytes(static_cast<double>(g.bytes())).c_str(), g.row_shards());
    }
  } else {
    std::printf("\nshard map  not ready (waiting for the model or for servers)\n");
  }

  std::printf(
      "\nservers    (a backup applies its primary's records, not pushes)\n"
      "  %-4s %-5s %-8s %-14s %-12s %-10s %s\n",
      "RANK", "GROUP", "ROLE", "PUSHES APPLIED", "BYTES/S", "PUSHES/S", "APPLIED CLOCKS");
  for (const control::StatusMember& m : ByRank(r, control::ROLE_SERVER)) {
    const std::string group = m.group() < 0 ? "-" : std::to_string(m.group());
    std::string role = m.spare() ? "spare" : "-";
    for (const control::StatusGroup& g : r.groups()) {
      if (g.primary_rank() == static_cast<int32_t>(m.rank())) role = "primary";
      if (g.backup_rank() == static_cast<int32_t>(m.rank())) role = "backup";
    }
    const control::MemberStats& s = m.stats();
    std::printf("  %-4u %-5s %-8s %-14" PRIu64 " %-12s %-10.1f %" PRIu64 "..%" PRIu64 "\n",
                m.rank(), group.c_str(), role.c_str(), s.pushes_applied(),
                (Bytes(m.bytes_per_second()) + "/s").c_str(), m.pushes_per_second(),
                s.min_applied_clock(), s.max_applied_clock());
  }
  std::printf("\nworkers    clocks %" PRIu64 "..%" PRIu64 "\n  %-4s %-8s %-5s %-12s %-12s %s\n",
              r.min_clock(), r.max_clock(), "RANK", "CLOCK", "LAG", "BYTES/S", "PUSHED", "PULLED");
  for (const control::StatusMember& m : ByRank(r, control::ROLE_WORKER)) {
    const control::MemberStats& s = m.stats();
    std::printf("  %-4u %-8" PRIu64 " %-5" PRIu64 " %-12s %-12s %s\n", m.rank(), s.clock(),
                m.clock_lag(), (Bytes(m.bytes_per_second()) + "/s").c_str(),
                Bytes(static_cast<double>(s.bytes_pushed())).c_str(),
                Bytes(static_cast<double>(s.bytes_pulled())).c_str());
  }
  if (r.has_checkpoint()) {
    const control::StatusCheckpoint& k = r.checkpoint();
    std::printf("\ncheckpoint clock %" PRIu64 " in %s at %s, %s (%u/%u groups)\n", k.clock(),
                k.dir().empty() ? "(server --checkpoint_dir)" : Printable(k.dir()).c_str(),
                UtcTime(k.unix_ms()).c_str(), k.complete() ? "complete" : "INCOMPLETE",
                k.groups_written(), k.groups());
  } else {
    std::printf(
        "\ncheckpoint none written since the coordinator started%s\n",
        r.config().checkpoint_every() > 0
            ? (" (every " + std::to_string(r.config().checkpoint_every()) + " clocks)").c_str()
            : "");
  }
}

int PrintJson(const StatusReply& r) {
  google::protobuf::util::JsonPrintOptions jo;
  jo.add_whitespace = true;
  jo.always_print_primitive_fields = true;
  jo.preserve_proto_field_names = true;
  std::string out;
  const auto st = google::protobuf::util::MessageToJsonString(r, &out, jo);
  if (!st.ok()) {
    std::fprintf(stderr, "shardps status: cannot print JSON: %s\n", st.ToString().c_str());
    return 1;
  }
  std::fputs(out.c_str(), stdout);
  if (out.empty() || out.back() != '\n') std::fputc('\n', stdout);
  return 0;
}

}  // namespace

int StatusMain(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  StatusOptions o;
  const int parsed = ParseArgs(argc, argv, &o);
  if (parsed != 0) return parsed < 0 ? 0 : parsed;
  while (true) {
    StatusOr<StatusReply> r = Ask(o);
    if (!r.ok()) {
      std::fprintf(stderr, "shardps status: %s\n",
                   Printable(std::string(r.status().message())).c_str());
      return 1;
    }
    if (o.json) {
      if (PrintJson(*r) != 0) return 1;
    } else {
      if (o.watch_s > 0) std::printf("--- %s\n", UtcTime(r->unix_ms()).c_str());
      PrintTable(*r, o.coordinator);
    }
    std::fflush(stdout);
    if (o.watch_s <= 0) return 0;
    std::this_thread::sleep_for(std::chrono::duration<double>(o.watch_s));
    if (!o.json) std::printf("\n");
  }
}

}  // namespace shardps::tools
