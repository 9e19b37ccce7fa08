// Internal to server/checkpoint*.cc (callers use server/checkpoint.h): the file format's
// encoder and verifying decoder (checkpoint_format.cc), used by the directory code in
// checkpoint.cc. docs/checkpoints.md has the byte layout.
//
// Thread safety: free functions that share no state; safe to call from any thread.
#ifndef SHARDPS_SERVER_CHECKPOINT_FORMAT_H_
#define SHARDPS_SERVER_CHECKPOINT_FORMAT_H_

#include <cstdint>
#include <string>

#include "common/status.h"
#include "server/checkpoint.h"

namespace shardps::server::checkpoint_internal {

// "<what> <path>: <strerror> (errno N)", with ENOSPC/EDQUOT spelled out for operators.
Status IoError(const char* what, const std::string& path, int err);

// Creates (or truncates) `tmp`, encodes the snapshot into it, fsyncs and closes it; *bytes gets
// the file's size. On failure the caller removes `tmp`.
Status WriteTemp(const std::string& tmp, const ShardSnapshot& s, uint64_t* bytes);

// Reads and verifies `path`; fills *out when non-null and *sum always. Messages do not name the
// path (the public wrappers add it; the directory scan reports by group).
Status ReadFile(const std::string& path, ShardSnapshot* out, SnapshotSummary* sum);

}  // namespace shardps::server::checkpoint_internal

#endif  // SHARDPS_SERVER_CHECKPOINT_FORMAT_H_
