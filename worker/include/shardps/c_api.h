/* The C API of libshardps (libshardps.so): the worker client for C, ctypes and cffi callers.
 *
 *   shardps_options o;
 *   shardps_options_init(&o);
 *   o.coordinator = "10.0.0.1:7070";
 *   o.cluster_token = "secret";
 *   shardps_client* c = NULL;
 *   shardps_error err;
 *   if (shardps_client_connect(&o, &c, &err) != SHARDPS_OK) { puts(err.message); ... }
 *   int64_t shape[2] = {256, 64};
 *   shardps_client_register_tensor(c, "fc1.weight", w, g, shape, 2, &err);
 *   shardps_client_start(c, &err);
 *   for (...) { compute gradients into g; shardps_client_step(c, &err); }
 *   shardps_client_destroy(c);   (leaves the cluster)
 *
 * Errors. Every function that can fail returns a shardps_code (SHARDPS_OK = 0; the other codes
 * are those of shardps::StatusCode, see status.h) and, when `err` is not NULL, fills it with
 * the code and a NUL-terminated message (truncated to fit). On success err->code is SHARDPS_OK
 * and err->message is "". No C++ exception ever crosses this boundary: one thrown inside
 * (std::bad_alloc, ...) is reported as SHARDPS_INTERNAL.
 *
 * Handles. shardps_client is opaque; it is created by shardps_client_connect and released by
 * shardps_client_destroy (NULL is accepted). Tensor memory stays the caller's: it is
 * registered, never copied, and must outlive the client. Passing NULL where a handle or an out
 * pointer is required returns SHARDPS_INVALID_ARGUMENT.
 *
 * Thread safety. A shardps_client is used by one thread at a time (the training loop's); calls
 * on one client from several threads at once need the caller's lock. Distinct clients are
 * independent and may be used from distinct threads concurrently. shardps_options_init and
 * shardps_code_name are thread-safe. A shardps_error belongs to its caller.
 */
#ifndef SHARDPS_C_API_H_
#define SHARDPS_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "shardps/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum shardps_code {
  SHARDPS_OK = 0,
  SHARDPS_CANCELLED = 1,
  SHARDPS_INVALID_ARGUMENT = 3,
  SHARDPS_DEADLINE_EXCEEDED = 4,
  SHARDPS_NOT_FOUND = 5,
  SHARDPS_ALREADY_EXISTS = 6,
  SHARDPS_PERMISSION_DENIED = 7,
  SHARDPS_RESOURCE_EXHAUSTED = 8,
  SHARDPS_FAILED_PRECONDITION = 9,
  SHARDPS_ABORTED = 10,
  SHARDPS_OUT_OF_RANGE = 11,
  SHARDPS_UNIMPLEMENTED = 12,
  SHARDPS_INTERNAL = 13,
  SHARDPS_UNAVAILABLE = 14,
  SHARDPS_DATA_LOSS = 15
} shardps_code;

#define SHARDPS_ERROR_MESSAGE_BYTES 512

typedef struct shardps_error {
  int code; /* a shardps_code */
  char message[SHARDPS_ERROR_MESSAGE_BYTES];
} shardps_error;

/* Connection options; initialise with shardps_options_init, then set fields. Strings are
 * copied by shardps_client_connect; NULL means "" (the default). */
typedef struct shardps_options {
  const char* coordinator;      /* host:port of shardps_coordinator (required) */
  const char* cluster_token;    /* must match the coordinator's */
  int requested_rank;           /* -1: the coordinator picks */
  const char* transport;        /* "verbs", "tcp", "shm" or "auto" (NULL: "auto") */
  const char* bind_ip;          /* local data-path address (verbs: selects the NIC) */
  const char* rdma_device;      /* verbs: device name, NULL or "" = automatic */
  int rdma_gid_index;           /* verbs: -1 = automatic RoCEv2 GID */
  int64_t setup_timeout_ms;     /* bound on joining and start-up (default 60000) */
  int64_t wait_timeout_ms;      /* bound on one pull's consistency wait (default 30000) */
  uint64_t cuda_pipeline_bytes; /* piece size of the CUDA staging pipeline (default 1 MiB) */
} shardps_options;

