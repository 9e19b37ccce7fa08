// The coordinator's answer to `shardps status` (StatusRequest, docs/control-protocol.md
// "Status"), and the member heartbeat stats it keeps for it. Loop thread only.
//
// A status asker proves the cluster token exactly as a joining member does, gets one reply
// (or an Error) and is closed; it never joins, so the membership and its epoch do not change.
// The reply names members, groups and counters, never a region descriptor, an rkey, a
// credential, a peer key or the token. Its cost is bounded: O(members + chunks) to build, at
// most kMaxStatusMembers members, at most kMaxStatusPerSecond answers per second.
#include <algorithm>
#include <chrono>

#include <glog/logging.h>

#include "common/crypto.h"
#include "server/coordinator.h"
#include "server/coordinator_conn.h"

namespace shardps::control {
namespace {

uint64_t UnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// Rates are measured over the heartbeats of the last kRateWindow (and one more: the window
// spans at least kRateWindow once that much has passed, or one interval if longer).
constexpr auto kRateWindow = std::chrono::seconds(1);

}  // namespace

void Coordinator::HandleStatusRequest(Conn* c, const StatusRequest& r) {
  c->status_answered = true;  // one reply per connection: closed once it is out (FlushOutput)
  const auto now = Clock::now();
  Envelope reply;
  if (!crypto::ConstantTimeEquals(r.cluster_token(), options_.cluster_token)) {
    {
      MutexLock l(&mu_);
      ++counters_.status_refused;
    }
    LOG(WARNING) << "coordinator: status request from " << c->peer
                 << " refused: wrong cluster token";
    reply.mutable_error()->set_message("status refused: wrong cluster token");
    Queue(c, reply);
    return;
  }
  while (!status_times_.empty() && now - status_times_.front() >= std::chrono::seconds(1)) {
    status_times_.pop_front();
  }
  if (status_times_.size() >= static_cast<size_t>(kMaxStatusPerSecond)) {
    {
      MutexLock l(&mu_);
      ++counters_.status_refused;
    }
    reply.mutable_error()->set_message("status refused: more than " +
                                       std::to_string(kMaxStatusPerSecond) +
                                       " requests in the last second; retry later");
    Queue(c, reply);
    return;
  }
  status_times_.push_back(now);
  *reply.mutable_status_reply() = BuildStatus();
  {
    MutexLock l(&mu_);
    ++counters_.status_answered;
  }
  VLOG(1) << "coordinator: status answered to " << c->peer;
  if (reply.ByteSizeLong() + 64 > options_.max_frame_bytes) {
    // Never leave the asker waiting for a reply that cannot be framed.
    Envelope err;
    err.mutable_error()->set_message("status reply of " + std::to_string(reply.ByteSizeLong()) +
                                     " bytes exceeds the control frame limit");
    Queue(c, err);
    return;
  }
  Queue(c, reply);
}

void Coordinator::NoteStats(Conn* c, const MemberStats& s) {
  const auto now = Clock::now();
  c->has_stats = true;
  c->stats = s;
  // Only the fields this coordinator knows go into status replies: a member's unknown fields
  // (a newer version, or garbage) must not grow every reply.
  c->stats.DiscardUnknownFields();
  const bool server = c->member.role() == ROLE_SERVER;
  Conn::RateSample sample{now, server ? s.bytes_applied() : s.bytes_pushed() + s.bytes_pulled(),
                          server ? s.pushes_applied() : 0};
  auto& w = c->rate_samples;
  // Counters only grow within one member process: one that went back (never expected) starts
  // a new window rather than giving a negative rate.
  if (!w.empty() && (sample.bytes < w.back().bytes || sample.pushes < w.back().pushes)) w.clear();
  w.push_back(sample);
  // Keep the newest sample that is at least kRateWindow old as the window's start.
  while (w.size() > 2 && (now - w[1].at >= kRateWindow || w.size() > Conn::kMaxRateSamples)) {
    w.pop_front();
  }
  const double dt = std::chrono::duration<double>(now - w.front().at).count();
  if (w.size() >= 2 && dt > 0) {
    c->bytes_per_second = static_cast<double>(sample.bytes - w.front().bytes) / dt;
    c->pushes_per_second = static_cast<double>(sample.pushes - w.front().pushes) / dt;
  }
  if (c->member.role() == ROLE_SERVER && s.has_checkpoint() &&
      (!checkpoint_seen_ || s.last_checkpoint_clock() > checkpoint_seen_clock_)) {
    checkpoint_seen_ = true;
    checkpoint_seen_clock_ = s.last_checkpoint_clock();
    checkpoint_seen_unix_ms_ = UnixMs();
  }
}

StatusReply Coordinator::BuildStatus() const {
  const auto now = Clock::now();
  const ClusterConfig& cfg = options_.config;
  StatusReply r;
  StatusConfig* sc = r.mutable_config();
  sc->set_mode(cfg.mode());
  sc->set_staleness(cfg.staleness());
  sc->set_num_servers(cfg.num_servers());
  sc->set_num_workers(cfg.num_workers());
  sc->set_replicas(std::max<uint32_t>(1, cfg.replicas()));
  sc->set_max_workers(cfg.max_workers());
  sc->set_transport(cfg.transport());
  sc->set_heartbeat_interval_ms(static_cast<uint32_t>(timeouts_.heartbeat_interval.count()));
  sc->set_lease_ms(static_cast<uint32_t>(timeouts_.lease.count()));
  sc->set_partition_bytes(cfg.partition_bytes());
  sc->set_checkpoint_dir(cfg.checkpoint_dir());
  sc->set_checkpoint_every(cfg.checkpoint_every());
  sc->set_optimizer(cfg.optimizer());
  r.set_epoch(epoch());
  r.set_uptime_ms(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now - started_at_).count()));
  r.set_unix_ms(UnixMs());
  r.set_startup_failure(startup_failure_);

  // Members: joined ones, then saved ones not back yet (a restarted coordinator).
  bool any_clock = false;
  uint64_t max_clock = 0, min_clock = 0;
  for (const auto& [fd, c] : conns_) {
    if (!c->joined || c->closing || c->member.role() != ROLE_WORKER || !c->has_stats) continue;
    const uint64_t k = c->stats.clock();
    min_clock = any_clock ? std::min(min_clock, k) : k;
    max_clock = any_clock ? std::max(max_clock, k) : k;
    any_clock = true;
  }
  r.set_max_clock(max_clock);
  r.set_min_clock(min_clock);
  auto fill = [&](const Member& m, StatusMember* s) {
    s->set_member_id(m.member_id());
    s->set_role(m.role());
    s->set_rank(m.rank());
    s->set_hostname(m.hostname());
    s->set_pid(m.pid());
    s->set_transport(m.transport());
    s->set_data_address(m.data_address());  // where it listens; never its regions
    s->set_spare(m.spare());
    int32_t group = -1;
    if (m.role() == ROLE_SERVER && shards_assigned_) {
      const uint32_t g = GroupOf(m.rank());
      const bool serves =
          g < primary_of_.size() && (primary_of_[g] == static_cast<int64_t>(m.rank()) ||
                                     backup_of_[g] == static_cast<int64_t>(m.rank()));
      if (serves) group = static_cast<int32_t>(g);
    }
    s->set_group(group);
  };
  std::vector<const Conn*> joined;
  for (const auto& [fd, c] : conns_) {
    if (c->joined && !c->closing) joined.push_back(c.get());
  }
  std::sort(joined.begin(), joined.end(), [](const Conn* a, const Conn* b) {
    return a->member.member_id() < b->member.member_id();
  });
  for (const Conn* c : joined) {
    if (c->member.role() == ROLE_SERVER) {
      r.set_servers(r.servers() + 1);
    } else {
      r.set_workers(r.workers() + 1);
    }
    if (r.members_size() >= kMaxStatusMembers) {
      r.set_members_truncated(true);
      continue;
    }
    StatusMember* s = r.add_members();
    fill(c->member, s);
    s->set_joined(true);
    s->set_suspected(c->suspected);
    s->set_alive(!c->suspected);
    const Clock::time_point heard = std::max(c->last_heard, c->detector.last());
    s->set_heartbeat_age_ms(static_cast<uint32_t>(std::min<int64_t>(
        UINT32_MAX, std::chrono::duration_cast<std::chrono::milliseconds>(now - heard).count())));
    if (c->has_stats) {
      *s->mutable_stats() = c->stats;
      s->set_bytes_per_second(c->bytes_per_second);
      s->set_pushes_per_second(c->pushes_per_second);
      if (c->member.role() == ROLE_WORKER) s->set_clock_lag(max_clock - c->stats.clock());
    }
  }
  for (const auto& [id, p] : pending_) {
    if (r.members_size() >= kMaxStatusMembers) {
      r.set_members_truncated(true);
      break;
    }
    StatusMember* s = r.add_members();
    fill(p.member, s);
    s->set_joined(false);
    s->set_alive(false);
  }

  // The shard map: per group, its servers and its chunks.
  r.set_shard_map_ready(shard_map_ready_);
  r.set_plan_fingerprint(plan_fingerprint_);
  if (shard_map_ready_) {
    r.set_shard_map_epoch(shard_map_.epoch());
    r.set_chunks(static_cast<uint32_t>(shard_map_.chunks_size()));
    const uint32_t groups = NumGroups();
    std::vector<StatusGroup> gs(groups);
    for (uint32_t g = 0; g < groups; ++g) {
      gs[g].set_group(g);
      gs[g].set_primary_rank(g < primary_of_.size() ? static_cast<int32_t>(primary_of_[g]) : -1);
      gs[g].set_backup_rank(g < backup_of_.size() ? static_cast<int32_t>(backup_of_[g]) : -1);
      gs[g].set_backup_in_sync(g < backup_synced_.size() && backup_of_[g] >= 0 &&
                               backup_synced_[g]);
    }
    for (const ServerEntry& e : shard_map_.servers()) {
      if (e.rank() < groups) gs[e.rank()].set_lost(e.lost());
    }
    uint64_t model_bytes = 0;
    for (const ChunkEntry& ce : shard_map_.chunks()) {
      model_bytes += ce.bytes();
      if (ce.server_rank() >= groups) continue;
      StatusGroup& g = gs[ce.server_rank()];
      g.set_chunks(g.chunks() + 1);
      g.set_bytes(g.bytes() + ce.bytes());
      if (ce.tensor() < static_cast<uint32_t>(shard_map_.tensors_size()) &&
          shard_map_.tensors(static_cast<int>(ce.tensor())).embedding()) {
        g.set_row_shards(g.row_shards() + 1);
      }
    }
    r.set_model_bytes(model_bytes);
    for (StatusGroup& g : gs) *r.add_groups() = std::move(g);
  }

  // The last checkpoint: the newest clock a server reported, complete once every group's
  // primary reported it (or a newer one).
  if (checkpoint_seen_) {
    StatusCheckpoint* ck = r.mutable_checkpoint();
    ck->set_clock(checkpoint_seen_clock_);
    ck->set_unix_ms(checkpoint_seen_unix_ms_);
    ck->set_dir(!last_checkpoint_request_.dir().empty() &&
                        last_checkpoint_request_.clock() == checkpoint_seen_clock_
                    ? last_checkpoint_request_.dir()
                    : cfg.checkpoint_dir());
    const uint32_t groups = NumGroups();
    uint32_t written = 0;
    for (uint32_t g = 0; g < groups && g < primary_of_.size(); ++g) {
      if (primary_of_[g] < 0) continue;
      for (const auto& [fd, c] : conns_) {
        if (c->joined && !c->closing && c->member.role() == ROLE_SERVER &&
            c->member.rank() == static_cast<uint32_t>(primary_of_[g]) && c->has_stats &&
            c->stats.has_checkpoint() &&
            c->stats.last_checkpoint_clock() >= checkpoint_seen_clock_) {
          ++written;
          break;
        }
      }
    }
    ck->set_groups(groups);
    ck->set_groups_written(written);
    ck->set_complete(written == groups);
  }
  return r;
}

}  // namespace shardps::control
