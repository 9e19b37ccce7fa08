// UniqueFd: owns a file descriptor, closes it once. The one RAII wrapper for fds in ShardPS;
// its accessors follow std::unique_ptr (get, release, reset).
// Thread safety: a value type; one owner.
#ifndef SHARDPS_COMMON_FD_H_
#define SHARDPS_COMMON_FD_H_

#include <unistd.h>

#include <utility>

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
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_FD_H_
