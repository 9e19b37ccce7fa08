// `shardps SUBCOMMAND [flags]`: one binary for the operator tools. Add a subcommand with one
// row in kSubcommands (and its declaration in tools/subcommands.h).
#include <cstdio>
#include <cstring>
#include <string>

#include "common/version.h"
#include "tools/subcommands.h"

namespace {

struct Subcommand {
  const char* name;
  int (*main)(int argc, char** argv);
  const char* help;
};

const Subcommand kSubcommands[] = {
    {"doctor", shardps::tools::DoctorMain,
     "check this host (RDMA devices, GIDs, memlock, huge pages, fork safety), the "
     "coordinator and peers; probe one-sided bandwidth and latency per pair"},
    {"status", shardps::tools::StatusMain,
     "ask a running cluster's coordinator who is in it and how it is doing"},
};

int Usage(FILE* out) {
  std::fprintf(out,
               "usage: shardps SUBCOMMAND [--flags]   (shardps SUBCOMMAND --help)\n"
               "       shardps --version\n\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-8s %s\n", s.name, s.help);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage(stderr);
  if (!std::strcmp(argv[1], "help") || !std::strcmp(argv[1], "--help") ||
      !std::strcmp(argv[1], "-h")) {
    Usage(stdout);
    return 0;
  }
  if (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version")) {
    std::printf("shardps %s\n", shardps::BuildVersion());
    return 0;
  }
  for (const Subcommand& s : kSubcommands) {
    if (!std::strcmp(argv[1], s.name)) {
      // The subcommand's argv[0] names it as its user typed it ("shardps doctor"): its --help
      // and --version say so.
      std::string name = std::string("shardps ") + s.name;
      argv[1] = name.data();
      return s.main(argc - 1, argv + 1);
    }
  }
  std::fprintf(stderr, "shardps: unknown subcommand '%s'\n\n", argv[1]);
  return Usage(stderr);
}
