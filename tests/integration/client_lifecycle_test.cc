// The client's lifecycle (shardps/client.h, "Lifecycle"): in every state, every public entry
// point of shardps::Client either works or returns the documented status, and none crashes or
// hangs. Each state is walked on a real in-process cluster; the calls that are valid there are
// checked to move the right bytes.
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "shardps/client.h"
#include "tests/integration/fault_injecting_fabric.h"
#include "tests/integration/in_process_cluster.h"
#include "worker/client_testing.h"

namespace shardps {
namespace {

using std::chrono::milliseconds;
using test::Cluster;
using test::ClusterSpec;

constexpr float kLr = 0.5f;

// Tensor "w" (300 floats: one chunk per server at partition_bytes 1024) and "b" (37 floats).
struct Model {
  std::vector<float> w = std::vector<float>(300), gw = std::vector<float>(300);
  std::vector<float> b = std::vector<float>(37), gb = std::vector<float>(37);
  Model() {
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 13);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 1.0f;
  }
  Status Register(Client& c) {
    RETURN_IF_ERROR(c.RegisterTensor("w", w.data(), gw.data(), {300}));
    return c.RegisterTensor("b", b.data(), gb.data(), {37});
  }
  // Gradients of step t (exact in float), and what one worker's step does to the weights.
  void SetGrads(int t) {
    for (size_t i = 0; i < gw.size(); ++i) gw[i] = 0.25f * static_cast<float>((i % 5) + t);
    for (size_t i = 0; i < gb.size(); ++i) gb[i] = 0.5f * static_cast<float>(t + 1);
  }
  void Expect(std::vector<float>* ew, std::vector<float>* eb) const {
    for (size_t i = 0; i < gw.size(); ++i) (*ew)[i] -= kLr * gw[i];
    for (size_t i = 0; i < gb.size(); ++i) (*eb)[i] -= kLr * gb[i];
  }
};

ClusterSpec OneWorker(const std::string& transport) {
  ClusterSpec spec;
  spec.transport = transport;
  spec.workers = 1;
  spec.servers = 2;
  spec.partition_bytes = 1024;
  spec.optimizer.lr = kLr;
  return spec;
}

// Every call that needs a running client, all refused with FAILED_PRECONDITION naming the call
// and `state` ("before Start()", "after Close()", ...).
void ExpectDataPathRefused(Client& c, const std::string& state) {
  SCOPED_TRACE("state: " + state);
  auto expect = [&](const Status& s, const std::string& call) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << call << ": " << s;
    EXPECT_NE(s.message().find(call + " " + state), std::string::npos) << call << ": " << s;
  };
  expect(c.Push("w").status(), "Push()");
  expect(c.Pull("w").status(), "Pull()");
  expect(c.Push("no-such-tensor").status(), "Push()");
  expect(c.Wait(Handle{1}), "Wait()");
  expect(c.Clock(), "Clock()");
  expect(c.Step(), "Step()");
  expect(c.RequestCheckpoint("").status(), "RequestCheckpoint()");
}

