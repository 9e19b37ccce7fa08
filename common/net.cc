#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace shardps::net {
namespace {

using Clock = std::chrono::steady_clock;

int MsLeft(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left, 1 << 30)));
}

StatusOr<sockaddr_storage> Resolve(const HostPort& hp, socklen_t* len, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  const int rc =
      getaddrinfo(hp.host.empty() ? nullptr : hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return UnavailableError("cannot resolve '" + hp.host + "': " + gai_strerror(rc));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

}  // namespace

StatusOr<HostPort> ParseHostPort(const std::string& s) {
  HostPort hp;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return InvalidArgumentError("bad address '" + s + "' (want [v6]:port)");
    }
    hp.host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos)
      return InvalidArgumentError("bad address '" + s + "' (want host:port)");
    hp.host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return InvalidArgumentError("bad port in '" + s + "'");
  }
  const unsigned long p = std::stoul(port);
  if (p > 65535) return InvalidArgumentError("port out of range in '" + s + "'");
  hp.port = static_cast<uint16_t>(p);
  return hp;
}

std::string SockaddrToString(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
  port = ntohs(a->sin6_port);
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

Status WaitFd(int fd, short events, Deadline deadline, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, MsLeft(deadline));
    if (rc > 0) return Status::OK();
    if (rc == 0) return DeadlineExceededError(what + ": timed out");
    if (errno != EINTR) return ErrnoError(what + ": poll", errno);
  }
}

Status SetNonBlocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return ErrnoError("fcntl(F_GETFL)", errno);
  if (fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK)) < 0) {
    return ErrnoError("fcntl(F_SETFL)", errno);
  }
  return Status::OK();
}

namespace {
StatusOr<std::string> BoundAddress(int fd) {
  sockaddr_storage actual{};
  socklen_t alen = sizeof(actual);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&actual), &alen) != 0) {
    return ErrnoError("getsockname", errno);
  }
  return SockaddrToString(actual);
}
}  // namespace

StatusOr<UniqueFd> BindTcp(const std::string& address, std::string* bound) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss, Resolve(hp, &len, true));
  UniqueFd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    return ErrnoError("bind " + address, errno);
  }
  if (bound != nullptr) {
    ASSIGN_OR_RETURN(*bound, BoundAddress(fd.get()));
  }
  return fd;
}

StatusOr<std::string> ListenOnBound(int fd, int backlog) {
  if (listen(fd, backlog) != 0) return ErrnoError("listen", errno);
  return BoundAddress(fd);
}

StatusOr<UniqueFd> ListenTcp(const std::string& address, std::string* bound, int backlog) {
  ASSIGN_OR_RETURN(UniqueFd fd, BindTcp(address, nullptr));
  ASSIGN_OR_RETURN(std::string actual, ListenOnBound(fd.get(), backlog));
  if (bound != nullptr) *bound = actual;
  return fd;
}

StatusOr<UniqueFd> ConnectTcp(const std::string& address, const std::string& bind_ip,
                              std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss, Resolve(hp, &len, false));
  UniqueFd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  if (!bind_ip.empty()) {
    socklen_t blen = 0;
    ASSIGN_OR_RETURN(sockaddr_storage bs, Resolve(HostPort{bind_ip, 0}, &blen, false));
    if (bind(fd.get(), reinterpret_cast<sockaddr*>(&bs), blen) != 0) {
      return ErrnoError("bind source " + bind_ip, errno);
    }
  }
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    if (errno != EINPROGRESS) return ErrnoError("connect " + address, errno);
    pollfd p{fd.get(), POLLOUT, 0};
    const int n = poll(&p, 1, MsLeft(deadline));
    if (n == 0) return DeadlineExceededError("connect " + address + ": timed out");
    if (n < 0) return ErrnoError("poll", errno);
    int err = 0;
    socklen_t elen = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err != 0) return ErrnoError("connect " + address, err);
  }
  RETURN_IF_ERROR(SetNonBlocking(fd.get(), false));
  const int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

StatusOr<UniqueFd> AcceptTcp(int listen_fd, std::chrono::milliseconds timeout) {
  pollfd p{listen_fd, POLLIN, 0};
  const int n = poll(&p, 1, static_cast<int>(timeout.count()));
  if (n == 0) return DeadlineExceededError("accept: nobody connected in time");
  if (n < 0) return ErrnoError("poll", errno);
  UniqueFd fd(accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) return ErrnoError("accept", errno);
  const int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Status SendAll(int fd, const void* data, size_t n, Deadline deadline, const char* what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoError(what, errno);
    pollfd pf{fd, POLLOUT, 0};
    const int r = poll(&pf, 1, MsLeft(deadline));
    if (r == 0) return DeadlineExceededError(std::string(what) + ": timed out");
    if (r < 0 && errno != EINTR) return ErrnoError(std::string(what) + ": poll", errno);
  }
  return Status::OK();
}

Status RecvAll(int fd, void* data, size_t n, Deadline deadline, const char* what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) return UnavailableError(std::string(what) + ": peer closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoError(what, errno);
    pollfd pf{fd, POLLIN, 0};
    const int r = poll(&pf, 1, MsLeft(deadline));
    if (r == 0) return DeadlineExceededError(std::string(what) + ": timed out");
    if (r < 0 && errno != EINTR) return ErrnoError(std::string(what) + ": poll", errno);
  }
  return Status::OK();
}

StatusOr<size_t> RecvSome(int fd, void* buf, size_t cap, const char* what) {
  for (;;) {
    const ssize_t k = recv(fd, buf, cap, MSG_DONTWAIT);
    if (k > 0) return static_cast<size_t>(k);
    if (k == 0) return UnavailableError(std::string(what) + ": peer closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
    return ErrnoError(what, errno);
  }
}

Status SendAll(int fd, const void* data, size_t n, std::chrono::milliseconds timeout) {
  return SendAll(fd, data, n, Clock::now() + timeout);
}

Status RecvAll(int fd, void* data, size_t n, std::chrono::milliseconds timeout) {
  return RecvAll(fd, data, n, Clock::now() + timeout);
}

bool HasUnacknowledgedData(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  return info.tcpi_unacked > 0;
}

}  // namespace shardps::net
