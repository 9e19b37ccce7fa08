// FaultTimeouts: every fault-tolerance timeout of a cluster, derived from one another and
// checked together (docs/fault-tolerance.md, "Liveness and timeouts"). The coordinator derives
// them at start from its flags (a timeout left at 0 takes its derived default), refuses to start
// on a set that contradicts itself, logs the table, and hands them to every member in
// ClusterConfig; servers and workers read them from there instead of keeping constants.
//
// The chain, each bound covering the ones before it:
//   heartbeat_interval  I       a member sends a heartbeat every I
//   suspect_after       H >= 3I  silence that makes a member suspected (the floor: the detector
//                                 suspects later when the member's measured jitter says so)
//   lease               L >= 2H  a member silent this long is declared dead; a primary that has
//                                 had no heartbeat acknowledged for L stops serving (fenced)
//   rejoin_grace        R >= L   a restarted coordinator waits this long for the members of
//                                 its saved state (a live one's lease may still run until then)
//   promote_drain       D        a promoted backup drains its old primary's stream for <= D
//   failover            F >= R+D+H  a worker waits this long for a failed group's new server
//                                 (through a coordinator restart, which waits R first)
//   backup_eviction     E = R+L+H  a backup whose primary's stream broke waits this long for a
//                                 promotion before it leaves (its primary may be within R)
//
// Thread safety: a value type.
#ifndef SHARDPS_PROTO_FAULT_TIMEOUTS_H_
#define SHARDPS_PROTO_FAULT_TIMEOUTS_H_

#include <chrono>
#include <string>

#include "common/status.h"
#include "proto/control.pb.h"

namespace shardps::control {

struct FaultTimeouts {
  using ms = std::chrono::milliseconds;
  ms heartbeat_interval{500};
  ms suspect_after{3000};
  ms lease{9000};
  ms rejoin_grace{9000};
  ms promote_drain{2000};
  ms failover{20000};
  ms backup_eviction{21000};
  double suspicion_phi = 8.0;

  // Fills the zero fields of `config` with their derived defaults and checks the set; the
  // config then carries the whole table to the members.
  static StatusOr<FaultTimeouts> Derive(ClusterConfig* config);
  // The table of a config that Derive() has completed (members: from their JoinReply).
  static FaultTimeouts Of(const ClusterConfig& config);
  std::string ToString() const;
};

}  // namespace shardps::control

#endif  // SHARDPS_PROTO_FAULT_TIMEOUTS_H_