// The getters work in every state.
void ExpectGetters(Client& c, const std::string& transport, uint64_t clock, bool registered) {
  EXPECT_EQ(c.rank(), 0u);
  EXPECT_EQ(c.clock(), clock);
  EXPECT_EQ(c.consistency(), "bsp");
  EXPECT_EQ(c.transport_name(), transport);
  EXPECT_LE(c.num_workers(), 1u);
  (void)c.counters();
  auto p = c.tensor_path("w");
  if (registered) {
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, TensorPath::kHost);
  } else {
    EXPECT_EQ(p.status().code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(c.tensor_path("no-such-tensor").status().code(), StatusCode::kNotFound);
}

// One Step of a lone worker moves exactly w -= lr * g.
void ExpectStepMovesWeights(Client& c, Model& m, int t) {
  std::vector<float> ew = m.w, eb = m.b;
  m.SetGrads(t);
  m.Expect(&ew, &eb);
  ASSERT_TRUE(c.Step().ok());
  EXPECT_EQ(m.w, ew);
  EXPECT_EQ(m.b, eb);
}

class ClientLifecycleTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = test::SkipReason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(ClientLifecycleTest, BeforeStart) {
  Cluster cluster(OneWorker(GetParam()));
  ClientOptions o = cluster.WorkerOptions(0);
  o.wait_timeout = milliseconds(3000);
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ExpectGetters(**c, GetParam(), 0, false);
  // Start without tensors is refused, and leaves the client joined (nothing was sent).
  EXPECT_EQ((*c)->Start().code(), StatusCode::kFailedPrecondition);
  ExpectDataPathRefused(**c, "before Start()");
  EXPECT_EQ((*c)->RegisterTensor("w", nullptr, m.gw.data(), {300}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->RegisterTensor("w", m.w.data(), m.gw.data(), {0}).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.Register(**c).ok());
  EXPECT_EQ((*c)->RegisterTensor("w", m.w.data(), m.gw.data(), {300}).code(),
            StatusCode::kAlreadyExists);
  ExpectDataPathRefused(**c, "before Start()");
  ExpectGetters(**c, GetParam(), 0, true);
  // The refused calls changed nothing: Start and a step work as on a fresh client.
  Status st = (*c)->Start();
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ((*c)->clock(), 0u);
  ExpectStepMovesWeights(**c, m, 0);
  EXPECT_EQ((*c)->clock(), 1u);
  EXPECT_TRUE((*c)->Close().ok());
}

TEST_P(ClientLifecycleTest, Running) {
  Cluster cluster(OneWorker(GetParam()));
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ASSERT_TRUE(m.Register(**c).ok());
  ASSERT_TRUE((*c)->Start().ok());
  const std::string running = "after Start()";
  for (const Status& s : {(*c)->RegisterTensor("x", m.w.data(), m.gw.data(), {3}), (*c)->Start()}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(running), std::string::npos) << s;
  }
  EXPECT_EQ((*c)->Push("no-such-tensor").status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*c)->Pull("no-such-tensor").status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*c)->Wait(Handle{12345}).code(), StatusCode::kNotFound);
  // Push, Clock and Pull one by one do what a Step does.
  std::vector<float> ew = m.w, eb = m.b;
  m.SetGrads(1);
  m.Expect(&ew, &eb);
  for (const char* name : {"w", "b"}) {
    auto h = (*c)->Push(name);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*c)->Wait(*h).ok());
    EXPECT_EQ((*c)->Wait(*h).code(), StatusCode::kNotFound);  // a handle is waited for once
  }
  ASSERT_TRUE((*c)->Clock().ok());
  for (const char* name : {"w", "b"}) {
    auto h = (*c)->Pull(name);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*c)->Wait(*h).ok());
  }
  EXPECT_EQ(m.w, ew);
  EXPECT_EQ(m.b, eb);
  ExpectStepMovesWeights(**c, m, 2);
  ExpectGetters(**c, GetParam(), 2, true);
  auto ck = (*c)->RequestCheckpoint(::testing::TempDir());
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(*ck, 3u);
  EXPECT_GE((*c)->counters().pushes, 4u);
  EXPECT_TRUE((*c)->Close().ok());
  EXPECT_TRUE((*c)->Close().ok());  // idempotent
}

TEST_P(ClientLifecycleTest, AfterFailedStart) {
  ClusterSpec spec = OneWorker(GetParam());
  spec.workers = 2;  // the second worker never comes: Start fails waiting for it
  Cluster cluster(spec);
  ClientOptions o = cluster.WorkerOptions(0);
  // It also bounds the join (Connect): 3 s, so that a loaded host does not fail the join.
  o.setup_timeout = milliseconds(3000);
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ASSERT_TRUE(m.Register(**c).ok());
  const Status failed = (*c)->Start();
  ASSERT_EQ(failed.code(), StatusCode::kDeadlineExceeded) << failed;
  const std::string state = "after a failed Start()";
  for (const Status& s : {(*c)->Start(), (*c)->RegisterTensor("x", m.w.data(), m.gw.data(), {3})}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(state), std::string::npos) << s;
    // The cause is named.
    EXPECT_NE(s.message().find("workers to join"), std::string::npos) << s;
  }
  ExpectDataPathRefused(**c, state);
  ExpectGetters(**c, GetParam(), 0, true);
  EXPECT_TRUE((*c)->Close().ok());
  ExpectDataPathRefused(**c, "after Close()");
  c->reset();
  // The failed client left the cluster usable: two fresh workers start and step (which also
  // lets the servers, waiting for the model, finish).
  std::vector<std::thread> workers;
  for (int r = 0; r < 2; ++r) {
    workers.emplace_back([&cluster, r] {
      auto w = Client::Connect(cluster.WorkerOptions(r));
      ASSERT_TRUE(w.ok()) << w.status();
      Model m;
      ASSERT_TRUE(m.Register(**w).ok());
      Status st = (*w)->Start();
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE((*w)->Step().ok());
      EXPECT_EQ((*w)->clock(), 1u);
      EXPECT_TRUE((*w)->Close().ok());
    });
  }
  for (auto& t : workers) t.join();
}

