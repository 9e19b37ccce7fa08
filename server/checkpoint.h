// Checkpoints of a shard group's state: the file format, atomic writes, verification, choosing
// the checkpoint to restore, retention, and a background writer. docs/checkpoints.md has the
// byte layout and the rules.
//
// A cluster checkpoint at clock K is one file per shard group g (a server's primary chunk set):
//   <dir>/ckpt-<K as %012llu>/group-<g>-of-<G>.shps
// It is *complete* when all G group files exist and verify (magic, version, every length, the
// CRC32C) with the expected plan fingerprint. Every server computes the same newest complete K
// from the same directory, so all groups restore the same clock.
//
// Thread safety: the free functions are safe to call from any thread (they share no state; two
// writers of the same group file at once are the caller's bug). CheckpointWriter says its own.
#ifndef SHARDPS_SERVER_CHECKPOINT_H_
#define SHARDPS_SERVER_CHECKPOINT_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace shardps::server {

// One chunk's state: its published weights and its optimizer (ChunkOptimizer::steps(),
// state1(), state2(); the states are empty for plain SGD).
struct ChunkState {
  uint32_t chunk_id = 0;
  uint64_t version = 0;
  std::vector<float> weights;
  uint64_t optimizer_steps = 0;
  std::vector<float> state1, state2;
  // A hashed row shard (docs/embeddings.md): per slot its key and its version, bit 63 set
  // when the slot holds a row. Empty for every other chunk.
  std::vector<uint64_t> row_keys, row_versions;
  // An incremental row shard state (base_clock != 0): only the local rows `row_index`
  // (ascending) are here — weights, state1/state2 (when present) and the row keys/versions hold
  // those rows only, in that order — and every other row is as in the same chunk of the group's
  // checkpoint at base_clock (itself full or incremental). ResolveIncremental makes it whole.
  uint64_t base_clock = 0;
  std::vector<uint64_t> row_index;
};

// What the group knows of one worker: its clock and the exactly-once dedupe state per slot.
struct WorkerProgress {
  uint32_t rank = 0;
  uint64_t clock = 0;
  std::vector<uint64_t> last_seq;      // per slot: highest push seq consumed
  std::vector<int64_t> applied_clock;  // per slot: clock of the last applied push, -1 = none
};

struct ShardSnapshot {
  std::string plan_fingerprint;
  uint32_t group = 0, num_groups = 1;
  uint64_t clock = 0;  // every chunk here has applied all pushes of clocks < clock
  uint64_t epoch = 0;
  std::string optimizer;  // e.g. "adam lr=0.001", for logs and checks
  std::vector<ChunkState> chunks;
  std::vector<WorkerProgress> workers;
};

// Format version this build writes and reads.
// 2: a chunk's record may carry row keys and versions (hashed row shards); 1 is still read.
constexpr uint32_t kCheckpointFormatVersion = 2;

// "<dir>/ckpt-000000000042" and "<dir>/ckpt-000000000042/group-1-of-4.shps".
std::string CheckpointDirName(const std::string& dir, uint64_t clock);
std::string GroupFileName(uint32_t group, uint32_t num_groups);
std::string SnapshotPath(const std::string& dir, uint64_t clock, uint32_t group,
                         uint32_t num_groups);

// Writes the snapshot to SnapshotPath(dir, s.clock, s.group, s.num_groups) atomically: a
// "<path>.tmp" is written and fsynced, renamed over the path, and the directory fsynced
// (creating dir and the ckpt directory as needed, fsyncing their parents). On any failure the
// temp file is removed, nothing else is touched, and the error names the path and errno;
// ENOSPC and EDQUOT are ResourceExhausted ("disk full" / "disk quota exceeded").
// InvalidArgument for a snapshot that cannot be a valid file (group >= num_groups, ...).
// *bytes_written, if non-null, gets the file's size.
Status WriteSnapshot(const std::string& dir, const ShardSnapshot& snapshot,
                     uint64_t* bytes_written = nullptr);

// Reads and fully verifies one group file. DataLoss says what is wrong: "bad magic",
// "truncated at byte N of M", "checksum mismatch", or the length that does not fit.
// No allocation is larger than the file itself.
StatusOr<ShardSnapshot> ReadSnapshot(const std::string& path);

// Verifies a group file like ReadSnapshot without keeping the arrays (memory: one 1 MiB buffer).
struct SnapshotSummary {
  std::string plan_fingerprint, optimizer;
  uint32_t group = 0, num_groups = 0;
  uint64_t clock = 0, epoch = 0, file_bytes = 0;
  uint32_t num_chunks = 0, num_workers = 0;
  uint64_t num_floats = 0;  // weights + optimizer state over all chunks
  std::vector<uint64_t> base_clocks;  // distinct base clocks of its incremental chunks
};
StatusOr<SnapshotSummary> VerifySnapshot(const std::string& path);

