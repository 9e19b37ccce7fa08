// Checkpoints (server/checkpoint.h): CRC32C vectors, bit-exact round trips, every truncation and
// every single-bit flip refused, hostile lengths refused without large allocations, choosing the
// checkpoint to restore, retention, the background writer, a genuinely full disk (a 256 KiB
// tmpfs; root only) and the CLI.
#include "server/checkpoint.h"

#include <dirent.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "wire/region_layout.h"

// Largest single allocation while g_track_alloc is set: hostile lengths must not reach malloc.
namespace {
std::atomic<bool> g_track_alloc{false};
std::atomic<size_t> g_max_alloc{0};
void* CountedAlloc(size_t n) {
  if (g_track_alloc.load(std::memory_order_relaxed)) {
    size_t m = g_max_alloc.load(std::memory_order_relaxed);
    while (n > m && !g_max_alloc.compare_exchange_weak(m, n)) {
    }
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace
void* operator new(size_t n) { return CountedAlloc(n); }
void* operator new[](size_t n) { return CountedAlloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace shardps::server {
namespace {

// ---- helpers ----

class TempDir {
 public:
  TempDir() {
    char t[] = "/tmp/shardps-ckpt-test-XXXXXX";
    path_ = ::mkdtemp(t) ? t : "";
  }
  ~TempDir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<uint8_t> Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}
void Spit(const std::string& path, const std::vector<uint8_t>& b, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(n));
}
bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.push_back(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}
float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(),
                                                           a.size() * sizeof(T)) == 0);
}

ShardSnapshot MakeSnapshot(uint64_t clock, uint32_t group, uint32_t num_groups,
                           size_t floats_per_chunk = 37, const std::string& fp = "plan-abc") {
  ShardSnapshot s;
  s.plan_fingerprint = fp;
  s.group = group;
  s.num_groups = num_groups;
  s.clock = clock;
  s.epoch = 3;
  s.optimizer = "adam lr=0.001";
  for (uint32_t c = 0; c < 3; ++c) {
    ChunkState cs;
    cs.chunk_id = group * 100 + c;
    cs.version = clock * 2 + c;
    cs.optimizer_steps = clock + c;
    cs.weights.resize(floats_per_chunk);
    for (size_t i = 0; i < cs.weights.size(); ++i) {
      cs.weights[i] = static_cast<float>(c) - 0.25f * static_cast<float>(i) + 1e-3f * clock;
    }
    if (c != 1) {  // chunk 1 has no optimizer state (as for SGD)
      cs.state1.assign(floats_per_chunk, 0.5f + c);
      cs.state2.assign(floats_per_chunk / 2 + 1, 1e-6f * (c + 1));
    }
    if (c == 2) {  // a hashed row shard: every slot's key and version (bit 63: occupied)
      for (uint64_t k = 0; k < 8; ++k) {
        cs.row_keys.push_back(k % 3 == 0 ? 0 : 0x9e3779b97f4a7c15ull * (k + clock));
        cs.row_versions.push_back(k % 3 == 0 ? 0 : (1ull << 63) | (clock + k));
      }
    }
    s.chunks.push_back(std::move(cs));
  }
  for (uint32_t r = 0; r < 2; ++r) {
    WorkerProgress w;
    w.rank = r * 5;
    w.clock = clock + r;
    w.last_seq = {clock * 3 + r, 0, UINT64_MAX};
    w.applied_clock = {static_cast<int64_t>(clock) - 1, -1, INT64_MIN};
    s.workers.push_back(std::move(w));
  }
  return s;
}

void ExpectSame(const ShardSnapshot& a, const ShardSnapshot& b) {
  EXPECT_EQ(a.plan_fingerprint, b.plan_fingerprint);
  EXPECT_EQ(a.group, b.group);
  EXPECT_EQ(a.num_groups, b.num_groups);
  EXPECT_EQ(a.clock, b.clock);
  EXPECT_EQ(a.epoch, b.epoch);
  EXPECT_EQ(a.optimizer, b.optimizer);
  ASSERT_EQ(a.chunks.size(), b.chunks.size());
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    EXPECT_EQ(a.chunks[i].chunk_id, b.chunks[i].chunk_id);
    EXPECT_EQ(a.chunks[i].version, b.chunks[i].version);
    EXPECT_EQ(a.chunks[i].optimizer_steps, b.chunks[i].optimizer_steps);
    EXPECT_TRUE(SameBytes(a.chunks[i].weights, b.chunks[i].weights)) << "chunk " << i;
    EXPECT_TRUE(SameBytes(a.chunks[i].state1, b.chunks[i].state1)) << "chunk " << i;
    EXPECT_TRUE(SameBytes(a.chunks[i].state2, b.chunks[i].state2)) << "chunk " << i;
    EXPECT_EQ(a.chunks[i].row_keys, b.chunks[i].row_keys) << "chunk " << i;
    EXPECT_EQ(a.chunks[i].row_versions, b.chunks[i].row_versions) << "chunk " << i;
  }
  ASSERT_EQ(a.workers.size(), b.workers.size());
  for (size_t i = 0; i < a.workers.size(); ++i) {
    EXPECT_EQ(a.workers[i].rank, b.workers[i].rank);
    EXPECT_EQ(a.workers[i].clock, b.workers[i].clock);
    EXPECT_EQ(a.workers[i].last_seq, b.workers[i].last_seq);
    EXPECT_EQ(a.workers[i].applied_clock, b.workers[i].applied_clock);
  }
}

// Recomputes both checksums after a deliberate edit, so that only the structural checks stand
// between a crafted file and the allocator.
void Reseal(std::vector<uint8_t>& b) {
  uint32_t h = crc32c::Value(b.data(), 60);
  std::memcpy(b.data() + 60, &h, 4);
  uint32_t t = crc32c::Value(b.data(), b.size() - 4);
  std::memcpy(b.data() + b.size() - 4, &t, 4);
}
template <typename T>
void Poke(std::vector<uint8_t>& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
}

// ---- CRC32C ----

TEST(Crc32cTest, Rfc3720Vectors) {
  // RFC 3720 appendix B.4, plus the common check value of "123456789".
  uint8_t zeros[32] = {}, ones[32], inc[32], dec[32];
  for (int i = 0; i < 32; ++i) {
    ones[i] = 0xff;
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  const uint8_t read_pdu[48] = {
      0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
      0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00,
      0x00, 0x00, 0x00};
  for (auto fn : {&crc32c::ExtendPortable, &crc32c::ExtendHardware, &crc32c::Extend}) {
    EXPECT_EQ(fn(0, zeros, 32), 0x8a9136aau);
    EXPECT_EQ(fn(0, ones, 32), 0x62a8ab43u);
    EXPECT_EQ(fn(0, inc, 32), 0x46dd794eu);
    EXPECT_EQ(fn(0, dec, 32), 0x113fdb5cu);
    EXPECT_EQ(fn(0, read_pdu, 48), 0xd9963a56u);
    EXPECT_EQ(fn(0, "123456789", 9), 0xe3069283u);
    EXPECT_EQ(fn(0, "", 0), 0u);
  }
}

TEST(Crc32cTest, ExtendIsConcatenationAndImplementationsAgree) {
  std::vector<uint8_t> d(10007);
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(i * 131 + (i >> 7));
  const uint32_t whole = crc32c::ExtendPortable(0, d.data(), d.size());
  EXPECT_EQ(crc32c::ExtendHardware(0, d.data(), d.size()), whole);
  for (size_t split : {0, 1, 7, 8, 13, 4096, 10006}) {
    for (size_t misalign : {0, 1, 3}) {
      if (split + misalign > d.size()) continue;
      uint32_t a = crc32c::Extend(0, d.data() + misalign, split);
      a = crc32c::Extend(a, d.data() + misalign + split, d.size() - split - misalign);
      EXPECT_EQ(a, crc32c::ExtendPortable(0, d.data() + misalign, d.size() - misalign));
    }
  }
}

// ExtendLanes (four interleaved streams on the hardware path) equals Extend lane by lane, for
// any lane count (the 4-lane groups and the rest), any length and any starting crc; and
// RowRecordCrcs equals RowRecordCrc for each record.
TEST(Crc32cTest, LanesEqualOneStreamEach) {
  std::vector<uint8_t> d(4096);
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<uint8_t>(i * 151 + (i >> 5));
  for (size_t lanes : {1, 3, 4, 5, 8, 9, 16}) {
    for (size_t n : {0, 1, 7, 8, 20, 256, 257}) {
      std::vector<const void*> p(lanes);
      std::vector<uint32_t> crc(lanes), want(lanes);
      for (size_t i = 0; i < lanes; ++i) {
        p[i] = d.data() + i * 211 + i % 3;  // misaligned some
        crc[i] = want[i] = static_cast<uint32_t>(i * 0x9e3779b9u);
        want[i] = crc32c::ExtendPortable(want[i], p[i], n);
      }
      crc32c::ExtendLanes(crc.data(), p.data(), lanes, n);
      EXPECT_EQ(crc, want) << lanes << " lanes of " << n << " bytes";
    }
  }
  constexpr size_t kValues = 256, kStride = sizeof(layout::RowHeader) + kValues;
  std::vector<char> recs(21 * kStride);
  std::vector<const char*> ptr;
  for (size_t r = 0; r < 21; ++r) {
    char* rec = recs.data() + r * kStride;
    for (size_t i = 0; i < kStride; ++i) rec[i] = static_cast<char>(r * 7 + i * 13);
    ptr.push_back(rec);
  }
  std::vector<uint32_t> got(ptr.size());
  layout::RowRecordCrcs(ptr.data(), ptr.size(), kValues, got.data());
  for (size_t r = 0; r < ptr.size(); ++r) {
    layout::RowHeader h;
    std::memcpy(&h, ptr[r], sizeof(h));
    EXPECT_EQ(got[r], layout::RowRecordCrc(h, ptr[r] + sizeof(h), kValues)) << "record " << r;
  }
}

// ---- format ----

TEST(CheckpointFormatTest, RoundTripIsBitExactIncludingNaNPayloadsAndDenormals) {
  TempDir dir;
  ShardSnapshot s = MakeSnapshot(42, 1, 4);
  s.plan_fingerprint = std::string("fp\0with\xff bytes", 15);
  auto& w = s.chunks[0].weights;
  w[0] = Bits(0x7fc00001);  // quiet NaN with a payload
  w[1] = Bits(0xffbadbad);  // negative NaN, another payload
  w[2] = Bits(0x7f800001);  // signalling NaN
  w[3] = Bits(0x00000001);  // smallest denormal
  w[4] = Bits(0x807fffff);  // largest negative denormal
  w[5] = Bits(0x80000000);  // -0
  w[6] = INFINITY;
  s.chunks[2].state2[0] = Bits(0x7fa5a5a5);
  uint64_t bytes = 0;
  ASSERT_TRUE(WriteSnapshot(dir.path(), s, &bytes).ok());
  const std::string path = SnapshotPath(dir.path(), 42, 1, 4);
  EXPECT_EQ(path, dir.path() + "/ckpt-000000000042/group-1-of-4.shps");
  EXPECT_EQ(Slurp(path).size(), bytes);
  EXPECT_EQ(Names(dir.path() + "/ckpt-000000000042"),
            std::vector<std::string>{"group-1-of-4.shps"});  // no temp file left
  auto back = ReadSnapshot(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(s, *back);
  uint32_t u;
  std::memcpy(&u, &back->chunks[0].weights[1], 4);
  EXPECT_EQ(u, 0xffbadbadu);

  auto sum = VerifySnapshot(path);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->file_bytes, bytes);
  EXPECT_EQ(sum->num_chunks, 3u);
  EXPECT_EQ(sum->num_workers, 2u);
  EXPECT_EQ(sum->num_floats, 3 * 37 + 2 * (37 + 19));
  EXPECT_EQ(sum->plan_fingerprint, s.plan_fingerprint);

  // Rewriting the same clock replaces the file atomically.
  s.epoch = 9;
  ASSERT_TRUE(WriteSnapshot(dir.path(), s).ok());
  EXPECT_EQ(ReadSnapshot(path)->epoch, 9u);
}

// A format-1 file (no row keys; written by the previous build) still reads: the same bytes
// with version 1 in the header and the trailer's crc recomputed.
TEST(CheckpointFormatTest, FormatOneFilesStillRead) {
  TempDir dir;
  ShardSnapshot s = MakeSnapshot(7, 0, 1);
  s.chunks[2].row_keys.clear();
  s.chunks[2].row_versions.clear();
  ASSERT_TRUE(WriteSnapshot(dir.path(), s).ok());
  const std::string path = SnapshotPath(dir.path(), 7, 0, 1);
  std::vector<uint8_t> bytes = Slurp(path);
  uint32_t version = 1;
  std::memcpy(&bytes[8], &version, 4);
  Reseal(bytes);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  auto back = ReadSnapshot(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(s, *back);
}

// Incremental row-shard checkpoints: a whole state at clock 10, increments at 20 (on 10) and
// 30 (on 20). Reading 30 and resolving it gives the rows as the increments left them; a
// checkpoint whose base is gone is not complete (the newest usable is then older); retention
// keeps the bases of what it keeps.
TEST(CheckpointDirTest, IncrementalChainsResolveAndGuardTheirBases) {
  TempDir dir;
  constexpr uint64_t kRows = 6, kDim = 2;
  auto whole = [&](uint64_t clock) {
    ShardSnapshot s = MakeSnapshot(clock, 0, 1);
    ChunkState& c = s.chunks[2];  // the row shard
    c.weights.assign(kRows * kDim, 0.0f);
    for (uint64_t i = 0; i < c.weights.size(); ++i) c.weights[i] = static_cast<float>(i);
    c.state1.assign(kRows * kDim, 1.0f);
    c.state2.clear();
    c.row_keys.assign(kRows, 7);
    c.row_versions.assign(kRows, 1ull << 63);
    return s;
  };
  auto increment = [&](uint64_t clock, uint64_t base, std::vector<uint64_t> rows, float v) {
    ShardSnapshot s = whole(clock);
    ChunkState& c = s.chunks[2];
    c.base_clock = base;
    c.row_index = rows;
    c.weights.assign(rows.size() * kDim, v);
    c.state1.assign(rows.size() * kDim, v + 0.5f);
    c.row_keys.assign(rows.size(), static_cast<uint64_t>(clock));
    c.row_versions.assign(rows.size(), (1ull << 63) | clock);
    return s;
  };
  ASSERT_TRUE(WriteSnapshot(dir.path(), whole(10)).ok());
  ASSERT_TRUE(WriteSnapshot(dir.path(), increment(20, 10, {1, 4}, 20.0f)).ok());
  ASSERT_TRUE(WriteSnapshot(dir.path(), increment(30, 20, {4, 5}, 30.0f)).ok());
  auto latest = LatestCompleteCheckpoint(dir.path(), 1, "plan-abc");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 30u);
  auto got = ReadSnapshot(SnapshotPath(dir.path(), 30, 0, 1));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(ResolveIncremental(dir.path(), &*got).ok());
  const ChunkState& c = got->chunks[2];
  EXPECT_EQ(c.base_clock, 0u);
  EXPECT_TRUE(c.row_index.empty());
  ASSERT_EQ(c.weights.size(), kRows * kDim);
  // rows 0, 2, 3 from clock 10; row 1 from 20; rows 4, 5 from 30.
  const std::vector<float> want_w = {0, 1, 20, 20, 4, 5, 6, 7, 30, 30, 30, 30};
  EXPECT_EQ(c.weights, want_w);
  EXPECT_EQ(c.state1[2], 20.5f);
  EXPECT_EQ(c.state1[8], 30.5f);
  EXPECT_EQ(c.state1[0], 1.0f);
  const std::vector<uint64_t> want_k = {7, 20, 7, 7, 30, 30};
  EXPECT_EQ(c.row_keys, want_k);
  EXPECT_EQ(c.row_versions[4], (1ull << 63) | 30u);
  // The dense chunks of the snapshot are untouched.
  EXPECT_EQ(got->chunks[0].weights, MakeSnapshot(30, 0, 1).chunks[0].weights);

  // Retention keeps the chain: keep 1 deletes nothing that 30 needs.
  size_t removed = 0;
  ASSERT_TRUE(PruneCheckpoints(dir.path(), 0, 1, 1, "plan-abc", &removed).ok());
  EXPECT_EQ(removed, 0u);
  EXPECT_EQ(Names(dir.path()).size(), 3u);

  // The middle of the chain gone: 30 is not complete, 10 is the newest usable.
  ASSERT_EQ(::unlink(SnapshotPath(dir.path(), 20, 0, 1).c_str()), 0);
  std::string report;
  latest = LatestCompleteCheckpoint(dir.path(), 1, "plan-abc", &report);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 10u);
  EXPECT_NE(report.find("based on ckpt-000000000020"), std::string::npos) << report;
  got = ReadSnapshot(SnapshotPath(dir.path(), 30, 0, 1));
  ASSERT_TRUE(got.ok());
  Status st = ResolveIncremental(dir.path(), &*got);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("ckpt-000000000020"), std::string::npos) << st;
}

