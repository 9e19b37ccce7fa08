// The coordinator's model and shard-map state machine (docs/control-protocol.md, "Model
// setup"): the registered model, shard assignment, the servers' regions, the shard map each
// worker receives (with its own peer keys), replica placement and failover of a group when
// its primary departs. Loop thread only.
#include <algorithm>
#include <string>
#include <vector>

#include <glog/logging.h>

#include "common/crash_point.h"
#include "common/trace.h"
#include "proto/credentials.h"
#include "proto/shard_plan.h"
#include "wire/region_layout.h"
#include "server/coordinator.h"
#include "server/coordinator_conn.h"

namespace shardps::control {

namespace {

StatusOr<ShardPlan> PlanFromModel(const RegisterModel& m, uint32_t num_servers,
                                  uint64_t default_partition,
                                  const std::vector<double>& capacity = {},
                                  const std::string& layout = "") {
  std::vector<TensorSpec> specs;
  for (const auto& t : m.tensors()) {
    if (!ValidDType(t.dtype())) {
      return InvalidArgumentError("tensor '" + t.name() + "': unknown dtype " +
                                  std::to_string(t.dtype()) + " (float32, float16, bfloat16)");
    }
    TensorSpec s;
    s.name = t.name();
    s.dtype = static_cast<DType>(t.dtype());
    s.shape.assign(t.shape().begin(), t.shape().end());
    s.embedding = t.embedding();
    s.max_ids = t.max_ids();
    s.init = t.init();
    s.init_scale = t.init_scale();
    s.init_seed = t.init_seed();
    s.hashed = t.hashed();
    s.admit_probability = t.hashed() ? t.admit_probability() : 1.0f;
    specs.push_back(std::move(s));
  }
  if (specs.empty()) return InvalidArgumentError("a model without tensors");
  const uint64_t part = m.partition_bytes() ? m.partition_bytes() : default_partition;
  ASSIGN_OR_RETURN(ShardLayout how, ParseShardLayout(layout));
  return PlanShards(specs, num_servers, part, capacity, how);
}

std::vector<double> Capacity(const ClusterConfig& c) {  // --server_capacity; empty: equal
  return {c.server_capacity().begin(), c.server_capacity().end()};
}

}  // namespace

uint32_t Coordinator::NumGroups() const {
  return std::max<uint32_t>(1, options_.config.num_servers());
}

uint32_t Coordinator::NumServerRanks() const {
  return NumGroups() * std::max<uint32_t>(1, options_.config.replicas());
}

void Coordinator::HandleRegisterModel(Conn* c, const RegisterModel& m) {
  const uint32_t num_servers = NumGroups();
  auto plan =
      PlanFromModel(m, num_servers, options_.config.partition_bytes(), Capacity(options_.config),
                    options_.config.shard_layout());
  if (!plan.ok()) {
    Envelope err;
    err.mutable_error()->set_message("model refused: " + plan.status().ToString());
    Queue(c, err);
    FlushOutput(c);
    Close(c, "model refused: " + plan.status().ToString(), true);
    return;
  }
  if (!model_registered_) {
    model_registered_ = true;
    model_ = m;
    plan_fingerprint_ = plan->Fingerprint();
    LOG(INFO) << "coordinator: model registered by member " << c->member.member_id() << ": "
              << plan->tensors.size() << " tensors, " << plan->chunks.size() << " chunks over "
              << num_servers << " servers (layout "
              << (options_.config.shard_layout().empty() ? "lpt" : options_.config.shard_layout())
              << ", imbalance " << plan->imbalance() << ", bytes per server " << [&] {
                   std::string b;
                   for (uint64_t x : plan->server_bytes) b += (b.empty() ? "" : ",") + std::to_string(x);
                   return b;
                 }() << ")";
  } else if (plan->Fingerprint() != plan_fingerprint_) {
    Envelope err;
    err.mutable_error()->set_message(
        "model differs from the one already registered (same tensors, shapes and order "
        "are required on every worker)");
    Queue(c, err);
    FlushOutput(c);
    Close(c, "model mismatch", true);
    return;
  }
  c->has_model = true;
  if (std::find(has_model_ids_.begin(), has_model_ids_.end(), c->member.member_id()) ==
      has_model_ids_.end()) {
    has_model_ids_.push_back(c->member.member_id());  // a rejoined worker may register again
  }
  dirty_ = true;
  if (shard_map_ready_) {
    Queue(c, ShardMapFor(c->member));
  } else if (!startup_failure_.empty()) {
    Envelope err;
    err.mutable_error()->set_message(startup_failure_);
    Queue(c, err);
  } else {
    awaiting_map_.push_back(c->member.member_id());
    MaybeAssignShards();
  }
}

void Coordinator::MaybeFailStartUp(const Member& m, const std::string& why) {
  if (!shards_assigned_ || shard_map_ready_ || !startup_failure_.empty()) return;
  const uint32_t r = m.rank();
  int64_t group = -1;
  for (uint32_t g = 0; g < primary_of_.size(); ++g) {
    if (primary_of_[g] < 0) group = g;  // no server left (ServerDeparted ran first)
  }
  // A departed backup is dropped and a departed primary's backup promoted (ServerDeparted);
  // only a group with no server left means the shard map can never be ready.
  if (group < 0) {
    MaybePublishShardMap();  // the departure may have been all it waited for
    return;
  }
  FailStartUp("start-up failed: server rank " + std::to_string(r) + " (group " +
              std::to_string(group) + ", member " + std::to_string(m.member_id()) +
              ") left before the shard map was ready: " + why +
              "; the job cannot start (fix the cause and start it again)");
}

void Coordinator::FailStartUp(const std::string& why) {
  startup_failure_ = why;
  LOG(ERROR) << "coordinator: " << startup_failure_ << "; telling every worker";
  Envelope err;
  err.mutable_error()->set_message(startup_failure_);
  for (auto& [fd, c] : conns_) {
    if (c->joined && !c->closing && c->member.role() == ROLE_WORKER) Queue(c.get(), err);
  }
}

Coordinator::Conn* Coordinator::ServerByRank(uint32_t rank) {
  for (auto& [fd, c] : conns_) {
    if (c->joined && !c->closing && c->member.role() == ROLE_SERVER && c->member.rank() == rank) {
      return c.get();
    }
  }
  return nullptr;
}

void Coordinator::MaybeAssignShards() {
  if (!model_registered_ || shards_assigned_ || !startup_failure_.empty()) return;
  const uint32_t num_servers = NumGroups();
  // Every server rank is there, or joined and died (start-up is failover-capable: a group keeps
  // whichever of its ranks is alive; a group with none cannot start).
  for (uint32_t r = 0; r < NumServerRanks(); ++r) {
    if (ServerByRank(r) == nullptr && gone_before_assignment_.count(r) == 0) return;
  }
  for (uint32_t g = 0; g < num_servers; ++g) {
    bool any = false;
    for (uint32_t r = g; r < NumServerRanks(); r += num_servers) {
      any = any || ServerByRank(r) != nullptr;
    }
    if (!any) {
      FailStartUp("start-up failed: no server of group " + std::to_string(g) +
                  " is left (its server rank(s) died before the shards were assigned); the job "
                  "cannot start (fix the cause and start it again)");
      return;
    }
  }
  auto plan = PlanFromModel(model_, num_servers, options_.config.partition_bytes(),
                            Capacity(options_.config), options_.config.shard_layout());
  if (!plan.ok()) return;  // checked when registered
  const uint32_t max_workers = std::max<uint32_t>(
      options_.config.max_workers(), std::max<uint32_t>(1, options_.config.num_workers()));
  // Server rank r holds group r % G; ranks >= G hold the backups, so the backup of group g
  // is the process started as rank G + g (launchers put it on another host than rank g).
  primary_of_.assign(num_servers, -1);
  backup_of_.assign(num_servers, -1);
  target_sent_.assign(num_servers, false);
  backup_synced_.assign(num_servers, true);  // start-up backups follow from the first record
  dirty_ = true;  // the assignment is saved before any of it is sent (write-ahead)
  for (uint32_t r = 0; r < NumServerRanks(); ++r) {
    if (ServerByRank(r) == nullptr) continue;  // died before the assignment
    const uint32_t g = r % num_servers;
    // The group's first live rank is its primary (rank g, or its backup's rank if g died).
    const bool backup = primary_of_[g] >= 0;
    (backup ? backup_of_ : primary_of_)[g] = r;
    Queue(ServerByRank(r), AssignmentFor(*plan, g, max_workers, backup, /*catch_up=*/false));
  }
  shards_assigned_ = true;
  CrashPoint("coordinator.after_assign_shards");  // before the state file is saved
  // Remember the plan in the map we will publish.
  shard_map_.Clear();
  for (const auto& t : plan->tensors) {
    TensorSpecProto* p = shard_map_.add_tensors();
    p->set_name(t.name);
    p->set_dtype(static_cast<uint32_t>(t.dtype));
    for (auto d : t.shape) p->add_shape(d);
    if (t.embedding) {
      p->set_embedding(true);
      p->set_max_ids(t.max_ids);
      p->set_init(t.init);
      p->set_init_scale(t.init_scale);
      p->set_init_seed(t.init_seed);
      p->set_hashed(t.hashed);
      p->set_admit_probability(t.admit_probability);
    }
  }
  for (const auto& ch : plan->chunks) {
    ChunkEntry* e = shard_map_.add_chunks();
    e->set_chunk_id(ch.chunk_id);
    e->set_tensor(ch.tensor);
    e->set_offset(ch.offset);
    e->set_bytes(ch.bytes);
    e->set_server_rank(ch.server);
    e->set_slot(ch.server_slot);
  }
  shard_map_.set_max_workers(max_workers);
  shard_map_.set_partition_bytes(plan->partition_bytes);
  shard_map_.set_plan_fingerprint(plan_fingerprint_);
  dirty_ = true;
  uint32_t without_backup = 0;
  for (uint32_t g = 0; g < num_servers; ++g) {
    if (options_.config.replicas() < 2 || backup_of_[g] >= 0) continue;
    // One of the group's ranks died before the assignment: its primary goes on alone (it
    // waits for this verdict before serving).
    ++without_backup;
    Envelope e;
    e.mutable_replica_target()->set_group(g);
    e.mutable_replica_target()->set_epoch(epoch());
    e.mutable_replica_target()->set_none(true);
    Queue(ServerByRank(static_cast<uint32_t>(primary_of_[g])), e);
    LOG(WARNING) << "coordinator: group " << g << " starts WITHOUT a backup (server rank "
                 << primary_of_[g] << " alone; its other rank died before the assignment)";
  }
  LOG(INFO) << "coordinator: shards assigned to " << num_servers << " groups on "
            << NumServerRanks() - gone_before_assignment_.size() << " servers"
            << (options_.config.replicas() < 2 ? " (no backups)"
                : without_backup == 0        ? " (every group has a backup)"
                                             : " (" + std::to_string(without_backup) +
                                                   " group(s) without a backup)");
}

void Coordinator::HandleShardsReady(Conn* c, const ShardsReady& r) {
  if (!shards_assigned_ || r.plan_fingerprint() != plan_fingerprint_) {
    Close(c, "shards_ready for a plan that was not assigned", true);
    return;
  }
  ready_[c->member.rank()] = r;
  dirty_ = true;
  MaybeSendReplicaTarget(GroupOf(c->member.rank()));
  MaybePublishShardMap();
}

Envelope Coordinator::AssignmentFor(const ShardPlan& plan, uint32_t g, uint32_t max_workers,
                                    bool backup, bool catch_up) const {
  Envelope e;
  AssignShards* a = e.mutable_assign_shards();
  bool any_rows = false;
  for (const auto& t : plan.tensors) any_rows |= t.embedding;
  // A row table's shard count: its chunks (PlanShards cuts it into K row shards).
  std::vector<uint32_t> shards(plan.tensors.size(), 0);
  for (const auto& ch : plan.chunks) ++shards[ch.tensor];
  for (const auto& ch : plan.chunks) {
    if (ch.server != g) continue;
    a->add_chunk_ids(ch.chunk_id);
    a->add_chunk_bytes(ch.bytes);
    const TensorSpec& t = plan.tensors[ch.tensor];
    a->add_chunk_dtypes(static_cast<uint32_t>(t.dtype));
    if (!any_rows) continue;
    RowShard* r = a->add_chunk_row_shards();
    if (!t.embedding) continue;
    const uint32_t k = shards[ch.tensor];
    r->set_rows(layout::RowGeometry::ShardRows(static_cast<uint64_t>(t.shape[0]), k,
                                               static_cast<uint32_t>(ch.offset), t.hashed));
    r->set_hashed(t.hashed);
    r->set_admit_probability(t.admit_probability);
    r->set_dim(static_cast<uint32_t>(t.shape[1]));
    r->set_max_ids(t.max_ids);
    r->set_shard(static_cast<uint32_t>(ch.offset));
    r->set_shards(k);
    r->set_table_rows(static_cast<uint64_t>(t.shape[0]));
    r->set_init(t.init);
    r->set_init_scale(t.init_scale);
    r->set_init_seed(t.init_seed);
  }
  a->set_max_workers(max_workers);
  a->set_plan_fingerprint(plan_fingerprint_);
  a->set_group(g);
  a->set_num_groups(NumGroups());
  a->set_backup(backup);
  a->set_catch_up(catch_up);
  return e;
}

void Coordinator::MaybeSendReplicaTarget(uint32_t g) {
  if (options_.config.replicas() < 2 || g >= primary_of_.size() || target_sent_[g]) return;
  if (primary_of_[g] < 0 || backup_of_[g] < 0) return;
  Conn* p = ServerByRank(static_cast<uint32_t>(primary_of_[g]));
  Conn* b = ServerByRank(static_cast<uint32_t>(backup_of_[g]));
  auto ready = ready_.find(static_cast<uint32_t>(backup_of_[g]));
  if (p == nullptr || b == nullptr || ready == ready_.end()) return;
  Envelope e;
  ReplicaTarget* t = e.mutable_replica_target();
  t->set_group(g);
  t->set_epoch(epoch());
  // A new backup of a training group copies the primary's snapshot before it follows.
  t->set_catch_up(g < backup_synced_.size() && !backup_synced_[g]);
  t->set_member_id(b->member.member_id());
  t->set_data_address(b->member.data_address());
  t->set_peer_key(
      PeerKey(CredentialOf(b->member),
              {p->member.member_id(), static_cast<int>(p->member.role()), p->member.rank()}));
  for (const Region& r : ready->second.regions()) {
    if (r.name().rfind("repl_", 0) == 0) *t->add_regions() = r;
  }
  target_sent_[g] = true;
  Queue(p, e);
  LOG(INFO) << "coordinator: group " << g << ": primary server rank " << primary_of_[g]
            << " replicates to server rank " << backup_of_[g] << " (" << b->member.data_address()
            << ")";
}

void Coordinator::FillServerEntry(uint32_t g, uint32_t server_rank, ServerEntry* e) {
  Conn* s = ServerByRank(server_rank);
  e->set_rank(g);
  e->set_server_rank(server_rank);
  e->set_lost(false);
  e->clear_regions();
  if (s == nullptr) return;
  e->set_member_id(s->member.member_id());
  e->set_data_address(s->member.data_address());
  for (const Region& r : ready_[server_rank].regions()) {
    if (r.name().rfind("repl_", 0) != 0) *e->add_regions() = r;
  }
}

void Coordinator::BroadcastShardMap() {
  dirty_ = true;
  shard_map_.set_epoch(epoch());
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing || c->member.role() != ROLE_WORKER) continue;
    if (std::find(awaiting_map_.begin(), awaiting_map_.end(), c->member.member_id()) !=
        awaiting_map_.end()) {
      continue;  // gets the map when it is ready
    }
    if (!c->has_model) continue;  // asks for it with RegisterModel
    Queue(c.get(), ShardMapFor(c->member));
  }
}

