#include "common/trace.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "common/thread_annotations.h"

namespace shardps::trace {

namespace internal {
std::atomic<bool> g_enabled{false};

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
}  // namespace internal

namespace {

int64_t RealtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// A metadata event ("M") naming this process or thread, as Perfetto reads them.
Event MetadataEvent(const char* name, const std::string& value) {
  Event e;
  e.ph = 'M';
  e.name = name;
  e.tid = ThreadId();
  e.Add(Arg("name", value));
  return e;
}

// A JSON string literal of `s`. Not control::JsonQuote (protobuf's JSON printer, which the tools
// use): this runs for every name and argument of up to a million events per flush, where building
// a google.protobuf.Value per string would cost more than the event itself. The strings are the
// code's own names, numbers and the host's name.
void AppendEscaped(std::string* out, std::string_view s) {
  out->push_back('"');
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      default:
        if (ch < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out->append(buf);
        } else {
          out->push_back(static_cast<char>(ch));
        }
    }
  }
  out->push_back('"');
}

// Microseconds with 3 decimals from nanoseconds (non-negative).
void AppendInt(std::string* out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, r.ptr);
}

void AppendMicros(std::string* out, int64_t ns) {
  if (ns < 0) ns = 0;
  AppendInt(out, ns / 1000);
  const int64_t frac = ns % 1000;
  const char digits[4] = {'.', static_cast<char>('0' + frac / 100),
                          static_cast<char>('0' + frac / 10 % 10), static_cast<char>('0' + frac % 10)};
  out->append(digits, 4);
}

void AppendEvent(std::string* out, const Event& e, int64_t pid) {
  out->append("{\"ph\":\"");
  out->push_back(e.ph);
  out->append("\",\"name\":");
  AppendEscaped(out, e.name);
  if (e.ph != 'M') {
    out->append(",\"cat\":");
    AppendEscaped(out, e.cat);
  }
  out->append(",\"pid\":");
  AppendInt(out, pid);
  out->append(",\"tid\":");
  AppendInt(out, e.tid);
  out->append(",\"ts\":");
  AppendMicros(out, e.ts_ns);
  if (e.ph == 'X') {
    out->append(",\"dur\":");
    AppendMicros(out, e.dur_ns);
  } else if (e.ph == 'i') {
    out->append(",\"s\":\"t\"");
  }
  if (e.nargs > 0) {
    out->append(",\"args\":{");
    for (int i = 0; i < e.nargs; ++i) {
      if (i > 0) out->push_back(',');
      AppendEscaped(out, e.args[i].key != nullptr ? e.args[i].key : "");
      out->push_back(':');
      if (e.args[i].is_string) {
        AppendEscaped(out, e.args[i].s);
      } else {
        AppendInt(out, e.args[i].i);
      }
    }
    out->push_back('}');
  }
  out->push_back('}');
}

std::string Hostname() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// The process's tracer. Lock order: file_mu before mu.
class Tracer {
 public:
  Status Start(const Options& o) EXCLUDES(file_mu_, mu_) {
    MutexLock f(&file_mu_);
    MutexLock l(&mu_);
    if (running_) return FailedPreconditionError("a trace is already being written");
    if (o.path.empty()) return InvalidArgumentError("trace: empty path");
    const size_t slash = o.path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : o.path.substr(0, slash + 1);
    if (access(dir.c_str(), W_OK) != 0) {
      return ErrnoError("trace file directory '" + dir + "' is not writable", errno);
    }
    options_ = o;
    if (options_.flush_events == 0) options_.flush_events = 1;
    running_ = true;
    buffer_.clear();
    accepted_ = 0;
    dropped_ = 0;
    written_ = 0;
    fd_ = -1;
    path_.clear();
    body_end_ = 0;
    first_event_ = true;
    write_failed_ = false;
    pid_ = getpid();
    hostname_ = Hostname();
    role_ = "process";
    rank_ = -1;
    group_ = -1;
    // The anchor: CLOCK_MONOTONIC read between two CLOCK_REALTIME readings.
    const int64_t r1 = RealtimeNs();
    anchor_mono_ns_ = internal::MonotonicNs();
    const int64_t r2 = RealtimeNs();
    anchor_real_ns_ = r1 + (r2 - r1) / 2;
    anchor_uncertainty_ns_ = (r2 - r1) / 2;
    internal::g_enabled.store(true, std::memory_order_relaxed);
    return Status::OK();
  }