TEST(CheckpointFormatTest, EmptySnapshotRoundTrips) {
  TempDir dir;
  ShardSnapshot s;
  ASSERT_TRUE(WriteSnapshot(dir.path(), s).ok());
  auto back = ReadSnapshot(SnapshotPath(dir.path(), 0, 0, 1));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(s, *back);
}

TEST(CheckpointFormatTest, InvalidSnapshotsAreRefusedBeforeTouchingDisk) {
  TempDir dir;
  ShardSnapshot s = MakeSnapshot(1, 4, 4);
  EXPECT_EQ(WriteSnapshot(dir.path(), s).code(), StatusCode::kInvalidArgument);
  s.num_groups = 0;
  s.group = 0;
  EXPECT_EQ(WriteSnapshot(dir.path(), s).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Names(dir.path()).empty());
}

TEST(CheckpointFormatTest, EveryTruncationIsDataLoss) {
  TempDir dir;
  ASSERT_TRUE(WriteSnapshot(dir.path(), MakeSnapshot(7, 0, 1)).ok());
  const auto good = Slurp(SnapshotPath(dir.path(), 7, 0, 1));
  ASSERT_GT(good.size(), 1000u);
  const std::string p = dir.path() + "/cut.shps";
  for (size_t n = 0; n < good.size(); ++n) {
    Spit(p, good, n);
    auto r = ReadSnapshot(p);
    ASSERT_FALSE(r.ok()) << "accepted a file cut at " << n;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << n << ": " << r.status();
    if (n >= 64) {
      EXPECT_NE(r.status().message().find("truncated at byte " + std::to_string(n) + " of " +
                                          std::to_string(good.size())),
                std::string::npos)
          << r.status();
    }
    ASSERT_FALSE(VerifySnapshot(p).ok());
  }
  // One byte too many is refused too.
  auto longer = good;
  longer.push_back(0);
  Spit(p, longer, longer.size());
  EXPECT_EQ(ReadSnapshot(p).status().code(), StatusCode::kDataLoss);
}

