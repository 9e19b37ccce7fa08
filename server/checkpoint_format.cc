// Checkpoint file format: encoding a ShardSnapshot into one group file (through a buffered,
// checksumming sink) and reading one back with every length and checksum verified. The byte
// layout is in docs/checkpoints.md; keep the two in step. Directories, restore selection and
// retention are in checkpoint.cc; the background writer is in checkpoint_writer.cc.
#include "server/checkpoint_format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/crc32c.h"
#include "common/fd.h"

namespace shardps::server {

// Integers and floats go to disk as the host's bytes (memcpy), so the host must be
// little-endian, the byte order the format specifies.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checkpoint format is little-endian");
static_assert(sizeof(float) == 4, "IEEE-754 binary32 floats");

namespace checkpoint_internal {
namespace {

constexpr char kMagic[8] = {'S', 'H', 'P', 'S', 'C', 'K', 'P', 'T'};
constexpr uint64_t kHeaderBytes = 64;
constexpr uint64_t kTrailerBytes = 4;
constexpr uint64_t kChunkFixedBytes = 48;
// A chunk record's flags (the u32 after its id): its row keys and versions follow its arrays
// (format 2: a hashed row shard).
constexpr uint32_t kChunkHasRowKeys = 1;
// ... and an incremental chunk's base clock and row index follow them, before the keys.
constexpr uint32_t kChunkIsIncremental = 2;
constexpr uint64_t kWorkerFixedBytes = 32;
constexpr uint64_t kMinFileBytes = kHeaderBytes + 8 + kTrailerBytes;  // two empty strings
constexpr size_t kIoBuffer = 1 << 20;

// The fixed 64-byte header; see docs/checkpoints.md.
struct Header {
  uint32_t version = kCheckpointFormatVersion;
  uint64_t file_bytes = 0;
  uint32_t group = 0, num_groups = 0;
  uint64_t clock = 0, epoch = 0;
  uint32_t num_chunks = 0, num_workers = 0;
};

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void EncodeHeader(const Header& h, uint8_t out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out, kMagic, 8);
  Put<uint32_t>(out + 8, h.version);
  Put<uint32_t>(out + 12, static_cast<uint32_t>(kHeaderBytes));
  Put<uint64_t>(out + 16, h.file_bytes);
  Put<uint32_t>(out + 24, h.group);
  Put<uint32_t>(out + 28, h.num_groups);
  Put<uint64_t>(out + 32, h.clock);
  Put<uint64_t>(out + 40, h.epoch);
  Put<uint32_t>(out + 48, h.num_chunks);
  Put<uint32_t>(out + 52, h.num_workers);
  Put<uint32_t>(out + 60, crc32c::Value(out, 60));
}

std::string Hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof(b), "0x%08x", v);
  return b;
}

}  // namespace

// "<what> <path>: <strerror> (errno N)", with ENOSPC/EDQUOT spelled out for operators.
Status IoError(const char* what, const std::string& path, int err) {
  std::string m = std::string(what) + " " + path + ": " + std::strerror(err) + " (errno " +
                  std::to_string(err) + ")";
  if (err == ENOSPC) return ResourceExhaustedError("disk full: " + m);
  if (err == EDQUOT) return ResourceExhaustedError("disk quota exceeded: " + m);
  return Status(ErrnoError("", err).code(), m);
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// Buffered sequential writer that checksums what it writes. Thread: one owner.
class Sink {
 public:
  Sink(int fd, const std::string& path) : fd_(fd), path_(path) { buf_.reserve(kIoBuffer); }

  Status Write(const void* data, size_t n) {
    crc_ = crc32c::Extend(crc_, data, n);
    return WriteRaw(data, n);
  }
  template <typename T>
  Status Pod(T v) {
    return Write(&v, sizeof(T));
  }
  Status String(const std::string& s) {
    RETURN_IF_ERROR(Pod<uint32_t>(static_cast<uint32_t>(s.size())));
    return Write(s.data(), s.size());
  }
  template <typename T>
  Status Array(const std::vector<T>& v) {
    return Write(v.data(), v.size() * sizeof(T));
  }
  Status Trailer() {
    uint32_t c = crc_;
    RETURN_IF_ERROR(WriteRaw(&c, sizeof(c)));
    return Flush();
  }
  uint32_t crc() const { return crc_; }
  uint64_t bytes() const { return bytes_; }

 private:
  Status WriteRaw(const void* data, size_t n) {
    bytes_ += n;
    if (buf_.size() + n > kIoBuffer) {
      RETURN_IF_ERROR(Flush());
      if (n >= kIoBuffer) return WriteFd(data, n);  // large arrays bypass the buffer
    }
    const auto* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n);
    return Status::OK();
  }
  Status Flush() {
    Status s = WriteFd(buf_.data(), buf_.size());
    buf_.clear();
    return s;
  }
  Status WriteFd(const void* data, size_t n) {
    int err = 0;
    if (!fdio::WriteAll(fd_, data, n, &err).ok()) return IoError("write", path_, err);
    return Status::OK();
  }

  int fd_;
  const std::string& path_;
  std::vector<uint8_t> buf_;
  uint32_t crc_ = 0;
  uint64_t bytes_ = 0;
};