/* Mirrors shardps::ClientCounters. */
typedef struct shardps_counters {
  uint64_t control_messages_sent;
  uint64_t heartbeats_sent;
  uint64_t pushes;
  uint64_t pulls;
  uint64_t pull_retries;
  uint64_t failovers;
  uint64_t pushes_resent;
  uint64_t pushes_lost;
  uint64_t bytes_pushed;
  uint64_t bytes_pulled;
} shardps_counters;

/* The path a tensor's memory takes (shardps::TensorPath). */
typedef enum shardps_tensor_path {
  SHARDPS_PATH_HOST = 0,
  SHARDPS_PATH_CUDA_DIRECT = 1,
  SHARDPS_PATH_CUDA_STAGED = 2
} shardps_tensor_path;

typedef struct shardps_client shardps_client; /* opaque */

SHARDPS_EXPORT void shardps_options_init(shardps_options* options);
/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value that is no code. Static storage. */
SHARDPS_EXPORT const char* shardps_code_name(int code);
/* The library's version and build options, e.g. "0.1.0 (git 531ef90; RelWithDebInfo; verbs on;
 * cuda on; gcc 12.2.0)". Static storage. Compare with SHARDPS_VERSION_STRING (version.h) to
 * check that the headers and the library agree. */
SHARDPS_EXPORT const char* shardps_version(void);

/* Joins the cluster. On success *out is a new client; on failure *out is NULL. */
SHARDPS_EXPORT int shardps_client_connect(const shardps_options* options, shardps_client** out,
                                          shardps_error* err);
/* Leaves the cluster (if not yet closed) and frees the client. NULL is a no-op. */
SHARDPS_EXPORT void shardps_client_destroy(shardps_client* client);

/* Registers a float32 tensor of ndim dimensions (shape[0..ndim)); see shardps::Client. */
SHARDPS_EXPORT int shardps_client_register_tensor(shardps_client* client, const char* name,
                                                  float* weights, float* grads,
                                                  const int64_t* shape, size_t ndim,
                                                  shardps_error* err);
/* The same for a tensor of element type dtype: 0 float32, 1 float16, 2 bfloat16 (16-bit
 * tensors travel as they are; the servers keep float32 master weights). */
SHARDPS_EXPORT int shardps_client_register_tensor_typed(shardps_client* client, const char* name,
                                                        void* weights, void* grads,
                                                        const int64_t* shape, size_t ndim,
                                                        uint32_t dtype, shardps_error* err);
/* Row tables (embeddings; docs/embeddings.md, shardps::Client::RegisterEmbedding). init: 0 normal
 * N(0, init_scale^2), 1 uniform U(-init_scale, init_scale), 2 zeros. */
typedef struct shardps_embedding_options {
  uint32_t max_ids; /* distinct rows of one step per shard (default 16384) */
  uint32_t init;
  float init_scale;
  uint64_t init_seed;
} shardps_embedding_options;
SHARDPS_EXPORT void shardps_embedding_options_init(shardps_embedding_options* options);
/* A row table of rows x dim values of dtype (0 float32, 1 float16, 2 bfloat16); before start.
 * options may be NULL (the defaults). */
SHARDPS_EXPORT int shardps_client_register_embedding(shardps_client* client, const char* name,
                                                     int64_t rows, int64_t dim, uint32_t dtype,
                                                     const shardps_embedding_options* options,
                                                     shardps_error* err);
/* Reads rows ids[0, n) into out (n x dim values of the table's dtype), at the consistency
 * bound of the current clock (Client::PullRows). */
SHARDPS_EXPORT int shardps_client_pull_rows(shardps_client* client, const char* name,
                                            const int64_t* ids, size_t n, void* out,
                                            shardps_error* err);
/* Adds gradient rows (n x dim, the table's dtype) for ids[0, n) to the table's gradient of this
 * step, summed per id; the next push or step sends it (Client::AddRowGradients). */
SHARDPS_EXPORT int shardps_client_add_row_gradients(shardps_client* client, const char* name,
                                                    const int64_t* ids, size_t n, const void* grads,
                                                    shardps_error* err);
/* The table's gradient rows of this step not yet pushed, each value multiplied by factor (a
 * loss scaler's 1/scale); *finite (may be NULL) set to whether all are finite then
 * (Client::ScaleRowGradients). */