TEST(CheckpointFormatTest, EverySingleBitFlipIsDataLoss) {
  TempDir dir;
  ASSERT_TRUE(WriteSnapshot(dir.path(), MakeSnapshot(7, 0, 1)).ok());
  const auto good = Slurp(SnapshotPath(dir.path(), 7, 0, 1));
  const std::string p = dir.path() + "/flip.shps";
  for (size_t off = 0; off < good.size(); ++off) {
    auto bad = good;
    bad[off] ^= static_cast<uint8_t>(1u << (off % 8));
    Spit(p, bad, bad.size());
    auto r = ReadSnapshot(p);
    ASSERT_FALSE(r.ok()) << "accepted a flip at byte " << off;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << off << ": " << r.status();
    const std::string& m = r.status().message();
    if (off < 8) {
      EXPECT_NE(m.find("bad magic"), std::string::npos) << m;
    } else if (off < 64) {
      EXPECT_NE(m.find("header checksum mismatch"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("checksum mismatch"), std::string::npos) << m;
    }
  }
  // All eight bits of a header byte and of a weight byte.
  for (size_t off : {size_t{20}, good.size() / 2}) {
    for (int bit = 0; bit < 8; ++bit) {
      auto bad = good;
      bad[off] ^= static_cast<uint8_t>(1u << bit);
      Spit(p, bad, bad.size());
      EXPECT_EQ(ReadSnapshot(p).status().code(), StatusCode::kDataLoss) << off << "/" << bit;
    }
  }
}

TEST(CheckpointFormatTest, HostileLengthsAreRefusedWithoutLargeAllocations) {
  TempDir dir;
  ShardSnapshot s = MakeSnapshot(5, 0, 1, 64, "fp");
  ASSERT_TRUE(WriteSnapshot(dir.path(), s).ok());
  const auto good = Slurp(SnapshotPath(dir.path(), 5, 0, 1));
  // Offsets per docs/checkpoints.md: header 64 bytes; "fp" (4+2); "adam lr=0.001" (4+13); then
  // chunk 0's fixed part: id, reserved, version, steps, n_weights @+24, n_state1 @+32, ...
  const size_t fp_len = 64, chunk0 = 64 + 4 + 2 + 4 + 13;
  const size_t chunk_bytes = 48 + 4 * (64 + 64 + 33);
  // Chunk 1 has no state; chunk 2 has 8 row keys and versions (a u64 count, then 16 B each).
  const size_t keys2 = chunk0 + 3 * chunk_bytes - 4 * (64 + 33);
  const size_t worker0 = keys2 + 8 + 16 * 8;
  struct Case {
    const char* name;
    size_t off;
    int width;
    uint64_t value;
    const char* expect;
  };
  const Case cases[] = {
      {"fingerprint length", fp_len, 4, 0xfffffff0u, "plan fingerprint length"},
      {"chunk count", 48, 4, 0xffffffffu, "chunk count length"},
      {"worker count", 52, 4, 0x7fffffffu, "worker count length"},
      {"weights length", chunk0 + 24, 8, uint64_t{1} << 60, "chunk 0 weights length"},
      {"weights length 400 MB", chunk0 + 24, 8, 100000000, "chunk 0 weights length"},
      {"weights length wraps", chunk0 + 24, 8, UINT64_MAX, "chunk 0 weights length"},
      {"state2 length", chunk0 + 40, 8, uint64_t{1} << 40, "chunk 0 state2 length"},
      {"row keys length", keys2, 8, uint64_t{1} << 59, "row keys length"},
      {"row keys length 9", keys2, 8, 9, "worker 0 last_seq length"},  // 16 B too many
      {"last_seq length", worker0 + 16, 8, uint64_t{1} << 61, "worker 0 last_seq length"},
      {"applied length", worker0 + 24, 8, 3 + 1000, "worker 0 applied_clock length"},
  };
  const std::string p = dir.path() + "/hostile.shps";
  for (const Case& c : cases) {
    auto bad = good;
    if (c.width == 4) Poke<uint32_t>(bad, c.off, static_cast<uint32_t>(c.value));
    else Poke<uint64_t>(bad, c.off, c.value);
    Reseal(bad);
    Spit(p, bad, bad.size());
    g_max_alloc = 0;
    g_track_alloc = true;
    auto r = ReadSnapshot(p);
    auto v = VerifySnapshot(p);
    g_track_alloc = false;
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << c.name << ": " << r.status();
    EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << c.name;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status();
    EXPECT_EQ(r.status().message().find("checksum mismatch"), std::string::npos)
        << c.name << ": the checksum was resealed, the length check must catch it";
    EXPECT_LE(g_max_alloc.load(), (size_t{64} << 10) + good.size()) << c.name;
  }
  // The untouched file still reads (the offsets above were right).
  auto ok = good;
  Reseal(ok);
  Spit(p, ok, ok.size());
  EXPECT_TRUE(ReadSnapshot(p).ok());
  // A header claiming a huge file.
  auto big = good;
  Poke<uint64_t>(big, 16, uint64_t{1} << 50);
  Reseal(big);
  Spit(p, big, big.size());
  auto r = ReadSnapshot(p);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("truncated at byte"), std::string::npos) << r.status();
}

