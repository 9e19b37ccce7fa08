// The socket seam: blocking TCP helpers for setup paths (control plane, the tcp and verbs
// providers' handshakes, tools, benchmarks, tests). Data paths do not use these. Files, pipes
// and fd ownership: common/fd.h. Thread safety: free functions, no shared state.
#ifndef SHARDPS_COMMON_NET_H_
#define SHARDPS_COMMON_NET_H_

#include <chrono>
#include <cstdint>
#include <string>

#include <sys/socket.h>

#include "common/fd.h"
#include "common/status.h"

namespace shardps::net {

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// "host:port", "[v6]:port". The port must be 0..65535.
StatusOr<HostPort> ParseHostPort(const std::string& s);

// Listens on host:port (port 0 = pick one); returns the socket and the bound "ip:port".
StatusOr<UniqueFd> ListenTcp(const std::string& address, std::string* bound, int backlog = 128);
// Binds host:port without listening: the port is reserved (no other socket, an outgoing
// connection's ephemeral port included, can take it) and nothing connects to it yet.
StatusOr<UniqueFd> BindTcp(const std::string& address, std::string* bound);
// Listens on a socket from BindTcp; returns its "ip:port".
StatusOr<std::string> ListenOnBound(int fd, int backlog = 128);
// Connects within timeout, optionally binding the source IP first. TCP_NODELAY is set.
StatusOr<UniqueFd> ConnectTcp(const std::string& address, const std::string& bind_ip,
                              std::chrono::milliseconds timeout);
// Accepts one connection within timeout (DEADLINE_EXCEEDED otherwise).
StatusOr<UniqueFd> AcceptTcp(int listen_fd, std::chrono::milliseconds timeout);

using Deadline = std::chrono::steady_clock::time_point;

// Sends/receives exactly n bytes before the deadline, on a blocking or non-blocking socket:
// MSG_NOSIGNAL (a dead peer is an error, not SIGPIPE), EINTR and partial transfers retried,
// poll(2) while the socket is full/empty. Errors: DEADLINE_EXCEEDED("<what>: timed out"),
// UNAVAILABLE("<what>: peer closed the connection") on EOF, errno errors as "<what>: ...".
Status SendAll(int fd, const void* data, size_t n, Deadline deadline, const char* what = "send");
Status RecvAll(int fd, void* data, size_t n, Deadline deadline, const char* what = "recv");
// The same with a timeout from now.
Status SendAll(int fd, const void* data, size_t n, std::chrono::milliseconds timeout);
Status RecvAll(int fd, void* data, size_t n, std::chrono::milliseconds timeout);

// One non-blocking receive of at most cap bytes (EINTR retried): how many arrived, 0 when
// nothing is there now; UNAVAILABLE("<what>: peer closed the connection") at EOF; errno errors
// as "<what>: ...". For event loops and liveness probes that read what is there.
StatusOr<size_t> RecvSome(int fd, void* buf, size_t cap, const char* what = "recv");

// Waits until fd is ready for `events` (poll(2), EINTR retried) or the deadline passes:
// DEADLINE_EXCEEDED("<what>: timed out").
Status WaitFd(int fd, short events, Deadline deadline, const std::string& what);

// "ip:port" or "[v6]:port" of an IPv4 / IPv6 socket address.
std::string SockaddrToString(const struct sockaddr_storage& ss);

Status SetNonBlocking(int fd, bool on);

// Whether a connected TCP socket has sent data its peer's kernel has not acknowledged yet
// (TCP_INFO tcpi_unacked): a liveness signal below the peer process (a stopped or descheduled
// process's kernel still acknowledges; a dead or cut-off host does not). False if unknown.
bool HasUnacknowledgedData(int fd);

}  // namespace shardps::net

#endif  // SHARDPS_COMMON_NET_H_
