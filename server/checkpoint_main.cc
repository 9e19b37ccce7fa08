// shardps_checkpoint: inspect and verify checkpoint directories (docs/checkpoints.md).
//
//   shardps_checkpoint list DIR          each checkpoint, complete or not, per group status
//   shardps_checkpoint verify PATH|DIR   exit 1 if any group file is corrupt
//   shardps_checkpoint dump PATH         header, chunks (with weight norms), workers
//   shardps_checkpoint bench DIR         write / read+verify throughput on DIR's disk
// --json prints one JSON document instead of plain words.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "common/version.h"
#include "proto/json_string.h"
#include "server/checkpoint.h"

DEFINE_bool(json, false, "Print JSON instead of plain words");
DEFINE_uint32(groups, 0, "list/verify: expected number of groups (0: from the file names)");
DEFINE_string(fingerprint, "", "list/verify: expected plan fingerprint (empty: any)");
DEFINE_uint32(max_values, 8, "dump: per-slot values printed per worker");
DEFINE_uint64(bench_mib, 64, "bench: snapshot size in MiB of weights");
DEFINE_uint32(bench_chunks, 16, "bench: chunks the snapshot is split into");
DEFINE_uint32(bench_reps, 5, "bench: writes (and reads) timed");

namespace {

using namespace shardps;
using namespace shardps::server;

std::string Json(const std::string& s) { return control::JsonQuote(s); }

bool IsDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// list and verify share the scan; verify's exit code counts the group files present that a
// restore could not use: corrupt, unreadable (e.g. a directory in a group file's place), or of
// another plan (a missing group makes a checkpoint incomplete, not corrupt).
int ListOrVerify(const std::string& dir, bool verify) {
  auto listing = ListCheckpoints(dir, FLAGS_groups, FLAGS_fingerprint);
  if (!listing.ok()) {
    std::fprintf(stderr, "%s\n", listing.status().ToString().c_str());
    return 2;
  }
  int corrupt = 0;
  std::string json = "{\"dir\":" + Json(dir) + ",\"checkpoints\":[";
  for (size_t i = 0; i < listing->size(); ++i) {
    const CheckpointListing& l = (*listing)[i];
    if (!FLAGS_json) {
      std::printf("%s  clock %" PRIu64 "  %s%s%s\n", l.path.c_str(), l.clock,
                  l.complete ? "complete" : "INCOMPLETE", l.complete ? "" : ": ",
                  l.why_incomplete.c_str());
    }
    json += std::string(i ? "," : "") + "{\"clock\":" + std::to_string(l.clock) +
            ",\"path\":" + Json(l.path) + ",\"complete\":" + (l.complete ? "true" : "false") +
            ",\"why_incomplete\":" + Json(l.why_incomplete) + ",\"files\":[";
    for (size_t j = 0; j < l.files.size(); ++j) {
      const GroupFileStatus& f = l.files[j];
      if (!f.status.ok()) ++corrupt;
      std::string detail;
      if (f.summary) {
        detail = std::to_string(f.summary->file_bytes) + " bytes, " +
                 std::to_string(f.summary->num_chunks) + " chunks, " +
                 std::to_string(f.summary->num_workers) + " workers, epoch " +
                 std::to_string(f.summary->epoch) + ", plan " + f.summary->plan_fingerprint;
      }
      if (!FLAGS_json) {
        std::printf("  group %u of %u: %s%s%s\n", f.group, f.num_groups,
                    f.status.ok() ? "ok" : f.status.ToString().c_str(),
                    detail.empty() ? "" : "  ", detail.c_str());
      }
      json += std::string(j ? "," : "") + "{\"group\":" + std::to_string(f.group) +
              ",\"num_groups\":" + std::to_string(f.num_groups) + ",\"path\":" + Json(f.path) +
              ",\"ok\":" + (f.status.ok() ? "true" : "false") +
              ",\"error\":" + Json(f.status.ok() ? "" : f.status.ToString());
      if (f.summary) {
        json += ",\"bytes\":" + std::to_string(f.summary->file_bytes) +
                ",\"chunks\":" + std::to_string(f.summary->num_chunks) +
                ",\"workers\":" + std::to_string(f.summary->num_workers) +
                ",\"epoch\":" + std::to_string(f.summary->epoch) +
                ",\"plan_fingerprint\":" + Json(f.summary->plan_fingerprint);
      }
      json += "}";
    }
    json += "]}";
  }
  json += "],\"corrupt_files\":" + std::to_string(corrupt) + "}";
  if (FLAGS_json) {
    std::printf("%s\n", json.c_str());
  } else if (listing->empty()) {
    std::printf("no checkpoints in %s\n", dir.c_str());
  }
  if (verify && !FLAGS_json) {
    std::printf("%d corrupt or unreadable file%s\n", corrupt, corrupt == 1 ? "" : "s");
  }
  return verify && corrupt > 0 ? 1 : 0;
}

int VerifyFile(const std::string& path) {
  auto s = VerifySnapshot(path);
  if (FLAGS_json) {
    std::printf("{\"path\":%s,\"ok\":%s,\"error\":%s}\n", Json(path).c_str(),
                s.ok() ? "true" : "false", Json(s.ok() ? "" : s.status().ToString()).c_str());
  } else if (s.ok()) {
    std::printf("%s: ok (group %u of %u, clock %" PRIu64 ", %" PRIu64 " bytes)\n", path.c_str(),
                s->group, s->num_groups, s->clock, s->file_bytes);
  } else {
    std::printf("%s\n", s.status().ToString().c_str());
  }
  return s.ok() ? 0 : 1;
}

struct Norms {
  double l2 = 0, max_abs = 0;
  uint64_t non_finite = 0;
};
Norms NormsOf(const std::vector<float>& v) {
  Norms n;
  for (float x : v) {
    if (!std::isfinite(x)) {
      ++n.non_finite;
      continue;
    }
    n.l2 += static_cast<double>(x) * x;
    n.max_abs = std::max(n.max_abs, std::fabs(static_cast<double>(x)));
  }
  n.l2 = std::sqrt(n.l2);
  return n;
}

template <typename T>
std::string Values(const std::vector<T>& v, bool json) {
  std::string o = json ? "[" : "";
  size_t n = std::min<size_t>(v.size(), FLAGS_max_values);
  for (size_t i = 0; i < n; ++i) o += (i ? (json ? "," : " ") : "") + std::to_string(v[i]);
  if (!json && v.size() > n) o += " ...(" + std::to_string(v.size()) + ")";
  return o + (json ? "]" : "");
}

int Dump(const std::string& path) {
  auto s = ReadSnapshot(path);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
    return 1;
  }
  std::string json = "{\"path\":" + Json(path) + ",\"plan_fingerprint\":" +
                     Json(s->plan_fingerprint) + ",\"group\":" + std::to_string(s->group) +
                     ",\"num_groups\":" + std::to_string(s->num_groups) +
                     ",\"clock\":" + std::to_string(s->clock) +
                     ",\"epoch\":" + std::to_string(s->epoch) +
                     ",\"optimizer\":" + Json(s->optimizer) + ",\"chunks\":[";
  if (!FLAGS_json) {
    std::printf("%s\n  format %u, group %u of %u, clock %" PRIu64 ", epoch %" PRIu64
                "\n  plan %s\n  optimizer %s\n  %zu chunks, %zu workers\n",
                path.c_str(), kCheckpointFormatVersion, s->group, s->num_groups, s->clock,
                s->epoch, s->plan_fingerprint.c_str(), s->optimizer.c_str(), s->chunks.size(),
                s->workers.size());
  }
  for (size_t i = 0; i < s->chunks.size(); ++i) {
    const ChunkState& c = s->chunks[i];
    Norms w = NormsOf(c.weights), a = NormsOf(c.state1), b = NormsOf(c.state2);
    char line[512];
    std::snprintf(line, sizeof(line),
                  "  chunk %u: version %" PRIu64 ", %zu weights, |w| %.6g, max|w| %.6g, "
                  "non-finite %" PRIu64 "; optimizer steps %" PRIu64
                  ", state1 %zu (|s1| %.6g), state2 %zu (|s2| %.6g)\n",
                  c.chunk_id, c.version, c.weights.size(), w.l2, w.max_abs, w.non_finite,
                  c.optimizer_steps, c.state1.size(), a.l2, c.state2.size(), b.l2);
    if (!FLAGS_json) std::fputs(line, stdout);
    char j[512];
    std::snprintf(j, sizeof(j),
                  "%s{\"chunk_id\":%u,\"version\":%" PRIu64 ",\"weights\":%zu,"
                  "\"weights_l2\":%.9g,\"weights_max_abs\":%.9g,\"non_finite\":%" PRIu64
                  ",\"optimizer_steps\":%" PRIu64 ",\"state1\":%zu,\"state1_l2\":%.9g,"
                  "\"state2\":%zu,\"state2_l2\":%.9g}",
                  i ? "," : "", c.chunk_id, c.version, c.weights.size(), w.l2, w.max_abs,
                  w.non_finite, c.optimizer_steps, c.state1.size(), a.l2, c.state2.size(), b.l2);
    json += j;
  }
  json += "],\"workers\":[";
  for (size_t i = 0; i < s->workers.size(); ++i) {
    const WorkerProgress& w = s->workers[i];
    if (!FLAGS_json) {
      std::printf("  worker %u: clock %" PRIu64 ", last_seq [%s], applied_clock [%s]\n", w.rank,
                  w.clock, Values(w.last_seq, false).c_str(),
                  Values(w.applied_clock, false).c_str());
    }
    json += std::string(i ? "," : "") + "{\"rank\":" + std::to_string(w.rank) +
            ",\"clock\":" + std::to_string(w.clock) + ",\"slots\":" +
            std::to_string(w.last_seq.size()) + ",\"last_seq\":" + Values(w.last_seq, true) +
            ",\"applied_clock\":" + Values(w.applied_clock, true) + "}";
  }
  json += "]}";
  if (FLAGS_json) std::printf("%s\n", json.c_str());
  return 0;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Drops the file's pages from the page cache so the next read comes from the disk (clean pages
// after the writer's fsync, so this is safe and touches nothing else).
void DropCache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

int Bench(const std::string& dir) {
  ShardSnapshot s;
  s.plan_fingerprint = "bench";
  s.optimizer = "sgd";
  const uint64_t floats = FLAGS_bench_mib * (1u << 20) / 4;
  const uint32_t chunks = std::max<uint32_t>(1, FLAGS_bench_chunks);
  for (uint32_t c = 0; c < chunks; ++c) {
    ChunkState cs;
    cs.chunk_id = c;
    cs.weights.resize(floats / chunks + (c < floats % chunks ? 1 : 0));
    for (size_t i = 0; i < cs.weights.size(); ++i) cs.weights[i] = 1e-3f * static_cast<float>(i % 977);
    s.chunks.push_back(std::move(cs));
  }
  WorkerProgress w;
  w.last_seq.assign(chunks, 7);
  w.applied_clock.assign(chunks, 6);
  s.workers.assign(4, w);
  std::vector<double> wr, rd_cold, rd_warm;
  uint64_t bytes = 0;
  for (uint32_t r = 0; r < FLAGS_bench_reps; ++r) {
    s.clock = 1000000 + r;
    auto t0 = std::chrono::steady_clock::now();
    Status st = WriteSnapshot(dir, s, &bytes);
    wr.push_back(Since(t0));
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    const std::string path = SnapshotPath(dir, s.clock, 0, 1);
    DropCache(path);
    t0 = std::chrono::steady_clock::now();
    auto back = ReadSnapshot(path);
    rd_cold.push_back(Since(t0));
    t0 = std::chrono::steady_clock::now();
    auto back2 = ReadSnapshot(path);
    rd_warm.push_back(Since(t0));
    if (!back.ok() || !back2.ok()) {
      std::fprintf(stderr, "%s\n", (back.ok() ? back2 : back).status().ToString().c_str());
      return 1;
    }
    if (back->chunks.size() != chunks || back->chunks[0].weights != s.chunks[0].weights) {
      std::fprintf(stderr, "%s: read back differs from what was written\n", path.c_str());
      return 1;
    }
    ::unlink(path.c_str());
    ::rmdir(CheckpointDirName(dir, s.clock).c_str());
  }
  auto report = [&](const char* what, std::vector<double> v) {
    std::sort(v.begin(), v.end());
    double mib = static_cast<double>(bytes) / (1 << 20);
    std::printf("%-22s %8.2f MiB  median %8.2f ms (%7.1f MB/s)  min %8.2f ms  max %8.2f ms\n",
                what, mib, v[v.size() / 2] * 1e3, bytes / v[v.size() / 2] / 1e6, v.front() * 1e3,
                v.back() * 1e3);
  };
  std::printf("bench: %u reps in %s\n", FLAGS_bench_reps, dir.c_str());
  report("write+fsync+rename", wr);
  report("read+verify (cold)", rd_cold);
  report("read+verify (warm)", rd_warm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(
      &argc, &argv,
      "shardps_checkpoint list DIR | verify PATH|DIR | dump PATH | bench DIR  [--json]", __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (argc != 3) {
    gflags::ShowUsageWithFlagsRestrict(argv[0], "checkpoint_main");
    return 2;
  }
  const std::string cmd = argv[1], arg = argv[2];
  if (cmd == "list") return ListOrVerify(arg, false);
  if (cmd == "verify") return IsDir(arg) ? ListOrVerify(arg, true) : VerifyFile(arg);
  if (cmd == "dump") return Dump(arg);
  if (cmd == "bench") return FLAGS_bench_reps == 0 ? 2 : Bench(arg);
  std::fprintf(stderr, "unknown command '%s' (list, verify, dump, bench)\n", cmd.c_str());
  return 2;
}