TEST(CheckpointFormatTest, NotACheckpointIsRefused) {
  TempDir dir;
  const std::string p = dir.path() + "/junk";
  std::vector<uint8_t> junk(5000);
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<uint8_t>(i * 7);
  Spit(p, junk, junk.size());
  auto r = ReadSnapshot(p);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("bad magic"), std::string::npos);
  EXPECT_NE(r.status().message().find(p), std::string::npos);  // names the file
  Spit(p, junk, 0);
  EXPECT_EQ(ReadSnapshot(p).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ReadSnapshot(dir.path() + "/missing").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(ReadSnapshot(dir.path()).ok());  // a directory
}

// ---- choosing the checkpoint, retention ----

void WriteAll(const std::string& dir, uint64_t clock, uint32_t g_count,
              const std::string& fp = "plan-abc") {
  for (uint32_t g = 0; g < g_count; ++g) {
    ASSERT_TRUE(WriteSnapshot(dir, MakeSnapshot(clock, g, g_count, 37, fp)).ok());
  }
}

TEST(CheckpointDirTest, LatestSkipsCorruptAndHalfWrittenAndSaysWhy) {
  TempDir dir;
  std::string report;
  EXPECT_EQ(LatestCompleteCheckpoint(dir.path(), 3, "plan-abc", &report).status().code(),
            StatusCode::kNotFound);
  WriteAll(dir.path(), 10, 3);
  WriteAll(dir.path(), 20, 3);
  WriteAll(dir.path(), 30, 3);
  WriteAll(dir.path(), 40, 3);
  // 40: group 1 corrupt.
  const std::string p40 = SnapshotPath(dir.path(), 40, 1, 3);
  auto b = Slurp(p40);
  b[b.size() / 2] ^= 0x10;
  Spit(p40, b, b.size());
  // 50: half-written: groups 0 and 2 done, group 1 still a temp file.
  ASSERT_TRUE(WriteSnapshot(dir.path(), MakeSnapshot(50, 0, 3)).ok());
  ASSERT_TRUE(WriteSnapshot(dir.path(), MakeSnapshot(50, 2, 3)).ok());
  Spit(SnapshotPath(dir.path(), 50, 1, 3) + ".tmp", b, 100);
  // Junk in the directory is ignored.
  ::mkdir((dir.path() + "/ckpt-12").c_str(), 0755);
  Spit(dir.path() + "/notes.txt", b, 3);

  auto k = LatestCompleteCheckpoint(dir.path(), 3, "plan-abc", &report);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(*k, 30u);
  EXPECT_NE(report.find("ckpt-000000000050: group 1: missing"), std::string::npos) << report;
  EXPECT_NE(report.find("ckpt-000000000040: group 1: checksum mismatch"), std::string::npos)
      << report;
  EXPECT_NE(report.find("using ckpt-000000000030"), std::string::npos) << report;
  EXPECT_LT(report.find("ckpt-000000000050"), report.find("ckpt-000000000040"));

  // Another plan: nothing matches, and the answer says why.
  auto other = LatestCompleteCheckpoint(dir.path(), 3, "plan-xyz", &report);
  EXPECT_EQ(other.status().code(), StatusCode::kNotFound);
  EXPECT_NE(report.find("plan fingerprint 'plan-abc' is not the expected 'plan-xyz'"),
            std::string::npos) << report;
  // A different group count sees no complete checkpoint either.
  EXPECT_FALSE(LatestCompleteCheckpoint(dir.path(), 2, "plan-abc").ok());

  // The listing shows all five, newest first, with per-group state.
  auto list = ListCheckpoints(dir.path());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 5u);
  EXPECT_EQ((*list)[0].clock, 50u);
  EXPECT_FALSE((*list)[0].complete);
  EXPECT_EQ((*list)[0].files.size(), 2u);
  EXPECT_FALSE((*list)[1].complete);
  EXPECT_EQ((*list)[1].files[1].status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE((*list)[2].complete);
  EXPECT_TRUE((*list)[4].complete);
}