bool Coordinator::JobDone() const {
  // Every expected worker came, and all have left: servers leaving now is the job's end, not a
  // failure (nothing is waiting for their state; checkpoints keep it).
  if (most_workers_ < std::max<uint32_t>(1, options_.config.num_workers())) return false;
  for (const auto& [fd, c] : conns_) {
    if (c->joined && !c->closing && c->member.role() == ROLE_WORKER) return false;
  }
  return true;
}

void Coordinator::ServerDeparted(const Member& m) {
  const bool done = JobDone();
  if (!shards_assigned_) {
    // Before the assignment nothing is lost: the assignment goes ahead without it (or waits
    // for a replacement with its rank that joins first).
    gone_before_assignment_.insert(m.rank());
    MaybeAssignShards();
    return;
  }
  const uint32_t r = m.rank();
  for (uint32_t g = 0; g < primary_of_.size(); ++g) {
    if (backup_of_[g] == static_cast<int64_t>(r)) {
      backup_of_[g] = -1;
      backup_synced_[g] = true;  // the next backup's state is decided when it is assigned
      target_sent_[g] = false;
      {
        MutexLock l(&mu_);
        ++counters_.backups_lost;
      }
      LOG_IF(WARNING, !done) << "coordinator: group " << g << " lost its backup (server rank "
                             << r << "); its primary goes on without replication";
      LOG_IF(INFO, done) << "coordinator: group " << g << ": backup server rank " << r
                         << " left after the job's workers were done";
      if (primary_of_[g] >= 0) {
        if (Conn* p = ServerByRank(static_cast<uint32_t>(primary_of_[g]))) {
          Envelope e;
          e.mutable_replica_target()->set_group(g);
          e.mutable_replica_target()->set_epoch(epoch());
          e.mutable_replica_target()->set_none(true);
          Queue(p, e);
        }
      }
    }
    if (primary_of_[g] != static_cast<int64_t>(r)) continue;
    Conn* b = backup_of_[g] >= 0 ? ServerByRank(static_cast<uint32_t>(backup_of_[g])) : nullptr;
    // Before the shard map is out nothing has been trained or replicated: a backup that has
    // not reported its shards yet takes over as well (start-up is failover-capable).
    // A new backup still copying the primary's snapshot does not hold the group's state.
    const bool synced = g >= backup_synced_.size() || backup_synced_[g];
    if (b != nullptr && !synced) {
      LOG(ERROR) << "coordinator: group " << g << ": its new backup, server rank "
                 << backup_of_[g] << ", was still copying the primary's snapshot: it cannot "
                 << "take over";
    }
    if (b != nullptr && synced &&
        (ready_.count(static_cast<uint32_t>(backup_of_[g])) || !shard_map_ready_)) {
      const uint32_t br = static_cast<uint32_t>(backup_of_[g]);
      primary_of_[g] = br;
      backup_of_[g] = -1;
      Envelope e;
      e.mutable_promote()->set_group(g);
      e.mutable_promote()->set_epoch(epoch());
      Queue(b, e);
      trace::Instant("promote", "coordinator", {{"group", g}, {"server_rank", br}});
      CrashPoint("coordinator.after_promote");
      {
        MutexLock l(&mu_);
        ++counters_.promotions;
      }
      // After the job's workers are done a primary leaving is the job's end (INFO); the
      // backup takes over all the same, so the group's state stays served.
      LOG_IF(WARNING, !done) << "coordinator: group " << g << ": primary server rank " << r
                             << " is gone; PROMOTING its backup, server rank " << br << " ("
                             << b->member.data_address() << "), at epoch " << epoch();
      LOG_IF(INFO, done) << "coordinator: group " << g << ": primary server rank " << r
                         << " left after the job's workers were done; its backup, server rank "
                         << br << ", takes the group over";
      if (shard_map_ready_ && static_cast<int>(g) < shard_map_.servers_size()) {
        FillServerEntry(g, br, shard_map_.mutable_servers(g));
        BroadcastShardMap();
      }
    } else {
      primary_of_[g] = -1;
      backup_of_[g] = -1;
      if (!done) {
        MutexLock l(&mu_);
        ++counters_.groups_lost;
      }
      if (done) {
        LOG(INFO) << "coordinator: group " << g << ": primary server rank " << r
                  << " left after the job's workers were done (its state goes with it; "
                     "checkpoints keep what was asked for)";
      } else {
        LOG(ERROR) << "coordinator: group " << g << ": primary server rank " << r
                   << " is gone and there is NO BACKUP: the state of its shards is lost. "
                      "Restart the cluster from the latest checkpoint (docs/fault-tolerance.md)";
      }
      if (shard_map_ready_ && static_cast<int>(g) < shard_map_.servers_size()) {
        shard_map_.mutable_servers(g)->set_lost(true);
        BroadcastShardMap();
      }
    }
  }
  reassigned_.erase(r);
  ready_.erase(r);  // its regions died with it (a replacement with its rank reports its own)
  dirty_ = true;
  // A group left without a backup takes a spare, if there is one.
  MaybeReplaceBackups();
}

