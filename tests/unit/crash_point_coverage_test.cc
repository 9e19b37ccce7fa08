// "A failure at every named crash point" (docs/fault-tolerance.md, "Crash points"), checked
// over the source rather than trusted: every CrashPoint("name") in the daemon's and the
// client's code must be armed by some test of tests/integration (a crash matrix case, a
// ClusterSpec.crash_point, a SHARDPS_CRASH_POINT set before a spawn), and every crash or stall
// point a test arms must exist in the code. A new point without a kill test fails the first
// check; a test arming a misspelt or removed point (it would never fire, so the test could not
// fail) fails the second.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace shardps {
namespace {

namespace fs = std::filesystem;

std::string Slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool IsSource(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".cc" || ext == ".h";
}

// Every name `re` captures (group 1) in the sources under `dirs`, with the first file seen.
std::map<std::string, std::string> Names(const std::vector<fs::path>& dirs, const std::regex& re) {
  std::map<std::string, std::string> out;
  for (const fs::path& dir : dirs) {
    if (!fs::exists(dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (!e.is_regular_file() || !IsSource(e.path())) continue;
      const std::string text = Slurp(e.path());
      for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
        out.emplace((*it)[1].str(), e.path().lexically_relative(SHARDPS_SOURCE_DIR).string());
      }
    }
  }
  return out;
}

class CrashPointCoverageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path root(SHARDPS_SOURCE_DIR);
    ASSERT_TRUE(fs::exists(root / "common" / "crash_point.h")) << "no source tree at " << root;
    const std::vector<fs::path> code = {root / "server", root / "worker", root / "common",
                                        root / "transport", root / "tools", root / "control"};
    crash_ = Names(code, std::regex(R"re(CrashPoint(?:Due)?\("([a-z]+\.[a-z_]+)")re"));
    stall_ = Names(code, std::regex(R"re(StallPoint(?:Due)?\("([a-z]+\.[a-z_]+)")re"));
    // A point as a test arms it: a string literal that is the name alone, or with "@N" (the Nth
    // time) or ":ms" (a stall's length), e.g. "server.after_publish@10", "worker.x@3:1500".
    armed_ = Names({root / "tests" / "integration"},
                   std::regex(R"re("((?:server|worker|coordinator)\.[a-z_]+)(?:@[0-9]+)?(?::[0-9]+)?")re"));
    // The test directory's file names of the same shape ("coordinator.log") are no points.
    for (const char* file : {"coordinator.addr", "coordinator.log", "coordinator.state"}) {
      armed_.erase(file);
    }
  }

  std::map<std::string, std::string> crash_, stall_, armed_;
};

TEST_F(CrashPointCoverageTest, EveryCrashPointInTheCodeIsArmedByATest) {
  ASSERT_GE(crash_.size(), 20u) << "the scan found too few crash points: is the regex stale?";
  for (const auto& [name, file] : crash_) {
    EXPECT_EQ(armed_.count(name), 1u)
        << "crash point '" << name << "' (" << file
        << ") is armed by no test in tests/integration: add a kill test for it (a CrashMatrixTest "
           "case, or a test that sets ClusterSpec.crash_point / SHARDPS_CRASH_POINT)";
  }
}

// Stall points exist for tests only (a descheduled process at a chosen line): one no test arms
// is a scene nobody checks.
TEST_F(CrashPointCoverageTest, EveryStallPointInTheCodeIsArmedByATest) {
  ASSERT_GE(stall_.size(), 5u) << "the scan found too few stall points: is the regex stale?";
  for (const auto& [name, file] : stall_) {
    EXPECT_EQ(armed_.count(name), 1u)
        << "stall point '" << name << "' (" << file << ") is armed by no test in tests/integration";
  }
}

TEST_F(CrashPointCoverageTest, EveryPointATestArmsExistsInTheCode) {
  ASSERT_GE(armed_.size(), 20u) << "the scan found too few armed points: is the regex stale?";
  for (const auto& [name, file] : armed_) {
    EXPECT_TRUE(crash_.count(name) == 1 || stall_.count(name) == 1)
        << file << " arms '" << name
        << "', which is no CrashPoint or StallPoint of the code: it never fires, so the test "
           "cannot fail";
  }
}

}  // namespace
}  // namespace shardps
