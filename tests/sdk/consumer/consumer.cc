// An out-of-tree C++ trainer of the ShardPS SDK: includes only the installed public headers,
// links only the installed library (tests/sdk/sdk_test.sh builds it twice, against
// shardps::shardps and shardps::shardps_static).
//
// usage: consumer COORDINATOR TOKEN STEPS LR  (the cluster: 1 worker, SGD with --lr=LR, BSP)
// Checks on data: after every step, each weight equals w - lr * g computed here; the library's
// version matches the headers'; a Status error crosses the library boundary intact.
#include <shardps/c_api.h>
#include <shardps/client.h>
#include <shardps/version.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAIL: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: consumer COORDINATOR TOKEN STEPS LR\n");
    return 2;
  }
  const int steps = std::atoi(argv[3]);
  const float lr = static_cast<float>(std::atof(argv[4]));

  const std::string lib_version = shardps_version();
  std::printf("consumer: headers %s, library %s\n", SHARDPS_VERSION_STRING, lib_version.c_str());
  Expect(lib_version.rfind(SHARDPS_VERSION_STRING, 0) == 0,
         "library version '" + lib_version + "' does not start with the headers' " +
             SHARDPS_VERSION_STRING);

  shardps::ClientOptions options;
  options.coordinator = argv[1];
  options.cluster_token = argv[2];
  options.transport = "tcp";
  options.bind_ip = "127.0.0.1";
  auto client = shardps::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "consumer: connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<shardps::Client> c = std::move(client).value();

  const int n = 3000;  // 12 KB: several chunks with a small --partition_bytes
  std::vector<float> w(n), g(n), expect(n);
  for (int i = 0; i < n; ++i) {
    w[i] = 0.001f * static_cast<float>(i % 1000) - 0.5f;
    g[i] = 0.01f * static_cast<float>(i % 7 + 1);
    expect[i] = w[i];
  }
  shardps::Status s = c->RegisterTensor("layer.weight", w.data(), g.data(), {30, 100});
  Expect(s.ok(), "RegisterTensor: " + s.ToString());
  s = c->Start();
  if (!s.ok()) {
    std::fprintf(stderr, "consumer: start: %s\n", s.ToString().c_str());
    return 1;
  }
  // An error from inside the library, as a value: code and message intact.
  std::vector<float> row(4);
  int64_t id = 0;
  s = c->PullRows("no_such_table", &id, 1, row.data());
  Expect(s.code() == shardps::StatusCode::kNotFound && s.message().find("no_such_table") !=
                                                          std::string::npos,
         "PullRows on an unknown table: " + s.ToString());
  std::printf("consumer: expected error: %s\n", s.ToString().c_str());

  for (int k = 0; k < steps; ++k) {
    s = c->Step();
    if (!s.ok()) {
      std::fprintf(stderr, "consumer: step %d: %s\n", k, s.ToString().c_str());
      return 1;
    }
    int wrong = 0;
    for (int i = 0; i < n; ++i) {
      expect[i] = expect[i] - lr * g[i];
      if (std::fabs(w[i] - expect[i]) > 1e-5f * std::max(1.0f, std::fabs(expect[i]))) ++wrong;
    }
    Expect(wrong == 0, "step " + std::to_string(k) + ": " + std::to_string(wrong) +
                           " weights differ from w - lr * g (w[1]=" + std::to_string(w[1]) +
                           ", expected " + std::to_string(expect[1]) + ")");
  }
  const shardps::ClientCounters counters = c->counters();
  std::printf("consumer: %d steps, w[1] = %.6f (expected %.6f), %llu pushes, transport %s\n",
              steps, w[1], expect[1], static_cast<unsigned long long>(counters.pushes),
              c->transport_name().c_str());
  Expect(counters.pushes >= static_cast<uint64_t>(steps), "pushes counted");
  s = c->Close();
  Expect(s.ok(), "Close: " + s.ToString());
  std::printf("consumer: %s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