uint64_t EncodedBytes(const ShardSnapshot& s) {
  uint64_t n = kHeaderBytes + 4 + s.plan_fingerprint.size() + 4 + s.optimizer.size();
  for (const auto& c : s.chunks) {
    n += kChunkFixedBytes + 4 * (c.weights.size() + c.state1.size() + c.state2.size());
    if (!c.row_keys.empty()) n += 8 + 16 * c.row_keys.size();  // a hashed row shard's slots
    if (c.base_clock != 0) n += 16 + 8 * c.row_index.size();
  }
  for (const auto& w : s.workers) {
    n += kWorkerFixedBytes + 8 * (w.last_seq.size() + w.applied_clock.size());
  }
  return n + kTrailerBytes;
}

Status EncodeTo(Sink& out, const ShardSnapshot& s) {
  Header h;
  h.file_bytes = EncodedBytes(s);
  h.group = s.group;
  h.num_groups = s.num_groups;
  h.clock = s.clock;
  h.epoch = s.epoch;
  h.num_chunks = static_cast<uint32_t>(s.chunks.size());
  h.num_workers = static_cast<uint32_t>(s.workers.size());
  uint8_t hb[kHeaderBytes];
  EncodeHeader(h, hb);
  RETURN_IF_ERROR(out.Write(hb, sizeof(hb)));
  RETURN_IF_ERROR(out.String(s.plan_fingerprint));
  RETURN_IF_ERROR(out.String(s.optimizer));
  for (const auto& c : s.chunks) {
    RETURN_IF_ERROR(out.Pod<uint32_t>(c.chunk_id));
    RETURN_IF_ERROR(out.Pod<uint32_t>((c.row_keys.empty() ? 0 : kChunkHasRowKeys) |
                                      (c.base_clock == 0 ? 0 : kChunkIsIncremental)));
    RETURN_IF_ERROR(out.Pod<uint64_t>(c.version));
    RETURN_IF_ERROR(out.Pod<uint64_t>(c.optimizer_steps));
    RETURN_IF_ERROR(out.Pod<uint64_t>(c.weights.size()));
    RETURN_IF_ERROR(out.Pod<uint64_t>(c.state1.size()));
    RETURN_IF_ERROR(out.Pod<uint64_t>(c.state2.size()));
    RETURN_IF_ERROR(out.Array(c.weights));
    RETURN_IF_ERROR(out.Array(c.state1));
    RETURN_IF_ERROR(out.Array(c.state2));
    if (c.base_clock != 0) {
      RETURN_IF_ERROR(out.Pod<uint64_t>(c.base_clock));
      RETURN_IF_ERROR(out.Pod<uint64_t>(c.row_index.size()));
      RETURN_IF_ERROR(out.Array(c.row_index));
    }
    if (!c.row_keys.empty()) {
      RETURN_IF_ERROR(out.Pod<uint64_t>(c.row_keys.size()));
      RETURN_IF_ERROR(out.Array(c.row_keys));
      RETURN_IF_ERROR(out.Array(c.row_versions));
    }
  }
  for (const auto& w : s.workers) {
    RETURN_IF_ERROR(out.Pod<uint32_t>(w.rank));
    RETURN_IF_ERROR(out.Pod<uint32_t>(0));
    RETURN_IF_ERROR(out.Pod<uint64_t>(w.clock));
    RETURN_IF_ERROR(out.Pod<uint64_t>(w.last_seq.size()));
    RETURN_IF_ERROR(out.Pod<uint64_t>(w.applied_clock.size()));
    RETURN_IF_ERROR(out.Array(w.last_seq));
    RETURN_IF_ERROR(out.Array(w.applied_clock));
  }
  RETURN_IF_ERROR(out.Trailer());
  if (out.bytes() != h.file_bytes) {
    return InternalError("encoded " + std::to_string(out.bytes()) + " bytes, expected " +
                         std::to_string(h.file_bytes));
  }
  return Status::OK();
}

}  // namespace

