// A local worker's connection to its host aggregator (worker/host_client.cc) against a fake
// aggregator played by this process over a real abstract unix socket.
//
//   AConnectionDroppedBeforeTheGreetingIsRetried  a connect() that lands in the backlog of a
//       listener which then closes without accepting it (an aggregator that is exiting: the
//       kernel may close a dying process's connections before its listening socket, so a worker
//       that saw EOF on its connection can still connect to the dead one's name) is retried like
//       a refused one, and the worker takes the next aggregator's greeting.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "shardps/client.h"
#include "worker/host_group.h"

namespace shardps {
namespace {

using std::chrono::milliseconds;

UniqueFd Listen(const std::string& path) {
  struct sockaddr_un addr;
  socklen_t len;
  if (!worker::host::MakeUnixAddress(path, &addr, &len).ok()) return UniqueFd();
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid() || bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(fd.get(), 8) != 0) {
    return UniqueFd();
  }
  return fd;
}

// Waits up to 10 s for a connection to be pending on `listener`; gives up early once `quit`.
bool Pending(int listener, const std::atomic<bool>& quit) {
  for (int i = 0; i < 200 && !quit.load(); ++i) {
    struct pollfd p = {listener, POLLIN, 0};
    if (poll(&p, 1, 50) > 0) return true;
  }
  return false;
}

TEST(HostClientTest, AConnectionDroppedBeforeTheGreetingIsRetried) {
  const std::string path = "@shardps-unit-host-client-" + std::to_string(getpid());
  UniqueFd dying = Listen(path);
  ASSERT_TRUE(dying.valid());
  ClientOptions o;
  o.aggregator = path;
  o.local_rank = 0;
  o.cluster_token = "token";
  o.setup_timeout = milliseconds(10000);
  std::atomic<bool> done{false};
  Status result;
  std::thread worker([&] {
    auto c = Client::Connect(o);
    result = c.status();
    if (c.ok()) (*c)->Close().IgnoreError();
    done.store(true);
  });
  // The worker's connect() is in the backlog; the listener goes away without accepting it.
  ASSERT_TRUE(Pending(dying.get(), done)) << "the worker never connected";
  dying.reset();
  // The restarted aggregator: same name, greets whoever connects.
  UniqueFd again = Listen(path);
  ASSERT_TRUE(again.valid());
  bool greeted = false;
  if (Pending(again.get(), done)) {
    UniqueFd c(accept4(again.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(c.valid());
    control::LocalMessage hello;
    auto* st = hello.mutable_started();
    st->set_cluster_rank(0);
    st->set_hosts(1);
    st->set_consistency("bsp");
    st->set_transport("tcp");
    st->set_local_workers(2);
    greeted = worker::host::SendLocal(c.get(), hello).ok();
    worker.join();
  } else {
    worker.join();
  }
  EXPECT_TRUE(result.ok()) << "a dropped greeting was taken as final: " << result;
  EXPECT_TRUE(greeted) << "the worker never connected to the restarted aggregator";
}

}  // namespace
}  // namespace shardps
