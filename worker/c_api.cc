// The C API (worker/include/shardps/c_api.h) over shardps::Client. Every entry point catches
// everything: no exception crosses into C.
#include "shardps/c_api.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "common/version.h"
#include "shardps/client.h"

struct shardps_client {
  std::unique_ptr<shardps::Client> impl;
};

namespace {

using shardps::Status;
using shardps::StatusCode;

// The C codes are the C++ codes.
static_assert(SHARDPS_OK == static_cast<int>(StatusCode::kOk));
static_assert(SHARDPS_CANCELLED == static_cast<int>(StatusCode::kCancelled));
static_assert(SHARDPS_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(SHARDPS_DEADLINE_EXCEEDED == static_cast<int>(StatusCode::kDeadlineExceeded));
static_assert(SHARDPS_NOT_FOUND == static_cast<int>(StatusCode::kNotFound));
static_assert(SHARDPS_FAILED_PRECONDITION == static_cast<int>(StatusCode::kFailedPrecondition));
static_assert(SHARDPS_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(SHARDPS_UNAVAILABLE == static_cast<int>(StatusCode::kUnavailable));
static_assert(SHARDPS_DATA_LOSS == static_cast<int>(StatusCode::kDataLoss));
static_assert(SHARDPS_PATH_CUDA_STAGED == static_cast<int>(shardps::TensorPath::kCudaStaged));

int Fill(shardps_error* err, int code, const std::string& message) {
  if (err != nullptr) {
    err->code = code;
    const size_t n = std::min(message.size(), sizeof(err->message) - 1);
    std::memcpy(err->message, message.data(), n);
    err->message[n] = '\0';
  }
  return code;
}

int Report(shardps_error* err, const Status& s) {
  return Fill(err, static_cast<int>(s.code()), s.message());
}

// Runs fn (returning Status), turning any exception into SHARDPS_INTERNAL.
template <typename Fn>
int Guard(shardps_error* err, Fn&& fn) {
  try {
    return Report(err, fn());
  } catch (const std::exception& e) {
    return Fill(err, SHARDPS_INTERNAL, std::string("unexpected C++ exception: ") + e.what());
  } catch (...) {
    return Fill(err, SHARDPS_INTERNAL, "unexpected C++ exception");
  }
}

Status NeedClient(const shardps_client* c) {
  if (c == nullptr || c->impl == nullptr) return shardps::InvalidArgumentError("null client");
  return Status::OK();
}

Status Null(const char* what) { return shardps::InvalidArgumentError(std::string("null ") + what); }

Status CopyOut(const std::string& s, char* buf, size_t capacity) {
  if (buf == nullptr || capacity == 0) return Null("buffer");
  const size_t n = std::min(s.size(), capacity - 1);
  std::memcpy(buf, s.data(), n);
  buf[n] = '\0';
  if (n < s.size()) {
    return shardps::OutOfRangeError("truncated to " + std::to_string(capacity - 1) + " of " +
                                    std::to_string(s.size()) + " bytes");
  }
  return Status::OK();
}

}  // namespace

extern "C" {

void shardps_options_init(shardps_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  const shardps::ClientOptions d;
  o->requested_rank = d.requested_rank;
  o->transport = "auto";
  o->rdma_gid_index = d.rdma_gid_index;
  o->setup_timeout_ms = d.setup_timeout.count();
  o->wait_timeout_ms = d.wait_timeout.count();
  o->cuda_pipeline_bytes = d.cuda_pipeline_bytes;
}

const char* shardps_code_name(int code) {
  if (code == SHARDPS_OK) return "OK";
  if (code < 0 || code > SHARDPS_DATA_LOSS || code == 2) return "UNKNOWN";
  return shardps::StatusCodeName(static_cast<StatusCode>(code));
}

const char* shardps_version(void) { return shardps::BuildVersion(); }

int shardps_client_connect(const shardps_options* o, shardps_client** out, shardps_error* err) {
  if (out != nullptr) *out = nullptr;
  return Guard(err, [&]() -> Status {
    if (o == nullptr) return Null("options");
    if (out == nullptr) return Null("out");
    if (o->coordinator == nullptr || o->coordinator[0] == '\0') {
      return shardps::InvalidArgumentError("options.coordinator is required");
    }
    if (o->setup_timeout_ms <= 0 || o->wait_timeout_ms <= 0) {
      return shardps::InvalidArgumentError("timeouts must be > 0 ms (shardps_options_init?)");
    }
    auto str = [](const char* s, const char* dflt) { return std::string(s ? s : dflt); };
    shardps::ClientOptions co;
    co.coordinator = o->coordinator;
    co.cluster_token = str(o->cluster_token, "");
    co.requested_rank = o->requested_rank;
    co.transport = str(o->transport, "auto");
    co.bind_ip = str(o->bind_ip, "");
    co.rdma_device = str(o->rdma_device, "");
    co.rdma_gid_index = o->rdma_gid_index;
    co.setup_timeout = std::chrono::milliseconds(o->setup_timeout_ms);
    co.wait_timeout = std::chrono::milliseconds(o->wait_timeout_ms);
    co.cuda_pipeline_bytes = o->cuda_pipeline_bytes;
    auto client = shardps::Client::Connect(co);
    if (!client.ok()) return client.status();
    auto handle = std::make_unique<shardps_client>();
    handle->impl = std::move(client).value();
    *out = handle.release();
    return Status::OK();
  });
}

void shardps_client_destroy(shardps_client* client) {
  try {
    delete client;  // ~Client leaves the cluster
  } catch (...) {
  }
}

int shardps_client_register_tensor(shardps_client* c, const char* name, float* weights,
                                   float* grads, const int64_t* shape, size_t ndim,
                                   shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (shape == nullptr && ndim > 0) return Null("shape");
    if (ndim == 0) return shardps::InvalidArgumentError("a tensor needs ndim >= 1");
    std::vector<int64_t> dims(shape, shape + ndim);
    return c->impl->RegisterTensor(name, weights, grads, dims);
  });
}

int shardps_client_register_tensor_typed(shardps_client* c, const char* name, void* weights,
                                         void* grads, const int64_t* shape, size_t ndim,
                                         uint32_t dtype, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (shape == nullptr && ndim > 0) return Null("shape");
    if (ndim == 0) return shardps::InvalidArgumentError("a tensor needs ndim >= 1");
    if (dtype > 2) return shardps::InvalidArgumentError("unknown dtype (0, 1, 2)");
    std::vector<int64_t> dims(shape, shape + ndim);
    return c->impl->RegisterTensor(name, weights, grads, dims,
                                   static_cast<shardps::TensorDType>(dtype));
  });
}

