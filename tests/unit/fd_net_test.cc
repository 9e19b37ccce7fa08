// The fd and socket seam (common/fd.h, common/net.h): ownership, all-bytes loops across partial
// transfers, deadlines, EOF and a dead peer, on real pipes and sockets.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/byte_pattern.h"
#include "common/fd.h"
#include "common/net.h"

namespace shardps {
namespace {

using std::chrono::milliseconds;

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1; }

void SocketPair(UniqueFd* a, UniqueFd* b) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  a->reset(sv[0]);
  b->reset(sv[1]);
}

TEST(UniqueFdTest, ClosesOnceAndMovesOwnership) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  const int r = p[0];
  {
    UniqueFd a(r);
    UniqueFd b(std::move(a));
    EXPECT_FALSE(a.valid());
    EXPECT_EQ(b.get(), r);
    UniqueFd c;
    c = std::move(b);
    EXPECT_TRUE(IsOpen(r));
  }
  EXPECT_FALSE(IsOpen(r));
  UniqueFd w(p[1]);
  const int raw = w.release();
  EXPECT_FALSE(w.valid());
  EXPECT_TRUE(IsOpen(raw));
  w.reset(raw);
  w.reset();
  EXPECT_FALSE(IsOpen(raw));
}

TEST(FdioTest, WriteAllAndReadFullMoveEveryByteThroughAPipe) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  UniqueFd r(p[0]), w(p[1]);
  std::vector<char> out(3 << 20), in(out.size());  // far more than a pipe holds: partial writes
  FillPattern(out.data(), out.size(), 1);
  Status wrote;
  std::thread writer([&] {
    wrote = fdio::WriteAll(w.get(), out.data(), out.size());
    w.reset();
  });
  ASSERT_TRUE(fdio::ReadFull(r.get(), in.data(), in.size()).ok());
  writer.join();
  ASSERT_TRUE(wrote.ok()) << wrote;
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.size()), 0);
  char extra;
  Status eof = fdio::ReadFull(r.get(), &extra, 1);
  EXPECT_EQ(eof.code(), StatusCode::kUnavailable) << eof;
}

TEST(FdioTest, WriteAllReportsTheErrno) {
  int err = 0;
  Status s = fdio::WriteAll(-1, "x", 1, &err);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(err, EBADF);
}

TEST(FdioTest, VectoredTransfersCrossSegmentsAndPartialTransfers) {
  UniqueFd a, b;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&a, &b));
  std::vector<char> s1(100), s2(2 << 20), s3(7);
  FillPattern(s1.data(), s1.size(), 2);
  FillPattern(s2.data(), s2.size(), 3);
  FillPattern(s3.data(), s3.size(), 4);
  std::vector<char> d1(s1.size() + 50), d2(s2.size() - 50 + s3.size());
  Status sent;
  std::thread sender([&] {
    iovec iov[3] = {{s1.data(), s1.size()}, {s2.data(), s2.size()}, {s3.data(), s3.size()}};
    sent = fdio::WritevAll(a.get(), iov, 3);
  });
  iovec dst[2] = {{d1.data(), d1.size()}, {d2.data(), d2.size()}};
  ASSERT_TRUE(fdio::ReadvFull(b.get(), dst, 2).ok());
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  std::string want(s1.begin(), s1.end());
  want.append(s2.begin(), s2.end());
  want.append(s3.begin(), s3.end());
  std::string got(d1.begin(), d1.end());
  got.append(d2.begin(), d2.end());
  EXPECT_EQ(got, want);
  a.reset();
  char c;
  iovec one{&c, 1};
  EXPECT_EQ(fdio::ReadvFull(b.get(), &one, 1).code(), StatusCode::kUnavailable);
}

TEST(NetTest, SendAllAndRecvAllMoveEveryByte) {
  UniqueFd a, b;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&a, &b));
  std::vector<char> out(8 << 20), in(out.size());  // more than the socket buffers: EAGAIN + poll
  FillPattern(out.data(), out.size(), 5);
  Status sent;
  std::thread sender(
      [&] { sent = net::SendAll(a.get(), out.data(), out.size(), milliseconds(10000)); });
  ASSERT_TRUE(net::RecvAll(b.get(), in.data(), in.size(), milliseconds(10000)).ok());
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.size()), 0);
}

