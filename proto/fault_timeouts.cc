#include "proto/fault_timeouts.h"

#include <algorithm>

namespace shardps::control {

namespace {
constexpr uint32_t kPromoteDrainMs = 2000;  // ShardServer::Promote's bound
}  // namespace

FaultTimeouts FaultTimeouts::Of(const ClusterConfig& c) {
  FaultTimeouts t;
  // Members of an older coordinator, or tests that build a config by hand, may leave fields at
  // 0: the same defaults as Derive() then apply.
  const uint32_t i = c.heartbeat_interval_ms() > 0 ? c.heartbeat_interval_ms() : 500;
  const uint32_t h = c.heartbeat_timeout_ms() > 0 ? c.heartbeat_timeout_ms() : 6 * i;
  const uint32_t l = c.lease_ms() > 0 ? c.lease_ms() : 3 * h;
  const uint32_t r = c.rejoin_grace_ms() > 0 ? c.rejoin_grace_ms() : l;
  const uint32_t f =
      c.failover_timeout_ms() > 0 ? c.failover_timeout_ms() : std::max(20000u, r + kPromoteDrainMs + h);
  t.heartbeat_interval = ms(i);
  t.suspect_after = ms(h);
  t.lease = ms(l);
  t.rejoin_grace = ms(r);
  t.promote_drain = ms(kPromoteDrainMs);
  t.failover = ms(f);
  t.backup_eviction = ms(r + l + h);
  t.suspicion_phi = c.suspicion_phi() > 0 ? c.suspicion_phi() : 8.0;
  return t;
}

StatusOr<FaultTimeouts> FaultTimeouts::Derive(ClusterConfig* c) {
  const FaultTimeouts t = Of(*c);
  c->set_heartbeat_interval_ms(static_cast<uint32_t>(t.heartbeat_interval.count()));
  c->set_heartbeat_timeout_ms(static_cast<uint32_t>(t.suspect_after.count()));
  c->set_lease_ms(static_cast<uint32_t>(t.lease.count()));
  c->set_rejoin_grace_ms(static_cast<uint32_t>(t.rejoin_grace.count()));
  c->set_failover_timeout_ms(static_cast<uint32_t>(t.failover.count()));
  c->set_suspicion_phi(t.suspicion_phi);
  auto need = [&](bool ok, const std::string& what) -> Status {
    if (ok) return Status::OK();
    return InvalidArgumentError("inconsistent fault-tolerance timeouts: " + what + " (" +
                                t.ToString() + "; docs/fault-tolerance.md, \"Liveness\")");
  };
  RETURN_IF_ERROR(need(t.heartbeat_interval >= ms(10), "heartbeat_interval_ms must be >= 10"));
  RETURN_IF_ERROR(need(t.suspect_after >= 3 * t.heartbeat_interval,
                       "heartbeat_timeout_ms must be >= 3 x heartbeat_interval_ms (three "
                       "heartbeats missed before a member is even suspected)"));
  RETURN_IF_ERROR(need(t.lease >= 2 * t.suspect_after,
                       "lease_ms must be >= 2 x heartbeat_timeout_ms (a suspected member is "
                       "probed before its lease runs out)"));
  RETURN_IF_ERROR(need(t.rejoin_grace >= t.lease,
                       "rejoin_grace_ms must be >= lease_ms (after a coordinator restart, a "
                       "member's lease granted by the old one may run until then)"));
  RETURN_IF_ERROR(need(t.failover >= t.rejoin_grace + t.promote_drain + t.suspect_after,
                       "failover_timeout_ms must be >= rejoin_grace_ms (>= lease_ms) + " +
                           std::to_string(kPromoteDrainMs) +
                           " ms (promotion drain) + heartbeat_timeout_ms (a worker must outwait "
                           "the detection of a stopped server, or a restarted coordinator's wait "
                           "for it, and its backup's promotion)"));
  RETURN_IF_ERROR(need(t.suspicion_phi >= 1 && t.suspicion_phi <= 30,
                       "suspicion_phi must be in [1, 30]"));
  return t;
}

std::string FaultTimeouts::ToString() const {
  auto s = [](ms v) { return std::to_string(v.count()) + " ms"; };
  return "heartbeat every " + s(heartbeat_interval) + ", suspect after >= " + s(suspect_after) +
         " (phi " + std::to_string(static_cast<int>(suspicion_phi)) + "), lease " + s(lease) +
         ", rejoin grace " + s(rejoin_grace) + ", promotion drain " + s(promote_drain) +
         ", worker failover " + s(failover) + ", backup eviction " + s(backup_eviction);
}

}  // namespace shardps::control