void Coordinator::MaybePublishShardMap() {
  const uint32_t num_servers = NumGroups();
  if (shard_map_ready_ || !shards_assigned_) return;
  // Every group's primary is alive and ready, and so is its backup if it still has one (a
  // server that died during start-up was promoted over or dropped by ServerDeparted).
  auto live_and_ready = [&](int64_t rank) {
    return rank >= 0 && ServerByRank(static_cast<uint32_t>(rank)) != nullptr &&
           ready_.count(static_cast<uint32_t>(rank)) != 0;
  };
  for (uint32_t g = 0; g < num_servers; ++g) {
    if (!live_and_ready(primary_of_[g])) return;
    if (backup_of_[g] >= 0 && !live_and_ready(backup_of_[g])) return;
  }
  shard_map_.clear_servers();
  for (uint32_t g = 0; g < num_servers; ++g) {
    FillServerEntry(g, static_cast<uint32_t>(primary_of_[g]), shard_map_.add_servers());
  }
  shard_map_ready_ = true;
  dirty_ = true;
  shard_map_.set_epoch(epoch());
  LOG(INFO) << "coordinator: shard map ready (" << shard_map_.chunks_size() << " chunks, "
            << num_servers << " servers); sending to " << awaiting_map_.size() << " workers";
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing) continue;
    // Those that asked, and those that had registered the model with a coordinator that
    // restarted since (awaiting_map_ is not in the state file; has_model is).
    if (c->has_model || std::find(awaiting_map_.begin(), awaiting_map_.end(),
                                  c->member.member_id()) != awaiting_map_.end()) {
      Queue(c.get(), ShardMapFor(c->member));
    }
  }
  awaiting_map_.clear();
  CrashPoint("coordinator.after_shard_map");
}

