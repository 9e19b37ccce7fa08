// TCP bootstrap and the queue-pair attribute message (see verbs_handshake.h).
#include "transport/verbs/verbs_handshake.h"

#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <glog/logging.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace shardps::transport::verbs {
namespace {

void PutLe(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

Status SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  if (!address.empty() && address[0] == '[') {
    auto close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return InvalidArgumentError("verbs: bad address '" + address + "' (want [v6]:port)");
    }
    *host = address.substr(1, close - 1);
    *port = address.substr(close + 2);
  } else {
    auto colon = address.rfind(':');
    if (colon == std::string::npos) {
      return InvalidArgumentError("verbs: bad address '" + address + "' (want host:port)");
    }
    *host = address.substr(0, colon);
    *port = address.substr(colon + 1);
  }
  if (port->empty()) return InvalidArgumentError("verbs: address '" + address + "' has no port");
  return Status::OK();
}

StatusOr<sockaddr_storage> Resolve(const std::string& host, const std::string& port, bool passive,
                                   socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgumentError("verbs: cannot resolve '" + host + ":" + port +
                                "': " + gai_strerror(rc));
  }
  sockaddr_storage ss{};
  // Prefer IPv4 for an unspecified passive address (RoCE GIDs here are IPv4-mapped).
  addrinfo* pick = res;
  for (addrinfo* a = res; a; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  }
  std::memcpy(&ss, pick->ai_addr, pick->ai_addrlen);
  *len = pick->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

// The bootstrap socket is idle after the handshake; keepalive probes make a peer host that
// vanished without a FIN (power loss, cable pull) an error on the socket within about
// kKeepIdle + kKeepCount * kKeepInterval = 15 s, which ProbePeer then reports. This bounds
// peer-death detection even where the QP retry budget does not (rxe with retry_cnt 7). It is
// deliberately not tighter: with 1 s / 3 x 1 s, a 64 MiB RDMA READ on rxe under emulation
// starved the (loopback) probes long enough to declare a live peer dead.
constexpr int kKeepIdleS = 5;
constexpr int kKeepIntervalS = 2;
constexpr int kKeepCount = 5;

void TuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepIdleS, sizeof(kKeepIdleS));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepIntervalS, sizeof(kKeepIntervalS));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &kKeepCount, sizeof(kKeepCount));
}

}  // namespace

void EncodeQpInfo(const QpInfo& info, uint8_t out[kQpInfoWireSize]) {
  std::memset(out, 0, kQpInfoWireSize);
  PutLe(out + 0, kHandshakeMagic, 4);
  PutLe(out + 4, kHandshakeVersion, 2);
  out[6] = info.link_layer;
  out[7] = info.mtu;
  PutLe(out + 8, info.qpn, 4);
  PutLe(out + 12, info.psn, 4);
  PutLe(out + 16, info.lid, 2);
  out[18] = info.responder_resources;
  out[19] = 0;
  PutLe(out + 20, info.recv_depth, 4);
  std::memcpy(out + 24, info.gid, 16);
}

StatusOr<QpInfo> DecodeQpInfo(const uint8_t* in, size_t len) {
  auto bad = [](const std::string& why) {
    return InvalidArgumentError("verbs handshake: malformed peer message: " + why);
  };
  if (len != kQpInfoWireSize) return bad("length " + std::to_string(len));
  if (GetLe(in, 4) != kHandshakeMagic) return bad("bad magic (not a ShardPS verbs peer?)");
  if (GetLe(in + 4, 2) != kHandshakeVersion) {
    return bad("unsupported version " + std::to_string(GetLe(in + 4, 2)));
  }
  QpInfo q;
  q.link_layer = in[6];
  q.mtu = in[7];
  q.qpn = static_cast<uint32_t>(GetLe(in + 8, 4));
  q.psn = static_cast<uint32_t>(GetLe(in + 12, 4));
  q.lid = static_cast<uint16_t>(GetLe(in + 16, 2));
  q.responder_resources = in[18];
  q.recv_depth = static_cast<uint32_t>(GetLe(in + 20, 4));
  std::memcpy(q.gid, in + 24, 16);
  if (q.link_layer != 1 && q.link_layer != 2) {
    return bad("link layer " + std::to_string(q.link_layer));
  }
  if (q.mtu < 1 || q.mtu > 5) return bad("mtu enum " + std::to_string(q.mtu));
  if (q.qpn == 0 || q.qpn >= (1u << 24)) return bad("qpn " + std::to_string(q.qpn));
  if (q.psn >= (1u << 24)) return bad("psn " + std::to_string(q.psn));
  if (q.responder_resources == 0) return bad("responder_resources 0");
  if (in[19] != 0) return bad("reserved byte set");
  if (q.link_layer == 1 && q.lid == 0) return bad("InfiniBand peer without a LID");
  if (q.link_layer == 2) {
    bool zero = true;
    for (uint8_t b : q.gid) zero = zero && b == 0;
    if (zero) return bad("RoCE peer with an all-zero GID");
  }
  return q;
}