TEST(NetTest, DeadlinesPeerCloseAndDeadPeerAreErrorsNamedByTheCaller) {
  UniqueFd a, b;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&a, &b));
  char buf[16];
  const auto t0 = std::chrono::steady_clock::now();
  Status s = net::RecvAll(b.get(), buf, sizeof(buf),
                          std::chrono::steady_clock::now() + milliseconds(50), "hello");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "hello: timed out");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(40));
  // Nobody reads: the send fills the buffers and times out.
  std::vector<char> big(64 << 20);
  s = net::SendAll(a.get(), big.data(), big.size(), milliseconds(50));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  // EOF before n bytes.
  UniqueFd c, d;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&c, &d));
  ASSERT_TRUE(net::SendAll(c.get(), "abc", 3, milliseconds(1000)).ok());
  c.reset();
  s = net::RecvAll(d.get(), buf, sizeof(buf), std::chrono::steady_clock::now() + milliseconds(1000),
                   "ready");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.message(), "ready: peer closed the connection");
  // Sending to a closed peer is an error, not SIGPIPE (MSG_NOSIGNAL).
  s = net::SendAll(d.get(), "abc", 3, milliseconds(1000));
  EXPECT_FALSE(s.ok());
}

TEST(NetTest, RecvSomeReadsWhatIsThereAndReportsEof) {
  UniqueFd a, b;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&a, &b));
  char buf[8];
  auto n = net::RecvSome(b.get(), buf, sizeof(buf));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u) << "nothing there: 0, not an error";
  ASSERT_TRUE(net::SendAll(a.get(), "0123456789", 10, milliseconds(1000)).ok());
  n = net::RecvSome(b.get(), buf, sizeof(buf));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 8u);
  EXPECT_EQ(std::string(buf, 8), "01234567");
  a.reset();
  n = net::RecvSome(b.get(), buf, sizeof(buf), "probe");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  n = net::RecvSome(b.get(), buf, sizeof(buf), "probe");
  EXPECT_EQ(n.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(n.status().message(), "probe: peer closed the connection");
}

TEST(NetTest, WaitFdWaitsForReadinessUntilTheDeadline) {
  UniqueFd a, b;
  ASSERT_NO_FATAL_FAILURE(SocketPair(&a, &b));
  Status s = net::WaitFd(b.get(), POLLIN, std::chrono::steady_clock::now() + milliseconds(30),
                         "waiting for the peer");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "waiting for the peer: timed out");
  EXPECT_TRUE(
      net::WaitFd(a.get(), POLLOUT, std::chrono::steady_clock::now() + milliseconds(1000), "send")
          .ok());
  ASSERT_TRUE(net::SendAll(a.get(), "x", 1, milliseconds(1000)).ok());
  EXPECT_TRUE(
      net::WaitFd(b.get(), POLLIN, std::chrono::steady_clock::now() + milliseconds(1000), "recv")
          .ok());
}

// An HA standby's reservation (BindTcp): the port is held but refuses connections; no port-0
// bind is handed it; once listening (ListenOnBound) it accepts on the same address.
TEST(NetTest, ABoundPortIsReservedAndRefusesUntilItListens) {
  std::string bound;
  auto b = net::BindTcp("127.0.0.1:0", &bound);
  ASSERT_TRUE(b.ok()) << b.status();
  auto refused = net::ConnectTcp(bound, "", milliseconds(2000));
  EXPECT_FALSE(refused.ok()) << "a bound socket that does not listen must refuse";
  // 200 port-0 listeners (each kept open, so each gets a distinct port): none is the reserved.
  std::vector<UniqueFd> others;
  for (int i = 0; i < 200; ++i) {
    std::string other;
    auto l = net::ListenTcp("127.0.0.1:0", &other);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_NE(other, bound) << "port-0 bind " << i << " was handed the reserved port";
    others.push_back(std::move(*l));
  }
  auto listening = net::ListenOnBound(b->get());
  ASSERT_TRUE(listening.ok()) << listening.status();
  EXPECT_EQ(*listening, bound);
  auto c = net::ConnectTcp(bound, "", milliseconds(5000));
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = net::AcceptTcp(b->get(), milliseconds(5000));
  ASSERT_TRUE(s.ok()) << s.status();
}

TEST(NetTest, ListenConnectAcceptOnLoopback) {
  std::string bound;
  auto l = net::ListenTcp("127.0.0.1:0", &bound);
  ASSERT_TRUE(l.ok()) << l.status();
  auto hp = net::ParseHostPort(bound);
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_NE(hp->port, 0);
  auto c = net::ConnectTcp(bound, "", milliseconds(5000));
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = net::AcceptTcp(l->get(), milliseconds(5000));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(net::SendAll(c->get(), "ping", 4, milliseconds(1000)).ok());
  char got[4];
  ASSERT_TRUE(net::RecvAll(s->get(), got, 4, milliseconds(1000)).ok());
  EXPECT_EQ(std::string(got, 4), "ping");
  EXPECT_EQ(net::AcceptTcp(l->get(), milliseconds(20)).status().code(),
            StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace shardps