TEST(CheckpointDirTest, PruneKeepsNewestCompleteAndNewerIncomplete) {
  TempDir dir;
  const std::string d = dir.path();
  WriteAll(d, 10, 2);
  WriteAll(d, 20, 2);
  WriteAll(d, 30, 2);
  ASSERT_TRUE(WriteSnapshot(d, MakeSnapshot(40, 0, 2)).ok());  // group 1 not yet written
  Spit(SnapshotPath(d, 10, 0, 2) + ".tmp", {1, 2, 3}, 3);       // stale temp of group 0

  EXPECT_EQ(PruneCheckpoints(d, 0, 2, 0, "plan-abc").code(), StatusCode::kInvalidArgument);
  size_t removed = 0;
  ASSERT_TRUE(PruneCheckpoints(d, 0, 2, 2, "plan-abc", &removed).ok());
  EXPECT_EQ(removed, 2u);  // group 0's file and temp file of ckpt 10
  EXPECT_FALSE(Exists(SnapshotPath(d, 10, 0, 2)));
  EXPECT_TRUE(Exists(SnapshotPath(d, 10, 1, 2)));  // other group's file untouched
  EXPECT_TRUE(Exists(SnapshotPath(d, 20, 0, 2)));
  EXPECT_TRUE(Exists(SnapshotPath(d, 30, 0, 2)));
  EXPECT_TRUE(Exists(SnapshotPath(d, 40, 0, 2)));  // newer, incomplete: kept
  ASSERT_TRUE(PruneCheckpoints(d, 1, 2, 2, "plan-abc", &removed).ok());
  EXPECT_EQ(removed, 1u);
  EXPECT_FALSE(Exists(CheckpointDirName(d, 10)));  // empty: removed
  EXPECT_EQ(*LatestCompleteCheckpoint(d, 2, "plan-abc"), 30u);

  // keep = 1 with the newest complete corrupted: 20 becomes the newest complete, so 30 (newer)
  // stays, and only what is older than 20 goes (nothing).
  auto b = Slurp(SnapshotPath(d, 30, 1, 2));
  b[100] ^= 1;
  Spit(SnapshotPath(d, 30, 1, 2), b, b.size());
  ASSERT_TRUE(PruneCheckpoints(d, 0, 2, 1, "plan-abc", &removed).ok());
  EXPECT_EQ(removed, 0u);
  EXPECT_TRUE(Exists(SnapshotPath(d, 20, 0, 2)));
  EXPECT_TRUE(Exists(SnapshotPath(d, 30, 0, 2)));
  // Fewer complete checkpoints than `keep`: nothing is deleted.
  ASSERT_TRUE(PruneCheckpoints(d, 0, 2, 5, "plan-abc", &removed).ok());
  EXPECT_EQ(removed, 0u);
}

