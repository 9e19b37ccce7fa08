#include "worker/recovery.h"

#include <algorithm>
#include <string>
#include <thread>

#include <glog/logging.h>

#include "common/crash_point.h"
#include "common/trace.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Status Recovery::MaybeRecover() {
  if (recovering_) return Status::OK();
  const uint64_t epoch = control_.epoch();
  bool departed = false;
  if (epoch != checked_epoch_) {
    checked_epoch_ = epoch;
    departed = sessions_.MarkDeparted(control_.membership());
  }
  if (!sessions_.MarkFailed() && !departed) return Status::OK();
  return Recover();
}

void Recovery::NoteDepartures() {
  if (recovering_) return;
  const uint64_t epoch = control_.epoch();
  if (epoch == checked_epoch_) return;
  checked_epoch_ = epoch;
  sessions_.MarkDeparted(control_.membership());
}

milliseconds Recovery::FailoverTimeout() const {
  if (options_.failover_timeout.count() > 0) return options_.failover_timeout;
  return milliseconds(config_.failover_timeout_ms() > 0 ? config_.failover_timeout_ms() : 20000);
}

Status Recovery::OutOfCluster() const {
  // Declared dead while stopped or cut off, and refused back: nothing here can be repaired;
  // the trainer must start again as a new worker (it then rejoins at the cluster's clock).
  const Status cs = control_.status();
  if (cs.code() != StatusCode::kPermissionDenied) return Status::OK();
  return AbortedError("worker rank " + std::to_string(rank_) +
                      " is no longer a member of the cluster: " + cs.ToString() +
                      "; restart this worker (it rejoins at the cluster's clock)");
}

Status Recovery::Recover() {
  RETURN_IF_ERROR(OutOfCluster());
  recovering_ = true;
  pull_.HoldDeadlines(true);
  struct Reset {
    bool* f;
    PullPipeline* pull;
    ~Reset() {
      *f = false;
      pull->HoldDeadlines(false);
    }
  } reset{&recovering_, &pull_};
  const auto t0 = SteadyClock::now();
  const milliseconds timeout = FailoverTimeout();
  const auto deadline = t0 + timeout;
  auto next_reconnect = t0 + milliseconds(20);
  have_newest_ = false;
  std::string names;
  for (uint32_t i = 0; i < sessions_.size(); ++i) {
    if (sessions_.at(i).failed) names += (names.empty() ? "" : ", ") + std::to_string(i);
  }
  LOG(WARNING) << "worker rank " << rank_ << ": server group(s) " << names
               << " failed; waiting up to " << timeout.count() << " ms for a failover";
  for (;;) {
    while (true) {
      RETURN_IF_ERROR(OutOfCluster());
      DrainShardMaps();
      RETURN_IF_ERROR(ReconnectLiveServers(SteadyClock::now() >= next_reconnect));
      if (SteadyClock::now() >= next_reconnect)
        next_reconnect = SteadyClock::now() + milliseconds(100);
      if (AllReplaced()) break;
      if (SteadyClock::now() > deadline) {
        for (uint32_t i = 0; i < sessions_.size(); ++i) {
          if (sessions_.at(i).failed) {
            return sessions_.ServerError(i, "failed, and no backup took over within " +
                                                std::to_string(timeout.count()) + " ms");
          }
        }
      }
      auto m = control_.WaitMessage(control::Envelope::kShardMap, milliseconds(20));
      if (m.ok()) Consider(*m);
      sessions_.Progress().IgnoreError();  // completions of the healthy servers keep flowing
    }
    if (!have_newest_) return Status::OK();  // every failed server was reconnected
    const Status moved = MoveToBackups(t0, deadline, timeout);
    // The server a group failed over to may die too, before or while this worker moves to it:
    // that is not this worker's error but the group's, and the coordinator says next what it
    // is (another server, or the group lost: DATA_LOSS). Wait for its word, within the same
    // deadline; the session that could not move stays failed.
    const bool transport_error = moved.code() == StatusCode::kUnavailable ||
                                 moved.code() == StatusCode::kDeadlineExceeded ||
                                 moved.code() == StatusCode::kPermissionDenied;
    // Past the deadline too: the loop first looks for the coordinator's verdict (a lost group is
    // DATA_LOSS), then reports the deadline.
    if (moved.ok() || !transport_error) return moved;
    LOG(WARNING) << "worker rank " << rank_ << ": the server a group failed over to failed too ("
                 << moved << "); waiting for the coordinator's next shard map";
    have_newest_ = false;
  }
}

void Recovery::DrainShardMaps() {
  while (true) {
    auto m = control_.WaitMessage(control::Envelope::kShardMap, milliseconds(0));
    if (!m.ok()) return;
    Consider(*m);
  }
}

void Recovery::Consider(const control::Envelope& e) {
  const uint64_t epoch = e.shard_map().epoch();
  if (epoch > sessions_.map_epoch() && (!have_newest_ || epoch > newest_.epoch())) {
    newest_ = e.shard_map();
    have_newest_ = true;
  }
}

const control::ServerEntry* Recovery::EntryOf(uint32_t i) const {
  if (!have_newest_) return nullptr;
  for (const auto& e : newest_.servers()) {
    if (e.rank() == i) return &e;
  }
  return nullptr;
}

