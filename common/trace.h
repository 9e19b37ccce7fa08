// A process-wide timeline tracer (docs/tracing.md): spans and instants in the Chrome Trace
// Event Format (JSON), which Perfetto and chrome://tracing open, one file per process, merged
// onto one clock by tools/shardps_trace_merge.py.
//
//   trace::Options o;  o.path = "/tmp/run/server-{rank}.json";
//   trace::ScopedTrace tracing(o);           // starts the process's tracer; stops it (flushes,
//   ...                                      // closes the file) when it goes out of scope
//   { trace::Span s("apply", "server"); s.Arg("chunk", id).Arg("clock", c); ... }
//   trace::Instant("promote", "server", {{"group", g}});
//
// Off (the default) an instrumentation point costs one load and one predictable branch: Span's
// constructor and Instant test Enabled() first, and Arg() on an inactive span returns at once.
// Names, categories and argument keys must be string literals (stored as pointers).
//
// Events are buffered in memory under a short lock and written to the file when the buffer
// holds Options::flush_events, at Flush(), and at Stop(). At most Options::max_events events
// (metadata aside) are kept per process; later ones are dropped and counted, and the count is
// written in the file. The file is rewritten in place at every flush so that it is a complete
// JSON document between flushes: new events are written over the old trailer, then the new
// trailer, then the file is truncated to its end. A process killed between flushes leaves a
// valid file with the events of its last flush (a kill during a flush may leave the trailer
// cut; the merge tool repairs that from the header and the one-event-per-line body).
//
// File layout:
//   {"shardps_header":{"version":1,"hostname":..,"pid":..,"clock_anchor":{..as below..}},
//   "traceEvents":[
//   {"ph":"M","name":"process_name",...}, {"ph":"X","name":"push",...,"ts":T,"dur":D}, ...
//   ],
//   "displayTimeUnit":"ms",
//   "shardps":{"version":1,"role":..,"rank":..,"group":..,"hostname":..,"pid":..,
//              "clock_anchor":{"monotonic_us":M,"realtime_us":R,"uncertainty_us":U},
//              "events":N,"dropped_events":K,"max_events":..}}
// ts and dur are CLOCK_MONOTONIC microseconds (3 decimals: nanoseconds). The anchor is one
// reading of CLOCK_MONOTONIC taken between two readings of CLOCK_REALTIME (their midpoint,
// U their half-distance), so ts - M + R puts an event on the wall clock, the one clock that
// processes on different hosts share (as well as NTP/PTP keeps them).
//
// The path may contain "{rank}" or "%r": replaced by "<rank>-<pid>" (this process's rank once
// SetIdentity named it, else "x-<pid>"), so several processes given the same path do not
// collide. The file is created at SetIdentity or at the first flush, whichever comes first.
//
// Thread safety: every function may be called from any thread. Start/Stop are meant for the
// process's start-up and shutdown (ScopedTrace); events recorded while stopped are discarded.
#ifndef SHARDPS_COMMON_TRACE_H_
#define SHARDPS_COMMON_TRACE_H_

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "common/status.h"