// ---- the background writer ----

// A write function that blocks until released, recording the clocks it was given.
struct GatedWrite {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int entered = 0;
  std::vector<uint64_t> clocks;
  CheckpointWriter::WriteFn Fn() {
    return [this](const std::string& dir, const ShardSnapshot& s, uint64_t* bytes) {
      std::unique_lock<std::mutex> l(mu);
      ++entered;
      cv.notify_all();
      cv.wait(l, [this] { return open; });
      clocks.push_back(s.clock);
      l.unlock();
      return WriteSnapshot(dir, s, bytes);
    };
  }
  void WaitEntered(int n) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return entered >= n; });
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu);
    open = true;
    cv.notify_all();
  }
};

// Every queued snapshot is written, in order, while a write blocks (each group must write every
// checkpoint, or the cluster checkpoint is never complete); beyond kMaxQueued (8) waiting ones
// the newest are dropped and counted.
TEST(CheckpointWriterTest, QueuedSnapshotsAreAllWrittenInOrderUpToTheBound) {
  TempDir dir;
  GatedWrite gate;
  CheckpointWriter w({dir.path(), 0, gate.Fn()});
  w.Submit(MakeSnapshot(1, 0, 1));
  gate.WaitEntered(1);  // clock 1 is being written
  for (uint64_t k = 2; k <= 11; ++k) w.Submit(MakeSnapshot(k, 0, 1));  // 8 fit, 10 and 11 drop
  EXPECT_EQ(w.Flush(std::chrono::milliseconds(50)).code(), StatusCode::kDeadlineExceeded);
  gate.Open();
  ASSERT_TRUE(w.Flush(std::chrono::seconds(10)).ok());
  auto st = w.stats();
  EXPECT_EQ(st.submitted, 11u);
  EXPECT_EQ(st.written, 9u);
  EXPECT_EQ(st.superseded, 2u);
  EXPECT_EQ(st.failed, 0u);
  EXPECT_EQ(st.last_written_clock, 9u);
  EXPECT_EQ(st.bytes_written, 9 * Slurp(SnapshotPath(dir.path(), 9, 0, 1)).size());
  EXPECT_GT(st.max_write_seconds, 0.0);
  EXPECT_EQ(gate.clocks, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_TRUE(Exists(CheckpointDirName(dir.path(), 2)));
  EXPECT_FALSE(Exists(CheckpointDirName(dir.path(), 10)));
  EXPECT_EQ(*LatestCompleteCheckpoint(dir.path(), 1, "plan-abc"), 9u);
}

TEST(CheckpointWriterTest, FailedWritesAreCountedAndTheWriterCarriesOn) {
  TempDir dir;
  int calls = 0;
  CheckpointWriter w({dir.path(), 2, [&](const std::string& d, const ShardSnapshot& s,
                                         uint64_t* bytes) -> Status {
                        if (++calls == 2) return ResourceExhaustedError("disk full: write x");
                        return WriteSnapshot(d, s, bytes);
                      }});
  w.Submit(MakeSnapshot(10, 0, 1));
  ASSERT_TRUE(w.Flush(std::chrono::seconds(10)).ok());
  w.Submit(MakeSnapshot(20, 0, 1));
  EXPECT_EQ(w.Flush(std::chrono::seconds(10)).code(), StatusCode::kResourceExhausted);
  for (uint64_t k : {30, 40, 50}) {
    w.Submit(MakeSnapshot(k, 0, 1));
    ASSERT_TRUE(w.Flush(std::chrono::seconds(10)).ok());
  }
  auto st = w.stats();
  EXPECT_EQ(st.written, 4u);
  EXPECT_EQ(st.failed, 1u);
  EXPECT_EQ(st.last_error.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(st.last_written_clock, 50u);
  // Retention (keep 2) ran after each write.
  auto list = ListCheckpoints(dir.path());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].clock, 50u);
  EXPECT_EQ((*list)[1].clock, 40u);
}

