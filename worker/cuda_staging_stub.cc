// cuda_staging.h in a build without CUDA: no pointer is a device pointer.
#include "worker/cuda_staging.h"

namespace shardps::worker {

bool IsCudaDevicePointer(const void*) { return false; }

StatusOr<std::unique_ptr<CudaStaging>> CudaStaging::Create(float*, float*, uint64_t, uint64_t) {
  return UnimplementedError("CUDA staging needs a build with CUDA (SHARDPS_HAVE_CUDA)");
}

}  // namespace shardps::worker
