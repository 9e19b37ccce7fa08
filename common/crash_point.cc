#include "common/crash_point.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include <glog/logging.h>

namespace shardps {

void CrashPoint(const char* name) {
  static const std::string armed = [] {
    const char* v = std::getenv("SHARDPS_CRASH_POINT");
    return std::string(v != nullptr ? v : "");
  }();
  if (armed.empty() || armed != name) return;
  LOG(ERROR) << "crash point " << name << " (SHARDPS_CRASH_POINT): exiting now";
  google::FlushLogFiles(google::GLOG_INFO);
  _exit(kCrashPointExitCode);
}

}  // namespace shardps
