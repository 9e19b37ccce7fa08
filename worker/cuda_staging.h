// CUDA support of the worker library: recognising device pointers, and the pinned-host staging
// pipeline for device tensors that the fabric cannot register directly. Internal.
//
// Staging, per tensor: pinned host mirrors of its weights and gradients (registered with the
// fabric once, like any host tensor), one CUDA stream and one event per piece.
//   push: StartGradsToHost() enqueues the device->host copies of every piece; the client posts
//         the network write of a piece as soon as GradsOnHost() reports it copied, so the copy
//         of piece k+1 runs on the copy engine while piece k is on the wire.
//   pull: each shard chunk, once read consistently into the host mirror, is sent back with
//         WeightsToDevice() while the other chunks are still being read; SyncWeights() waits
//         for the last copy.
// The stream is a blocking stream, so it is ordered after work on the legacy default stream.
//
// Built with CUDA (SHARDPS_HAVE_CUDA) from cuda_staging.cc, otherwise cuda_staging_stub.cc
// (no device pointer is ever recognised, Create fails with kUnimplemented).
//
// Thread safety: a CudaStaging belongs to the client's thread. IsCudaDevicePointer is
// thread-safe.
#ifndef SHARDPS_WORKER_CUDA_STAGING_H_
#define SHARDPS_WORKER_CUDA_STAGING_H_

#include <cstdint>
#include <memory>

#include "shardps/status.h"

namespace shardps::worker {

// True if ptr is CUDA device memory. False for host memory, in builds without CUDA, and on
// machines without a CUDA device or driver (the CUDA error is cleared, never reported).
bool IsCudaDevicePointer(const void* ptr);

class CudaStaging {
 public:
  // For one tensor of `bytes` bytes whose weights and gradients are at the device addresses
  // given; piece_bytes is the pipeline granularity (> 0).
  static StatusOr<std::unique_ptr<CudaStaging>> Create(float* device_weights,
                                                       float* device_grads, uint64_t bytes,
                                                       uint64_t piece_bytes);
  virtual ~CudaStaging() = default;
  CudaStaging(const CudaStaging&) = delete;
  CudaStaging& operator=(const CudaStaging&) = delete;

  // Pinned host mirrors, `bytes` each.
  virtual float* host_weights() const = 0;
  virtual float* host_grads() const = 0;
  virtual uint64_t piece_bytes() const = 0;

  // Enqueues the device->host copy of the whole gradient, one event per piece.
  virtual Status StartGradsToHost() = 0;
  // Non-blocking: whether gradient bytes [0, end) have reached the host mirror.
  virtual StatusOr<bool> GradsOnHost(uint64_t end) = 0;
  // Enqueues the host->device copy of weight bytes [offset, offset + length).
  virtual Status WeightsToDevice(uint64_t offset, uint64_t length) = 0;
  // Blocks until every enqueued weight copy has finished.
  virtual Status SyncWeights() = 0;
  // Copies the device weights into the host mirror and waits (start-up: rank 0 publishes its
  // initial weights from the mirror).
  virtual Status WeightsToHost() = 0;

 protected:
  CudaStaging() = default;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_CUDA_STAGING_H_
