#include "common/stall_point.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <glog/logging.h>

namespace shardps {

namespace {

struct Armed {
  std::string name;  // "" = none
  long long nth = 1;
  std::chrono::milliseconds stall{0};
  long long reached = 0;
};

std::mutex mu;
Armed armed;                           // guarded by mu
std::atomic<bool> any_armed{false};    // fast path: false = nothing to compare
std::atomic<long long> served{0};

// "name:ms" or "name@N:ms"; anything malformed arms nothing (logged).
void ParseEnvLocked() {
  const char* v = std::getenv("SHARDPS_STALL_POINT");
  if (v == nullptr || *v == '\0') return;
  std::string s = v;
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 >= s.size()) {
    LOG(ERROR) << "SHARDPS_STALL_POINT=" << s << " is not name[@N]:ms; nothing armed";
    return;
  }
  const long long ms = std::atoll(s.c_str() + colon + 1);
  s.resize(colon);
  long long nth = 1;
  const size_t at = s.find('@');
  if (at != std::string::npos) {
    nth = std::max(1LL, std::atoll(s.c_str() + at + 1));
    s.resize(at);
  }
  if (s.empty() || ms <= 0) {
    LOG(ERROR) << "SHARDPS_STALL_POINT=" << v << " is not name[@N]:ms; nothing armed";
    return;
  }
  armed = Armed{s, nth, std::chrono::milliseconds(ms), 0};
  any_armed.store(true, std::memory_order_relaxed);
}

std::once_flag env_once;

void LoadEnv() {
  std::call_once(env_once, [] {
    std::lock_guard<std::mutex> l(mu);
    ParseEnvLocked();
  });
}

// Runs before main: the fast path needs any_armed set before the first StallPoint.
const bool env_loaded = (LoadEnv(), true);

}  // namespace

void StallPoint(const char* name) {
  if (!any_armed.load(std::memory_order_relaxed)) return;
  std::chrono::milliseconds stall{0};
  {
    std::lock_guard<std::mutex> l(mu);
    if (armed.name.empty() || armed.name != name) return;
    if (++armed.reached != armed.nth) return;
    stall = armed.stall;
    armed.name.clear();
    any_armed.store(false, std::memory_order_relaxed);
  }
  LOG(WARNING) << "stall point " << name << " (SHARDPS_STALL_POINT): this thread stops for "
               << stall.count() << " ms";
  std::this_thread::sleep_for(stall);
  served.fetch_add(1);
  LOG(WARNING) << "stall point " << name << ": resumed";
}

bool StallPointDue(const char* name) {
  if (!any_armed.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> l(mu);
  return !armed.name.empty() && armed.name == name && armed.reached + 1 == armed.nth;
}

void ArmStallPointForTest(const std::string& name, long long nth,
                          std::chrono::milliseconds stall) {
  LoadEnv();
  std::lock_guard<std::mutex> l(mu);
  armed = Armed{name, std::max(1LL, nth), stall, 0};
  any_armed.store(!name.empty(), std::memory_order_relaxed);
}

long long StallPointsServed() { return served.load(); }

}  // namespace shardps
