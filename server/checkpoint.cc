// Checkpoint directories: the atomic write of a group file (WriteSnapshot), verified reads, the
// directory scan, choosing the checkpoint to restore, and retention. The file format (encoding,
// verification) is in checkpoint_format.cc; the background writer is in checkpoint_writer.cc.
#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include <glog/logging.h>

#include "common/fd.h"
#include "server/checkpoint_format.h"

namespace shardps::server {

using checkpoint_internal::IoError;
using checkpoint_internal::ReadFile;
using checkpoint_internal::WriteTemp;

namespace {

// ---------------------------------------------------------------------------------------------
// Directories

Status FsyncPath(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return IoError("open directory", path, errno);
  if (::fsync(fd.get()) != 0) return IoError("fsync directory", path, errno);
  return Status::OK();
}

std::string ParentOf(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// mkdir if missing; fsyncs the parent when it created the directory.
Status EnsureDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0) return FsyncPath(ParentOf(path));
  if (errno != EEXIST) return IoError("mkdir", path, errno);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return IoError("stat", path, errno);
  if (!S_ISDIR(st.st_mode)) return FailedPreconditionError(path + " exists and is not a directory");
  return Status::OK();
}

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};
using DirPtr = std::unique_ptr<DIR, DirCloser>;

StatusOr<std::vector<std::string>> ListNames(const std::string& dir) {
  DirPtr d(::opendir(dir.c_str()));
  if (!d) return IoError("opendir", dir, errno);
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d.get())) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  return names;
}

// Parses a run of decimal digits (no sign, at most 19 digits, so no overflow).
bool ParseDigits(const std::string& s, size_t begin, size_t end, uint64_t* v) {
  if (begin >= end || end - begin > 19) return false;
  *v = 0;
  for (size_t i = begin; i < end; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    *v = *v * 10 + static_cast<uint64_t>(s[i] - '0');
  }
  return true;
}

bool ParseCkptDirName(const std::string& n, uint64_t* clock) {
  return n.size() == 17 && n.compare(0, 5, "ckpt-") == 0 && ParseDigits(n, 5, 17, clock);
}

