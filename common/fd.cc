#include "common/fd.h"

#include <unistd.h>

#include <cerrno>
#include <string>

#include <glog/logging.h>

namespace shardps {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0 && ::close(fd_) != 0) PLOG(WARNING) << "close(" << fd_ << ")";
  fd_ = fd;
}

namespace fdio {
namespace {

Status TransferV(int fd, iovec* iov, int n, bool send, const char* what) {
  while (n > 0) {
    const ssize_t r = send ? ::writev(fd, iov, n) : ::readv(fd, iov, n);
    if (r == 0 && !send) return UnavailableError(std::string(what) + ": peer closed");
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(what, errno);
    }
    size_t left = static_cast<size_t>(r);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Status::OK();
}

}  // namespace

Status WriteAll(int fd, const void* data, size_t n, int* err) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = w < 0 ? errno : ENOSPC;
      if (err != nullptr) *err = e;
      return ErrnoError("write", e);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

Status ReadFull(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoError("read", errno);
    if (r == 0) return UnavailableError("read: peer closed");
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

Status WritevAll(int fd, iovec* iov, int n, const char* what) {
  return TransferV(fd, iov, n, true, what);
}

Status ReadvFull(int fd, iovec* iov, int n, const char* what) {
  return TransferV(fd, iov, n, false, what);
}

}  // namespace fdio
}  // namespace shardps