void shardps_embedding_options_init(shardps_embedding_options* o) {
  if (o == nullptr) return;
  const shardps::EmbeddingOptions d;
  o->max_ids = d.max_ids;
  o->init = static_cast<uint32_t>(d.init);
  o->init_scale = d.init_scale;
  o->init_seed = d.init_seed;
}

int shardps_client_register_embedding(shardps_client* c, const char* name, int64_t rows,
                                      int64_t dim, uint32_t dtype,
                                      const shardps_embedding_options* options,
                                      shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (dtype > 2) return shardps::InvalidArgumentError("unknown dtype (0, 1, 2)");
    shardps::EmbeddingOptions o;
    if (options != nullptr) {
      if (options->init > 2) return shardps::InvalidArgumentError("unknown init (0, 1, 2)");
      o.max_ids = options->max_ids;
      o.init = static_cast<shardps::EmbeddingOptions::Init>(options->init);
      o.init_scale = options->init_scale;
      o.init_seed = options->init_seed;
    }
    return c->impl->RegisterEmbedding(name, rows, dim, static_cast<shardps::TensorDType>(dtype),
                                      o);
  });
}

int shardps_client_pull_rows(shardps_client* c, const char* name, const int64_t* ids, size_t n,
                             void* out, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    return c->impl->PullRows(name, ids, n, out);
  });
}

int shardps_client_add_row_gradients(shardps_client* c, const char* name, const int64_t* ids,
                                     size_t n, const void* grads, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    return c->impl->AddRowGradients(name, ids, n, grads);
  });
}

int shardps_client_scale_row_gradients(shardps_client* c, const char* name, float factor,
                                       int* finite, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    ASSIGN_OR_RETURN(const bool all_finite, c->impl->ScaleRowGradients(name, factor));
    if (finite != nullptr) *finite = all_finite ? 1 : 0;
    return Status::OK();
  });
}

