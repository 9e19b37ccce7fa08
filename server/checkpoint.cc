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
#include <memory>

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
  std::vector<CheckpointListing> out;
  for (const auto& [k, p] : dirs) out.push_back(Examine(k, p, num_groups, fingerprint));
  return out;
}

StatusOr<uint64_t> LatestCompleteCheckpoint(const std::string& dir, uint32_t num_groups,
                                            const std::string& fingerprint, std::string* report) {
  if (num_groups == 0) return InvalidArgumentError("num_groups must be at least 1");
  ASSIGN_OR_RETURN(auto dirs, CkptDirs(dir));
  std::string refused;
  for (const auto& [k, p] : dirs) {
    CheckpointListing l = Examine(k, p, num_groups, fingerprint);
    if (l.complete) {
      if (report) *report = refused + "using " + Basename(p);
      return k;
    }
    refused += Basename(p) + ": " + l.why_incomplete + "; ";
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
  size_t kept = 0, i = 0;
  for (; i < dirs.size() && kept < keep; ++i) {
    if (Examine(dirs[i].first, dirs[i].second, num_groups, fingerprint).complete) ++kept;
  }
  if (kept < keep) i = dirs.size();  // fewer complete than `keep`: delete nothing
  size_t n = 0;
  Status first_error;
  const std::string mine = GroupFileName(group, num_groups);
  for (; i < dirs.size(); ++i) {
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
