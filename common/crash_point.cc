#include "common/crash_point.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include <glog/logging.h>

namespace shardps {

namespace {

struct Armed {
  std::string name;     // "" = none
  long long nth = 1;    // crash on the nth time the point is reached ("name@nth")
};

Armed Parse() {
  Armed a;
  const char* v = std::getenv("SHARDPS_CRASH_POINT");
  if (v == nullptr) return a;
  a.name = v;
  const size_t at = a.name.find('@');
  if (at != std::string::npos) {
    a.nth = std::max(1LL, std::atoll(a.name.c_str() + at + 1));
    a.name.resize(at);
  }
  return a;
}

const Armed& ArmedPoint() {
  static const Armed armed = Parse();
  return armed;
}

std::atomic<long long> reached{0};  // times the armed point was reached

}  // namespace

bool CrashPointDue(const char* name) {
  const Armed& armed = ArmedPoint();
  if (armed.name.empty() || armed.name != name) return false;
  return reached.load() + 1 >= armed.nth;
}

void CrashPoint(const char* name) {
  const Armed& armed = ArmedPoint();
  if (armed.name.empty() || armed.name != name) return;
  if (reached.fetch_add(1) + 1 < armed.nth) return;
  LOG(ERROR) << "crash point " << name << " (SHARDPS_CRASH_POINT, time " << armed.nth
             << "): exiting now";
  google::FlushLogFiles(google::GLOG_INFO);
  _exit(kCrashPointExitCode);
}

}  // namespace shardps