  Status Stop() EXCLUDES(file_mu_, mu_) {
    MutexLock f(&file_mu_);
    {
      MutexLock l(&mu_);
      if (!running_) return Status::OK();
      internal::g_enabled.store(false, std::memory_order_relaxed);
    }
    Status st = FlushLocked();
    {
      MutexLock l(&mu_);
      running_ = false;
      buffer_.clear();
    }
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    path_.clear();
    return st;
  }

  Status Flush() EXCLUDES(file_mu_, mu_) {
    MutexLock f(&file_mu_);
    return FlushLocked();
  }

  void Record(Event&& e) EXCLUDES(file_mu_, mu_) {
    bool flush = false;
    {
      MutexLock l(&mu_);
      if (!running_) return;
      if (e.ph != 'M') {
        if (accepted_ >= options_.max_events) {
          ++dropped_;
          return;
        }
        ++accepted_;
      }
      if (buffer_.capacity() == 0) buffer_.reserve(options_.flush_events);
      buffer_.push_back(std::move(e));
      flush = buffer_.size() >= options_.flush_events;
    }
    if (flush) Flush().IgnoreError();  // a failed write is logged once (WriteFailed)
  }

  void SetIdentity(const std::string& role, int64_t rank, int64_t group) EXCLUDES(file_mu_, mu_) {
    std::string label;
    {
      MutexLock f(&file_mu_);
      MutexLock l(&mu_);
      if (!running_) return;
      role_ = role;
      rank_ = rank;
      group_ = group;
      label = role;
      if (group >= 0) label += " g" + std::to_string(group);
      if (rank >= 0) label += " r" + std::to_string(rank);
      label += " (" + hostname_ + ":" + std::to_string(pid_) + ")";
    }
    Record(MetadataEvent("process_name", label));
    Status st = Flush();  // creates the file, under its final name
    if (!st.ok()) LOG(ERROR) << "trace: " << st;
  }

  std::string path() EXCLUDES(file_mu_) {
    MutexLock f(&file_mu_);
    return path_;
  }
  uint64_t dropped() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return dropped_;
  }

 private:
  Status FlushLocked() REQUIRES(file_mu_) EXCLUDES(mu_) {
    std::vector<Event> events;
    std::string trailer;
    int64_t pid = 0;
    {
      MutexLock l(&mu_);
      if (!running_) return Status::OK();
      pid = pid_;
      events.swap(buffer_);
      if (write_failed_) return Status::OK();  // reported once
      if (fd_ < 0) {
        path_ = ExpandPath(options_.path, rank_, pid_);
      }
    }
    if (fd_ < 0) {
      fd_ = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
      if (fd_ < 0) return WriteFailed(ErrnoError("trace: open " + path_, errno));
      std::string head;
      {
        MutexLock l(&mu_);
        head = "{\"shardps_header\":{\"version\":1,\"hostname\":";
        AppendEscaped(&head, hostname_);
        head += ",\"pid\":" + std::to_string(pid_) + ",\"clock_anchor\":" + Anchor() +
                "},\n\"traceEvents\":[\n";
      }
      RETURN_IF_ERROR(WriteAt(head, 0));
      body_end_ = head.size();
    }
    std::string body;
    body.reserve(events.size() * 160);
    for (const Event& e : events) {
      if (!first_event_) body.append(",\n");
      first_event_ = false;
      AppendEvent(&body, e, pid);
      if (e.ph != 'M') ++written_;
    }
    {
      MutexLock l(&mu_);
      trailer = Trailer();
    }
    RETURN_IF_ERROR(WriteAt(body, body_end_));
    body_end_ += body.size();
    RETURN_IF_ERROR(WriteAt(trailer, body_end_));
    if (ftruncate(fd_, static_cast<off_t>(body_end_ + trailer.size())) != 0) {
      return WriteFailed(ErrnoError("trace: truncate " + path_, errno));
    }
    return Status::OK();
  }

  std::string Trailer() REQUIRES(file_mu_, mu_) {
    std::string t = "\n],\n\"displayTimeUnit\":\"ms\",\n\"shardps\":{\"version\":1,\"role\":";
    AppendEscaped(&t, role_);
    t += ",\"rank\":" + std::to_string(rank_) + ",\"group\":" + std::to_string(group_) +
         ",\"hostname\":";
    AppendEscaped(&t, hostname_);
    t += ",\"pid\":" + std::to_string(pid_) + ",\"clock_anchor\":" + Anchor() +
         ",\"events\":" + std::to_string(written_) +
         ",\"dropped_events\":" + std::to_string(dropped_) +
         ",\"max_events\":" + std::to_string(options_.max_events) + "}}\n";
    return t;
  }

  std::string Anchor() REQUIRES(mu_) {
    std::string t = "{\"monotonic_us\":";
    AppendMicros(&t, anchor_mono_ns_);
    t += ",\"realtime_us\":";
    AppendMicros(&t, anchor_real_ns_);
    t += ",\"uncertainty_us\":";
    AppendMicros(&t, anchor_uncertainty_ns_);
    return t + "}";
  }

  Status WriteAt(const std::string& s, uint64_t off) REQUIRES(file_mu_) {
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = pwrite(fd_, s.data() + done, s.size() - done,
                               static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return WriteFailed(ErrnoError("trace: write " + path_, n < 0 ? errno : EIO));
      done += static_cast<size_t>(n);
    }
    return Status::OK();
  }

  // A file that cannot be written (disk full, removed directory) stops the recording: the
  // process goes on untraced, and says so once.
  Status WriteFailed(Status st) REQUIRES(file_mu_) EXCLUDES(mu_) {
    LOG(ERROR) << st << "; tracing stops";
    internal::g_enabled.store(false, std::memory_order_relaxed);
    MutexLock l(&mu_);
    write_failed_ = true;
    buffer_.clear();
    return st;
  }

  Mutex file_mu_;
  int fd_ GUARDED_BY(file_mu_) = -1;
  std::string path_ GUARDED_BY(file_mu_);
  uint64_t body_end_ GUARDED_BY(file_mu_) = 0;
  bool first_event_ GUARDED_BY(file_mu_) = true;
  uint64_t written_ GUARDED_BY(file_mu_) = 0;

  Mutex mu_ ACQUIRED_AFTER(file_mu_);
  bool running_ GUARDED_BY(mu_) = false;
  bool write_failed_ GUARDED_BY(mu_) = false;
  Options options_ GUARDED_BY(mu_);
  std::vector<Event> buffer_ GUARDED_BY(mu_);
  uint64_t accepted_ GUARDED_BY(mu_) = 0;
  uint64_t dropped_ GUARDED_BY(mu_) = 0;
  int64_t pid_ GUARDED_BY(mu_) = 0;
  std::string hostname_ GUARDED_BY(mu_);
  std::string role_ GUARDED_BY(mu_);
  int64_t rank_ GUARDED_BY(mu_) = -1;
  int64_t group_ GUARDED_BY(mu_) = -1;
  int64_t anchor_mono_ns_ GUARDED_BY(mu_) = 0;
  int64_t anchor_real_ns_ GUARDED_BY(mu_) = 0;
  int64_t anchor_uncertainty_ns_ GUARDED_BY(mu_) = 0;
};

