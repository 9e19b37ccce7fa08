// The fd seam: UniqueFd, the one RAII owner of a file descriptor in ShardPS (its accessors
// follow std::unique_ptr: get, release, reset), and the blocking read/write-all loops for
// files, pipes and blocking sockets. Sockets with a deadline use common/net.h instead.
// Thread safety: UniqueFd is a value type with one owner; the functions share no state.
#ifndef SHARDPS_COMMON_FD_H_
#define SHARDPS_COMMON_FD_H_

#include <sys/uio.h>

#include <cstddef>
#include <utility>

#include "common/status.h"

namespace shardps {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  // Closes the fd held (a failing close(2) is logged, never thrown), then holds fd.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

namespace fdio {

// Writes all n bytes with write(2), retrying EINTR and partial writes; a write that returns 0
// counts as ENOSPC. On failure, *err (when given) receives the errno.
Status WriteAll(int fd, const void* data, size_t n, int* err = nullptr);
// Reads exactly n bytes with read(2), retrying EINTR and short reads; EOF before n bytes is
// UNAVAILABLE("peer closed").
Status ReadFull(int fd, void* data, size_t n);
// Moves every byte of iov[0..n) with writev(2) / readv(2) across partial transfers (the array
// is consumed). readv hitting EOF is UNAVAILABLE. `what` prefixes the errors.
Status WritevAll(int fd, iovec* iov, int n, const char* what = "writev");
Status ReadvFull(int fd, iovec* iov, int n, const char* what = "readv");

}  // namespace fdio
}  // namespace shardps

#endif  // SHARDPS_COMMON_FD_H_