namespace shardps::trace {

struct Options {
  std::string path;               // empty: tracing stays off
  uint64_t max_events = 1000000;  // per process, metadata aside; later events are dropped
  uint64_t flush_events = 8192;   // buffered events that trigger a write to the file
};

namespace internal {
extern std::atomic<bool> g_enabled;
int64_t MonotonicNs();
}  // namespace internal

// True while a trace is being recorded. The one branch every instrumentation point pays.
inline bool Enabled() {
  return __builtin_expect(internal::g_enabled.load(std::memory_order_relaxed), 0);
}

// One argument of an event: an integer, or a string (copied).
struct Arg {
  Arg() = default;
  Arg(const char* k, int64_t v) : key(k), i(v) {}
  Arg(const char* k, uint64_t v) : key(k), i(static_cast<int64_t>(v)) {}
  Arg(const char* k, int v) : key(k), i(v) {}
  Arg(const char* k, uint32_t v) : key(k), i(v) {}
  Arg(const char* k, std::string v) : key(k), s(std::move(v)), is_string(true) {}
  Arg(const char* k, const char* v) : key(k), s(v), is_string(true) {}
  const char* key = nullptr;
  int64_t i = 0;
  std::string s;
  bool is_string = false;
};

inline constexpr int kMaxArgs = 6;

struct Event {
  char ph = 'X';  // 'X' span, 'i' instant, 'M' metadata
  const char* name = "";
  const char* cat = "";
  int64_t ts_ns = 0;   // CLOCK_MONOTONIC
  int64_t dur_ns = 0;  // spans
  uint32_t tid = 0;
  int nargs = 0;
  Arg args[kMaxArgs];
  void Add(Arg a) {
    if (nargs < kMaxArgs) args[nargs++] = std::move(a);
  }
};

// Starts the process's tracer: OK with Enabled() true; INVALID_ARGUMENT if the path's
// directory cannot be written; FAILED_PRECONDITION if a trace is already running (the running
// one is kept).
Status Start(const Options& options);
// Writes what is buffered and closes the file; Enabled() is false after it. OK when not running.
Status Stop();
// Writes what is buffered (a complete document). OK when not running.
Status Flush();
// Names this process in the file: role ("worker", "server", "coordinator"), rank (-1: none),
// group (servers; -1: none). Creates the file if it is not yet created.
void SetIdentity(const std::string& role, int64_t rank, int64_t group = -1);
// Names the calling thread (a "thread_name" metadata event).
void NameThread(const std::string& name);
// The path being written ("" before the file is created or when not running).
std::string CurrentPath();
// Events dropped since Start (the max_events bound).
uint64_t DroppedEvents();

// Records an event (ts_ns and tid must be set; use the helpers below).
void Record(Event&& e);
uint32_t ThreadId();

// An instant event.
inline void Instant(const char* name, const char* cat, std::initializer_list<Arg> args = {}) {
  if (!Enabled()) return;
  Event e;
  e.ph = 'i';
  e.name = name;
  e.cat = cat;
  e.ts_ns = internal::MonotonicNs();
  e.tid = ThreadId();
  for (const Arg& a : args) e.Add(a);
  Record(std::move(e));
}

// A span whose start was taken earlier (NowNs()), for work that starts in one call and ends in
// another (a pull posted in Pull() and finished by a completion).
inline int64_t NowNs() { return Enabled() ? internal::MonotonicNs() : 0; }
// An instant event at a time taken earlier (NowNs(); 0: not traced): for an event that others
// can observe the moment it happens, stamped before it happens rather than after (a publish
// that a peer's read can see before the publishing thread records it).
inline void InstantAt(const char* name, const char* cat, int64_t ts_ns,
                      std::initializer_list<Arg> args = {}) {
  if (!Enabled() || ts_ns == 0) return;
  Event e;
  e.ph = 'i';
  e.name = name;
  e.cat = cat;
  e.ts_ns = ts_ns;
  e.tid = ThreadId();
  for (const Arg& a : args) e.Add(a);
  Record(std::move(e));
}
inline void Complete(const char* name, const char* cat, int64_t start_ns,
                     std::initializer_list<Arg> args = {}) {
  if (!Enabled() || start_ns == 0) return;
  Event e;
  e.name = name;
  e.cat = cat;
  e.ts_ns = start_ns;
  e.dur_ns = internal::MonotonicNs() - start_ns;
  e.tid = ThreadId();
  for (const Arg& a : args) e.Add(a);
  Record(std::move(e));
}

// A span from construction to destruction (RAII).
class Span {
 public:
  Span(const char* name, const char* cat) {
    if (Enabled()) {
      e_.emplace();
      e_->name = name;
      e_->cat = cat;
      e_->ts_ns = internal::MonotonicNs();
    }
  }
  ~Span() {
    if (!e_) return;
    e_->dur_ns = internal::MonotonicNs() - e_->ts_ns;
    e_->tid = ThreadId();
    Record(std::move(*e_));
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  template <typename T>
  Span& Arg(const char* key, T value) {
    if (e_) e_->Add(trace::Arg(key, value));
    return *this;
  }
  bool active() const { return e_.has_value(); }

 private:
  std::optional<Event> e_;  // engaged while tracing: nothing is constructed when off
};

// Starts tracing for its lifetime if options.path is set (and no trace runs yet); stops it
// (flushes, closes the file) when destroyed, if it started it.
class ScopedTrace {
 public:
  ScopedTrace() = default;
  explicit ScopedTrace(const Options& options) { status_ = Begin(options); }
  ~ScopedTrace() { End(); }
  ScopedTrace(const ScopedTrace&) = delete;
  ScopedTrace& operator=(const ScopedTrace&) = delete;
  // As the constructor; INVALID_ARGUMENT for a path that cannot be written. A trace already
  // running in this process (another ScopedTrace) is left to its owner: OK, owns() false.
  Status Begin(const Options& options);
  void End();
  bool owns() const { return owns_; }
  const Status& status() const { return status_; }

 private:
  bool owns_ = false;
  Status status_;
};

// Replaces "{rank}" and "%r" in `path` by "<rank>-<pid>" ("x-<pid>" for rank < 0).
std::string ExpandPath(const std::string& path, int64_t rank, int64_t pid);

}  // namespace shardps::trace

#endif  // SHARDPS_COMMON_TRACE_H_
