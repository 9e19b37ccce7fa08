// Named crash points for fault tests (issue 14): a process whose environment names a point in
// SHARDPS_CRASH_POINT exits at once (_exit(86), no cleanup, like a kill -9 between two lines)
// when it reaches that point. Unset (production), a crash point costs one branch on a cached
// value. Points are named "<role>.<where>", e.g. "server.after_shards_ready"; the list is in
// docs/fault-tolerance.md.
//
// Thread safety: any thread.
#ifndef SHARDPS_COMMON_CRASH_POINT_H_
#define SHARDPS_COMMON_CRASH_POINT_H_

namespace shardps {

// Exits the process with status 86 if SHARDPS_CRASH_POINT equals `name`, or is "name@N" and
// this is the Nth time the point is reached (points inside loops, e.g. the Nth publication).
void CrashPoint(const char* name);

// True if the next CrashPoint(name) would exit. A caller that holds work back (a batch of posts
// not yet sent) sends it first, so that the process dies where the point says: after the work
// before it has left.
bool CrashPointDue(const char* name);

// The exit status of a crash point.
inline constexpr int kCrashPointExitCode = 86;

}  // namespace shardps

#endif  // SHARDPS_COMMON_CRASH_POINT_H_