TEST(CheckpointWriterTest, DestructorWritesWhatIsQueued) {
  TempDir dir;
  {
    CheckpointWriter w({dir.path(), 0, nullptr});
    w.Submit(MakeSnapshot(7, 0, 1));
  }
  EXPECT_EQ(*LatestCompleteCheckpoint(dir.path(), 1, "plan-abc"), 7u);
}

// ---- a full disk, for real ----

class SmallTmpfs {
 public:
  explicit SmallTmpfs(const std::string& where) : path_(where + "/mnt") {
    ::mkdir(path_.c_str(), 0755);
    if (::mount("tmpfs", path_.c_str(), "tmpfs", 0, "size=256k") == 0) {
      mounted_ = true;
    } else {
      error_ = std::strerror(errno);
    }
  }
  ~SmallTmpfs() {
    if (mounted_ && ::umount2(path_.c_str(), MNT_DETACH) != 0) {
      std::fprintf(stderr, "umount %s: %s\n", path_.c_str(), std::strerror(errno));
    }
  }
  bool mounted() const { return mounted_; }
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_, error_;
  bool mounted_ = false;
};

TEST(CheckpointDiskFullTest, FailedWriteLeavesPreviousCheckpointLatestAndTrainingGoesOn) {
  TempDir dir;
  SmallTmpfs fs(dir.path());
  if (!fs.mounted()) GTEST_SKIP() << "cannot mount a 256 KiB tmpfs: " << fs.error();
  const std::string d = fs.path() + "/ckpt";
  ShardSnapshot small = MakeSnapshot(10, 0, 1, 4000, "fp");  // ~96 KB
  ASSERT_TRUE(WriteSnapshot(d, small).ok());
  const std::string p10 = SnapshotPath(d, 10, 0, 1);
  const auto before = Slurp(p10);

  ShardSnapshot big = MakeSnapshot(20, 0, 1, 20000, "fp");  // ~480 KB: cannot fit
  Status st = WriteSnapshot(d, big);
  ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("disk full"), std::string::npos) << st;
  EXPECT_NE(st.message().find(SnapshotPath(d, 20, 0, 1) + ".tmp"), std::string::npos) << st;
  EXPECT_NE(st.message().find("errno 28"), std::string::npos) << st;
  EXPECT_TRUE(Names(CheckpointDirName(d, 20)).empty());  // no temp file left
  EXPECT_EQ(Slurp(p10), before);                         // previous one untouched
  auto back = ReadSnapshot(p10);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(small, *back);
  std::string report;
  EXPECT_EQ(*LatestCompleteCheckpoint(d, 1, "fp", &report), 10u);
  EXPECT_NE(report.find("ckpt-000000000020: group 0: missing"), std::string::npos) << report;

  // Through the background writer: the failure is counted, the next snapshot that fits lands.
  CheckpointWriter w({d, 1, nullptr});
  big.clock = 30;
  w.Submit(std::move(big));
  EXPECT_EQ(w.Flush(std::chrono::seconds(10)).code(), StatusCode::kResourceExhausted);
  ShardSnapshot next = MakeSnapshot(40, 0, 1, 4000, "fp");
  w.Submit(ShardSnapshot(next));
  ASSERT_TRUE(w.Flush(std::chrono::seconds(10)).ok());
  auto stats = w.stats();
  EXPECT_EQ(stats.failed, 1u);
  EXPECT_EQ(stats.written, 1u);
  EXPECT_EQ(stats.last_error.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(*LatestCompleteCheckpoint(d, 1, "fp"), 40u);
  ExpectSame(next, *ReadSnapshot(SnapshotPath(d, 40, 0, 1)));
  // keep = 1: everything older than 40 is gone, including the empty directories of the
  // failed writes.
  EXPECT_EQ(Names(d), std::vector<std::string>{"ckpt-000000000040"});
}