Tracer& TheTracer() {
  static Tracer* t = new Tracer();  // never destroyed: spans may end during static destruction
  return *t;
}

}  // namespace

Status Start(const Options& options) { return TheTracer().Start(options); }
Status Stop() { return TheTracer().Stop(); }
Status Flush() { return TheTracer().Flush(); }
void SetIdentity(const std::string& role, int64_t rank, int64_t group) {
  TheTracer().SetIdentity(role, rank, group);
}
std::string CurrentPath() { return TheTracer().path(); }
uint64_t DroppedEvents() { return TheTracer().dropped(); }
void Record(Event&& e) { TheTracer().Record(std::move(e)); }

uint32_t ThreadId() {
  thread_local const uint32_t tid = static_cast<uint32_t>(syscall(SYS_gettid));
  return tid;
}

void NameThread(const std::string& name) {
  if (!Enabled()) return;
  Record(MetadataEvent("thread_name", name));
}

std::string ExpandPath(const std::string& path, int64_t rank, int64_t pid) {
  const std::string who = (rank >= 0 ? std::to_string(rank) : std::string("x")) + "-" +
                          std::to_string(pid);
  std::string out;
  for (size_t i = 0; i < path.size();) {
    if (path.compare(i, 6, "{rank}") == 0) {
      out += who;
      i += 6;
    } else if (path.compare(i, 2, "%r") == 0) {
      out += who;
      i += 2;
    } else {
      out.push_back(path[i++]);
    }
  }
  return out;
}

Status ScopedTrace::Begin(const Options& options) {
  if (options.path.empty() || owns_) return Status::OK();
  Status st = Start(options);
  if (st.code() == StatusCode::kFailedPrecondition) return Status::OK();  // another owner's
  RETURN_IF_ERROR(st);
  owns_ = true;
  return Status::OK();
}

void ScopedTrace::End() {
  if (!owns_) return;
  owns_ = false;
  Status st = Stop();
  if (!st.ok()) LOG(ERROR) << "trace: " << st;
}

}  // namespace shardps::trace
