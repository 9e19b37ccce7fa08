// Helpers shared by the ps-lite drivers (bench/pslite_rows_bench.cc, bench/pslite_dense_bench.cc),
// which are built outside ShardPS's build by bench/pslite_lib.sh (plain g++ -std=c++14, no
// ShardPS library): comma lists, a monotonic clock, and --name=value flags.
//
// Thread safety: free functions over values.
#ifndef SHARDPS_BENCH_PSLITE_DRIVER_UTIL_H_
#define SHARDPS_BENCH_PSLITE_DRIVER_UTIL_H_

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace pslite_driver {

inline std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) {
    if (!x.empty()) v.push_back(x);
  }
  return v;
}

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Calls set(name, value) for every --name=value argument; exits 2 with a message naming `prog`
// on an argument of another form, or when set returns false (an unknown name).
inline void ParseFlags(int argc, char** argv, const char* prog,
                       const std::function<bool(const std::string&, const std::string&)>& set) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      fprintf(stderr, "%s: bad argument %s (want --name=value)\n", prog, a.c_str());
      exit(2);
    }
    const std::string k = a.substr(2, eq - 2), v = a.substr(eq + 1);
    if (!set(k, v)) {
      fprintf(stderr, "%s: unknown flag --%s\n", prog, k.c_str());
      exit(2);
    }
  }
}

}  // namespace pslite_driver

#endif  // SHARDPS_BENCH_PSLITE_DRIVER_UTIL_H_