// One checkpoint directory as found on disk (for LatestCompleteCheckpoint, PruneCheckpoints
// and the CLI).
struct GroupFileStatus {
  uint32_t group = 0, num_groups = 0;
  std::string path;
  Status status;  // OK when the file verified (and matched the expected fingerprint, if any)
  std::optional<SnapshotSummary> summary;
};
struct CheckpointListing {
  uint64_t clock = 0;
  std::string path;
  std::vector<GroupFileStatus> files;  // group files present, by group
  bool complete = false;
  std::string why_incomplete;  // plain words, empty when complete
};
// Lists every ckpt-* directory under dir, newest first, verifying every group file in it.
// num_groups == 0: G is taken from the file names (a mix of G is reported as incomplete);
// plan_fingerprint empty: any fingerprint, as long as all groups agree. NotFound if dir is
// missing; entries that are not ckpt-<12 digits> are ignored.
StatusOr<std::vector<CheckpointListing>> ListCheckpoints(const std::string& dir,
                                                         uint32_t num_groups = 0,
                                                         const std::string& plan_fingerprint = "");

// The newest clock K whose num_groups group files all verify with plan_fingerprint. Refused
// newer ones are explained in *report (if non-null), e.g.
//   "ckpt-000000000040: group 1: checksum mismatch; using ckpt-000000000030".
// NotFound when there is none. Reads (and checksums) every retained file: a checkpoint is
// complete only if the bases of its incremental chunks are too.
StatusOr<uint64_t> LatestCompleteCheckpoint(const std::string& dir, uint32_t num_groups,
                                            const std::string& plan_fingerprint,
                                            std::string* report = nullptr);

// Replaces every incremental chunk of `snapshot` (read from `dir`) by its whole state, reading
// the group's checkpoints it is based on (each verified; a chain of at most 64). DataLoss naming
// the missing or bad base otherwise.
Status ResolveIncremental(const std::string& dir, ShardSnapshot* snapshot);

// Retention for one group: keeps this group's files of the newest `keep` complete checkpoints
// (keep >= 1), of every checkpoint newer than the newest complete one (possibly still being
// written by other groups) and of every checkpoint a kept one is based on (incremental chunks); deletes this group's files (and stale temp files) of every older
// checkpoint, complete or not, and removes ckpt directories left empty. *removed, if non-null,
// gets the number of files deleted.
Status PruneCheckpoints(const std::string& dir, uint32_t group, uint32_t num_groups, size_t keep,
                        const std::string& plan_fingerprint, size_t* removed = nullptr);

// Writes snapshots in the background so that the apply thread never waits for the disk.
//
// One write at a time, in submission order. Submit() queues a snapshot and returns at once. Every
// snapshot is written — a cluster checkpoint is complete only when every group wrote its file
// for that clock, and groups cannot agree on which ones to skip — unless kMaxQueued are already
// waiting: the new one is then dropped (counted as superseded, logged; that checkpoint will
// not be complete). A failed write is counted and logged (once per distinct error, again after
// a success), and the writer carries on with the next snapshot. After each successful write,
// if Options::keep > 0, PruneCheckpoints runs for the snapshot's group.
//
// Thread safety: every method may be called from any thread. The destructor writes what is
// queued, then joins the thread; it must not race with other calls.
class CheckpointWriter {
 public:
  using WriteFn =
      std::function<Status(const std::string& dir, const ShardSnapshot&, uint64_t* bytes_written)>;
  struct Options {
    std::string dir;
    size_t keep = 0;  // 0: no retention
    WriteFn write;    // test seam; empty = WriteSnapshot
  };
  // Called on the writer thread after each write (metrics): success, bytes, seconds.
  using ObserveFn = std::function<void(bool ok, uint64_t bytes, double seconds)>;
  struct Stats {
    uint64_t submitted = 0, written = 0, failed = 0, superseded = 0;
    uint64_t bytes_written = 0;  // sum over successful writes
    std::optional<uint64_t> last_written_clock;
    double last_write_seconds = 0, max_write_seconds = 0, total_write_seconds = 0;
    Status last_error;  // OK if no write has failed
  };

  explicit CheckpointWriter(Options options, ObserveFn observe = nullptr);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void Submit(ShardSnapshot&& snapshot);
  // Waits until nothing is queued or being written. Returns the status of the last write
  // attempted (OK if none), or DeadlineExceeded if still busy after `timeout`.
  Status Flush(std::chrono::milliseconds timeout);
  Stats stats() const;

 private:
  void Run();
  void Record(const ShardSnapshot& s, const Status& st, uint64_t bytes, double seconds)
      REQUIRES(mu_);

  const Options options_;
  const ObserveFn observe_;
  mutable Mutex mu_;
  CondVar cv_;       // signalled on Submit and on stop
  CondVar idle_cv_;  // signalled when a write ends
  static constexpr size_t kMaxQueued = 8;
  std::deque<ShardSnapshot> queued_ GUARDED_BY(mu_);
  bool writing_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
  Status last_attempt_ GUARDED_BY(mu_);
  std::string last_logged_error_ GUARDED_BY(mu_);
  Stats stats_ GUARDED_BY(mu_);
  std::thread thread_;  // last: started after every member above exists
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_CHECKPOINT_H_