StatusOr<UniqueFd> TcpListen(const std::string& address, const std::string& default_host,
                             std::string* resolved_ip, int* resolved_port) {
  std::string host, port;
  RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  if (host.empty()) host = default_host;
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss, Resolve(host, port, /*passive=*/true, &len));
  UniqueFd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return ErrnoError("verbs bootstrap: socket", errno);
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    return ErrnoError("verbs bootstrap: bind " + address, errno);
  }
  if (listen(fd.get(), 128) != 0) return ErrnoError("verbs bootstrap: listen", errno);
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  char ip[INET6_ADDRSTRLEN] = {};
  if (bound.ss_family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(&bound);
    inet_ntop(AF_INET, &s->sin_addr, ip, sizeof(ip));
    *resolved_port = ntohs(s->sin_port);
  } else {
    auto* s = reinterpret_cast<sockaddr_in6*>(&bound);
    inet_ntop(AF_INET6, &s->sin6_addr, ip, sizeof(ip));
    *resolved_port = ntohs(s->sin6_port);
  }
  *resolved_ip = ip;
  RETURN_IF_ERROR(net::SetNonBlocking(fd.get(), true));
  return fd;
}

StatusOr<UniqueFd> TcpAcceptNow(int listen_fd, std::string* peer, std::string* peer_ip) {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len,
                     SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return UniqueFd();
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        return ResourceExhaustedError(std::string("verbs bootstrap: accept: ") + strerror(errno));
      }
      return ErrnoError("verbs bootstrap: accept", errno);
    }
    UniqueFd owned(fd);
    TuneSocket(fd);
    *peer = net::SockaddrToString(ss);
    // The source for the gate's per-source limit: an IPv4 address (all of 127/8 as one, and
    // IPv4-mapped IPv6 as IPv4), or an IPv6 /64.
    char ip[INET6_ADDRSTRLEN] = "?";
    in_addr v4{};
    bool is_v4 = false;
    if (ss.ss_family == AF_INET) {
      v4 = reinterpret_cast<sockaddr_in*>(&ss)->sin_addr;
      is_v4 = true;
    } else if (ss.ss_family == AF_INET6) {
      in6_addr a = reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr;
      if (IN6_IS_ADDR_V4MAPPED(&a)) {
        std::memcpy(&v4, a.s6_addr + 12, 4);
        is_v4 = true;
      } else {
        std::memset(a.s6_addr + 8, 0, 8);
        inet_ntop(AF_INET6, &a, ip, sizeof(ip));
        *peer_ip = std::string(ip) + "/64";
      }
    }
    if (is_v4) {
      inet_ntop(AF_INET, &v4, ip, sizeof(ip));
      *peer_ip = (ntohl(v4.s_addr) >> 24) == 127 ? std::string("127.0.0.0/8") : std::string(ip);
    }
    return owned;
  }
}

StatusOr<UniqueFd> TcpConnect(const std::string& address, const std::string& bind_ip,
                              Deadline deadline, std::string* local, bool retry_refused) {
  std::string host, port;
  RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  socklen_t len = 0;
  ASSIGN_OR_RETURN(sockaddr_storage ss, Resolve(host, port, /*passive=*/false, &len));
  for (;;) {
    UniqueFd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) return ErrnoError("verbs bootstrap: socket", errno);
    if (!bind_ip.empty()) {
      socklen_t blen = 0;
      ASSIGN_OR_RETURN(sockaddr_storage src, Resolve(bind_ip, "0", /*passive=*/false, &blen));
      if (bind(fd.get(), reinterpret_cast<sockaddr*>(&src), blen) != 0) {
        return ErrnoError("verbs bootstrap: bind source " + bind_ip, errno);
      }
    }
    int rc = connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len);
    if (rc != 0 && errno != EINPROGRESS) {
      return ErrnoError("verbs bootstrap: connect " + address, errno);
    }
    if (rc != 0) {
      RETURN_IF_ERROR(
          net::WaitFd(fd.get(), POLLOUT, deadline, "verbs bootstrap: connecting to " + address));
      int err = 0;
      socklen_t elen = sizeof(err);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &elen);
      if (err == ECONNREFUSED && retry_refused && std::chrono::steady_clock::now() < deadline) {
        // The listener may not be up yet: retry until the connect timeout, like NCCL does.
        usleep(10000);
        continue;
      }
      if (err != 0) return ErrnoError("verbs bootstrap: connect " + address, err);
    }
    TuneSocket(fd.get());
    sockaddr_storage me{};
    socklen_t mlen = sizeof(me);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&me), &mlen);
    *local = net::SockaddrToString(me);
    return fd;
  }
}

Status ProbePeer(int fd) {
  uint8_t buf[64];
  for (;;) {
    // Nothing is sent after `ready`: stray bytes are discarded (so the socket does not stay
    // readable and keep Wait spinning); only EOF or an error is a death notice.
    ASSIGN_OR_RETURN(size_t n, net::RecvSome(fd, buf, sizeof(buf),
                                             "bootstrap connection to the peer (process exited?)"));
    if (n == 0) return Status::OK();
  }
}

}  // namespace shardps::transport::verbs