Status Recovery::ReconnectLiveServers(bool reconnect_due) {
  const control::Membership members = control_.membership();
  for (uint32_t i = 0; i < sessions_.size(); ++i) {
    ServerSession& s = sessions_.at(i);
    if (!s.failed) continue;
    const control::ServerEntry* se = EntryOf(i);
    if (se != nullptr && se->lost()) return sessions_.ApplyEntry(*se, i);  // the DataLoss error
    if (se != nullptr && se->member_id() != s.member_id) continue;         // failed over
    // Not replaced: if its process is still a member, the data path failed without the server
    // dying (an error completion, a reset connection): reconnect to the same server. Its
    // exactly-once state survives (same incarnation), so resending is safe.
    bool member = false;
    for (const auto& m : members.members()) member = member || m.member_id() == s.member_id;
    if (member && reconnect_due) {
      // Bounded: a server that just died may not refuse at once (a verbs bootstrap behind a
      // slow route, a half-open connection); the membership decides soon anyway.
      Status st = sessions_.Connect(i, step_.clock, milliseconds(1000));
      if (st.ok()) st = Resync(i);
      if (st.ok()) {
        ++reconnects_;
        trace::Instant("reconnect", "worker", {{"server", i}, {"clock", step_.clock}});
        LOG(WARNING) << "worker rank " << rank_ << ": reconnected to server group " << i
                     << " (server rank " << s.server_rank << ", still a member) after a "
                     << "data-path failure";
      } else {
        s.failed = true;
        VLOG(1) << "reconnect to server group " << i << ": " << st;
      }
    } else if (!member && config_.replicas() < 2) {
      return sessions_.ServerError(
          i,
          "failed, and the cluster has no backups (replicas=1): the state of "
          "its shards is lost; restart from the latest checkpoint");
    }
  }
  return Status::OK();
}

bool Recovery::AllReplaced() const {
  for (uint32_t i = 0; i < sessions_.size(); ++i) {
    if (!sessions_.at(i).failed) continue;
    const control::ServerEntry* se = EntryOf(i);
    if (se == nullptr || se->member_id() == sessions_.at(i).member_id) return false;
  }
  return true;
}

Status Recovery::MoveToBackups(SteadyClock::time_point t0, SteadyClock::time_point deadline,
                               milliseconds timeout) {
  sessions_.set_map_epoch(newest_.epoch());
  for (const auto& se : newest_.servers()) {
    if (se.rank() >= sessions_.size()) continue;
    ServerSession& s = sessions_.at(se.rank());
    if (se.member_id() == s.member_id && !s.failed) continue;
    RETURN_IF_ERROR(sessions_.ApplyEntry(se, se.rank()));
    // A promoted server was listening since its start: a refused connect means it died too,
    // and the coordinator's next map says what now (so refused is not retried: verbs would
    // retry it until the timeout, past the failover deadline). The timeout itself stays long:
    // a server being promoted accepts only after draining its old primary's stream.
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline + timeout - SteadyClock::now());
    Status st = sessions_.Connect(se.rank(), step_.clock, std::max(left, milliseconds(1000)));
    if (st.ok()) st = WaitServing(se.rank());
    if (st.ok()) st = Resync(se.rank());
    if (!st.ok()) {
      s.failed = true;  // still waiting for a server for this group (Recover decides)
      return st;
    }
    ++failovers_;
    trace::Instant("failover", "worker",
                   {{"server", se.rank()}, {"server_rank", se.server_rank()},
                    {"epoch", newest_.epoch()}, {"clock", step_.clock}});
    LOG(WARNING) << "worker rank " << rank_ << ": server group " << se.rank()
                 << " failed over to server rank " << se.server_rank() << " at "
                 << se.data_address() << " (epoch " << newest_.epoch() << ") in "
                 << std::chrono::duration_cast<milliseconds>(SteadyClock::now() - t0).count()
                 << " ms";
  }
  return Status::OK();
}

Status Recovery::WaitServing(uint32_t server) {
  const ServerSession& s = sessions_.at(server);
  if (s.chunk_of_slot.empty()) return Status::OK();
  const uint32_t chunk = s.chunk_of_slot[0];
  const auto deadline = SteadyClock::now() + options_.setup_timeout;
  auto never = [&] { return sessions_.ServerError(server, "never started serving"); };
  while (true) {
    RETURN_IF_ERROR(sessions_.ReadHeader(server, 0, chunk, deadline, never));
    const auto* h = reinterpret_cast<const layout::ChunkHeader*>(sessions_.ChunkStaging(chunk, 2));
    if (h->serving_epoch.load(std::memory_order_relaxed) != 0) return Status::OK();
    if (SteadyClock::now() > deadline) return never();
    std::this_thread::sleep_for(milliseconds(1));
  }
}

Status Recovery::Resync(uint32_t server) {
  const auto deadline = SteadyClock::now() + options_.setup_timeout;
  RETURN_IF_ERROR(sessions_.ReadAcks(
      server, 0, deadline,
      [&] { return sessions_.ServerError(server, "no answer after failover"); },
      /*stop_if_failed=*/false));
  CrashPoint("worker.before_resend");
  RETURN_IF_ERROR(push_.Resync(server, sessions_.Acks(server)));
  // The clock goes after the pushes: it tells the server every push of the earlier clocks is in.
  if (step_.clock > 0) RETURN_IF_ERROR(sessions_.SendClock(server, step_.clock));
  pull_.Restart(server);
  return Status::OK();
}

}  // namespace shardps::worker
