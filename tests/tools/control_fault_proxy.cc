// control_fault_proxy: a fault-injecting proxy for the ShardPS control plane (tests/tools/
// fault_proxy.h). Put it between members and shardps_coordinator; it drops, delays or
// blackholes whole control frames. See docs/fault-tolerance-tools.md.
//
// Signals: SIGUSR1 toggles the blackhole; SIGTERM/SIGINT print the counters and exit 0.
#include <signal.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "tests/tools/fault_proxy.h"

DEFINE_string(listen, "127.0.0.1:0", "Address to listen on (port 0: pick one; see --port_file)");
DEFINE_string(upstream, "", "The coordinator's host:port (required)");
DEFINE_double(drop_percent, 0, "Drop this percentage of the frames acted on (0..100)");
DEFINE_uint32(delay_ms, 0, "Delay frames by this many ms (order on a connection is kept)");
DEFINE_double(delay_percent, 100, "Delay this percentage of the frames acted on (0..100)");
DEFINE_uint64(seed, 1, "Seed of the drop/delay draws (the same seed, the same choices)");
DEFINE_string(only, "",
              "Act only on this Envelope body: join, join_reply, heartbeat, leave, membership, "
              "error, register_model, assign_shards, shards_ready, shard_map (default: all)");
DEFINE_string(direction, "both", "Act on frames going up (member -> coordinator), down, or both");
DEFINE_uint32(blackhole_after_ms, 0,
              "Start a blackhole (no forwarding either way, sockets kept open) this many ms "
              "after start; 0: never (SIGUSR1 toggles it at any time)");
DEFINE_uint32(blackhole_for_ms, 0, "End that blackhole after this many ms; 0: it lasts");
DEFINE_bool(stats, false, "Print the counters to stderr every second");
DEFINE_string(port_file, "", "Write the bound ip:port to this file once listening");
DEFINE_uint64(max_frame_bytes, 16u << 20, "A frame longer than this is malformed");

namespace {

constexpr char kUsage[] =
    "control_fault_proxy --upstream HOST:PORT [--listen ADDR] [--drop_percent P]\n"
    "    [--delay_ms D --delay_percent P] [--seed S] [--only BODY] [--direction up|down|both]\n"
    "    [--blackhole_after_ms T [--blackhole_for_ms L]] [--stats] [--port_file FILE]\n"
    "\n"
    "Forwards every connection it accepts to the coordinator and parses the control framing\n"
    "(magic, then u32-length-prefixed Envelopes) both ways, acting on whole frames: drop,\n"
    "delay (keeping order), or blackhole everything (a partition; SIGUSR1 toggles it).\n"
    "Malformed input from either side closes that connection pair; the proxy keeps running.\n"
    "Counters (per body: forwarded, dropped, delayed, blackholed) go to stderr on exit\n"
    "(SIGTERM, SIGINT) and every second with --stats.\n";

void PrintHelp() {
  printf("%s\nFlags:\n", kUsage);
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  for (const auto& f : flags) {
    if (f.filename.find("control_fault_proxy") == std::string::npos) continue;
    printf("  --%s (%s; default %s)\n      %s\n", f.name.c_str(), f.type.c_str(),
           f.default_value.empty() ? "\"\"" : f.default_value.c_str(), f.description.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h") || !strcmp(argv[i], "-help")) {
      PrintHelp();
      return 0;
    }
  }
  gflags::SetUsageMessage(kUsage);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);

  using shardps::tools::FaultProxy;
  using shardps::tools::FaultProxyOptions;
  FaultProxyOptions o;
  o.listen_address = FLAGS_listen;
  o.upstream = FLAGS_upstream;
  o.drop_percent = FLAGS_drop_percent;
  o.delay_ms = FLAGS_delay_ms;
  o.delay_percent = FLAGS_delay_percent;
  o.seed = FLAGS_seed;
  o.only = FLAGS_only;
  o.max_frame_bytes = FLAGS_max_frame_bytes;
  auto dir = shardps::tools::ParseProxyDirection(FLAGS_direction);
  if (!dir.ok()) {
    fprintf(stderr, "control_fault_proxy: %s\n", dir.status().ToString().c_str());
    return 2;
  }
  o.direction = *dir;

  // Signals are taken synchronously by this thread; block them before any thread starts.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  auto proxy = FaultProxy::Start(o);
  if (!proxy.ok()) {
    fprintf(stderr, "control_fault_proxy: %s\n%s", proxy.status().ToString().c_str(), kUsage);
    return 2;
  }
  if (!FLAGS_port_file.empty()) {
    const std::string tmp = FLAGS_port_file + ".tmp";
    { std::ofstream(tmp) << (*proxy)->address() << "\n"; }
    if (rename(tmp.c_str(), FLAGS_port_file.c_str()) != 0) {
      fprintf(stderr, "control_fault_proxy: cannot write %s\n", FLAGS_port_file.c_str());
      return 1;
    }
  }
  LOG(INFO) << "control_fault_proxy: listening on " << (*proxy)->address();

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next_stats = start + std::chrono::seconds(1);
  bool hole_started = false, hole_ended = false;
  while (true) {
    const auto now = Clock::now();
    if (FLAGS_blackhole_after_ms > 0 && !hole_started &&
        now - start >= std::chrono::milliseconds(FLAGS_blackhole_after_ms)) {
      hole_started = true;
      (*proxy)->SetBlackhole(true);
    }
    if (hole_started && !hole_ended && FLAGS_blackhole_for_ms > 0 &&
        now - start >= std::chrono::milliseconds(FLAGS_blackhole_after_ms) +
                           std::chrono::milliseconds(FLAGS_blackhole_for_ms)) {
      hole_ended = true;
      (*proxy)->SetBlackhole(false);
    }
    if (FLAGS_stats && now >= next_stats) {
      next_stats += std::chrono::seconds(1);
      fprintf(stderr, "[stats]%s\n%s", (*proxy)->blackhole() ? " (blackhole)" : "",
              (*proxy)->counters().ToString().c_str());
    }
    timespec ts{0, 20 * 1000 * 1000};  // 20 ms: timers above are checked at this resolution
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig == SIGUSR1) {
      (*proxy)->SetBlackhole(!(*proxy)->blackhole());
    } else if (sig == SIGTERM || sig == SIGINT) {
      break;
    }
  }
  (*proxy)->Stop();
  fprintf(stderr, "[final]\n%s", (*proxy)->counters().ToString().c_str());
  return 0;
}