Status WriteTemp(const std::string& tmp, const ShardSnapshot& s, uint64_t* bytes) {
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return IoError("create", tmp, errno);
  Sink sink(fd.get(), tmp);
  RETURN_IF_ERROR(EncodeTo(sink, s));
  if (::fsync(fd.get()) != 0) return IoError("fsync", tmp, errno);
  if (::close(fd.release()) != 0) return IoError("close", tmp, errno);
  *bytes = sink.bytes();
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Reading
namespace {

// Sequential reader over [kHeaderBytes, body_end) that checksums what it reads.
// Thread: one owner.
class Source {
 public:
  Source(int fd, uint64_t body_end, uint32_t header_crc)
      : fd_(fd), end_(body_end), crc_(header_crc) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return end_ - pos_; }
  uint32_t crc() const { return crc_; }

  // Callers check n <= remaining() first, so a bad length never reaches an allocation.
  Status Read(void* dst, uint64_t n) {
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      if (off_ == len_) RETURN_IF_ERROR(Fill());
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, len_ - off_));
      std::memcpy(out, buf_.data() + off_, take);
      crc_ = crc32c::Extend(crc_, buf_.data() + off_, take);
      off_ += take;
      out += take;
      n -= take;
      pos_ += take;
    }
    return Status::OK();
  }
  Status Skip(uint64_t n) {
    while (n > 0) {
      if (off_ == len_) RETURN_IF_ERROR(Fill());
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, len_ - off_));
      crc_ = crc32c::Extend(crc_, buf_.data() + off_, take);
      off_ += take;
      n -= take;
      pos_ += take;
    }
    return Status::OK();
  }
  template <typename T>
  Status Pod(T* v) {
    if (remaining() < sizeof(T)) return Short(sizeof(T));
    return Read(v, sizeof(T));
  }
  Status String(std::string* s, const char* what) {
    uint32_t n = 0;
    RETURN_IF_ERROR(Pod(&n));
    if (n > remaining()) return Bad(what, n, 1);
    s->resize(n);
    return Read(s->data(), n);
  }
  // Reads count elements of T into *v (or skips them when v is null).
  template <typename T>
  Status Array(uint64_t count, std::vector<T>* v, const std::string& what) {
    if (count > remaining() / sizeof(T)) return Bad(what.c_str(), count, sizeof(T));
    if (v == nullptr) return Skip(count * sizeof(T));
    v->resize(static_cast<size_t>(count));
    return Read(v->data(), count * sizeof(T));
  }
  Status Short(uint64_t need) const {
    return DataLossError("record at byte " + std::to_string(pos_) + " needs " +
                         std::to_string(need) + " bytes, " + std::to_string(remaining()) +
                         " left before the checksum");
  }
  Status Bad(const char* what, uint64_t count, uint64_t size) const {
    return DataLossError(std::string(what) + " length " + std::to_string(count) + " (x" +
                         std::to_string(size) + " bytes) at byte " + std::to_string(pos_) +
                         " exceeds the " + std::to_string(remaining()) +
                         " bytes left before the checksum");
  }

 private:
  Status Fill() {
    size_t want = static_cast<size_t>(std::min<uint64_t>(kIoBuffer, end_ - pos_));
    if (buf_.size() < want) buf_.resize(want);  // small files get a small buffer
    for (;;) {
      ssize_t r = ::pread(fd_, buf_.data(), want, static_cast<off_t>(pos_));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return ErrnoError("read", errno);
      if (r == 0) {
        return DataLossError("truncated at byte " + std::to_string(pos_) + " of " +
                             std::to_string(end_ + kTrailerBytes) + " (file shrank while read)");
      }
      len_ = static_cast<size_t>(r);
      off_ = 0;
      return Status::OK();
    }
  }

  int fd_;
  uint64_t end_;
  uint64_t pos_ = kHeaderBytes;
  uint32_t crc_;
  std::vector<uint8_t> buf_;
  size_t off_ = 0, len_ = 0;
};