SHARDPS_EXPORT int shardps_client_scale_row_gradients(shardps_client* client, const char* name,
                                                      float factor, int* finite,
                                                      shardps_error* err);
/* *sum = the sum of the squares of those values (Client::RowGradientsSquaredNorm). */
SHARDPS_EXPORT int shardps_client_row_gradients_squared_norm(shardps_client* client,
                                                             const char* name, double* sum,
                                                             shardps_error* err);
/* Drops them: the next push of the table carries none (Client::ClearRowGradients). */
SHARDPS_EXPORT int shardps_client_clear_row_gradients(shardps_client* client, const char* name,
                                                      shardps_error* err);
/* A dense tensor's state (Client::SetState / SetStateValues / GetState), between steps: part 1
 * the master weights, 2 and 3 the optimizer state buffers (momentum or Adam's first moment;
 * Adam's second), 4 (set only, values NULL) drops the state; the step count set to `steps`.
 * values: the tensor's element count of float32, whatever its dtype (a 16-bit tensor's float32
 * master and state set exactly); NULL: the values now in its gradient buffer, in its dtype. */
SHARDPS_EXPORT int shardps_client_set_state(shardps_client* client, const char* name,
                                            uint32_t part, const float* values, uint64_t steps,
                                            shardps_error* err);
/* Reads the float32 master weights and optimizer state of a dense tensor (its element count
 * each; any may be NULL); *steps, *has1, *has2 (may be NULL) as for shardps_client_get_rows. */
SHARDPS_EXPORT int shardps_client_get_state(shardps_client* client, const char* name,
                                            float* weights, float* state1, float* state2,
                                            uint64_t* steps, int* has1, int* has2,
                                            shardps_error* err);
/* A row table's state (Client::SetRows / GetRows / TableKeys): part 1 the rows' values, 2 and 3
 * their optimizer state rows (Adagrad's sum or Adam's first moment; Adam's second), with the
 * table's step count set to `steps`. values: n x dim float32 (16-bit tables: rounded on the
 * wire); ids distinct. */
SHARDPS_EXPORT int shardps_client_set_rows(shardps_client* client, const char* name,
                                           uint32_t part, const int64_t* ids, size_t n,
                                           const float* values, uint64_t steps,
                                           shardps_error* err);
/* Reads rows ids[0, n): float32 values and state rows (n x dim each; any may be NULL);
 * *steps, *has1, *has2 (may be NULL): the table's step count and whether each state exists. */
SHARDPS_EXPORT int shardps_client_get_rows(shardps_client* client, const char* name,
                                           const int64_t* ids, size_t n, float* weights,
                                           float* state1, float* state2, uint64_t* steps,
                                           int* has1, int* has2, shardps_error* err);
/* The keys holding a row in a hashed table: *count receives how many; up to `capacity` of them
 * are written to keys (SHARDPS_RESOURCE_EXHAUSTED when capacity < *count: call again). */
SHARDPS_EXPORT int shardps_client_table_keys(shardps_client* client, const char* name,
                                             int64_t* keys, size_t capacity, size_t* count,
                                             shardps_error* err);
SHARDPS_EXPORT int shardps_client_start(shardps_client* client, shardps_error* err);
/* Client::MarkNonFinite: the next pushes come from a step with non-finite gradients. */
SHARDPS_EXPORT int shardps_client_mark_non_finite(shardps_client* client, int non_finite,
                                                  shardps_error* err);
/* Client::SetNoGradient: the next pushes of a dense tensor carry no gradient (a frozen
 * parameter); BSP leaves a chunk all of whose pushes of a clock carry the mark as it is. */
SHARDPS_EXPORT int shardps_client_set_no_gradient(shardps_client* client, const char* name,
                                                  int no_gradient, shardps_error* err);
/* Whether this library was built with CUDA (device tensors recognised): 1 or 0. */
SHARDPS_EXPORT int shardps_built_with_cuda(void);
/* Asynchronous push / pull of one tensor; *handle is then passed to shardps_client_wait. */
SHARDPS_EXPORT int shardps_client_push(shardps_client* client, const char* name, uint64_t* handle,
                                       shardps_error* err);