// ---- the CLI ----

int RunCli(const std::string& cmd, std::string* out) {
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return -1;
  char buf[4096];
  out->clear();
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  int rc = ::pclose(f);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(CheckpointCliTest, ListVerifyDump) {
  TempDir dir;
  const std::string d = dir.path(), cli = SHARDPS_CHECKPOINT_CLI;
  WriteAll(d, 10, 2);
  WriteAll(d, 20, 2);
  std::string out;
  EXPECT_EQ(RunCli(cli + " verify " + d, &out), 0) << out;
  EXPECT_NE(out.find("0 corrupt or unreadable files"), std::string::npos) << out;
  auto b = Slurp(SnapshotPath(d, 20, 1, 2));
  b[b.size() - 9] ^= 4;
  Spit(SnapshotPath(d, 20, 1, 2), b, b.size());
  EXPECT_EQ(RunCli(cli + " verify " + d, &out), 1) << out;
  EXPECT_NE(out.find("1 corrupt or unreadable file"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " verify " + SnapshotPath(d, 20, 1, 2), &out), 1) << out;
  EXPECT_NE(out.find("checksum mismatch"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " list " + d, &out), 0) << out;
  EXPECT_NE(out.find("clock 20  INCOMPLETE: group 1: checksum mismatch"), std::string::npos)
      << out;
  EXPECT_NE(out.find("clock 10  complete"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " list --json " + d, &out), 0) << out;
  EXPECT_NE(out.find("\"clock\":20,"), std::string::npos) << out;
  EXPECT_NE(out.find("\"corrupt_files\":1}"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " dump " + SnapshotPath(d, 10, 0, 2), &out), 0) << out;
  EXPECT_NE(out.find("group 0 of 2, clock 10, epoch 3"), std::string::npos) << out;
  EXPECT_NE(out.find("optimizer adam lr=0.001"), std::string::npos) << out;
  EXPECT_NE(out.find("worker 5: clock 11"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " dump --json " + SnapshotPath(d, 10, 0, 2), &out), 0) << out;
  EXPECT_NE(out.find("\"applied_clock\":[9,-1,-9223372036854775808]"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " dump " + SnapshotPath(d, 20, 1, 2), &out), 1) << out;
}

// A directory where a group file should be is a file restore cannot use: verify says so and
// exits 1. (Before, it reported "0 corrupt files" and exited 0 while restore refused it.)
TEST(CheckpointCliTest, VerifyCountsAGroupFileThatIsADirectory) {
  TempDir dir;
  const std::string d = dir.path(), cli = SHARDPS_CHECKPOINT_CLI;
  WriteAll(d, 10, 2);
  const std::string victim = SnapshotPath(d, 10, 1, 2);
  ASSERT_EQ(::unlink(victim.c_str()), 0);
  ASSERT_EQ(::mkdir(victim.c_str(), 0700), 0);
  std::string out;
  EXPECT_EQ(RunCli(cli + " verify " + d, &out), 1) << out;
  EXPECT_NE(out.find("1 corrupt or unreadable file"), std::string::npos) << out;
  EXPECT_EQ(RunCli(cli + " list " + d, &out), 0) << out;
  EXPECT_NE(out.find("INCOMPLETE"), std::string::npos) << out;
}

}  // namespace
}  // namespace shardps::server