Status ParseBody(Source& in, const Header& h, ShardSnapshot* out, SnapshotSummary* sum) {
  RETURN_IF_ERROR(in.String(&sum->plan_fingerprint, "plan fingerprint"));
  RETURN_IF_ERROR(in.String(&sum->optimizer, "optimizer"));
  if (h.num_chunks > in.remaining() / kChunkFixedBytes) {
    return in.Bad("chunk count", h.num_chunks, kChunkFixedBytes);
  }
  if (out) out->chunks.reserve(h.num_chunks);
  for (uint32_t i = 0; i < h.num_chunks; ++i) {
    ChunkState c;
    uint32_t reserved = 0;
    uint64_t nw = 0, n1 = 0, n2 = 0;
    RETURN_IF_ERROR(in.Pod(&c.chunk_id));
    RETURN_IF_ERROR(in.Pod(&reserved));
    RETURN_IF_ERROR(in.Pod(&c.version));
    RETURN_IF_ERROR(in.Pod(&c.optimizer_steps));
    RETURN_IF_ERROR(in.Pod(&nw));
    RETURN_IF_ERROR(in.Pod(&n1));
    RETURN_IF_ERROR(in.Pod(&n2));
    const std::string tag = "chunk " + std::to_string(i) + " ";
    RETURN_IF_ERROR(in.Array(nw, out ? &c.weights : nullptr, tag + "weights"));
    RETURN_IF_ERROR(in.Array(n1, out ? &c.state1 : nullptr, tag + "state1"));
    RETURN_IF_ERROR(in.Array(n2, out ? &c.state2 : nullptr, tag + "state2"));
    if ((reserved & ~(kChunkHasRowKeys | kChunkIsIncremental)) != 0 ||
        (reserved != 0 && h.version < 2)) {
      return DataLossError(tag + "flags " + std::to_string(reserved) + " unknown to format " +
                           std::to_string(h.version));
    }
    if ((reserved & kChunkIsIncremental) != 0) {
      uint64_t base = 0, ni = 0;
      RETURN_IF_ERROR(in.Pod(&base));
      RETURN_IF_ERROR(in.Pod(&ni));
      if (base == 0 || base >= h.clock) {
        return DataLossError(tag + "base clock " + std::to_string(base) + " is not before " +
                             std::to_string(h.clock));
      }
      RETURN_IF_ERROR(in.Array(ni, out ? &c.row_index : nullptr, tag + "row index"));
      c.base_clock = base;
      if (std::find(sum->base_clocks.begin(), sum->base_clocks.end(), base) ==
          sum->base_clocks.end()) {
        sum->base_clocks.push_back(base);
      }
    }
    if ((reserved & kChunkHasRowKeys) != 0) {
      uint64_t nk = 0;
      RETURN_IF_ERROR(in.Pod(&nk));
      if (nk > in.remaining() / 16) return in.Bad("row keys", nk, 16);
      RETURN_IF_ERROR(in.Array(nk, out ? &c.row_keys : nullptr, tag + "row keys"));
      RETURN_IF_ERROR(in.Array(nk, out ? &c.row_versions : nullptr, tag + "row versions"));
    }
    sum->num_floats += nw + n1 + n2;
    if (out) out->chunks.push_back(std::move(c));
  }
  if (h.num_workers > in.remaining() / kWorkerFixedBytes) {
    return in.Bad("worker count", h.num_workers, kWorkerFixedBytes);
  }
  if (out) out->workers.reserve(h.num_workers);
  for (uint32_t i = 0; i < h.num_workers; ++i) {
    WorkerProgress w;
    uint32_t reserved = 0;
    uint64_t ns = 0, na = 0;
    RETURN_IF_ERROR(in.Pod(&w.rank));
    RETURN_IF_ERROR(in.Pod(&reserved));
    RETURN_IF_ERROR(in.Pod(&w.clock));
    RETURN_IF_ERROR(in.Pod(&ns));
    RETURN_IF_ERROR(in.Pod(&na));
    const std::string tag = "worker " + std::to_string(i) + " ";
    RETURN_IF_ERROR(in.Array(ns, out ? &w.last_seq : nullptr, tag + "last_seq"));
    RETURN_IF_ERROR(in.Array(na, out ? &w.applied_clock : nullptr, tag + "applied_clock"));
    if (out) out->workers.push_back(std::move(w));
  }
  if (in.remaining() != 0) {
    return DataLossError(std::to_string(in.remaining()) + " unparsed bytes at byte " +
                         std::to_string(in.pos()) + " before the checksum");
  }
  return Status::OK();
}

}  // namespace

