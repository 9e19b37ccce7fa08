// CheckpointWriter (server/checkpoint.h): the background thread that writes submitted
// snapshots one at a time, in submission order, applies retention after each successful write,
// and keeps the stats.
#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include <glog/logging.h>

#include "common/trace.h"
#include "server/checkpoint.h"

namespace shardps::server {

CheckpointWriter::CheckpointWriter(Options options, ObserveFn observe)
    : options_(std::move(options)), observe_(std::move(observe)), thread_([this] { Run(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void CheckpointWriter::Submit(ShardSnapshot&& snapshot) {
  {
    MutexLock l(&mu_);
    ++stats_.submitted;
    if (queued_.size() >= kMaxQueued) {
      ++stats_.superseded;
      LOG_EVERY_N(ERROR, 16) << "checkpoint: " << kMaxQueued << " snapshots already wait for "
                             << "the disk; the one of group " << snapshot.group << " at clock "
                             << snapshot.clock << " is dropped (checkpoints are taken faster "
                             << "than they can be written: raise --checkpoint_every)";
      return;
    }
    queued_.push_back(std::move(snapshot));
  }
  cv_.Signal();
}

Status CheckpointWriter::Flush(std::chrono::milliseconds timeout) {
  MutexLock l(&mu_);
  if (!idle_cv_.WaitFor(&mu_, timeout,
                        [this]() REQUIRES(mu_) { return queued_.empty() && !writing_; })) {
    return DeadlineExceededError("checkpoint writer still busy after " +
                                 std::to_string(timeout.count()) + " ms");
  }
  return last_attempt_;
}

CheckpointWriter::Stats CheckpointWriter::stats() const {
  MutexLock l(&mu_);
  return stats_;
}

void CheckpointWriter::Run() {
  trace::NameThread("checkpoint writer");
  mu_.Lock();
  for (;;) {
    cv_.Wait(&mu_, [this]() REQUIRES(mu_) { return stop_ || !queued_.empty(); });
    if (queued_.empty()) break;  // stopping, nothing left to write
    ShardSnapshot s = std::move(queued_.front());
    queued_.pop_front();
    writing_ = true;
    mu_.Unlock();
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t bytes = 0;
    trace::Span span("ckpt_write", "server");
    span.Arg("group", s.group).Arg("clock", s.clock);
    Status st = options_.write ? options_.write(options_.dir, s, &bytes)
                               : WriteSnapshot(options_.dir, s, &bytes);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (observe_) observe_(st.ok(), bytes, secs);
    if (st.ok() && options_.keep > 0) {
      Status p =
          PruneCheckpoints(options_.dir, s.group, s.num_groups, options_.keep, s.plan_fingerprint);
      if (!p.ok()) LOG(WARNING) << "checkpoint: retention for group " << s.group << ": " << p;
    }
    mu_.Lock();
    Record(s, st, bytes, secs);
    writing_ = false;
    idle_cv_.SignalAll();
  }
  mu_.Unlock();
}

void CheckpointWriter::Record(const ShardSnapshot& s, const Status& st, uint64_t bytes,
                              double seconds) {
  last_attempt_ = st;
  if (st.ok()) {
    if (!last_logged_error_.empty()) {
      LOG(INFO) << "checkpoint: writes succeed again (clock " << s.clock << ", " << stats_.failed
                << " failed so far)";
      last_logged_error_.clear();
    }
    ++stats_.written;
    stats_.bytes_written += bytes;
    stats_.last_written_clock = s.clock;
    stats_.last_write_seconds = seconds;
    stats_.max_write_seconds = std::max(stats_.max_write_seconds, seconds);
    stats_.total_write_seconds += seconds;
    return;
  }
  ++stats_.failed;
  stats_.last_error = st;
  // The same failure at every clock names a different path; log by code and cause.
  const std::string& m = st.message();
  size_t cause = m.rfind(": ");
  std::string key = std::string(StatusCodeName(st.code())) + " " +
                    (cause == std::string::npos ? m : m.substr(cause + 2));
  if (key != last_logged_error_) {
    LOG(ERROR) << "checkpoint: write of group " << s.group << " at clock " << s.clock
               << " failed: " << st << " (training continues; repeats of this error are "
               << "counted, not logged)";
    last_logged_error_ = key;
  }
}

}  // namespace shardps::server
