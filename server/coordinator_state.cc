// The coordinator's restart state (--state_file: saved after every change, loaded at start so
// that members rejoin as themselves) and the members' credentials (proto/credentials.h,
// docs/security.md). Loop thread only.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <cerrno>
#include <string>

#include <glog/logging.h>

#include "common/fd.h"
#include "common/stall_point.h"
#include "proto/credentials.h"
#include "proto/etcd_client.h"
#include "server/coordinator.h"
#include "server/coordinator_conn.h"

namespace shardps::control {

void Coordinator::SaveState() {
  StallPoint("coordinator.save_state");  // a disk (or etcd) that stalls the save
  dirty_ = false;
  CoordinatorState st;
  {
    MutexLock l(&mu_);
    st.set_epoch(membership_.epoch());
    *st.mutable_members() = membership_.members();
  }
  st.set_next_member_id(next_member_id_);
  st.set_credential_secret(credential_secret_);
  st.set_model_registered(model_registered_);
  *st.mutable_model() = model_;
  st.set_plan_fingerprint(plan_fingerprint_);
  st.set_shards_assigned(shards_assigned_);
  st.set_shard_map_ready(shard_map_ready_);
  *st.mutable_shard_map() = shard_map_;
  for (int64_t p : primary_of_) st.add_primary_of(p);
  for (int64_t b : backup_of_) st.add_backup_of(b);
  for (bool t : target_sent_) st.add_target_sent(t);
  for (bool y : backup_synced_) st.add_backup_synced(y);
  for (const auto& [rank, group] : reassigned_) {
    st.add_reassigned_rank(rank);
    st.add_reassigned_group(group);
  }
  for (const auto& [rank, r] : ready_) {
    st.add_ready_ranks(rank);
    *st.add_ready() = r;
  }
  for (uint32_t id : has_model_ids_) st.add_model_members(id);
  st.set_most_workers(most_workers_);
  st.set_barrier_generation(barrier_generation_);
  std::string bytes;
  if (!st.SerializeToString(&bytes)) {
    LOG(ERROR) << "coordinator: cannot serialise its state";
    return;
  }
  if (!options_.etcd_endpoints.empty()) {
    // HA: written only while this coordinator still leads (a transaction guarded by the
    // leader key). Refused means another coordinator leads: stop now, never act beside it.
    auto etcd = etcd::Client::Create(options_.etcd_endpoints);
    StatusOr<bool> put = etcd.ok() ? etcd->PutIf(options_.etcd_leader_key, options_.etcd_leader_value,
                                                 options_.etcd_state_key, bytes)
                                   : StatusOr<bool>(etcd.status());
    if (put.ok() && !*put) {
      LOG(ERROR) << "coordinator: LOST LEADERSHIP (" << options_.etcd_leader_key
                 << " no longer names this coordinator); exiting at once so that only the "
                    "leader acts";
      std::_Exit(3);
    }
    if (!put.ok()) {
      LOG(ERROR) << "coordinator: cannot save its state to etcd: " << put.status()
                 << " (a successor would not know the latest change)";
    }
    return;
  }
  const std::string tmp = options_.state_file + ".tmp";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  bool ok = fd.valid() && fdio::WriteAll(fd.get(), bytes.data(), bytes.size()).ok();
  ok = ok && fsync(fd.get()) == 0;
  fd.reset();
  if (!ok || rename(tmp.c_str(), options_.state_file.c_str()) != 0) {
    PLOG(ERROR) << "coordinator: cannot save its state to " << options_.state_file
                << " (a restart would not take the members back)";
    unlink(tmp.c_str());
  }
}

std::string Coordinator::CredentialOf(const Member& m) const {
  return MemberCredential(credential_secret_,
                          {m.member_id(), static_cast<int>(m.role()), m.rank()});
}

Envelope Coordinator::ShardMapFor(const Member& worker) const {
  Envelope e;
  ShardMap* map = e.mutable_shard_map();
  *map = shard_map_;
  map->set_epoch(epoch());
  const Identity client{worker.member_id(), static_cast<int>(worker.role()), worker.rank()};
  for (ServerEntry& se : *map->mutable_servers()) {
    if (se.lost()) continue;
    const std::string server_credential =
        MemberCredential(credential_secret_, {se.member_id(), ROLE_SERVER, se.server_rank()});
    se.set_peer_key(PeerKey(server_credential, client));
  }
  return e;
}

StatusOr<std::string> Coordinator::ReadStateBytes(bool* found) {
  *found = false;
  if (!options_.etcd_endpoints.empty()) {
    ASSIGN_OR_RETURN(etcd::Client etcd, etcd::Client::Create(options_.etcd_endpoints));
    ASSIGN_OR_RETURN(std::optional<etcd::KeyValue> kv, etcd.Get(options_.etcd_state_key));
    if (!kv) return std::string();
    *found = true;
    return kv->value;
  }
  UniqueFd fd(open(options_.state_file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return std::string();  // a fresh cluster
    return ErrnoError("open " + options_.state_file, errno);
  }
  *found = true;
  std::string bytes;
  char buf[1 << 16];
  while (true) {
    const ssize_t k = read(fd.get(), buf, sizeof(buf));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return ErrnoError("read " + options_.state_file, errno);
    if (k == 0) break;
    bytes.append(buf, static_cast<size_t>(k));
    if (bytes.size() > (256u << 20)) return DataLossError(options_.state_file + ": too large");
  }
  return bytes;
}

Status Coordinator::LoadState() {
  bool found = false;
  ASSIGN_OR_RETURN(std::string bytes, ReadStateBytes(&found));
  if (!found) return Status::OK();  // a fresh cluster
  CoordinatorState st;
  if (!st.ParseFromString(bytes)) {
    return DataLossError(StateSource() + ": not a coordinator state (corrupt?)");
  }
  next_member_id_ = std::max<uint32_t>(st.next_member_id(), 1);
  if (st.credential_secret().size() == 32) {
    credential_secret_ = st.credential_secret();
  } else if (!st.members().empty()) {
    LOG(WARNING) << "coordinator: " << StateSource()
                 << " has no credential secret (an older version wrote it): its members cannot "
                    "prove who they are and must join anew";
  }
  model_registered_ = st.model_registered();
  model_ = st.model();
  plan_fingerprint_ = st.plan_fingerprint();
  shards_assigned_ = st.shards_assigned();
  shard_map_ready_ = st.shard_map_ready();
  shard_map_ = st.shard_map();
  primary_of_.assign(st.primary_of().begin(), st.primary_of().end());
  backup_of_.assign(st.backup_of().begin(), st.backup_of().end());
  target_sent_.assign(st.target_sent().begin(), st.target_sent().end());
  backup_synced_.assign(st.backup_synced().begin(), st.backup_synced().end());
  backup_synced_.resize(primary_of_.size(), true);  // an older state file: start-up backups
  for (int i = 0; i < st.reassigned_rank_size() && i < st.reassigned_group_size(); ++i) {
    reassigned_[st.reassigned_rank(i)] = st.reassigned_group(i);
  }
  for (int i = 0; i < st.ready_ranks_size() && i < st.ready_size(); ++i) {
    ready_[st.ready_ranks(i)] = st.ready(i);
  }
  has_model_ids_.assign(st.model_members().begin(), st.model_members().end());
  most_workers_ = st.most_workers();
  barrier_generation_ = st.barrier_generation();
  const auto deadline = Clock::now() + options_.rejoin_grace;
  for (const Member& m : st.members()) pending_[m.member_id()] = Pending{m, deadline};
  {
    MutexLock l(&mu_);
    membership_.set_epoch(st.epoch());
    *membership_.mutable_members() = st.members();
  }
  LOG(WARNING) << "coordinator: restarted from " << StateSource() << " at epoch "
               << st.epoch() << "; expecting " << pending_.size() << " members back within "
               << options_.rejoin_grace.count() << " ms";
  return Status::OK();
}

}  // namespace shardps::control