SHARDPS_EXPORT int shardps_client_pull(shardps_client* client, const char* name, uint64_t* handle,
                                       shardps_error* err);
SHARDPS_EXPORT int shardps_client_wait(shardps_client* client, uint64_t handle, shardps_error* err);
SHARDPS_EXPORT int shardps_client_clock(shardps_client* client, shardps_error* err);
/* Push every tensor, wait, clock, pull every tensor, wait. */
SHARDPS_EXPORT int shardps_client_step(shardps_client* client, shardps_error* err);
/* The learning rate the servers apply to this worker's next pushes of tensor `name` (NULL or
 * "": every tensor; lr 0: the servers' --lr); it travels with the pushes (Client::
 * SetLearningRate). */
SHARDPS_EXPORT int shardps_client_set_learning_rate(shardps_client* client, const char* name,
                                                    float lr, shardps_error* err);
/* The update rule the servers apply to tensor `name`'s next pushes (NULL or "": every tensor),
 * torch.optim semantics (Client::SetUpdateRule). kind: 0 the servers' --optimizer, 1 SGD,
 * 2 Adam, 3 AdamW, 4 store, 5 Adagrad (momentum carries lr_decay and dampening
 * initial_accumulator_value). */
typedef struct shardps_update_rule {
  uint32_t kind;
  float lr, momentum, dampening;
  int nesterov;
  float weight_decay, beta1, beta2, eps;
} shardps_update_rule;
SHARDPS_EXPORT int shardps_client_set_update_rule(shardps_client* client, const char* name,
                                                  const shardps_update_rule* rule,
                                                  shardps_error* err);
/* Asks every server for a checkpoint at the next clock, into the cluster's checkpoint
 * directory or dir (NULL or "": the cluster's); *clock receives that clock (may be NULL). */
SHARDPS_EXPORT int shardps_client_request_checkpoint(shardps_client* client, const char* dir,
                                                     uint64_t* clock, shardps_error* err);
/* Client::Barrier: waits until every live worker called it as often as this one; timeout_ms 0:
 * the setup timeout (SHARDPS_DEADLINE_EXCEEDED after it). */
SHARDPS_EXPORT int shardps_client_barrier(shardps_client* client, uint64_t timeout_ms,
                                          shardps_error* err);
/* Leaves the cluster. Closing again is OK; after it every other call but the accessors
 * returns SHARDPS_FAILED_PRECONDITION ("Push() after Close()"), until shardps_client_destroy.
 * The states and what each call does in each: shardps/client.h, "Lifecycle". A NULL client
 * is SHARDPS_INVALID_ARGUMENT for every call; a destroyed one must not be used. */
SHARDPS_EXPORT int shardps_client_close(shardps_client* client, shardps_error* err);

/* Accessors. Strings are copied into buf (capacity bytes, NUL-terminated, truncated);
 * SHARDPS_OUT_OF_RANGE if it had to be truncated. */
SHARDPS_EXPORT int shardps_client_rank(const shardps_client* client, uint32_t* rank,
                                       shardps_error* err);
SHARDPS_EXPORT int shardps_client_num_workers(const shardps_client* client, uint32_t* n,
                                              shardps_error* err);
SHARDPS_EXPORT int shardps_client_clock_value(const shardps_client* client, uint64_t* clock,
                                              shardps_error* err);
/* Client::barrier_generation: the newest barrier generation passed (or released by the cluster
 * when this worker joined); the next shardps_client_barrier is this + 1. */
SHARDPS_EXPORT int shardps_client_barrier_generation(const shardps_client* client,
                                                     uint64_t* generation, shardps_error* err);
SHARDPS_EXPORT int shardps_client_consistency(const shardps_client* client, char* buf,
                                              size_t capacity, shardps_error* err);
SHARDPS_EXPORT int shardps_client_transport(const shardps_client* client, char* buf,
                                            size_t capacity, shardps_error* err);
SHARDPS_EXPORT int shardps_client_counters(const shardps_client* client, shardps_counters* out,
                                           shardps_error* err);
SHARDPS_EXPORT int shardps_client_tensor_path(const shardps_client* client, const char* name,
                                              int* path, shardps_error* err);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHARDPS_C_API_H_ */