// "group-<g>-of-<G>.shps" (suffix ".shps") or the temp name (suffix ".shps.tmp").
bool ParseGroupFileName(const std::string& n, const std::string& suffix, uint32_t* g,
                        uint32_t* num) {
  if (n.size() <= 6 + suffix.size() || n.compare(0, 6, "group-") != 0 ||
      n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  size_t of = n.find("-of-", 6);
  uint64_t a = 0, b = 0;
  if (of == std::string::npos || !ParseDigits(n, 6, of, &a) ||
      !ParseDigits(n, of + 4, n.size() - suffix.size(), &b) || a > UINT32_MAX || b > UINT32_MAX) {
    return false;
  }
  *g = static_cast<uint32_t>(a);
  *num = static_cast<uint32_t>(b);
  return GroupFileName(*g, *num) + (suffix == ".shps" ? "" : ".tmp") == n;  // canonical only
}

// ckpt-* directories under dir, newest first.
StatusOr<std::vector<std::pair<uint64_t, std::string>>> CkptDirs(const std::string& dir) {
  ASSIGN_OR_RETURN(std::vector<std::string> names, ListNames(dir));
  std::vector<std::pair<uint64_t, std::string>> out;
  for (const auto& n : names) {
    uint64_t k = 0;
    if (ParseCkptDirName(n, &k)) out.emplace_back(k, dir + "/" + n);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

std::string Basename(const std::string& p) { return p.substr(p.rfind('/') + 1); }

CheckpointListing Examine(uint64_t clock, const std::string& path, uint32_t num_groups,
                          const std::string& fingerprint) {
  CheckpointListing l;
  l.clock = clock;
  l.path = path;
  auto names = ListNames(path);
  if (!names.ok()) {
    l.why_incomplete = names.status().message();
    return l;
  }
  for (const auto& n : *names) {
    GroupFileStatus f;
    if (!ParseGroupFileName(n, ".shps", &f.group, &f.num_groups)) continue;
    f.path = path + "/" + n;
    SnapshotSummary sum;
    f.status = ReadFile(f.path, nullptr, &sum);
    if (f.status.ok()) {
      if (sum.group != f.group || sum.num_groups != f.num_groups || sum.clock != clock) {
        f.status = DataLossError("file holds group " + std::to_string(sum.group) + " of " +
                                 std::to_string(sum.num_groups) + " at clock " +
                                 std::to_string(sum.clock) + ", not what its name says");
      } else if (!fingerprint.empty() && sum.plan_fingerprint != fingerprint) {
        f.status = FailedPreconditionError("plan fingerprint '" + sum.plan_fingerprint +
                                           "' is not the expected '" + fingerprint + "'");
      }
      f.summary = sum;
    }
    l.files.push_back(std::move(f));
  }
  std::sort(l.files.begin(), l.files.end(), [](const auto& a, const auto& b) {
    return a.num_groups != b.num_groups ? a.num_groups < b.num_groups : a.group < b.group;
  });
  uint32_t g_count = num_groups;
  std::vector<std::string> why;
  if (g_count == 0) {
    for (const auto& f : l.files) {
      if (g_count != 0 && f.num_groups != g_count) {
        why.push_back("group files disagree on the number of groups");
        break;
      }
      g_count = f.num_groups;
    }
    if (l.files.empty()) why.push_back("no group files");
  }
  std::string fp_seen;
  for (uint32_t g = 0; g < g_count && why.size() < 8; ++g) {
    auto it = std::find_if(l.files.begin(), l.files.end(), [&](const GroupFileStatus& f) {
      return f.group == g && f.num_groups == g_count;
    });
    if (it == l.files.end()) {
      why.push_back("group " + std::to_string(g) + ": missing");
    } else if (!it->status.ok()) {
      why.push_back("group " + std::to_string(g) + ": " + it->status.message());
    } else if (!fp_seen.empty() && it->summary->plan_fingerprint != fp_seen) {
      why.push_back("group " + std::to_string(g) + ": plan fingerprint differs from group 0");
    } else {
      fp_seen = it->summary->plan_fingerprint;
    }
  }
  l.complete = why.empty();
  for (size_t i = 0; i < why.size(); ++i) l.why_incomplete += (i ? "; " : "") + why[i];
  return l;
}

// Every checkpoint directory, newest first; a checkpoint whose group files are based on (hold
// incremental chunks of) a checkpoint that is not complete is not complete either.
std::vector<CheckpointListing> ExamineAll(const std::vector<std::pair<uint64_t, std::string>>& dirs,
                                          uint32_t num_groups, const std::string& fingerprint) {
  std::vector<CheckpointListing> out;
  for (const auto& [k, p] : dirs) out.push_back(Examine(k, p, num_groups, fingerprint));
  std::map<uint64_t, bool> complete;
  for (auto it = out.rbegin(); it != out.rend(); ++it) {  // oldest first: bases come before
    if (it->complete) {
      for (const GroupFileStatus& f : it->files) {
        if (!f.summary) continue;
        for (uint64_t base : f.summary->base_clocks) {
          if (!complete[base]) {
            it->complete = false;
            it->why_incomplete = "group " + std::to_string(f.group) + " is based on " +
                                 Basename(CheckpointDirName("", base)) +
                                 ", which is not complete";
            break;
          }
        }
        if (!it->complete) break;
      }
    }
    complete[it->clock] = it->complete;
  }
  return out;
}

}  // namespace

std::string CheckpointDirName(const std::string& dir, uint64_t clock) {
  char b[32];
  std::snprintf(b, sizeof(b), "ckpt-%012llu", static_cast<unsigned long long>(clock));
  return dir + "/" + b;
}

std::string GroupFileName(uint32_t group, uint32_t num_groups) {
  return "group-" + std::to_string(group) + "-of-" + std::to_string(num_groups) + ".shps";
}

std::string SnapshotPath(const std::string& dir, uint64_t clock, uint32_t group,
                         uint32_t num_groups) {
  return CheckpointDirName(dir, clock) + "/" + GroupFileName(group, num_groups);
}

Status WriteSnapshot(const std::string& dir, const ShardSnapshot& s, uint64_t* bytes_written) {
  if (s.num_groups == 0 || s.group >= s.num_groups) {
    return InvalidArgumentError("snapshot of group " + std::to_string(s.group) + " of " +
                                std::to_string(s.num_groups));
  }
  if (s.chunks.size() > UINT32_MAX || s.workers.size() > UINT32_MAX ||
      s.plan_fingerprint.size() > UINT32_MAX || s.optimizer.size() > UINT32_MAX) {
    return InvalidArgumentError("snapshot too large for the format");
  }
  if (dir.empty()) return InvalidArgumentError("empty checkpoint directory");
  RETURN_IF_ERROR(EnsureDir(dir));
  const std::string ckpt_dir = CheckpointDirName(dir, s.clock);
  RETURN_IF_ERROR(EnsureDir(ckpt_dir));
  const std::string path = ckpt_dir + "/" + GroupFileName(s.group, s.num_groups);
  const std::string tmp = path + ".tmp";
  uint64_t bytes = 0;
  Status st = WriteTemp(tmp, s, &bytes);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) st = IoError("rename", tmp, errno);
  if (!st.ok()) {
    if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) {
      LOG(WARNING) << "checkpoint: cannot remove " << tmp << ": " << std::strerror(errno);
    }
    return st;
  }
  // The rename is durable once the directory is; a failure here leaves a complete file that
  // may or may not survive a crash, so report it (the caller retries at the next clock).
  RETURN_IF_ERROR(FsyncPath(ckpt_dir));
  if (bytes_written) *bytes_written = bytes;
  return Status::OK();
}

