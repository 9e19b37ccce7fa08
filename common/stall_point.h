// Named stall points for busy-host tests: a thread that reaches a point armed in
// SHARDPS_STALL_POINT ("name:ms" or "name@N:ms") sleeps there for ms milliseconds, as if the
// scheduler had taken its core away between two lines (a descheduled process on a loaded host,
// a slow disk). Crash points (common/crash_point.h) ask "what if the process dies here?"; stall
// points ask "what if it stops here for longer than any timeout?". Unarmed (production), a
// stall point costs one relaxed load. Points are named "<role>.<where>"; the list is in
// docs/fault-tolerance.md ("Stall points").
//
// Thread safety: any thread. ArmStallPointForTest may race with StallPoint; a point reached
// while it is being armed may or may not stall.
#ifndef SHARDPS_COMMON_STALL_POINT_H_
#define SHARDPS_COMMON_STALL_POINT_H_

#include <chrono>
#include <string>

namespace shardps {

// Sleeps for the armed duration if `name` is armed and this is the Nth time it is reached
// (N = 1 unless "@N" was given). Each arming stalls once.
void StallPoint(const char* name);

// True if the next StallPoint(name) would stall. A caller that holds work back (a batch of
// posts not yet sent) sends it first, so that the stall happens where the point says: after the
// work before it has left. Unarmed, one relaxed load.
bool StallPointDue(const char* name);

// Arms `name` in this process (in-process tests), replacing SHARDPS_STALL_POINT: the `nth`
// time it is reached from now, it stalls for `stall`. An empty name disarms.
void ArmStallPointForTest(const std::string& name, long long nth, std::chrono::milliseconds stall);

// How many stalls this process has served (tests check that the armed point was reached).
long long StallPointsServed();

}  // namespace shardps

#endif  // SHARDPS_COMMON_STALL_POINT_H_
