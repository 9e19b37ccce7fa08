// The conformance binary doubles as the peer process of the peer-death tests: re-executed with
// --conformance_peer=PROVIDER it serves one region instead of running tests.
#include <cstring>
#include <string>

#include <glog/logging.h>
#include <gtest/gtest.h>

#include "tests/conformance/conformance_env.h"

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  std::string peer;
  size_t bytes = 1 << 20;
  for (int i = 1; i < argc; ++i) {
    if (strncmp(argv[i], "--conformance_peer=", 19) == 0) peer = argv[i] + 19;
    if (strncmp(argv[i], "--conformance_peer_bytes=", 25) == 0) bytes = std::stoull(argv[i] + 25);
  }
  if (!peer.empty()) return shardps::transport::conformance::RunPeerMain(peer, bytes);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