int shardps_client_row_gradients_squared_norm(shardps_client* c, const char* name, double* sum,
                                              shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (sum == nullptr) return Null("sum");
    ASSIGN_OR_RETURN(*sum, c->impl->RowGradientsSquaredNorm(name));
    return Status::OK();
  });
}

int shardps_client_clear_row_gradients(shardps_client* c, const char* name, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    return c->impl->ClearRowGradients(name);
  });
}

int shardps_client_set_state(shardps_client* c, const char* name, uint32_t part,
                             const float* values, uint64_t steps, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (part < 1 || part > 4 || (part == 4 && values != nullptr)) {
      return shardps::InvalidArgumentError(
          "part must be 1 (weights), 2 (state 1), 3 (state 2) or 4 (no state, values NULL)");
    }
    const auto p = static_cast<shardps::Client::StatePart>(part);
    return values == nullptr ? c->impl->SetState(name, p, steps)
                             : c->impl->SetStateValues(name, p, values, steps);
  });
}

int shardps_client_get_state(shardps_client* c, const char* name, float* weights, float* state1,
                             float* state2, uint64_t* steps, int* has1, int* has2,
                             shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    bool h1 = false, h2 = false;
    RETURN_IF_ERROR(c->impl->GetState(name, weights, state1, state2, steps, &h1, &h2));
    if (has1 != nullptr) *has1 = h1 ? 1 : 0;
    if (has2 != nullptr) *has2 = h2 ? 1 : 0;
    return Status::OK();
  });
}

int shardps_client_set_rows(shardps_client* c, const char* name, uint32_t part,
                            const int64_t* ids, size_t n, const float* values, uint64_t steps,
                            shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (part < 1 || part > 3) {
      return shardps::InvalidArgumentError("part must be 1 (values), 2 (state 1) or 3 (state 2)");
    }
    return c->impl->SetRows(name, static_cast<shardps::Client::StatePart>(part), ids, n, values, steps);
  });
}

int shardps_client_get_rows(shardps_client* c, const char* name, const int64_t* ids, size_t n,
                            float* weights, float* state1, float* state2, uint64_t* steps,
                            int* has1, int* has2, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    shardps::Client::RowStateInfo info;
    RETURN_IF_ERROR(c->impl->GetRows(name, ids, n, weights, state1, state2, &info));
    if (steps != nullptr) *steps = info.steps;
    if (has1 != nullptr) *has1 = info.has1 ? 1 : 0;
    if (has2 != nullptr) *has2 = info.has2 ? 1 : 0;
    return Status::OK();
  });
}

int shardps_client_table_keys(shardps_client* c, const char* name, int64_t* keys,
                              size_t capacity, size_t* count, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (count == nullptr) return Null("count");
    ASSIGN_OR_RETURN(std::vector<int64_t> all, c->impl->TableKeys(name));
    *count = all.size();
    if (all.size() > capacity) {
      return shardps::ResourceExhaustedError("table '" + std::string(name) + "' has " +
                                    std::to_string(all.size()) + " keys; capacity " +
                                    std::to_string(capacity));
    }
    if (!all.empty()) {
      if (keys == nullptr) return Null("keys");
      std::memcpy(keys, all.data(), all.size() * sizeof(int64_t));
    }
    return Status::OK();
  });
}

int shardps_client_mark_non_finite(shardps_client* c, int non_finite, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    c->impl->MarkNonFinite(non_finite != 0);
    return Status::OK();
  });
}

int shardps_client_set_no_gradient(shardps_client* c, const char* name, int no_gradient,
                                   shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    return c->impl->SetNoGradient(name, no_gradient != 0);
  });
}

int shardps_built_with_cuda(void) { return shardps::BuiltWithCuda() ? 1 : 0; }

int shardps_client_start(shardps_client* c, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->Start();
  });
}

int shardps_client_push(shardps_client* c, const char* name, uint64_t* handle, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (handle == nullptr) return Null("handle");
    auto h = c->impl->Push(name);
    if (!h.ok()) return h.status();
    *handle = h->id;
    return Status::OK();
  });
}

int shardps_client_pull(shardps_client* c, const char* name, uint64_t* handle, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (handle == nullptr) return Null("handle");
    auto h = c->impl->Pull(name);
    if (!h.ok()) return h.status();
    *handle = h->id;
    return Status::OK();
  });
}

int shardps_client_wait(shardps_client* c, uint64_t handle, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->Wait(shardps::Handle{handle});
  });
}

