// The model a configuration trains, as the tools (shardps doctor, shardps plan) read it:
//
//   model      = bytes | file
//   bytes      = digits [suffix]         ; "268435456", "256MiB", "1G"; one float32 tensor
//   suffix     = "K" | "KiB" | "M" | "MiB" | "G" | "GiB"   ; powers of 1024
//   file       = line*                   ; a path to a text file
//   line       = name dim+ | table | "#" comment | blank   ; one float32 tensor per line
//   table      = "embedding" name rows dim ["max_ids=" n]    ; a row table (default 16384)
//
// e.g. "fc1.weight 784 256", "embedding items 10000000 64 max_ids=8192". A file takes precedence
// when the argument names one.
//
// Thread safety: free functions, no state.
#ifndef SHARDPS_TOOLS_MODEL_SPEC_H_
#define SHARDPS_TOOLS_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/shard_plan.h"

namespace shardps::tools {

// Parses "256MiB" style sizes (the bytes form above).
StatusOr<uint64_t> ParseBytes(const std::string& text);

// Tensors of the model named by `model` (a size or a file, see above).
StatusOr<std::vector<TensorSpec>> LoadModelSpec(const std::string& model);

// Parses the file form from text (`origin` names it in errors).
StatusOr<std::vector<TensorSpec>> ParseModelSpec(const std::string& text,
                                                 const std::string& origin);

}  // namespace shardps::tools

#endif  // SHARDPS_TOOLS_MODEL_SPEC_H_
