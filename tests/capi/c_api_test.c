/* c_api_test: the C API (shardps/c_api.h) from C, linked against libshardps.so, on a real
 * cluster: shardps_coordinator and two shardps_server processes over tcp, started here with
 * posix_spawn under `timeout -s KILL` (so nothing outlives the test), and two clients in two
 * threads (distinct handles on distinct threads, as the header allows).
 *
 * Checks, on data: error codes and messages of misuse; the client's lifecycle (every entry point
 * with a null client, and before Start, after a failed Start and after Close: refused with
 * FAILED_PRECONDITION naming the call and the state, getters still working); rank 0's initial
 * weights reaching
 * rank 1 at Start; after each BSP step, every worker's weights equal w - lr * mean(grads)
 * computed here; counters, consistency and transport strings; tensor paths.
 *
 * usage: c_api_test COORDINATOR_BIN SERVER_BIN WORK_DIR   (exit 0: pass, 1: fail) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardps/c_api.h"

extern char** environ;

#define kWorkers 2
#define kSteps 4
#define kRows 3
#define kCols 50 /* w: 150 floats = 600 bytes: several 128-byte chunks on both servers */
#define kBias 5
static const float kLr = 0.5f;
static const char* kToken = "c-api-test-secret";

static int failures = 0;
#define EXPECT(cond, ...)                                             \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      __sync_fetch_and_add(&failures, 1);                             \
    }                                                                 \
  } while (0)

static pid_t children[8];
static int num_children = 0;

/* Spawns argv under `timeout -s KILL 90`, output appended to log. */
static pid_t spawn_bounded(char* const* argv, const char* log) {
  char* full[32];
  int n = 0;
  full[n++] = "timeout";
  full[n++] = "-s";
  full[n++] = "KILL";
  full[n++] = "90";
  for (int i = 0; argv[i] != NULL && n < 31; ++i) full[n++] = argv[i];
  full[n] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  int rc = posix_spawnp(&pid, "timeout", &fa, NULL, full, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    fprintf(stderr, "posix_spawn %s: %s\n", argv[0], strerror(rc));
    return -1;
  }
  children[num_children++] = pid;
  return pid;
}

static void kill_children(void) {
  for (int i = 0; i < num_children; ++i) {
    if (children[i] > 0) {
      kill(children[i], SIGKILL);
      waitpid(children[i], NULL, 0);
      children[i] = -1;
    }
  }
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The gradient worker r computes at step t (1-based) for element k of a tensor. */
static float grad_of(int r, int t, int k, int tensor) {
  return (float)((r + 1) * ((k % 7) - 3)) * 0.01f + 0.001f * (float)(t * (tensor + 1));
}
static float init_of(int k, int tensor) { return 0.01f * (float)k - (float)tensor; }

typedef struct {
  const char* coordinator;
  int rank;
  float w[kRows * kCols], gw[kRows * kCols];
  float b[kBias], gb[kBias];
  int ok;
} worker_arg;

/* Every data-path call on c is refused with FAILED_PRECONDITION naming the call and `state`. */
static void expect_refused(shardps_client* c, const char* state) {
  shardps_error err;
  uint64_t h = 0;
  char want[160];
  int rc;
#define REFUSED(call, name)                                                                        \
  rc = (call);                                                                                     \
  snprintf(want, sizeof want, "%s %s", name, state);                                               \
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION && strstr(err.message, want) != NULL, "%s %s: %s '%s'", \
         name, state, shardps_code_name(rc), err.message)
  REFUSED(shardps_client_push(c, "w", &h, &err), "Push()");
  REFUSED(shardps_client_pull(c, "w", &h, &err), "Pull()");
  REFUSED(shardps_client_wait(c, 1, &err), "Wait()");
  REFUSED(shardps_client_clock(c, &err), "Clock()");
  REFUSED(shardps_client_step(c, &err), "Step()");
  REFUSED(shardps_client_request_checkpoint(c, NULL, NULL, &err), "RequestCheckpoint()");
#undef REFUSED
}

