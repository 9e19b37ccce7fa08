// libFuzzer target: the coordinator (server/coordinator.h) as a peer sees it, over TCP.
//
// One in-process Coordinator is started once. Each input is written over a fresh connection:
//   byte 0   bit 0: first send the magic and a well-formed JoinRequest (right token), so the
//                   fuzzer starts past authentication; bit 1: join as a server, else a worker;
//                   bit 2: request rank (byte 0 >> 3), else any rank
//   the rest the bytes written (after the prefix, if any)
// then the write side is shut down and the connection read until the coordinator closes it
// (it must: EOF closes a connection). Every kHealthEvery inputs (and at the first) a separate,
// well-formed join must still be accepted within a few seconds. No crash, no hang, no leak
// (libFuzzer's -timeout and leak detection catch the last two).
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <glog/logging.h>
#include <google/protobuf/stubs/logging.h>

#include "common/net.h"
#include "proto/framing.h"
#include "server/coordinator.h"

namespace {

using namespace shardps;           // NOLINT
using namespace shardps::control;  // NOLINT

constexpr char kToken[] = "fuzz-token";
constexpr int kHealthEvery = 32;
constexpr auto kCloseDeadline = std::chrono::seconds(10);

[[noreturn]] void Fail(const std::string& what) {
  fprintf(stderr, "fuzz_coordinator: check failed: %s\n", what.c_str());
  abort();
}

Coordinator* g_coordinator = nullptr;

// RST on close: no TIME_WAIT, so thousands of connections per second do not exhaust ports.
void CloseHard(UniqueFd* fd) {
  linger l{1, 0};
  setsockopt(fd->get(), SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  fd->reset();
}

UniqueFd Connect() {
  auto fd = net::ConnectTcp(g_coordinator->address(), "", std::chrono::milliseconds(5000));
  if (!fd.ok()) Fail("connect to the coordinator: " + fd.status().ToString());
  timeval tv{5, 0};
  setsockopt(fd->get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return std::move(*fd);
}

std::string JoinFrame(Role role, int32_t rank) {
  Envelope e;
  JoinRequest* j = e.mutable_join();
  j->set_cluster_token(kToken);
  j->set_role(role);
  j->set_hostname("fuzz");
  j->set_pid(1);
  j->set_transport("tcp");
  j->set_requested_rank(rank);
  if (role == ROLE_SERVER) j->set_data_address("127.0.0.1:1");
  auto f = EncodeFrame(e);
  if (!f.ok()) Fail("encode join");
  return std::string(kMagic) + *f;
}

void HealthCheck() {
  UniqueFd fd = Connect();
  const std::string join = JoinFrame(ROLE_WORKER, -1);
  Status s = net::SendAll(fd.get(), join.data(), join.size(), std::chrono::milliseconds(5000));
  if (!s.ok()) Fail("health join send: " + s.ToString());
  FrameDecoder d;
  auto reply = ReceiveEnvelope(fd.get(), &d, std::chrono::milliseconds(5000));
  if (!reply.ok()) Fail("health join: no reply: " + reply.status().ToString());
  if (reply->body_case() != Envelope::kJoinReply || !reply->join_reply().accepted() ||
      reply->join_reply().member_id() == 0) {
    Fail("health join not accepted: " + reply->ShortDebugString());
  }
  CloseHard(&fd);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Envelopes with invalid UTF-8 in string fields fail to parse, and protobuf logs each one.
  google::protobuf::SetLogHandler(nullptr);
  FLAGS_minloglevel = 3;  // the coordinator logs every refusal; keep the fuzzer's output clean
  FLAGS_logtostderr = true;
  CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.cluster_token = kToken;
  o.handshake_timeout = std::chrono::milliseconds(3000);
  o.config.set_num_servers(1);
  o.config.set_num_workers(1);
  o.config.set_max_workers(4);
  o.config.set_partition_bytes(4096);
  o.config.set_transport("tcp");
  o.config.set_heartbeat_interval_ms(100);
  o.config.set_heartbeat_timeout_ms(20000);
  auto c = Coordinator::Start(o);
  if (!c.ok()) Fail("start coordinator: " + c.status().ToString());
  g_coordinator = c->release();  // lives for the whole process
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t inputs = 0;
  if (inputs++ % kHealthEvery == 0) HealthCheck();
  if (size == 0) return 0;
  std::string out;
  if (data[0] & 1) {
    out = JoinFrame((data[0] & 2) ? ROLE_SERVER : ROLE_WORKER, (data[0] & 4) ? data[0] >> 3 : -1);
  }
  out.append(reinterpret_cast<const char*>(data + 1), size - 1);

  UniqueFd fd = Connect();
  // An error means the coordinator closed on a protocol error: fine.
  net::SendAll(fd.get(), out.data(), out.size(), std::chrono::milliseconds(5000)).IgnoreError();
  shutdown(fd.get(), SHUT_WR);
  // The coordinator must close the connection now (our EOF closes it), and promptly.
  const auto deadline = std::chrono::steady_clock::now() + kCloseDeadline;
  char buf[64 << 10];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) Fail("the coordinator kept a connection open after the peer's EOF");
    pollfd p{fd.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t k = recv(fd.get(), buf, sizeof(buf), 0);
    if (k <= 0) break;  // EOF or reset
  }
  CloseHard(&fd);
  return 0;
}
