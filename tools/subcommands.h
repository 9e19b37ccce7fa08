// The subcommands of the `shardps` binary. Each takes argv with the subcommand name as argv[0]
// and returns the process exit status (0 ok, 1 a problem found, 2 usage error).
#ifndef SHARDPS_TOOLS_SUBCOMMANDS_H_
#define SHARDPS_TOOLS_SUBCOMMANDS_H_

namespace shardps::tools {

int DoctorMain(int argc, char** argv);  // tools/doctor_main.cc
int StatusMain(int argc, char** argv);  // tools/status_main.cc

}  // namespace shardps::tools

#endif  // SHARDPS_TOOLS_SUBCOMMANDS_H_
