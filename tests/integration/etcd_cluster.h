// A real 3-member etcd cluster on loopback for tests (Debian's etcd-server): started with free
// ports under `dir`, every member killed in the destructor. Every wait is bounded.
#ifndef SHARDPS_TESTS_INTEGRATION_ETCD_CLUSTER_H_
#define SHARDPS_TESTS_INTEGRATION_ETCD_CLUSTER_H_

#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/net.h"
#include "proto/etcd_client.h"
#include "tests/integration/child_process.h"

namespace shardps::testing_util {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

// A free loopback port (bound, then released for the next process to bind).
inline uint16_t FreeLoopbackPort() {
  std::string bound;
  auto fd = net::ListenTcp("127.0.0.1:0", &bound);
  if (!fd.ok()) return 0;
  return static_cast<uint16_t>(std::stoi(bound.substr(bound.rfind(':') + 1)));
}

class EtcdCluster {
 public:
  ~EtcdCluster() {
    for (auto& m : members_) m->Kill();
  }
  // "" when started and healthy; else why not.
  std::string Start(const std::string& dir) {
    if (access(kEtcdBinary, X_OK) != 0) return std::string(kEtcdBinary) + " is not installed";
    std::string cluster;
    for (int i = 0; i < 3; ++i) {
      client_port_[i] = FreeLoopbackPort();
      peer_port_[i] = FreeLoopbackPort();
      cluster += (i ? "," : "") + Name(i) + "=http://127.0.0.1:" + std::to_string(peer_port_[i]);
    }
    for (int i = 0; i < 3; ++i) {
      const std::string c = "http://127.0.0.1:" + std::to_string(client_port_[i]);
      const std::string p = "http://127.0.0.1:" + std::to_string(peer_port_[i]);
      auto m = ChildProcess::Spawn(
          {kEtcdBinary, "--name=" + Name(i), "--data-dir=" + dir + "/" + Name(i),
           "--listen-client-urls=" + c, "--advertise-client-urls=" + c, "--listen-peer-urls=" + p,
           "--initial-advertise-peer-urls=" + p, "--initial-cluster=" + cluster,
           "--initial-cluster-state=new", "--initial-cluster-token=shardps-etcd-test",
           "--heartbeat-interval=50", "--election-timeout=500"},
          dir + "/" + Name(i) + ".log");
      if (!m.ok()) return m.status().ToString();
      members_.push_back(std::move(*m));
    }
    auto c = etcd::Client::Create(Endpoints());
    if (!c.ok()) return c.status().ToString();
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(30000);
    Status st = UnavailableError("not tried");
    while (std::chrono::steady_clock::now() < until && !(st = c->Put("/shardps-test/up", "1")).ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!st.ok()) return "etcd cluster did not come up: " + st.ToString();
    return "";
  }
  std::string Endpoints() const {
    std::string e;
    for (int i = 0; i < 3; ++i) {
      e += (i ? "," : "") + std::string("http://127.0.0.1:") + std::to_string(client_port_[i]);
    }
    return e;
  }
  ChildProcess* member(int i) { return members_[i].get(); }
  static std::string Name(int i) { return "m" + std::to_string(i); }

 private:
  uint16_t client_port_[3] = {0, 0, 0};
  uint16_t peer_port_[3] = {0, 0, 0};
  std::vector<std::unique_ptr<ChildProcess>> members_;
};

}  // namespace shardps::testing_util

#endif  // SHARDPS_TESTS_INTEGRATION_ETCD_CLUSTER_H_