uint32_t Coordinator::GroupOf(uint32_t rank) const {
  auto it = reassigned_.find(rank);
  return it != reassigned_.end() ? it->second : rank % NumGroups();
}

void Coordinator::MaybeReplaceBackups() {
  if (options_.config.replicas() < 2 || !shard_map_ready_ || !startup_failure_.empty()) return;
  for (uint32_t g = 0; g < primary_of_.size(); ++g) {
    if (primary_of_[g] < 0 || backup_of_[g] >= 0) continue;
    if (ServerByRank(static_cast<uint32_t>(primary_of_[g])) == nullptr) continue;
    // A free server: joined, not a primary or a backup of any group; spares first.
    Conn* pick = nullptr;
    for (auto& [fd, c] : conns_) {
      if (!c->joined || c->closing || c->member.role() != ROLE_SERVER) continue;
      const int64_t r = c->member.rank();
      // Not serving a group, never given shards (ready_: it reported some), and not the
      // unsynced backup of a group that was lost meanwhile (reassigned_).
      if (std::find(primary_of_.begin(), primary_of_.end(), r) != primary_of_.end() ||
          std::find(backup_of_.begin(), backup_of_.end(), r) != backup_of_.end() ||
          ready_.count(static_cast<uint32_t>(r)) != 0 ||
          reassigned_.count(static_cast<uint32_t>(r)) != 0) {
        continue;
      }
      // Spares first, then the lowest rank (deterministic: the first spare started).
      if (pick == nullptr || (c->member.spare() && !pick->member.spare()) ||
          (c->member.spare() == pick->member.spare() && c->member.rank() < pick->member.rank())) {
        pick = c.get();
      }
    }
    if (pick == nullptr) return;
    auto plan = PlanFromModel(model_, NumGroups(), options_.config.partition_bytes(),
                              Capacity(options_.config),
                              options_.config.shard_layout());
    if (!plan.ok()) return;
    const uint32_t r = pick->member.rank();
    backup_of_[g] = r;
    backup_synced_[g] = false;
    target_sent_[g] = false;
    reassigned_[r] = g;
    ready_.erase(r);  // a replacement's rank may be a dead server's: its regions are gone
    assigned_at_[g] = std::chrono::steady_clock::now();
    dirty_ = true;  // saved before the assignment leaves (write-ahead)
    Queue(pick, AssignmentFor(*plan, g, shard_map_.max_workers(), /*backup=*/true,
                              /*catch_up=*/true));
    {
      MutexLock l(&mu_);
      ++counters_.backups_assigned;
    }
    LOG(WARNING) << "coordinator: group " << g << " has no backup: server rank " << r
                 << (pick->member.spare() ? " (a spare)" : " (joined after the assignment)")
                 << ", member " << pick->member.member_id()
                 << ", becomes its NEW BACKUP; it copies primary server rank " << primary_of_[g]
                 << "'s snapshot while training goes on";
  }
}