StatusOr<ShardSnapshot> ReadSnapshot(const std::string& path) {
  ShardSnapshot s;
  SnapshotSummary sum;
  Status st = ReadFile(path, &s, &sum);
  if (!st.ok()) return st.WithContext(path);
  return s;
}

StatusOr<SnapshotSummary> VerifySnapshot(const std::string& path) {
  SnapshotSummary sum;
  Status st = ReadFile(path, nullptr, &sum);
  if (!st.ok()) return st.WithContext(path);
  return sum;
}

StatusOr<std::vector<CheckpointListing>> ListCheckpoints(const std::string& dir,
                                                         uint32_t num_groups,
                                                         const std::string& fingerprint) {
  ASSIGN_OR_RETURN(auto dirs, CkptDirs(dir));
  return ExamineAll(dirs, num_groups, fingerprint);
}

Status ResolveIncremental(const std::string& dir, ShardSnapshot* s) {
  std::map<uint64_t, ShardSnapshot> bases;  // read once each
  for (size_t i = 0; i < s->chunks.size(); ++i) {
    ChunkState& c = s->chunks[i];
    // The chain of this chunk, newest first, down to a whole state.
    std::vector<const ChunkState*> chain = {&c};
    const ChunkState* at = &c;
    uint64_t at_clock = s->clock;
    while (at->base_clock != 0) {
      if (chain.size() > 64) return DataLossError("a chain of more than 64 incremental checkpoints");
      const uint64_t base = at->base_clock;
      if (base >= at_clock) return DataLossError("a base clock that is not older");
      auto it = bases.find(base);
      if (it == bases.end()) {
        const std::string path = SnapshotPath(dir, base, s->group, s->num_groups);
        auto b = ReadSnapshot(path);
        if (!b.ok()) {
          return DataLossError("checkpoint at clock " + std::to_string(s->clock) +
                               " is based on " + path + ": " + b.status().message());
        }
        if (b->plan_fingerprint != s->plan_fingerprint || b->chunks.size() != s->chunks.size()) {
          return DataLossError(path + " is not of the same plan");
        }
        it = bases.emplace(base, std::move(*b)).first;
      }
      at = &it->second.chunks[i];
      at_clock = base;
      if (at->chunk_id != c.chunk_id) return DataLossError("a base holds another chunk");
      chain.push_back(at);
    }
    if (chain.size() == 1) continue;
    // Oldest (whole) first, then each increment's rows over it.
    ChunkState whole = *chain.back();
    const uint64_t rows_n = whole.row_keys.empty() ? 0 : whole.row_keys.size();
    for (auto it = chain.rbegin() + 1; it != chain.rend(); ++it) {
      const ChunkState& d = **it;
      const uint64_t n = d.row_index.size();
      if (n == 0) {
        whole.version = d.version;
        whole.optimizer_steps = d.optimizer_steps;
        continue;
      }
      if (d.weights.size() % n != 0) return DataLossError("increment's rows do not divide");
      const uint64_t dim = d.weights.size() / n;
      auto overlay = [&](std::vector<float>& dst, const std::vector<float>& src,
                         const char* what) -> Status {
        if (src.empty()) return Status::OK();
        if (dst.empty()) return DataLossError(std::string("an increment has ") + what +
                                              " its base lacks");
        if (src.size() != n * dim) return DataLossError(std::string("increment's ") + what);
        for (uint64_t r = 0; r < n; ++r) {
          const uint64_t row = d.row_index[r];
          if ((row + 1) * dim > dst.size()) return DataLossError("increment row out of range");
          std::copy_n(src.data() + r * dim, dim, dst.data() + row * dim);
        }
        return Status::OK();
      };
      RETURN_IF_ERROR(overlay(whole.weights, d.weights, "weights"));
      RETURN_IF_ERROR(overlay(whole.state1, d.state1, "state 1"));
      RETURN_IF_ERROR(overlay(whole.state2, d.state2, "state 2"));
      if (!d.row_keys.empty()) {
        if (d.row_keys.size() != n || d.row_versions.size() != n || rows_n == 0) {
          return DataLossError("increment's row keys");
        }
        for (uint64_t r = 0; r < n; ++r) {
          if (d.row_index[r] >= rows_n) return DataLossError("increment row out of range");
          whole.row_keys[d.row_index[r]] = d.row_keys[r];
          whole.row_versions[d.row_index[r]] = d.row_versions[r];
        }
      }
      whole.version = d.version;
      whole.optimizer_steps = d.optimizer_steps;
    }
    whole.base_clock = 0;
    whole.row_index.clear();
    c = std::move(whole);
  }
  return Status::OK();
}

