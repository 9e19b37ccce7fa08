// FaultProxy: a control-plane TCP proxy that injects faults per message (in the spirit of
// ps-lite's PS_DROP_MSG). It listens, connects every accepted connection to the upstream
// (the coordinator), and parses the framing (proto/framing.h) in both directions:
//   up   = member -> coordinator: the magic, then frames;
//   down = coordinator -> member: frames.
// Each whole frame is forwarded byte for byte, dropped, or delayed (order on a connection is
// kept: a frame behind a delayed one waits for it), by seeded random draws, optionally only for
// one Envelope body and one direction. A blackhole stops all forwarding, both directions, with
// the sockets kept open (a partition): frames that arrive meanwhile are read and discarded, and
// frames already queued wait. Malformed input from either side (bad magic, a length of 0 or
// over the limit, an envelope that does not parse or has no body) closes that connection pair
// once the frames before it have been forwarded, is logged and counted; the proxy keeps
// running.
//
// Thread safety: Start/Stop/SetBlackhole/counters from any thread; the event loop runs on its
// own thread and owns every connection.
#ifndef SHARDPS_TESTS_TOOLS_FAULT_PROXY_H_
#define SHARDPS_TESTS_TOOLS_FAULT_PROXY_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/status.h"
#include "proto/framing.h"

namespace shardps::tools {

enum class ProxyDirection { kUp = 1, kDown = 2, kBoth = 3 };
StatusOr<ProxyDirection> ParseProxyDirection(const std::string& s);

struct FaultProxyOptions {
  std::string listen_address = "127.0.0.1:0";
  std::string upstream;     // "host:port" of the coordinator
  double drop_percent = 0;  // 0..100, of the frames acted on
  uint32_t delay_ms = 0;
  double delay_percent = 100;  // 0..100, of the frames acted on, when delay_ms > 0
  uint64_t seed = 1;
  std::string only;  // an Envelope body name ("heartbeat"); empty: every body
  ProxyDirection direction = ProxyDirection::kBoth;
  size_t max_frame_bytes = control::kDefaultMaxFrameBytes;
  std::chrono::milliseconds connect_timeout{3000};
};

struct BodyCounters {
  uint64_t forwarded = 0;  // written on (delayed ones included, once released)
  uint64_t dropped = 0;
  uint64_t delayed = 0;
  uint64_t blackholed = 0;  // discarded because they arrived during a blackhole
};

struct FaultProxyCounters {
  std::map<std::string, BodyCounters> by_body;  // "join", "heartbeat", ...
  uint64_t connections = 0;                     // pairs opened
  uint64_t malformed = 0;                       // pairs closed for malformed input
  uint64_t upstream_failures = 0;               // accepted, but the upstream was unreachable
  BodyCounters Total() const;
  // "heartbeat: forwarded 3 dropped 9 delayed 0 blackholed 0" per body, then a totals line.
  std::string ToString() const;
};

class FaultProxy {
 public:
  static StatusOr<std::unique_ptr<FaultProxy>> Start(const FaultProxyOptions& options);
  ~FaultProxy();
  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  const std::string& address() const { return address_; }  // the bound "ip:port"
  void SetBlackhole(bool on);
  bool blackhole() const { return blackhole_.load(); }
  FaultProxyCounters counters() const;
  void Stop();

 private:
  struct Flow;
  struct Pair;
  explicit FaultProxy(const FaultProxyOptions& options);
  void Loop();
  void AcceptNew();
  void ReadInto(Pair* p, Flow* f);
  void ParseFrames(Pair* p, Flow* f);
  void Release(Pair* p, Flow* f);
  void Flush(Pair* p, Flow* f);
  void Malformed(Pair* p, Flow* f, const std::string& why);
  void ClosePair(Pair* p, const std::string& why);
  bool Roll(double percent);

  const FaultProxyOptions options_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> blackhole_{false};

  // Loop-thread state.
  std::map<uint64_t, std::unique_ptr<Pair>> pairs_;
  uint64_t next_pair_ = 1;
  uint64_t rng_;  // splitmix64 state

  mutable std::mutex mu_;  // guards counters_
  FaultProxyCounters counters_;
};

}  // namespace shardps::tools

#endif  // SHARDPS_TESTS_TOOLS_FAULT_PROXY_H_