int shardps_client_clock(shardps_client* c, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->Clock();
  });
}

int shardps_client_set_learning_rate(shardps_client* c, const char* name, float lr,
                                     shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->SetLearningRate(name == nullptr ? "" : name, lr);
  });
}

int shardps_client_set_update_rule(shardps_client* c, const char* name,
                                   const shardps_update_rule* r, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (r == nullptr) return shardps::InvalidArgumentError("rule is NULL");
    if (r->kind > 5) return shardps::InvalidArgumentError("unknown update rule kind");
    shardps::UpdateRule u;
    u.kind = static_cast<shardps::UpdateRule::Kind>(r->kind);
    u.lr = r->lr;
    u.momentum = r->momentum;
    u.dampening = r->dampening;
    u.nesterov = r->nesterov != 0;
    u.weight_decay = r->weight_decay;
    u.beta1 = r->beta1;
    u.beta2 = r->beta2;
    u.eps = r->eps;
    if (u.kind == shardps::UpdateRule::Kind::kAdagrad) {  // the wire's field use
      u.lr_decay = r->momentum;
      u.initial_accumulator_value = r->dampening;
    }
    return c->impl->SetUpdateRule(name == nullptr ? "" : name, u);
  });
}

int shardps_client_step(shardps_client* c, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->Step();
  });
}

int shardps_client_request_checkpoint(shardps_client* c, const char* dir, uint64_t* clock,
                                      shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    auto k = c->impl->RequestCheckpoint(dir == nullptr ? "" : dir);
    if (!k.ok()) return k.status();
    if (clock != nullptr) *clock = *k;
    return Status::OK();
  });
}

int shardps_client_barrier(shardps_client* c, uint64_t timeout_ms, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    // Beyond 30 years is "for ever" (and would overflow the steady clock's deadline).
    const uint64_t most = uint64_t{1} << 40;
    return c->impl->Barrier(std::chrono::milliseconds(std::min(timeout_ms, most)));
  });
}

int shardps_client_close(shardps_client* c, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return c->impl->Close();
  });
}

int shardps_client_rank(const shardps_client* c, uint32_t* rank, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (rank == nullptr) return Null("rank");
    *rank = c->impl->rank();
    return Status::OK();
  });
}

int shardps_client_num_workers(const shardps_client* c, uint32_t* n, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (n == nullptr) return Null("n");
    *n = c->impl->num_workers();
    return Status::OK();
  });
}

int shardps_client_clock_value(const shardps_client* c, uint64_t* clock, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (clock == nullptr) return Null("clock");
    *clock = c->impl->clock();
    return Status::OK();
  });
}

int shardps_client_barrier_generation(const shardps_client* c, uint64_t* generation,
                                      shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (generation == nullptr) return Null("generation");
    *generation = c->impl->barrier_generation();
    return Status::OK();
  });
}

int shardps_client_consistency(const shardps_client* c, char* buf, size_t capacity,
                               shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return CopyOut(c->impl->consistency(), buf, capacity);
  });
}

int shardps_client_transport(const shardps_client* c, char* buf, size_t capacity,
                             shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    return CopyOut(c->impl->transport_name(), buf, capacity);
  });
}

int shardps_client_counters(const shardps_client* c, shardps_counters* out, shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (out == nullptr) return Null("out");
    const shardps::ClientCounters k = c->impl->counters();
    out->control_messages_sent = k.control_messages_sent;
    out->heartbeats_sent = k.heartbeats_sent;
    out->pushes = k.pushes;
    out->pulls = k.pulls;
    out->pull_retries = k.pull_retries;
    out->failovers = k.failovers;
    out->pushes_resent = k.pushes_resent;
    out->pushes_lost = k.pushes_lost;
    out->bytes_pushed = k.bytes_pushed;
    out->bytes_pulled = k.bytes_pulled;
    return Status::OK();
  });
}

int shardps_client_tensor_path(const shardps_client* c, const char* name, int* path,
                               shardps_error* err) {
  return Guard(err, [&]() -> Status {
    RETURN_IF_ERROR(NeedClient(c));
    if (name == nullptr) return Null("name");
    if (path == nullptr) return Null("path");
    auto p = c->impl->tensor_path(name);
    if (!p.ok()) return p.status();
    *path = static_cast<int>(*p);
    return Status::OK();
  });
}

}  // extern "C"