StatusOr<uint64_t> LatestCompleteCheckpoint(const std::string& dir, uint32_t num_groups,
                                            const std::string& fingerprint, std::string* report) {
  if (num_groups == 0) return InvalidArgumentError("num_groups must be at least 1");
  ASSIGN_OR_RETURN(auto dirs, CkptDirs(dir));
  std::string refused;
  for (const CheckpointListing& l : ExamineAll(dirs, num_groups, fingerprint)) {
    if (l.complete) {
      if (report) *report = refused + "using " + Basename(l.path);
      return l.clock;
    }
    refused += Basename(l.path) + ": " + l.why_incomplete + "; ";
  }
  std::string msg = "no complete checkpoint of " + std::to_string(num_groups) + " groups in " +
                    dir +
                    (refused.empty() ? "" : " (" + refused.substr(0, refused.size() - 2) + ")");
  if (report) *report = msg;
  return NotFoundError(msg);
}

Status PruneCheckpoints(const std::string& dir, uint32_t group, uint32_t num_groups, size_t keep,
                        const std::string& fingerprint, size_t* removed) {
  if (keep == 0) return InvalidArgumentError("keep must be at least 1");
  if (num_groups == 0 || group >= num_groups) {
    return InvalidArgumentError("group " + std::to_string(group) + " of " +
                                std::to_string(num_groups));
  }
  ASSIGN_OR_RETURN(auto dirs, CkptDirs(dir));
  const std::vector<CheckpointListing> all = ExamineAll(dirs, num_groups, fingerprint);
  size_t kept = 0, i = 0;
  for (; i < all.size() && kept < keep; ++i) {
    if (all[i].complete) ++kept;
  }
  if (kept < keep) i = dirs.size();  // fewer complete than `keep`: delete nothing
  // Checkpoints the kept ones are based on stay too (transitively: bases are older).
  std::set<uint64_t> needed;
  for (size_t j = 0; j < all.size(); ++j) {
    if (j >= i && needed.count(all[j].clock) == 0) continue;
    for (const GroupFileStatus& f : all[j].files) {
      if (f.summary) needed.insert(f.summary->base_clocks.begin(), f.summary->base_clocks.end());
    }
  }
  size_t n = 0;
  Status first_error;
  const std::string mine = GroupFileName(group, num_groups);
  for (; i < dirs.size(); ++i) {
    if (needed.count(dirs[i].first) != 0) continue;
    const std::string& p = dirs[i].second;
    for (const std::string& f : {p + "/" + mine, p + "/" + mine + ".tmp"}) {
      if (::unlink(f.c_str()) == 0) {
        ++n;
      } else if (errno != ENOENT && first_error.ok()) {
        first_error = IoError("unlink", f, errno);
      }
    }
    if (::rmdir(p.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT &&
        first_error.ok()) {
      first_error = IoError("rmdir", p, errno);
    }
  }
  if (n > 0) {
    Status s = FsyncPath(dir);
    if (!s.ok() && first_error.ok()) first_error = s;
  }
  if (removed) *removed = n;
  return first_error;
}

}  // namespace shardps::server
