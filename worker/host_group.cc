#include "worker/host_group.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace shardps::worker::host {

GroupLayout GroupLayout::Make(uint32_t local_workers, const std::vector<uint64_t>& tensor_bytes) {
  GroupLayout g;
  g.local_workers = local_workers;
  g.tensors = static_cast<uint32_t>(tensor_bytes.size());
  g.tensor_bytes = tensor_bytes;
  uint64_t off = 0;
  for (uint64_t b : tensor_bytes) {
    g.tensor_offset.push_back(off);
    off += PageUp(b);
  }
  g.slots_offset = PageUp(sizeof(GroupHeader));
  g.slot_stride = (sizeof(LocalSlot) + g.tensors * sizeof(TensorControl) + 63) & ~uint64_t{63};
  g.grads_offset = PageUp(g.slots_offset + local_workers * g.slot_stride);
  g.grads_stride = PageUp(off);
  g.weights_offset = g.grads_offset + local_workers * g.grads_stride;
  g.region_bytes = g.weights_offset + PageUp(off);
  return g;
}

control::LocalWelcome GroupLayout::ToWelcome(uint64_t generation) const {
  control::LocalWelcome w;
  w.set_generation(generation);
  w.set_local_workers(local_workers);
  w.set_region_bytes(region_bytes);
  w.set_slots_offset(slots_offset);
  w.set_slot_stride(slot_stride);
  w.set_grads_offset(grads_offset);
  w.set_grads_stride(grads_stride);
  w.set_weights_offset(weights_offset);
  for (uint32_t t = 0; t < tensors; ++t) {
    auto* a = w.add_tensors();
    a->set_offset(tensor_offset[t]);
    a->set_bytes(tensor_bytes[t]);
  }
  return w;
}

StatusOr<GroupLayout> GroupLayout::FromWelcome(const control::LocalWelcome& w, uint32_t tensors) {
  auto bad = [](const std::string& why) {
    return InvalidArgumentError("host aggregator sent a bad layout: " + why);
  };
  if (static_cast<uint32_t>(w.tensors_size()) != tensors) return bad("tensor count differs");
  if (w.local_workers() == 0 || w.local_workers() > 4096) return bad("local_workers");
  GroupLayout g;
  g.local_workers = w.local_workers();
  g.tensors = tensors;
  g.region_bytes = w.region_bytes();
  g.slots_offset = w.slots_offset();
  g.slot_stride = w.slot_stride();
  g.grads_offset = w.grads_offset();
  g.grads_stride = w.grads_stride();
  g.weights_offset = w.weights_offset();
  uint64_t end = 0;
  for (const auto& a : w.tensors()) {
    if (a.offset() < end || a.bytes() > (uint64_t{1} << 40) || a.offset() % 64 != 0) {
      return bad("tensor areas overlap or are misaligned");
    }
    end = a.offset() + a.bytes();
    g.tensor_offset.push_back(a.offset());
    g.tensor_bytes.push_back(a.bytes());
  }
  const uint64_t area = PageUp(end);
  if (g.slots_offset < sizeof(GroupHeader) ||
      g.slot_stride < sizeof(LocalSlot) + tensors * sizeof(TensorControl) ||
      g.grads_offset < g.slots_offset + g.local_workers * g.slot_stride ||
      g.grads_stride < area || g.grads_offset % kPage != 0 || g.grads_stride % kPage != 0 ||
      g.weights_offset < g.grads_offset + g.local_workers * g.grads_stride ||
      g.weights_offset % kPage != 0 || g.region_bytes < g.weights_offset + area) {
    return bad("areas out of order or outside the region");
  }
  return g;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::microseconds timeout) {
  struct timespec ts;
  ts.tv_sec = timeout.count() / 1000000;
  ts.tv_nsec = (timeout.count() % 1000000) * 1000;
  // Shared (not FUTEX_PRIVATE_FLAG): the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

Status SendLocal(int sock, const control::LocalMessage& m, int fd_to_pass, int fd2) {
  std::string bytes;
  if (!m.SerializeToString(&bytes) || bytes.size() > kMaxLocalMessage) {
    return InternalError("host group: a local message does not serialize");
  }
  struct iovec iov = {bytes.data(), bytes.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  int fds[2] = {fd_to_pass, fd2};
  const int nfds = fd_to_pass < 0 ? 0 : (fd2 < 0 ? 1 : 2);
  alignas(struct cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
  }
  for (;;) {
    const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return Status::OK();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) return UnavailableError("host group: peer gone");
    return ErrnoError("host group: sendmsg", errno);
  }
}

StatusOr<control::LocalMessage> ReceiveLocal(int sock, std::chrono::milliseconds timeout,
                                             UniqueFd* fd, UniqueFd* fd2) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    struct pollfd p = {sock, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoError("host group: poll", errno);
    if (r == 0) return DeadlineExceededError("host group: no message from the peer in time");
    break;
  }
  std::vector<char> buf(kMaxLocalMessage);
  struct iovec iov = {buf.data(), buf.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == ECONNRESET) return UnavailableError("host group: peer gone");
    return ErrnoError("host group: recvmsg", errno);
  }
  // Every fd that arrived is owned here (closed unless handed to the caller).
  std::vector<UniqueFd> fds;
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.emplace_back(f);
    }
  }
  if (n == 0) return UnavailableError("host group: peer gone");
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    return InvalidArgumentError("host group: an oversized local message");
  }
  control::LocalMessage m;
  if (!m.ParseFromArray(buf.data(), static_cast<int>(n)) ||
      m.body_case() == control::LocalMessage::BODY_NOT_SET) {
    return InvalidArgumentError("host group: a local message that does not parse");
  }
  if (fd != nullptr && !fds.empty()) *fd = std::move(fds[0]);
  if (fd2 != nullptr && fds.size() > 1) *fd2 = std::move(fds[1]);
  return m;
}

bool PeerGone(int sock) {
  struct pollfd p = {sock, POLLIN, 0};
  const int r = poll(&p, 1, 0);
  if (r <= 0) return false;
  if ((p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) return true;
  if ((p.revents & POLLIN) != 0) {
    char c;
    const ssize_t n = recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
  }
  return false;
}

Status MakeUnixAddress(const std::string& path, struct sockaddr_un* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr->sun_path)) {
    return InvalidArgumentError("host aggregator socket path must be 1.." +
                                std::to_string(sizeof(addr->sun_path) - 1) + " bytes: '" + path +
                                "'");
  }
  std::memcpy(addr->sun_path, path.data(), path.size());
  if (path[0] == '@') addr->sun_path[0] = '\0';  // abstract namespace
  *len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + path.size() +
                                (path[0] == '@' ? 0 : 1));
  return Status::OK();
}

Mapping::~Mapping() {
  if (p_ != nullptr) munmap(p_, n_);
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) munmap(p_, n_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

StatusOr<Mapping> Mapping::Map(int fd, uint64_t offset, uint64_t bytes, bool writable) {
  Mapping m;
  if (bytes == 0) return m;
  void* p = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) return ErrnoError("host group: mmap of the shared region", errno);
  m.p_ = p;
  m.n_ = bytes;
  return m;
}

}  // namespace shardps::worker::host