/* The getters answer in every state. */
static void expect_getters(shardps_client* c, uint64_t want_clock) {
  shardps_error err;
  uint32_t u = 0;
  uint64_t clock = 99;
  char buf[64];
  shardps_counters k;
  int path = -1;
  EXPECT(shardps_client_rank(c, &u, &err) == SHARDPS_OK, "rank: %s", err.message);
  EXPECT(shardps_client_num_workers(c, &u, &err) == SHARDPS_OK, "num_workers: %s", err.message);
  EXPECT(shardps_client_clock_value(c, &clock, &err) == SHARDPS_OK && clock == want_clock,
         "clock %llu, want %llu", (unsigned long long)clock, (unsigned long long)want_clock);
  EXPECT(
      shardps_client_consistency(c, buf, sizeof buf, &err) == SHARDPS_OK && strcmp(buf, "bsp") == 0,
      "consistency '%s'", buf);
  EXPECT(
      shardps_client_transport(c, buf, sizeof buf, &err) == SHARDPS_OK && strcmp(buf, "tcp") == 0,
      "transport '%s'", buf);
  EXPECT(shardps_client_counters(c, &k, &err) == SHARDPS_OK, "counters: %s", err.message);
  EXPECT(shardps_client_tensor_path(c, "w", &path, &err) == SHARDPS_OK && path == SHARDPS_PATH_HOST,
         "tensor path %d", path);
}

/* Every entry point refuses a null client with INVALID_ARGUMENT (and a null err is allowed). */
static void null_client_checks(void) {
  shardps_error err;
  uint64_t h = 0, u64 = 0;
  uint32_t u = 0;
  float w[1], g[1];
  const int64_t shape[1] = {1};
  char buf[8];
  shardps_counters k;
  int path = 0;
  const int rcs[] = {
      shardps_client_register_tensor(NULL, "w", w, g, shape, 1, &err),
      shardps_client_start(NULL, &err),
      shardps_client_push(NULL, "w", &h, &err),
      shardps_client_pull(NULL, "w", &h, &err),
      shardps_client_wait(NULL, 1, &err),
      shardps_client_clock(NULL, &err),
      shardps_client_step(NULL, &err),
      shardps_client_request_checkpoint(NULL, "", &u64, &err),
      shardps_client_close(NULL, &err),
      shardps_client_rank(NULL, &u, &err),
      shardps_client_num_workers(NULL, &u, &err),
      shardps_client_clock_value(NULL, &u64, &err),
      shardps_client_consistency(NULL, buf, sizeof buf, &err),
      shardps_client_transport(NULL, buf, sizeof buf, &err),
      shardps_client_counters(NULL, &k, &err),
      shardps_client_tensor_path(NULL, "w", &path, &err),
      shardps_client_step(NULL, NULL),
  };
  for (size_t i = 0; i < sizeof rcs / sizeof rcs[0]; ++i) {
    EXPECT(rcs[i] == SHARDPS_INVALID_ARGUMENT, "null client, call %zu: %s", i,
           shardps_code_name(rcs[i]));
  }
}

/* A Start that fails (the cluster wants 2 workers; none other has joined yet and the setup bound
 * is 3 s, which also bounds the join: shorter failed joins on a loaded host) leaves a client on
 * which only close and the getters work. */
static void failed_start_checks(const char* coordinator) {
  shardps_options o;
  shardps_options_init(&o);
  o.coordinator = coordinator;
  o.cluster_token = kToken;
  o.transport = "tcp";
  o.bind_ip = "127.0.0.1";
  o.setup_timeout_ms = 3000;
  shardps_error err;
  shardps_client* c = NULL;
  int rc = shardps_client_connect(&o, &c, &err);
  EXPECT(rc == SHARDPS_OK, "connect: %s %s", shardps_code_name(rc), err.message);
  if (rc != SHARDPS_OK) return;
  static float w[4], g[4];
  const int64_t shape[1] = {4};
  rc = shardps_client_register_tensor(c, "w", w, g, shape, 1, &err);
  EXPECT(rc == SHARDPS_OK, "register: %s", err.message);
  rc = shardps_client_start(c, &err);
  EXPECT(rc == SHARDPS_DEADLINE_EXCEEDED, "start without the other worker: %s '%s'",
         shardps_code_name(rc), err.message);
  rc = shardps_client_start(c, &err);
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION && strstr(err.message, "after a failed Start()"),
         "start again: %s '%s'", shardps_code_name(rc), err.message);
  rc = shardps_client_register_tensor(c, "x", w, g, shape, 1, &err);
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION, "register after a failed start: %s",
         shardps_code_name(rc));
  expect_refused(c, "after a failed Start()");
  expect_getters(c, 0);
  rc = shardps_client_close(c, &err);
  EXPECT(rc == SHARDPS_OK, "close: %s", err.message);
  expect_refused(c, "after Close()");
  shardps_client_destroy(c);
}

