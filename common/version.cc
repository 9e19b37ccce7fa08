#include "common/version.h"

#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/build_info.h"

namespace shardps {
namespace {

// "ON"/"OFF" (CMake's) as "on"/"off".
const char* OnOff(const char* cmake_bool) {
  return (std::strcmp(cmake_bool, "ON") == 0 || std::strcmp(cmake_bool, "1") == 0 ||
          std::strcmp(cmake_bool, "TRUE") == 0)
             ? "on"
             : "off";
}

// The ShardPS source directories: a flag defined in one of them is ours (the build maps the
// source root away from __FILE__, -fmacro-prefix-map); glog's and gflags' are not.
bool IsProjectFile(const std::string& file) {
  static const char* const kDirs[] = {"common/", "transport/", "proto/", "server/", "worker/",
                                      "tools/",  "examples/",  "tests/", "bench/",  "python/"};
  for (const char* d : kDirs) {
    if (file.compare(0, std::strlen(d), d) == 0) return true;
  }
  return false;
}

void PrintFlag(const gflags::CommandLineFlagInfo& f) {
  std::string line = "    --" + f.name;
  std::string def = f.type == "string" ? "\"" + f.default_value + "\"" : f.default_value;
  std::printf("%s (%s)\n      type: %s  default: %s\n", line.c_str(), f.description.c_str(),
              f.type.c_str(), def.c_str());
}

void PrintHelp(const char* program, const char* usage, const char* main_file) {
  std::printf("%s\n\n", usage);
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);  // sorted by file, then name
  std::map<std::string, std::vector<gflags::CommandLineFlagInfo>> others;
  bool any_own = false;
  for (const auto& f : flags) {
    if (f.filename == main_file) {
      if (!any_own) std::printf("  %s flags:\n", program);
      any_own = true;
      PrintFlag(f);
    } else if (IsProjectFile(f.filename)) {
      others[f.filename].push_back(f);
    }
  }
  for (const auto& [file, list] : others) {
    std::printf("\n  from %s:\n", file.c_str());
    for (const auto& f : list) PrintFlag(f);
  }
  std::printf(
      "\n  Logging (glog) flags such as --v, --logtostderr, --log_dir, --minloglevel, and the\n"
      "  flag-file flags: %s --helpfull lists every flag.\n",
      program);
}

}  // namespace

const char* BuildVersion() {
  static const std::string v = std::string(SHARDPS_BUILD_VERSION) + " (git " + SHARDPS_BUILD_GIT +
                               "; " + SHARDPS_BUILD_TYPE + "; verbs " + OnOff(SHARDPS_BUILD_VERBS) +
                               "; cuda " + OnOff(SHARDPS_BUILD_CUDA) + "; " +
                               SHARDPS_BUILD_COMPILER + ")";
  return v.c_str();
}

void ParseCommandLine(int* argc, char*** argv, const char* usage, const char* main_file) {
  const char* argv0 = (*argc > 0 && (*argv)[0] != nullptr) ? (*argv)[0] : "shardps";
  const char* slash = std::strrchr(argv0, '/');
  const char* program = slash ? slash + 1 : argv0;
  gflags::SetUsageMessage(usage);
  gflags::SetVersionString(BuildVersion());
  for (int i = 1; i < *argc; ++i) {
    const char* a = (*argv)[i];
    if (std::strcmp(a, "--") == 0) break;
    if (!std::strcmp(a, "--help") || !std::strcmp(a, "-help") || !std::strcmp(a, "-h") ||
        !std::strcmp(a, "--helpshort") || !std::strcmp(a, "-helpshort")) {
      PrintHelp(program, usage, main_file);
      std::fflush(stdout);
      std::exit(0);
    }
    if (!std::strcmp(a, "--version") || !std::strcmp(a, "-version")) {
      std::printf("%s %s\n", program, BuildVersion());
      std::fflush(stdout);
      std::exit(0);
    }
    if (!std::strcmp(a, "--helpfull") || !std::strcmp(a, "-helpfull")) {
      gflags::ShowUsageWithFlags(program);  // the usage message, then every flag
      std::fflush(stdout);
      std::exit(0);
    }
  }
  gflags::ParseCommandLineFlags(argc, argv, true);
}

}  // namespace shardps