void Coordinator::HandleReplicaSynced(Conn* c, const ReplicaSynced& r) {
  const uint32_t g = r.group();
  if (g >= backup_of_.size() || backup_of_[g] != static_cast<int64_t>(c->member.rank())) {
    LOG(WARNING) << "coordinator: replica_synced for group " << g << " from server rank "
                 << c->member.rank() << ", which is not its backup; ignored";
    return;
  }
  if (backup_synced_[g]) return;  // repeated after a rejoin
  backup_synced_[g] = true;
  dirty_ = true;
  {
    MutexLock l(&mu_);
    ++counters_.backups_synced;
  }
  auto at = assigned_at_.find(g);
  const int64_t ms =
      at == assigned_at_.end()
          ? -1
          : std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  at->second)
                .count();
  LOG(WARNING) << "coordinator: group " << g << " is REPLICATED AGAIN: server rank "
               << c->member.rank() << " copied " << r.snapshot_bytes() << " bytes in "
               << r.copy_ms() << " ms (" << r.records_held() << " records held meanwhile)"
               << (ms >= 0 ? "; " + std::to_string(ms) + " ms after it was assigned" : "");
  if (primary_of_[g] >= 0) {
    if (Conn* p = ServerByRank(static_cast<uint32_t>(primary_of_[g]))) {
      Envelope e;
      *e.mutable_replica_synced() = r;
      Queue(p, e);  // the primary frees its snapshot
    }
  }
}

}  // namespace shardps::control