// Reads and verifies `path`; fills *out when non-null. Messages do not name the path (the
// public wrappers add it; the directory scan reports by group).
Status ReadFile(const std::string& path, ShardSnapshot* out, SnapshotSummary* sum) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError("open", errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError("fstat", errno);
  if (!S_ISREG(st.st_mode)) return FailedPreconditionError("not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);

  uint8_t hb[kHeaderBytes] = {};
  size_t got = 0;
  while (got < kHeaderBytes) {
    ssize_t r = ::pread(fd.get(), hb + got, kHeaderBytes - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoError("read", errno);
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  if (got >= 8 && std::memcmp(hb, kMagic, 8) != 0) {
    return DataLossError("bad magic (not a ShardPS checkpoint file)");
  }
  if (got < kHeaderBytes) {
    return DataLossError("truncated at byte " + std::to_string(got) + " of at least " +
                         std::to_string(kHeaderBytes) + " (inside the header)");
  }
  const uint32_t stored_hcrc = Get<uint32_t>(hb + 60), hcrc = crc32c::Value(hb, 60);
  if (stored_hcrc != hcrc) {
    return DataLossError("header checksum mismatch (stored " + Hex32(stored_hcrc) + ", computed " +
                         Hex32(hcrc) + ")");
  }
  Header h;
  h.version = Get<uint32_t>(hb + 8);
  const uint32_t header_bytes = Get<uint32_t>(hb + 12);
  h.file_bytes = Get<uint64_t>(hb + 16);
  h.group = Get<uint32_t>(hb + 24);
  h.num_groups = Get<uint32_t>(hb + 28);
  h.clock = Get<uint64_t>(hb + 32);
  h.epoch = Get<uint64_t>(hb + 40);
  h.num_chunks = Get<uint32_t>(hb + 48);
  h.num_workers = Get<uint32_t>(hb + 52);
  if (h.version != kCheckpointFormatVersion && h.version != 1) {
    return DataLossError("unsupported format version " + std::to_string(h.version) +
                         " (this build reads 1 and " + std::to_string(kCheckpointFormatVersion) + ")");
  }
  if (header_bytes != kHeaderBytes || h.file_bytes < kMinFileBytes || h.num_groups == 0 ||
      h.group >= h.num_groups) {
    return DataLossError("inconsistent header (header_bytes " + std::to_string(header_bytes) +
                         ", file_bytes " + std::to_string(h.file_bytes) + ", group " +
                         std::to_string(h.group) + " of " + std::to_string(h.num_groups) + ")");
  }
  if (size < h.file_bytes) {
    return DataLossError("truncated at byte " + std::to_string(size) + " of " +
                         std::to_string(h.file_bytes));
  }
  if (size > h.file_bytes) {
    return DataLossError(std::to_string(size - h.file_bytes) + " trailing bytes after the end (" +
                         std::to_string(h.file_bytes) + " bytes) the header records");
  }

  Source in(fd.get(), h.file_bytes - kTrailerBytes, crc32c::Value(hb, kHeaderBytes));
  *sum = SnapshotSummary();
  Status parsed = ParseBody(in, h, out, sum);
  // Whatever the parse found, checksum the rest: a corrupt file is reported as such, and a
  // structural error only when the checksum holds (a writer bug or a crafted file).
  RETURN_IF_ERROR(in.Skip(in.remaining()));
  uint32_t stored = 0;
  for (;;) {
    ssize_t r = ::pread(fd.get(), &stored, 4, static_cast<off_t>(h.file_bytes - 4));
    if (r < 0 && errno == EINTR) continue;
    if (r != 4) return DataLossError("cannot read the checksum at the end of the file");
    break;
  }
  if (stored != in.crc()) {
    return DataLossError("checksum mismatch (stored " + Hex32(stored) + ", computed " +
                         Hex32(in.crc()) + " over " + std::to_string(h.file_bytes - 4) + " bytes)");
  }
  RETURN_IF_ERROR(parsed);
  sum->group = h.group;
  sum->num_groups = h.num_groups;
  sum->clock = h.clock;
  sum->epoch = h.epoch;
  sum->file_bytes = h.file_bytes;
  sum->num_chunks = h.num_chunks;
  sum->num_workers = h.num_workers;
  if (out) {
    out->plan_fingerprint = sum->plan_fingerprint;
    out->optimizer = sum->optimizer;
    out->group = h.group;
    out->num_groups = h.num_groups;
    out->clock = h.clock;
    out->epoch = h.epoch;
  }
  return Status::OK();
}

}  // namespace checkpoint_internal
}  // namespace shardps::server
