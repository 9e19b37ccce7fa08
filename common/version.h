// The version and build options of this build, and the command line every ShardPS program
// parses the same way: --help shows the program's own flags first and exits 0, --helpfull
// every flag (glog's too), --version the version and build options.
//
// Thread safety: BuildVersion() is thread-safe; ParseCommandLine is called once, from main,
// before any other thread exists.
#ifndef SHARDPS_COMMON_VERSION_H_
#define SHARDPS_COMMON_VERSION_H_

namespace shardps {

// "0.1.0 (git 531ef90; RelWithDebInfo; verbs on; cuda on; GNU 12.2.0)". Static storage.
const char* BuildVersion();

// Parses argc/argv with gflags (removing the flags it parsed). Before that it answers, and
// exits 0 after printing to stdout:
//   --help, -h, -help, --helpshort   `usage`, then this program's flags (those defined in
//                                    `main_file` first, then the other ShardPS flags it links,
//                                    grouped by source file relative to the source tree), and
//                                    a line on --helpfull;
//   --helpfull                      gflags' list of every flag (glog's too);
//   --version                       "PROGRAM VERSION".
// Anything after a bare "--" is left alone. An unknown flag is gflags' error (exit 1).
void ParseCommandLine(int* argc, char*** argv, const char* usage, const char* main_file);

}  // namespace shardps

#endif  // SHARDPS_COMMON_VERSION_H_
