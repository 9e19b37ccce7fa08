// cuda_staging.h with CUDA: pinned host mirrors, one blocking stream, one event per piece.
#include "worker/cuda_staging.h"

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include <glog/logging.h>

namespace shardps::worker {
namespace {

Status CudaError(const std::string& what, cudaError_t e) {
  return InternalError(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// RAII for what the staging owns. Deleters log, never throw.
struct PinnedDeleter {
  void operator()(void* p) const {
    if (p != nullptr && cudaFreeHost(p) != cudaSuccess) LOG(ERROR) << "cudaFreeHost failed";
  }
};
using PinnedPtr = std::unique_ptr<void, PinnedDeleter>;

class CudaStagingImpl final : public CudaStaging {
 public:
  CudaStagingImpl(float* dw, float* dg, uint64_t bytes, uint64_t piece)
      : dev_weights_(dw), dev_grads_(dg), bytes_(bytes), piece_(piece) {}
  ~CudaStagingImpl() override {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) {
      LOG(ERROR) << "cudaStreamDestroy failed";
    }
  }

  Status Init() {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes_, cudaHostAllocDefault);
    if (e != cudaSuccess) return CudaError("cudaHostAlloc weights", e);
    host_weights_.reset(p);
    e = cudaHostAlloc(&p, bytes_, cudaHostAllocDefault);
    if (e != cudaSuccess) return CudaError("cudaHostAlloc grads", e);
    host_grads_.reset(p);
    // A blocking stream: ordered after the legacy default stream, where the trainer's kernels
    // that produced the gradients run unless it chose another stream.
    e = cudaStreamCreate(&stream_);
    if (e != cudaSuccess) return CudaError("cudaStreamCreate", e);
    const uint64_t pieces = (bytes_ + piece_ - 1) / piece_;
    events_.resize(pieces, nullptr);
    for (auto& ev : events_) {
      e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e != cudaSuccess) return CudaError("cudaEventCreate", e);
    }
    return Status::OK();
  }

  float* host_weights() const override { return static_cast<float*>(host_weights_.get()); }
  float* host_grads() const override { return static_cast<float*>(host_grads_.get()); }
  uint64_t piece_bytes() const override { return piece_; }

  Status StartGradsToHost() override {
    for (uint64_t i = 0; i < events_.size(); ++i) {
      const uint64_t off = i * piece_;
      const uint64_t len = std::min(piece_, bytes_ - off);
      cudaError_t e = cudaMemcpyAsync(static_cast<char*>(host_grads_.get()) + off,
                                      reinterpret_cast<char*>(dev_grads_) + off, len,
                                      cudaMemcpyDeviceToHost, stream_);
      if (e != cudaSuccess) return CudaError("cudaMemcpyAsync D2H", e);
      e = cudaEventRecord(events_[i], stream_);
      if (e != cudaSuccess) return CudaError("cudaEventRecord", e);
    }
    return Status::OK();
  }

  StatusOr<bool> GradsOnHost(uint64_t end) override {
    if (end == 0) return true;
    const uint64_t piece = std::min<uint64_t>((end - 1) / piece_, events_.size() - 1);
    const cudaError_t e = cudaEventQuery(events_[piece]);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return CudaError("cudaEventQuery", e);
  }

  Status WeightsToDevice(uint64_t offset, uint64_t length) override {
    const cudaError_t e = cudaMemcpyAsync(reinterpret_cast<char*>(dev_weights_) + offset,
                                          static_cast<char*>(host_weights_.get()) + offset,
                                          length, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return CudaError("cudaMemcpyAsync H2D", e);
    return Status::OK();
  }

  Status WeightsToHost() override {
    cudaError_t e = cudaMemcpyAsync(host_weights_.get(), dev_weights_, bytes_,
                                    cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) return CudaError("cudaMemcpyAsync D2H weights", e);
    return SyncWeights();
  }

  Status SyncWeights() override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaError("cudaStreamSynchronize", e);
    return Status::OK();
  }

 private:
  float* const dev_weights_;
  float* const dev_grads_;
  const uint64_t bytes_;
  const uint64_t piece_;
  PinnedPtr host_weights_;
  PinnedPtr host_grads_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

bool IsCudaDevicePointer(const void* ptr) {
  if (ptr == nullptr) return false;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // no driver or no device: nothing can be device memory
    return false;
  }
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

StatusOr<std::unique_ptr<CudaStaging>> CudaStaging::Create(float* device_weights,
                                                           float* device_grads, uint64_t bytes,
                                                           uint64_t piece_bytes) {
  if (bytes == 0 || piece_bytes == 0) {
    return InvalidArgumentError("CUDA staging needs bytes > 0 and piece_bytes > 0");
  }
  auto s = std::make_unique<CudaStagingImpl>(device_weights, device_grads, bytes, piece_bytes);
  RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<CudaStaging>(std::move(s));
}

}  // namespace shardps::worker