TEST_P(ClientLifecycleTest, AfterClose) {
  Cluster cluster(OneWorker(GetParam()));
  {
    // Closed before Start.
    auto c = Client::Connect(cluster.WorkerOptions(0));
    ASSERT_TRUE(c.ok()) << c.status();
    Model m;
    ASSERT_TRUE(m.Register(**c).ok());
    EXPECT_TRUE((*c)->Close().ok());
    EXPECT_EQ((*c)->Start().code(), StatusCode::kFailedPrecondition);
    ExpectDataPathRefused(**c, "after Close()");
    ExpectGetters(**c, GetParam(), 0, true);
  }
  auto c = Client::Connect(cluster.WorkerOptions(0));
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ASSERT_TRUE(m.Register(**c).ok());
  ASSERT_TRUE((*c)->Start().ok());
  ExpectStepMovesWeights(**c, m, 0);
  auto pending = (*c)->Push("w");  // never waited for: Close abandons it
  ASSERT_TRUE(pending.ok());
  ASSERT_TRUE((*c)->Close().ok());
  const std::vector<float> w = m.w;
  for (const Status& s : {(*c)->Start(), (*c)->RegisterTensor("x", m.w.data(), m.gw.data(), {3})}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("after Close()"), std::string::npos) << s;
  }
  ExpectDataPathRefused(**c, "after Close()");
  EXPECT_EQ((*c)->Wait(*pending).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.w, w);  // nothing was pulled into the weights after Close
  ExpectGetters(**c, GetParam(), 1, true);
  EXPECT_TRUE((*c)->Close().ok());
}

// A server of a cluster without backups dies: the data-path error is unrecoverable, reported
// once with its cause, and every later data-path call is refused naming it.
TEST_P(ClientLifecycleTest, AfterAnUnrecoverableDataPathError) {
  Cluster cluster(OneWorker(GetParam()));
  ClientOptions o = cluster.WorkerOptions(0);
  o.wait_timeout = milliseconds(3000);
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ASSERT_TRUE(m.Register(**c).ok());
  ASSERT_TRUE((*c)->Start().ok());
  ExpectStepMovesWeights(**c, m, 0);
  cluster.StopServer(1);
  Status st;
  for (int t = 0; t < 20 && st.ok(); ++t) st = (*c)->Step();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.code(), StatusCode::kFailedPrecondition) << st;
  const std::string state = "after an unrecoverable data-path error";
  ExpectDataPathRefused(**c, state);
  const Status again = (*c)->Step();
  EXPECT_NE(again.message().find(st.message()), std::string::npos)
      << "the refusal names the cause: " << again;
  for (const Status& s : {(*c)->Start(), (*c)->RegisterTensor("x", m.w.data(), m.gw.data(), {3})}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  }
  ExpectGetters(**c, GetParam(), (*c)->clock(), true);
  EXPECT_TRUE((*c)->Close().ok());
  ExpectDataPathRefused(**c, "after Close()");
}

// Data-path errors the client survives (a reconnect to the same, live server) leave it running,
// and the weights exact: the client over the fault-injecting fabric (every 3rd message-carrying
// write names a wrong rkey), through the testing seam worker/client_testing.h.
TEST_P(ClientLifecycleTest, SurvivedDataPathErrorsKeepItRunning) {
  Cluster cluster(OneWorker(GetParam()));
  const ClientOptions o = cluster.WorkerOptions(0);
  auto fabric = transport::Fabric::Open(worker::ClientFabricOptions(o));
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  test::FaultOptions fault;
  fault.error_every = 3;
  // Start does not recover (a failed setup write fails Start): an endpoint's first posts, the
  // hello and rank 0's initial weights (at most 3 chunks per server here), are left alone.
  fault.skip_first_posts = 4;
  auto wrapped = std::make_unique<test::FaultInjectingFabric>(std::move(*fabric), fault);
  const std::shared_ptr<const test::FaultCounters> injected = wrapped->counters();
  auto c = worker::ConnectOverFabric(o, std::move(wrapped));
  ASSERT_TRUE(c.ok()) << c.status();
  Model m;
  ASSERT_TRUE(m.Register(**c).ok());
  ASSERT_TRUE((*c)->Start().ok());
  for (int t = 0; t < 8; ++t) ExpectStepMovesWeights(**c, m, t);
  EXPECT_GE(injected->injected.load(), 3u);
  EXPECT_EQ((*c)->counters().reconnects, injected->injected.load());
  EXPECT_EQ((*c)->clock(), 8u);
  EXPECT_TRUE((*c)->Clock().ok());  // still running
  EXPECT_TRUE((*c)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientLifecycleTest, ::testing::Values("tcp", "shm", "verbs"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace shardps
