// Status lives in the public header set (worker/include/shardps/status.h), as LevelDB keeps
// its Status in include/leveldb/; internal code includes it through this path.
#ifndef SHARDPS_COMMON_STATUS_H_
#define SHARDPS_COMMON_STATUS_H_

#include "shardps/status.h"

#endif  // SHARDPS_COMMON_STATUS_H_