static void* worker_main(void* p) {
  worker_arg* a = (worker_arg*)p;
  shardps_options o;
  shardps_options_init(&o);
  o.coordinator = a->coordinator;
  o.cluster_token = kToken;
  o.requested_rank = a->rank;
  o.transport = "tcp";
  o.bind_ip = "127.0.0.1";
  o.setup_timeout_ms = 30000;
  o.wait_timeout_ms = 15000;
  shardps_error err;
  shardps_client* c = NULL;
  int rc = shardps_client_connect(&o, &c, &err);
  EXPECT(rc == SHARDPS_OK, "rank %d connect: %s %s", a->rank, shardps_code_name(rc), err.message);
  if (rc != SHARDPS_OK) return NULL;
  EXPECT(err.code == SHARDPS_OK && err.message[0] == '\0', "success leaves an empty message");

  /* Rank 0's weights are the initial weights; rank 1 starts from garbage it must not keep. */
  for (int k = 0; k < kRows * kCols; ++k) a->w[k] = a->rank == 0 ? init_of(k, 0) : 99.0f;
  for (int k = 0; k < kBias; ++k) a->b[k] = a->rank == 0 ? init_of(k, 1) : -99.0f;
  const int64_t wshape[2] = {kRows, kCols};
  const int64_t bshape[1] = {kBias};
  rc = shardps_client_register_tensor(c, "w", a->w, a->gw, wshape, 2, &err);
  EXPECT(rc == SHARDPS_OK, "register w: %s", err.message);
  rc = shardps_client_register_tensor(c, "b", a->b, a->gb, bshape, 1, &err);
  EXPECT(rc == SHARDPS_OK, "register b: %s", err.message);
  /* A row table beside them (docs/embeddings.md): 20 rows x 2, zeros. */
  shardps_embedding_options eo;
  shardps_embedding_options_init(&eo);
  EXPECT(eo.max_ids == 16384, "default max_ids %u", eo.max_ids);
  eo.max_ids = 8;
  eo.init = 2;
  rc = shardps_client_register_embedding(c, "e", 20, 2, 0, &eo, &err);
  EXPECT(rc == SHARDPS_OK, "register e: %s", err.message);
  rc = shardps_client_register_tensor(c, "b", a->b, a->gb, bshape, 1, &err);
  EXPECT(rc == SHARDPS_ALREADY_EXISTS, "duplicate: %s", shardps_code_name(rc));
  EXPECT(strstr(err.message, "'b'") != NULL, "message names the tensor: %s", err.message);
  uint64_t h = 0;
  rc = shardps_client_push(c, "w", &h, &err);
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION, "push before start: %s", shardps_code_name(rc));
  /* Refused before Start, and without effect: Start and the steps below go on as if never
   * called (a clock before Start would put this worker a clock ahead of the other). */
  expect_refused(c, "before Start()");
  expect_getters(c, 0);

  rc = shardps_client_start(c, &err);
  EXPECT(rc == SHARDPS_OK, "rank %d start: %s", a->rank, err.message);
  if (rc != SHARDPS_OK) {
    shardps_client_destroy(c);
    return NULL;
  }
  for (int k = 0; k < kRows * kCols; ++k) {
    EXPECT(a->w[k] == init_of(k, 0), "rank %d w[%d] = %g after start, want %g", a->rank, k, a->w[k],
           init_of(k, 0));
  }
  for (int k = 0; k < kBias; ++k) {
    EXPECT(a->b[k] == init_of(k, 1), "rank %d b[%d] = %g after start", a->rank, k, a->b[k]);
  }
  /* Live membership: read it before the first step, after which the other may leave. */
  uint32_t nw = 0;
  EXPECT(shardps_client_num_workers(c, &nw, &err) == SHARDPS_OK && nw == kWorkers, "workers %u",
         nw);
  rc = shardps_client_push(c, "nope", &h, &err);
  EXPECT(rc == SHARDPS_NOT_FOUND, "unknown tensor: %s", shardps_code_name(rc));
  rc = shardps_client_set_no_gradient(c, "nope", 1, &err);
  EXPECT(rc == SHARDPS_NOT_FOUND, "no-gradient mark of an unknown tensor: %s",
         shardps_code_name(rc));
  rc = shardps_client_set_no_gradient(c, "e", 1, &err);
  EXPECT(rc == SHARDPS_INVALID_ARGUMENT, "no-gradient mark of a row table: %s",
         shardps_code_name(rc));
  rc = shardps_client_set_no_gradient(c, "w", 0, &err);  /* the default: it has gradients */
  EXPECT(rc == SHARDPS_OK, "no-gradient mark cleared: %s", err.message);
  int path = -1;
  rc = shardps_client_tensor_path(c, "w", &path, &err);
  EXPECT(rc == SHARDPS_OK && path == SHARDPS_PATH_HOST, "host tensor path %d", path);

  /* The expected weights, as the servers compute them (BSP, average, sgd). */
  float ew[kRows * kCols], eb[kBias];
  for (int k = 0; k < kRows * kCols; ++k) ew[k] = init_of(k, 0);
  for (int k = 0; k < kBias; ++k) eb[k] = init_of(k, 1);
  for (int t = 1; t <= kSteps; ++t) {
    for (int k = 0; k < kRows * kCols; ++k) a->gw[k] = grad_of(a->rank, t, k, 0);
    for (int k = 0; k < kBias; ++k) a->gb[k] = grad_of(a->rank, t, k, 1);
    /* Row a->rank (this worker's own) and row 5 (everyone's): gradient -1 each. */
    const int64_t ids[2] = {a->rank, 5};
    const float minus[4] = {-1.0f, -1.0f, -1.0f, -1.0f};
    /* First row 7 (3, 4), scaled, measured and dropped: it never reaches a server. */
    {
      const int64_t seven = 7;
      const float g7[2] = {3.0f, 4.0f};
      double sq = -1;
      int finite = -1;
      rc = shardps_client_add_row_gradients(c, "e", &seven, 1, g7, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_row_gradients_squared_norm(c, "e", &sq, &err);
      EXPECT(rc == SHARDPS_OK && sq == 25.0, "rank %d row norm %g: %s", a->rank, sq, err.message);
      rc = shardps_client_scale_row_gradients(c, "e", 2.0f, &finite, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_row_gradients_squared_norm(c, "e", &sq, &err);
      EXPECT(rc == SHARDPS_OK && finite == 1 && sq == 100.0, "rank %d scaled norm %g (%d): %s",
             a->rank, sq, finite, err.message);
      rc = shardps_client_clear_row_gradients(c, "e", &err);
      if (rc == SHARDPS_OK) rc = shardps_client_row_gradients_squared_norm(c, "e", &sq, &err);
      EXPECT(rc == SHARDPS_OK && sq == 0.0, "rank %d norm after clear %g: %s", a->rank, sq,
             err.message);
      rc = shardps_client_clear_row_gradients(c, "w", &err);
      EXPECT(rc == SHARDPS_INVALID_ARGUMENT || rc == SHARDPS_NOT_FOUND,
             "clear of a dense tensor's rows: %s", shardps_code_name(rc));
      rc = shardps_client_row_gradients_squared_norm(c, "e", NULL, &err);
      EXPECT(rc == SHARDPS_INVALID_ARGUMENT, "NULL sum: %s", shardps_code_name(rc));
    }
    rc = shardps_client_add_row_gradients(c, "e", ids, 2, minus, &err);
    EXPECT(rc == SHARDPS_OK, "rank %d row gradients: %s", a->rank, err.message);
    {
      double sq = -1;
      rc = shardps_client_row_gradients_squared_norm(c, "e", &sq, &err);
      EXPECT(rc == SHARDPS_OK && sq == 4.0, "rank %d step rows' norm %g", a->rank, sq);
    }
    if (t % 2 == 1) {
      rc = shardps_client_step(c, &err);
      EXPECT(rc == SHARDPS_OK, "rank %d step %d: %s", a->rank, t, err.message);
    } else { /* the same step, spelled out with the asynchronous calls */
      uint64_t hw = 0, hb = 0;
      rc = shardps_client_push(c, "w", &hw, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_push(c, "b", &hb, &err);
      uint64_t he = 0;
      if (rc == SHARDPS_OK) rc = shardps_client_push(c, "e", &he, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_wait(c, he, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_wait(c, hw, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_wait(c, hb, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_clock(c, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_pull(c, "w", &hw, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_pull(c, "b", &hb, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_wait(c, hw, &err);
      if (rc == SHARDPS_OK) rc = shardps_client_wait(c, hb, &err);
      EXPECT(rc == SHARDPS_OK, "rank %d async step %d: %s", a->rank, t, err.message);
    }
    if (rc != SHARDPS_OK) break;
    for (int k = 0; k < kRows * kCols; ++k) {
      float sum = 0;
      for (int r = 0; r < kWorkers; ++r) sum += grad_of(r, t, k, 0);
      ew[k] -= kLr * (sum / kWorkers);
      EXPECT(fabsf(a->w[k] - ew[k]) <= 1e-5f * (1 + fabsf(ew[k])),
             "rank %d step %d w[%d] = %.7g, want %.7g", a->rank, t, k, a->w[k], ew[k]);
    }
    for (int k = 0; k < kBias; ++k) {
      float sum = 0;
      for (int r = 0; r < kWorkers; ++r) sum += grad_of(r, t, k, 1);
      eb[k] -= kLr * (sum / kWorkers);
      EXPECT(fabsf(a->b[k] - eb[k]) <= 1e-5f * (1 + fabsf(eb[k])),
             "rank %d step %d b[%d] = %.7g, want %.7g", a->rank, t, k, a->b[k], eb[k]);
    }
  }
  /* The table after kSteps BSP steps (average over kWorkers, sgd): its own row moved by
   * kLr / kWorkers per step, the shared row by kLr. */
  float rows[2 * 2] = {0, 0, 0, 0};
  const int64_t read_ids[2] = {a->rank, 5};
  rc = shardps_client_pull_rows(c, "e", read_ids, 2, rows, &err);
  EXPECT(rc == SHARDPS_OK, "rank %d pull rows: %s", a->rank, err.message);
  EXPECT(fabsf(rows[0] - kSteps * kLr / kWorkers) < 1e-5f && rows[0] == rows[1],
         "rank %d own row %g %g, want %g", a->rank, rows[0], rows[1], kSteps * kLr / kWorkers);
  EXPECT(fabsf(rows[2] - kSteps * kLr) < 1e-5f, "rank %d shared row %g, want %g", a->rank,
         rows[2], kSteps * kLr);
  {
    const int64_t seven = 7;
    float r7[2] = {-1, -1};
    rc = shardps_client_pull_rows(c, "e", &seven, 1, r7, &err);
    EXPECT(rc == SHARDPS_OK && r7[0] == 0.0f && r7[1] == 0.0f,
           "rank %d row 7 (its gradients were cleared every step) %g %g", a->rank, r7[0], r7[1]);
  }
  const int64_t outside = 20;
  rc = shardps_client_pull_rows(c, "e", &outside, 1, rows, &err);
  EXPECT(rc == SHARDPS_INVALID_ARGUMENT && strstr(err.message, "'e'") != NULL,
         "id outside the table: %s %s", shardps_code_name(rc), err.message);
  /* A row table's state: this worker's own row read as float32 with its state, then row
   * 10 + rank set and read back (Client::SetRows / GetRows). */
  {
    float w[2] = {0, 0};
    uint64_t steps = 99;
    int has1 = 7, has2 = 7;
    rc = shardps_client_get_rows(c, "e", read_ids, 1, w, NULL, NULL, &steps, &has1, &has2, &err);
    EXPECT(rc == SHARDPS_OK && w[0] == rows[0] && w[1] == rows[1] && has1 == 0 && has2 == 0,
           "rank %d get rows: %s (%g %g, has %d %d)", a->rank, err.message, w[0], w[1], has1,
           has2);
    const int64_t mine = 10 + a->rank;
    const float set[2] = {a->rank + 0.5f, -0.25f};
    rc = shardps_client_set_rows(c, "e", 1, &mine, 1, set, 0, &err);
    EXPECT(rc == SHARDPS_OK, "rank %d set rows: %s", a->rank, err.message);
    rc = shardps_client_get_rows(c, "e", &mine, 1, w, NULL, NULL, NULL, NULL, NULL, &err);
    EXPECT(rc == SHARDPS_OK && w[0] == set[0] && w[1] == set[1], "rank %d row set: %g %g",
           a->rank, w[0], w[1]);
    rc = shardps_client_set_rows(c, "e", 4, &mine, 1, set, 0, &err);
    EXPECT(rc == SHARDPS_INVALID_ARGUMENT, "part 4: %s", shardps_code_name(rc));
    size_t count = 0;
    rc = shardps_client_table_keys(c, "e", NULL, 0, &count, &err);
    EXPECT(rc == SHARDPS_INVALID_ARGUMENT && strstr(err.message, "dense") != NULL,
           "keys of a dense table: %s %s", shardps_code_name(rc), err.message);
  }
  /* A dense tensor's state (Client::GetState / SetStateValues): the float32 master of "w" is
   * the weights this worker pulled; rank 0 sets "b" from float32 values and reads them back. */
  {
    float mw[kRows * kCols], mb[kBias];
    uint64_t steps = 99;
    int has1 = 7, has2 = 7;
    rc = shardps_client_get_state(c, "w", mw, NULL, NULL, &steps, &has1, &has2, &err);
    EXPECT(rc == SHARDPS_OK && memcmp(mw, a->w, sizeof mw) == 0 && has1 == 0 && has2 == 0,
           "rank %d get state: %s (has %d %d)", a->rank, err.message, has1, has2);
    if (a->rank == 0) {
      float set[kBias];
      for (int k = 0; k < kBias; ++k) set[k] = 0.1f * k - 1.0f / 3;
      rc = shardps_client_set_state(c, "b", 1, set, 0, &err);
      EXPECT(rc == SHARDPS_OK, "set state: %s", err.message);
      rc = shardps_client_get_state(c, "b", mb, NULL, NULL, NULL, NULL, NULL, &err);
      EXPECT(rc == SHARDPS_OK && memcmp(mb, set, sizeof mb) == 0, "state set: %s",
             err.message);
    }
    rc = shardps_client_set_state(c, "b", 4, mb, 0, &err);
    EXPECT(rc == SHARDPS_INVALID_ARGUMENT, "part 4 with values: %s", shardps_code_name(rc));
    rc = shardps_client_set_state(c, "e", 1, mb, 0, &err);
    EXPECT(rc == SHARDPS_INVALID_ARGUMENT && strstr(err.message, "'e'") != NULL,
           "a row table's dense state: %s %s", shardps_code_name(rc), err.message);
  }
  /* Client::Barrier: both workers pass it (each waits for the other). */
  uint64_t generation = 99;
  EXPECT(shardps_client_barrier_generation(c, &generation, &err) == SHARDPS_OK && generation == 0,
         "barrier generation before the first %llu", (unsigned long long)generation);
  rc = shardps_client_barrier(c, 20000, &err);
  EXPECT(rc == SHARDPS_OK, "rank %d barrier: %s", a->rank, err.message);
  EXPECT(shardps_client_barrier_generation(c, &generation, &err) == SHARDPS_OK && generation == 1,
         "barrier generation after the first %llu", (unsigned long long)generation);
  uint32_t rank = 99;
  uint64_t clock = 0;
  EXPECT(shardps_client_rank(c, &rank, &err) == SHARDPS_OK && rank == (uint32_t)a->rank, "rank %u",
         rank);
  EXPECT(shardps_client_clock_value(c, &clock, &err) == SHARDPS_OK && clock == kSteps, "clock %llu",
         (unsigned long long)clock);
  char buf[64];
  EXPECT(
      shardps_client_consistency(c, buf, sizeof buf, &err) == SHARDPS_OK && strcmp(buf, "bsp") == 0,
      "consistency '%s'", buf);
  EXPECT(
      shardps_client_transport(c, buf, sizeof buf, &err) == SHARDPS_OK && strcmp(buf, "tcp") == 0,
      "transport '%s'", buf);
  char tiny[3];
  rc = shardps_client_consistency(c, tiny, sizeof tiny, &err);
  EXPECT(rc == SHARDPS_OUT_OF_RANGE && strcmp(tiny, "bs") == 0, "truncation: %s '%s'",
         shardps_code_name(rc), tiny);
  shardps_counters k;
  EXPECT(shardps_client_counters(c, &k, &err) == SHARDPS_OK, "counters: %s", err.message);
  /* Dense bytes, plus per step the table's two entries (an 8-byte id and 2 floats each). */
  EXPECT(k.bytes_pushed == (uint64_t)kSteps * ((kRows * kCols + kBias) * sizeof(float) +
                                               2 * (8 + 2 * sizeof(float))),
         "bytes_pushed %llu", (unsigned long long)k.bytes_pushed);
  EXPECT(k.pushes >= (uint64_t)kSteps * 2, "pushes %llu", (unsigned long long)k.pushes);
  rc = shardps_client_close(c, &err);
  EXPECT(rc == SHARDPS_OK, "close: %s", err.message);
  /* After close: every data-path call refused, nothing written into the weights. */
  const float w0 = a->w[0];
  expect_refused(c, "after Close()");
  rc = shardps_client_start(c, &err);
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION, "start after close: %s", shardps_code_name(rc));
  rc = shardps_client_register_tensor(c, "x", a->w, a->gw, bshape, 1, &err);
  EXPECT(rc == SHARDPS_FAILED_PRECONDITION, "register after close: %s", shardps_code_name(rc));
  expect_getters(c, kSteps);
  EXPECT(a->w[0] == w0, "weights changed after close");
  rc = shardps_client_close(c, &err);
  EXPECT(rc == SHARDPS_OK, "close twice: %s", err.message);
  shardps_client_destroy(c);
  a->ok = 1;
  return NULL;
}

static void misuse_checks(const char* coordinator) {
  shardps_error err;
  shardps_client* c = (shardps_client*)0x1;
  int rc = shardps_client_connect(NULL, &c, &err);
  EXPECT(rc == SHARDPS_INVALID_ARGUMENT && c == NULL, "null options: %s", shardps_code_name(rc));
  EXPECT(err.code == rc && strlen(err.message) > 0, "error filled: '%s'", err.message);
  shardps_options o;
  shardps_options_init(&o);
  rc = shardps_client_connect(&o, &c, &err);
  EXPECT(rc == SHARDPS_INVALID_ARGUMENT && strstr(err.message, "coordinator") != NULL,
         "no coordinator: %s '%s'", shardps_code_name(rc), err.message);
  rc = shardps_client_start(NULL, NULL); /* err may be NULL */
  EXPECT(rc == SHARDPS_INVALID_ARGUMENT, "null client: %s", shardps_code_name(rc));
  EXPECT(strcmp(shardps_code_name(SHARDPS_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED") == 0 &&
             strcmp(shardps_code_name(1234), "UNKNOWN") == 0,
         "code names");
  /* A wrong cluster token is refused with a message, not a crash or a hang. */
  o.coordinator = coordinator;
  o.cluster_token = "wrong-token";
  o.transport = "tcp";
  o.bind_ip = "127.0.0.1";
  o.setup_timeout_ms = 5000;
  const double t0 = now_s();
  rc = shardps_client_connect(&o, &c, &err);
  EXPECT(rc != SHARDPS_OK && c == NULL && strlen(err.message) > 0, "wrong token: %s '%s'",
         shardps_code_name(rc), err.message);
  EXPECT(now_s() - t0 < 10, "wrong token answered in %.1f s", now_s() - t0);
  shardps_client_destroy(NULL);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s COORDINATOR_BIN SERVER_BIN WORK_DIR\n", argv[0]);
    return 2;
  }
  const char* dir = argv[3];
  mkdir(dir, 0755);
  char addr_file[512], log[512], a1[600], a2[600], a3[128];
  snprintf(addr_file, sizeof addr_file, "%s/coordinator.addr", dir);
  unlink(addr_file);
  snprintf(log, sizeof log, "%s/coordinator.log", dir);
  snprintf(a1, sizeof a1, "--address_file=%s", addr_file);
  snprintf(a2, sizeof a2, "--cluster_token=%s", kToken);
  snprintf(a3, sizeof a3, "--num_workers=%d", kWorkers);
  char* coord[] = {argv[1],
                   "--listen=127.0.0.1:0",
                   a1,
                   a2,
                   "--consistency=bsp",
                   "--num_servers=2",
                   a3,
                   "--data_transport=tcp",
                   "--partition_bytes=128",
                   "--exit_when_done",
                   NULL};
  if (spawn_bounded(coord, log) < 0) return 1;
  char address[128] = {0};
  for (double t0 = now_s(); now_s() - t0 < 15;) {
    FILE* f = fopen(addr_file, "r");
    if (f != NULL) {
      if (fgets(address, sizeof address, f) != NULL) address[strcspn(address, "\n ")] = '\0';
      fclose(f);
      if (address[0] != '\0') break;
    }
    usleep(50000);
  }
  if (address[0] == '\0') {
    fprintf(stderr, "FAIL: the coordinator wrote no address within 15 s (log %s)\n", log);
    kill_children();
    return 1;
  }
  char ca[200];
  snprintf(ca, sizeof ca, "--coordinator=%s", address);
  char lr[32];
  snprintf(lr, sizeof lr, "--lr=%g", kLr);
  for (int i = 0; i < 2; ++i) {
    char rank[32], slog[512];
    snprintf(rank, sizeof rank, "--rank=%d", i);
    snprintf(slog, sizeof slog, "%s/server%d.log", dir, i);
    char* server[] = {argv[2],
                      ca,
                      a2,
                      "--transport=tcp",
                      "--bind_ip=127.0.0.1",
                      rank,
                      "--optimizer=sgd",
                      lr,
                      "--exit_when_done",
                      NULL};
    if (spawn_bounded(server, slog) < 0) {
      kill_children();
      return 1;
    }
  }
  misuse_checks(address);
  null_client_checks();
  failed_start_checks(address);

  pthread_t th[kWorkers];
  static worker_arg args[kWorkers];
  for (int r = 0; r < kWorkers; ++r) {
    args[r].coordinator = address;
    args[r].rank = r;
    pthread_create(&th[r], NULL, worker_main, &args[r]);
  }
  for (int r = 0; r < kWorkers; ++r) pthread_join(th[r], NULL);
  for (int r = 0; r < kWorkers; ++r) EXPECT(args[r].ok, "worker %d finished", r);

  /* --exit_when_done: coordinator and servers leave by themselves once the workers are gone. */
  for (double t0 = now_s(); now_s() - t0 < 15;) {
    int alive = 0;
    for (int i = 0; i < num_children; ++i) {
      if (children[i] > 0 && waitpid(children[i], NULL, WNOHANG) == 0) {
        alive = 1;
      } else {
        children[i] = -1;
      }
    }
    if (!alive) break;
    usleep(100000);
  }
  kill_children();
  if (failures)
    fprintf(stderr, "c_api_test: %d failure(s); logs in %s\n", failures, dir);
  else
    printf("c_api_test: PASS (%d workers, %d steps, weights checked)\n", kWorkers, kSteps);
  return failures ? 1 : 0;
}
