// ps_test_worker: the worker process of the process-level integration tests
// (tests/integration/process_cluster_test.cc, tests/netns/netns_cluster_test.sh). It is a test
// fixture, not an example: it joins through the public Client API only, trains a deterministic
// model on deterministic synthetic data, and writes what the tests assert on to --out.
//
// Modes:
//   train       join the cluster, train --steps BSP/SSP steps, write weights and counters;
//   standalone  no cluster: the same training in one process, where each step's gradient is the
//               average over the union of the --workers workers' minibatches (what BSP with
//               server-side averaging computes), applied with the servers' SGD formula;
//   join        join, leave, exit 0 (does the coordinator still accept a valid worker?);
//   compare     no cluster: checks the result files --results=A,B,... against the standalone
//               run's --reference within the tolerance derived in CompareMain (scripts use it;
//               process_cluster_test.cc asserts element by element itself).
//
// Models:
//   linreg   least squares y = x W + b, W (--dim x --outputs) and b (--outputs). Sample s of the
//            data set is a pure function of s; worker r's minibatch at step t is samples
//            (t * workers + r) * batch ... + batch - 1, so the W minibatches of a step are
//            disjoint and their union is the standalone run's batch;
//   counter  w[k] counts worker k's applied pushes (servers: --aggregation=sum --lr=1); after
//            each step the worker checks the SSP bound w[k] >= clock - staleness for every k.
//   signature  W and b hold one element per (worker, clock) update (servers: --aggregation=sum
//            --lr=1); after each step the worker decodes which updates its pull holds and
//            checks the cluster's consistency mode on it (tests/integration/signature_check.h).
//            Written: sig_pulls, sig_at_bound, sig_max_staleness; violations counts both tensors'.
//            --signature_rows: the same signatures in three row tables of one row per update
//            (dense S, hashed H, dense with a worker cache C), each read whole with PullRows
//            after every step and checked the same way (a row whose values differ is a
//            violation too). Written: row_sig_pulls, row_cache_hits; violations, sig_at_bound
//            and sig_max_staleness include them. --nosignature_dense leaves W and b out;
//            --signature_reader_ms=D makes a worker that only reads the tables, for D ms.
//            --signature_push_by_hand_every=N: every Nth step pushes everything by hand
//            before Step().
//
// Result file (--out), written atomically (tmp + rename), one "key value..." per line:
//   mode, rank, steps, workers (standalone) or workers_before_last_step (train), consistency,
//   transport, control_messages_steady, heartbeats, pushes, pulls, pull_retries,
//   pull_other_buffer (the last five
//   counted from Start() to the end of training), violations, max_lead, max_abs_grad
//   (standalone), lr, and "tensor NAME N v0 v1 ..." with floats printed with 9 significant
//   digits (an exact round trip of a float).
//
// Exit codes: 0 done, 2 bad flags, 3 join refused or failed, 4 setup failed, 5 a step failed,
// 6 the result file could not be written, 7 compare: the results differ. Errors are printed to
// stderr with the reason.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "shardps/client.h"
#include "tests/integration/fault_injecting_fabric.h"
#include "tests/integration/hashed_table_model.h"
#include "tests/integration/signature_check.h"
#include "transport/flags.h"
#include "worker/client_testing.h"

DEFINE_string(mode, "train", "train, standalone, join or compare");
DEFINE_bool(standalone, false, "Same as --mode=standalone");
DEFINE_string(model, "linreg", "linreg or counter");
DEFINE_string(coordinator, "127.0.0.1:7070", "shardps_coordinator address (host:port)");
DEFINE_string(cluster_token, "", "Cluster secret");
DEFINE_int32(rank, -1, "Requested worker rank (-1: the coordinator picks)");
DEFINE_int32(workers, 1, "Workers in the job (data sharding; standalone: workers emulated)");
DEFINE_bool(weights_view, false,
            "train: read the weights through Client::WeightsView with host_weights_in_place "
            "(under an aggregator: no copy into the registered buffers; written: "
            "view_buffer_untouched)");
DEFINE_int32(local_workers, 0,
             "standalone: sum each host's this many workers first, as a host aggregator does "
             "(0: flat)");
DEFINE_int32(steps, 20, "Training steps");
DEFINE_int32(batch, 8, "linreg: samples per worker per step");
DEFINE_int32(dim, 64, "linreg: input features");
DEFINE_int32(outputs, 8, "linreg: outputs");
DEFINE_int32(embedding_rows, 0,
             "linreg: also train a row table E of this many rows x 4 (0: none); see RowTask");
DEFINE_bool(freeze_b, false,
            "--model=linreg: tensor b is frozen (Client::SetNoGradient, zeros pushed) under SGD "
            "with weight decay 0.5, so only the servers' skip keeps it as it is; standalone "
            "leaves b at its initial value");
DEFINE_bool(embedding_load, false,
            "--embedding_rows (dense): every worker sets every row to RowTask::Loaded after "
            "Start (Client::SetRows, a pretrained table); standalone starts from them");
DEFINE_int32(load_delay_ms, 0,
             "--embedding_load: rank 0 sleeps this long before its load (the others may start "
             "training meanwhile unless --barrier_after_load holds them)");
DEFINE_bool(barrier_after_load, true,
            "--embedding_load: every worker calls Client::Barrier after its load, before its "
            "first step");
DEFINE_bool(join_open_barrier, false,
            "a worker restarted into a job whose workers pass a barrier after their load (and "
            "that does not load again): after Start it calls Client::Barrier once unless the "
            "cluster had released one when it joined (it is a live worker: the barrier waits "
            "for it)");
DEFINE_bool(dense_load, false,
             "rank 0 sets every dense tensor's master weights to 1000 from float32 values "
             "(Client::SetStateValues) after Start, then every worker passes a barrier, "
             "reads them back (result: dense_loaded 1 when exactly 1000) and passes another");
DEFINE_int32(barrier_every, 0,
             "every that many steps (and before the first), after a random pause of up to 40 "
             "ms, Client::Barrier; the result lists each barrier's arrival and release times "
             "(steady clock, ns: barrier_arrive_ns, barrier_release_ns) and the generation each "
             "passed (barrier_gen)");
DEFINE_bool(barrier_by_clock, false,
            "--barrier_every: barriers follow the clock (Client::clock), not the step count: "
            "before a step, whenever the generation of the latest multiple of it at or below "
            "the clock (clock / every + 1) is not released yet (Client::barrier_generation). "
            "A schedule that stays aligned when a restart skips clocks, even one that lands on "
            "a multiple in the middle of a step (a learner whose aggregator restarted inside a "
            "wait for weights)");
DEFINE_int32(hold_before_barrier, 0,
             "--barrier_every: before arriving at this barrier generation, wait (up to 120 s) "
             "until --hold_file exists (a test orders a restart against a barrier with it)");
DEFINE_int32(hold_at_step, 0,
             "before step N (0: never), wait (up to 120 s) until --hold_file exists: a test that "
             "kills a process mid-run holds every worker short of the end until it has, so that "
             "a test thread descheduled past the kill point cannot find training over");
DEFINE_string(hold_file, "", "--hold_before_barrier, --hold_at_step: the file to wait for");
DEFINE_bool(count_in_b, false,
            "counter: b counts worker k's applied pushes in b[k] too (W alone says nothing of "
            "b's chunk)");
DEFINE_bool(embedding_hashed, false,
            "--embedding_rows: the table takes hashed 64-bit keys, embedding_rows its capacity");
DEFINE_double(lr, 0.1, "Learning rate; must equal the servers' --lr (standalone applies it)");
DEFINE_int32(staleness, 0, "counter: the SSP bound s to check");
DEFINE_int32(max_delay_ms, 0, "Random sleep in [0, max) before each step (seeded by rank)");
DEFINE_int32(step_delay_ms, 0, "Fixed sleep before each step");
DEFINE_string(out, "", "Result file");
DEFINE_string(optimizer, "sgd", "standalone: sgd or momentum (the servers' --optimizer)");
DEFINE_double(momentum, 0.9, "standalone: the servers' --momentum");
DEFINE_bool(resume, false,
            "train: continue the schedule from the clock Start() joined at (steps clock..steps-1), "
            "as a cluster restored from a checkpoint does");
DEFINE_int32(checkpoint_after_step, -1, "train: rank 0 requests a checkpoint after this step");
DEFINE_string(progress_file, "", "If set, the number of completed steps is written here");
DEFINE_int32(setup_timeout_ms, 30000, "Client setup timeout");
DEFINE_int32(wait_timeout_ms, 15000, "Client wait timeout (a stuck pull fails after this)");
DEFINE_uint64(inject_data_error_every, 0,
              "Testing: every Nth message-carrying data-path post (write with immediate) names a "
              "wrong rkey, an error completion (tests/integration/fault_injecting_fabric.h)");
DEFINE_bool(signature_rows, false,
            "--model=signature: also three row tables of workers x steps rows of 4 floats (dense, "
            "hashed, dense with a worker cache), one row per (worker, clock) update, read whole "
            "after every step and checked like W and b");
DEFINE_int32(signature_reader_ms, 0,
             "--model=signature --signature_rows: push nothing; read every row table whole, over "
             "and over, for this long, checking each read against the earlier ones (ASP: an "
             "update once seen never disappears), then write the result and leave");
DEFINE_bool(signature_dense, true,
            "--model=signature: register W and b (false, with --signature_rows: the row tables "
            "only, so that no dense pull in Step() waits for the clock before a row pull does)");
DEFINE_bool(signature_wait_hand_pushes, false,
            "--signature_push_by_hand_every: wait for the pushes by hand before Step() (the "
            "caller may reuse the buffers then: a failover during Step counts them lost if "
            "they were not replicated) instead of after it");
DEFINE_int32(signature_push_by_hand_every, 0,
             "--model=signature: every Nth step (steps t with t % N == N - 1; 0: none) pushes "
             "the step's tensors and tables by hand (PushMany, awaited after Step) before "
             "Step(), which must not push them again (a second push of a clock would replace "
             "the first in BSP, count twice in ASP/SSP)");
DEFINE_string(reference, "", "compare: the standalone run's result file");
DEFINE_string(results, "", "compare: comma-separated result files of the cluster's workers");

namespace {

using shardps::Client;
using shardps::ClientCounters;
using shardps::Status;

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// A float in [-1, 1) from a key: 24 random bits, so exactly representable.
float Uniform(uint64_t key) {
  return static_cast<float>(static_cast<int64_t>(SplitMix(key) >> 40) - (1 << 23)) /
         static_cast<float>(1 << 23);
}

// The linear-regression problem: x (dim), y (outputs) of sample s.
struct LinReg {
  int dim, outputs;
  float X(uint64_t s, int i) const { return Uniform((s << 20) ^ (1ull << 60) ^ i); }
  float TrueW(int i, int j) const { return Uniform((2ull << 60) ^ (i * 4096 + j)); }
  float Y(uint64_t s, int j) const {
    float y = Uniform((3ull << 60) ^ j) + 0.01f * Uniform((s << 20) ^ (4ull << 60) ^ j);
    for (int i = 0; i < dim; ++i) y += X(s, i) * TrueW(i, j);
    return y;
  }
  float InitW(size_t i) const { return 0.01f * static_cast<float>(static_cast<int>(i % 7) - 3); }
  float InitB(size_t j) const { return 0.5f; }
  // Mean gradient of 0.5 * ||x W + b - y||^2 over samples first .. first+batch-1. The same code
  // computes a worker's contribution in both modes, so those partials are bit-identical.
  void Gradient(const std::vector<float>& w, const std::vector<float>& b, uint64_t first, int batch,
                std::vector<float>* gw, std::vector<float>* gb) const {
    std::fill(gw->begin(), gw->end(), 0.0f);
    std::fill(gb->begin(), gb->end(), 0.0f);
    std::vector<float> x(dim), e(outputs);
    for (int n = 0; n < batch; ++n) {
      const uint64_t s = first + n;
      for (int i = 0; i < dim; ++i) x[i] = X(s, i);
      for (int j = 0; j < outputs; ++j) {
        float p = b[j];
        for (int i = 0; i < dim; ++i) p += x[i] * w[i * outputs + j];
        e[j] = p - Y(s, j);
      }
      for (int i = 0; i < dim; ++i) {
        for (int j = 0; j < outputs; ++j) (*gw)[i * outputs + j] += x[i] * e[j];
      }
      for (int j = 0; j < outputs; ++j) (*gb)[j] += e[j];
    }
    const float inv = 1.0f / static_cast<float>(batch);
    for (float& g : *gw) g *= inv;
    for (float& g : *gb) g *= inv;
  }
  uint64_t FirstSample(int step, int workers, int rank, int batch) const {
    return (static_cast<uint64_t>(step) * workers + rank) * batch;
  }
};

// The row table's task (--embedding_rows): each step, worker r reads the rows of its ids (three
// seeded ids, and a hot row every worker shares, twice) and pushes g = e_id - target_id per
// occurrence: least squares of every row toward its target. The gradient depends on the rows
// read, so a read that missed a step shows in the result.
struct RowTask {
  static constexpr int kDim = 4;
  static std::vector<int64_t> Ids(int step, int rank, int rows) {
    std::vector<int64_t> ids;
    for (uint64_t k = 0; k < 3; ++k) {
      const uint64_t x = SplitMix((uint64_t(step) * 64 + rank) * 8 + k);
      // Hashed: any 64-bit key (negative ones included); dense: a row.
      ids.push_back(static_cast<int64_t>(FLAGS_embedding_hashed ? x : x % rows));
    }
    ids.push_back(step % 7);
    ids.push_back(step % 7);
    return ids;
  }
  static float Target(int64_t id, int j) { return Uniform((5ull << 60) ^ (id * 8 + j)); }
  // --embedding_load: a row's loaded value.
  static float Loaded(int64_t id, int j) { return Uniform((7ull << 60) ^ (id * 8 + j)); }
  // Hashed: every key any worker touches in `steps` steps, in a fixed order (the result's rows).
  static std::vector<int64_t> AllKeys(int steps, int workers, int rows) {
    std::vector<int64_t> all;
    for (int t = 0; t < steps; ++t) {
      for (int r = 0; r < workers; ++r) {
        for (int64_t k : Ids(t, r, rows)) {
          if (std::find(all.begin(), all.end(), k) == all.end()) all.push_back(k);
        }
      }
    }
    return all;
  }
  // One worker's gradient rows for `ids`, given the rows it read, summed per id in the order
  // the client sums them (first occurrence order, from zero): (ids, sums).
  static void Coalesce(const std::vector<int64_t>& ids, const std::vector<float>& rows,
                       std::vector<int64_t>* uniq, std::vector<float>* sums) {
    uniq->clear();
    sums->clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      size_t u = std::find(uniq->begin(), uniq->end(), ids[i]) - uniq->begin();
      if (u == uniq->size()) {
        uniq->push_back(ids[i]);
        sums->resize(sums->size() + kDim, 0.0f);
      }
      for (int j = 0; j < kDim; ++j) {
        (*sums)[u * kDim + j] += rows[i * kDim + j] - Target(ids[i], j);
      }
    }
  }
};

struct Result {
  std::string mode;
  int rank = -1;
  int steps = 0;
  // standalone: --workers; train: live workers just before the last step (the others cannot
  // have finished and left yet: BSP's last step needs this worker's push).
  uint32_t workers = 0;
  std::string consistency, transport;
  uint64_t control_steady = 0;
  ClientCounters counters;
  // --inject_data_error_every: errors the fault-injecting fabric caused.
  uint64_t injected_errors = 0;
  uint64_t violations = 0;
  int64_t max_lead = 0;
  // --model=counter with --embedding_rows: how many of this worker's row pushes its own row
  // (100 + rank) holds at the end (-1: not measured).
  int64_t row_count = -1;
  int64_t dense_loaded = -1;  // --dense_load: 1 when the loaded weights read back exactly
  std::string barrier_arrive_ns, barrier_release_ns, barrier_gen;  // --barrier_every: lists
  int view_buffer_untouched = -1;  // --weights_view: 1 if the registered buffers kept their values
  uint64_t sig_pulls = 0, sig_at_bound = 0;  // signature model
  uint64_t row_sig_pulls = 0;                 // --signature_rows: row-table pulls checked
  int64_t sig_max_staleness = 0;
  uint64_t start_clock = 0;  // the clock after Start() (> 0: joined a running cluster)
  uint64_t end_clock = 0;    // the clock after the last step (> steps: clocks were skipped)
  float max_abs_grad = 0;    // standalone: largest |gradient element| of any worker's minibatch
  std::vector<std::pair<std::string, const std::vector<float>*>> tensors;
};

bool WriteAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) return false;
  const bool ok = fwrite(text.data(), 1, text.size(), f) == text.size();
  if (fclose(f) != 0 || !ok) return false;
  return rename(tmp.c_str(), path.c_str()) == 0;
}

int WriteResult(const Result& r) {
  if (FLAGS_out.empty()) return 0;
  std::string s;
  char buf[64];
  auto kv = [&](const char* k, const std::string& v) { s += std::string(k) + " " + v + "\n"; };
  kv("mode", r.mode);
  kv("rank", std::to_string(r.rank));
  kv("steps", std::to_string(r.steps));
  kv(r.mode == "standalone" ? "workers" : "workers_before_last_step", std::to_string(r.workers));
  kv("consistency", r.consistency.empty() ? "-" : r.consistency);
  kv("transport", r.transport.empty() ? "-" : r.transport);
  kv("control_messages_steady", std::to_string(r.control_steady));
  kv("heartbeats", std::to_string(r.counters.heartbeats_sent));
  kv("pushes", std::to_string(r.counters.pushes));
  kv("pulls", std::to_string(r.counters.pulls));
  kv("pull_retries", std::to_string(r.counters.pull_retries));
  kv("pull_other_buffer", std::to_string(r.counters.pull_other_buffer));
  kv("failovers", std::to_string(r.counters.failovers));
  kv("pushes_resent", std::to_string(r.counters.pushes_resent));
  kv("pushes_lost", std::to_string(r.counters.pushes_lost));
  kv("reconnects", std::to_string(r.counters.reconnects));
  kv("injected_errors", std::to_string(r.injected_errors));
  kv("start_clock", std::to_string(r.start_clock));
  kv("end_clock", std::to_string(r.end_clock));
  kv("violations", std::to_string(r.violations));
  kv("max_lead", std::to_string(r.max_lead));
  if (r.row_count >= 0) kv("row_count", std::to_string(r.row_count));
  if (r.dense_loaded >= 0) kv("dense_loaded", std::to_string(r.dense_loaded));
  if (!r.barrier_arrive_ns.empty()) {
    kv("barrier_arrive_ns", r.barrier_arrive_ns);
    kv("barrier_release_ns", r.barrier_release_ns);
    kv("barrier_gen", r.barrier_gen);
  }
  if (r.view_buffer_untouched >= 0) {
    kv("view_buffer_untouched", std::to_string(r.view_buffer_untouched));
  }
  kv("sig_pulls", std::to_string(r.sig_pulls));
  kv("sig_at_bound", std::to_string(r.sig_at_bound));
  kv("sig_max_staleness", std::to_string(r.sig_max_staleness));
  if (FLAGS_signature_rows) {
    kv("row_sig_pulls", std::to_string(r.row_sig_pulls));
    kv("row_cache_hits", std::to_string(r.counters.row_cache_hits));
  }
  snprintf(buf, sizeof(buf), "%.17g", FLAGS_lr);
  kv("lr", buf);
  snprintf(buf, sizeof(buf), "%.9g", r.max_abs_grad);
  kv("max_abs_grad", buf);
  for (const auto& [name, v] : r.tensors) {
    s += "tensor " + name + " " + std::to_string(v->size());
    for (float x : *v) {
      snprintf(buf, sizeof(buf), " %.9g", x);
      s += buf;
    }
    s += "\n";
  }
  if (!WriteAtomically(FLAGS_out, s)) {
    fprintf(stderr, "ps_test_worker: cannot write %s\n", FLAGS_out.c_str());
    return 6;
  }
  return 0;
}

// Marks that this worker reached the hold (<hold_file>.held.<rank>, for the test's report),
// then waits (up to 120 s) until --hold_file exists; false when it never appeared.
bool AwaitHoldFile(int me) {
  WriteAtomically(FLAGS_hold_file + ".held." + std::to_string(me), "held\n");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (access(FLAGS_hold_file.c_str(), F_OK) != 0) {
    if (std::chrono::steady_clock::now() > until) {
      fprintf(stderr, "ps_test_worker rank %d: %s never appeared\n", me, FLAGS_hold_file.c_str());
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

void Progress(int steps) {
  if (!FLAGS_progress_file.empty()) {
    WriteAtomically(FLAGS_progress_file, std::to_string(steps) + "\n");
  }
}

// The servers' SGD update with weight decay 0 (server/optimizer.cc), term for term, so that
// the only difference left between the modes is the order in which the servers sum.
void SgdApply(std::vector<float>* w, const std::vector<float>& sum, float scale, float lr) {
  for (size_t i = 0; i < w->size(); ++i) {
    (*w)[i] = (*w)[i] - lr * (scale * sum[i] + 0.0f * (*w)[i]);
  }
}

// The servers' momentum update with weight decay 0, term for term (server/optimizer.cc).
void MomentumApply(std::vector<float>* w, std::vector<float>* v, const std::vector<float>& sum,
                   float scale, float lr, float mu) {
  const float wd = 0.0f;
  for (size_t i = 0; i < w->size(); ++i) {
    (*v)[i] = mu * (*v)[i] + scale * sum[i] + wd * (*w)[i];
    (*w)[i] = (*w)[i] - lr * (*v)[i];
  }
}

int RunStandalone() {
  const LinReg m{FLAGS_dim, FLAGS_outputs};
  const size_t nw = static_cast<size_t>(FLAGS_dim) * FLAGS_outputs;
  std::vector<float> w(nw), b(FLAGS_outputs), gw(nw), gb(FLAGS_outputs);
  std::vector<float> sw(nw), sb(FLAGS_outputs);
  std::vector<float> vw(nw, 0.0f), vb(FLAGS_outputs, 0.0f);  // momentum buffers
  for (size_t i = 0; i < nw; ++i) w[i] = m.InitW(i);
  for (size_t j = 0; j < b.size(); ++j) b[j] = m.InitB(j);
  const float lr = static_cast<float>(FLAGS_lr);  // the servers hold lr as a float too
  const float scale = 1.0f / static_cast<float>(FLAGS_workers);
  float max_abs_grad = 0;
  const int erows = FLAGS_embedding_rows;
  std::vector<float> e(static_cast<size_t>(erows) * RowTask::kDim, 0.0f);  // zeros-initialised
  if (FLAGS_embedding_load && !FLAGS_embedding_hashed) {
    for (int64_t id = 0; id < erows; ++id) {
      for (int j = 0; j < RowTask::kDim; ++j) e[id * RowTask::kDim + j] = RowTask::Loaded(id, j);
    }
  }
  // Hashed: the servers' placement, admission and eviction, in one process (2 shards: the
  // cluster's --servers of these tests).
  shardps::test::HashedTableModel hashed_e(static_cast<uint64_t>(std::max(erows, 1)), 2,
                                           RowTask::kDim, shardps::RowInitKind::kZeros, 1.0f, 0,
                                           1.0f);
  for (int t = 0; t < FLAGS_steps; ++t) {
    if (erows > 0 && FLAGS_embedding_hashed) {
      std::vector<std::vector<uint64_t>> order(2);
      std::map<uint64_t, std::vector<float>> sum;
      for (int r = 0; r < FLAGS_workers; ++r) {
        const std::vector<int64_t> ids = RowTask::Ids(t, r, erows);
        std::vector<float> rows(ids.size() * RowTask::kDim);
        for (size_t i = 0; i < ids.size(); ++i) {
          const std::vector<float> v = hashed_e.Read(static_cast<uint64_t>(ids[i]));
          std::copy(v.begin(), v.end(), &rows[i * RowTask::kDim]);
        }
        std::vector<int64_t> uniq;
        std::vector<float> sums;
        RowTask::Coalesce(ids, rows, &uniq, &sums);
        for (size_t u = 0; u < uniq.size(); ++u) {
          const uint64_t key = static_cast<uint64_t>(uniq[u]);
          auto [it, fresh] = sum.try_emplace(key, std::vector<float>(RowTask::kDim, 0.0f));
          if (fresh) order[hashed_e.ShardOf(key)].push_back(key);
          for (int j = 0; j < RowTask::kDim; ++j) it->second[j] += sums[u * RowTask::kDim + j];
        }
      }
      for (uint32_t k = 0; k < 2; ++k) {
        std::vector<float> flat;
        for (uint64_t key : order[k]) flat.insert(flat.end(), sum[key].begin(), sum[key].end());
        hashed_e.Apply(k, order[k], flat, scale, lr);
      }
    } else if (erows > 0) {
      // The servers' BSP clock of a row shard: each row's sum over the workers in rank order
      // (each worker's own sum first), then w - lr * (scale * sum) (server/row_shard.cc).
      std::map<int64_t, std::vector<float>> sum;
      for (int r = 0; r < FLAGS_workers; ++r) {
        const std::vector<int64_t> ids = RowTask::Ids(t, r, erows);
        std::vector<float> rows(ids.size() * RowTask::kDim);
        for (size_t i = 0; i < ids.size(); ++i) {
          std::copy_n(&e[ids[i] * RowTask::kDim], RowTask::kDim, &rows[i * RowTask::kDim]);
        }
        std::vector<int64_t> uniq;
        std::vector<float> sums;
        RowTask::Coalesce(ids, rows, &uniq, &sums);
        for (size_t u = 0; u < uniq.size(); ++u) {
          std::vector<float>& acc = sum[uniq[u]];
          acc.resize(RowTask::kDim, 0.0f);
          for (int j = 0; j < RowTask::kDim; ++j) acc[j] += sums[u * RowTask::kDim + j];
        }
      }
      for (auto& [id, g] : sum) {
        for (int j = 0; j < RowTask::kDim; ++j) {
          float& x = e[id * RowTask::kDim + j];
          x = x - lr * (scale * g[j]);
        }
      }
    }
    std::fill(sw.begin(), sw.end(), 0.0f);
    std::fill(sb.begin(), sb.end(), 0.0f);
    // The union of the workers' minibatches, summed as the servers do: in rank order; with
    // --local_workers=L (host aggregation, docs/hierarchical.md) each host's L workers first
    // (local-rank order, by its aggregator), then the hosts' sums in host order (the servers).
    const int per_host = FLAGS_local_workers > 0 ? FLAGS_local_workers : 1;
    std::vector<float> hw(nw), hb(FLAGS_outputs);
    for (int h = 0; h * per_host < FLAGS_workers; ++h) {
      for (int l = 0; l < per_host && h * per_host + l < FLAGS_workers; ++l) {
        const int r = h * per_host + l;
        m.Gradient(w, b, m.FirstSample(t, FLAGS_workers, r, FLAGS_batch), FLAGS_batch, &gw, &gb);
        if (l == 0) {
          hw = gw;
          hb = gb;
        } else {
          for (size_t i = 0; i < nw; ++i) hw[i] += gw[i];
          for (size_t j = 0; j < hb.size(); ++j) hb[j] += gb[j];
        }
        for (float g : gw) max_abs_grad = std::max(max_abs_grad, std::fabs(g));
        for (float g : gb) max_abs_grad = std::max(max_abs_grad, std::fabs(g));
      }
      for (size_t i = 0; i < nw; ++i) sw[i] += hw[i];
      for (size_t j = 0; j < sb.size(); ++j) sb[j] += hb[j];
    }
    if (FLAGS_optimizer == "momentum") {
      const float mu = static_cast<float>(FLAGS_momentum);
      MomentumApply(&w, &vw, sw, scale, lr, mu);
      if (!FLAGS_freeze_b) MomentumApply(&b, &vb, sb, scale, lr, mu);
    } else {
      SgdApply(&w, sw, scale, lr);
      if (!FLAGS_freeze_b) SgdApply(&b, sb, scale, lr);
    }
  }
  Result r;
  r.mode = "standalone";
  r.steps = FLAGS_steps;
  r.workers = static_cast<uint32_t>(FLAGS_workers);
  r.max_abs_grad = max_abs_grad;
  r.tensors = {{"W", &w}, {"b", &b}};
  if (erows > 0 && FLAGS_embedding_hashed) {
    e.clear();
    for (int64_t k : RowTask::AllKeys(FLAGS_steps, FLAGS_workers, erows)) {
      const std::vector<float> v = hashed_e.Read(static_cast<uint64_t>(k));
      e.insert(e.end(), v.begin(), v.end());
    }
  }
  if (erows > 0) r.tensors.push_back({"E", &e});
  return WriteResult(r);
}

int RunCluster() {
  shardps::ClientOptions o;
  const shardps::transport::FabricOptions fo = shardps::transport::FabricOptionsFromFlags();
  o.coordinator = FLAGS_coordinator;
  o.cluster_token = FLAGS_cluster_token;
  o.requested_rank = FLAGS_rank;
  o.host_weights_in_place = FLAGS_weights_view;
  o.transport = fo.provider;
  o.bind_ip = fo.bind_ip;
  o.rdma_device = fo.rdma_device;
  o.rdma_gid_index = fo.rdma_gid_index;
  o.setup_timeout = std::chrono::milliseconds(FLAGS_setup_timeout_ms);
  o.wait_timeout = std::chrono::milliseconds(FLAGS_wait_timeout_ms);
  // --inject_data_error_every: the client's fabric wrapped in the fault-injecting decorator.
  std::shared_ptr<const shardps::test::FaultCounters> faults;
  auto client = [&]() -> shardps::StatusOr<std::unique_ptr<Client>> {
    if (FLAGS_inject_data_error_every == 0) return Client::Connect(o);
    auto fabric = shardps::transport::Fabric::Open(shardps::worker::ClientFabricOptions(o));
    if (!fabric.ok()) return fabric.status();
    shardps::test::FaultOptions fault;
    fault.error_every = FLAGS_inject_data_error_every;
    auto wrapped = std::make_unique<shardps::test::FaultInjectingFabric>(std::move(*fabric), fault);
    faults = wrapped->counters();
    return shardps::worker::ConnectOverFabric(o, std::move(wrapped));
  }();
  if (!client.ok()) {
    fprintf(stderr, "ps_test_worker: cannot join the cluster at %s: %s\n",
            FLAGS_coordinator.c_str(), client.status().ToString().c_str());
    return 3;
  }
  Client& c = **client;
  const int me = static_cast<int>(c.rank());
  Result r;
  r.mode = FLAGS_mode;
  r.rank = me;
  r.transport = c.transport_name();
  r.consistency = c.consistency();
  if (FLAGS_mode == "join") {
    Status st = c.Close();
    if (!st.ok()) {
      fprintf(stderr, "ps_test_worker: leave failed: %s\n", st.ToString().c_str());
      return 3;
    }
    return WriteResult(r);
  }

  const LinReg m{FLAGS_dim, FLAGS_outputs};
  const bool linreg = FLAGS_model == "linreg";
  const bool signature = FLAGS_model == "signature";
  const size_t nsig = static_cast<size_t>(FLAGS_workers) * FLAGS_steps;
  const size_t nw =
      linreg ? static_cast<size_t>(FLAGS_dim) * FLAGS_outputs : (signature ? nsig : FLAGS_workers);
  const size_t nb =
      linreg ? FLAGS_outputs : (signature ? nsig : (FLAGS_count_in_b ? FLAGS_workers : 1));
  std::vector<shardps::testing_util::SignatureCheck> sig, row_sig;
  // --signature_rows: update u = w * steps + t is row ids[u] of each table (hashed: a scattered
  // 64-bit key, negative ones included).
  struct SigTable {
    const char* name;
    bool hashed;
    uint32_t cache_rows;
    std::vector<int64_t> ids;
  };
  constexpr int kSigDim = 4;
  std::vector<SigTable> sig_tables;
  if (signature && FLAGS_signature_rows) {
    sig_tables = {{"S", false, 0, {}}, {"H", true, 0, {}}, {"C", false, 48, {}}};
    for (SigTable& tb : sig_tables) {
      for (size_t u = 0; u < nsig; ++u) {
        tb.ids.push_back(static_cast<int64_t>(tb.hashed ? SplitMix(u + 1) : u));
      }
    }
  }
  if (signature) {
    // The cluster's mode, as the client reports it: "bsp", "asp", "ssp(s=2)", "vsgd(s=2)".
    const std::string cm = c.consistency();
    shardps::testing_util::Mode mode;
    const size_t paren = cm.find("(s=");
    const int s = paren == std::string::npos ? 0 : std::atoi(cm.c_str() + paren + 3);
    if (!shardps::testing_util::ParseMode(cm.substr(0, paren), &mode)) {
      fprintf(stderr, "ps_test_worker: unknown consistency %s\n", cm.c_str());
      return 2;
    }
    if (FLAGS_signature_dense) {
      for (int i = 0; i < 2; ++i) sig.emplace_back(mode, s, FLAGS_workers, FLAGS_steps);
    }
    for (size_t i = 0; i < sig_tables.size(); ++i) {
      row_sig.emplace_back(mode, s, FLAGS_workers, FLAGS_steps);
    }
  }
  std::vector<float> w(nw), b(nb), gw(nw), gb(nb);
  // Only rank 0's initial weights count; the others start from garbage so that a worker that
  // trained from its own initial weights would show in the result.
  for (size_t i = 0; i < nw; ++i) w[i] = me == 0 ? (linreg ? m.InitW(i) : 0.0f) : -99.0f;
  for (size_t j = 0; j < nb; ++j) b[j] = me == 0 ? (linreg ? m.InitB(j) : 0.0f) : -99.0f;
  const int64_t wshape = static_cast<int64_t>(nw);
  std::vector<int64_t> shape_w =
      linreg ? std::vector<int64_t>{FLAGS_dim, FLAGS_outputs} : std::vector<int64_t>{wshape};
  // --weights_view: the registered buffers are copies that pulls must not touch; w and b are
  // refreshed from the views after every step.
  std::vector<float> wreg = w, breg = b;
  const std::vector<float> wreg0 = wreg, breg0 = breg;
  float* wbuf = FLAGS_weights_view ? wreg.data() : w.data();
  float* bbuf = FLAGS_weights_view ? breg.data() : b.data();
  auto refresh = [&]() -> Status {
    if (!FLAGS_weights_view) return Status::OK();
    auto vw = c.WeightsView("W");
    if (!vw.ok()) return vw.status();
    auto vb = c.WeightsView("b");
    if (!vb.ok()) return vb.status();
    std::memcpy(w.data(), *vw, w.size() * sizeof(float));
    std::memcpy(b.data(), *vb, b.size() * sizeof(float));
    return Status::OK();
  };
  const bool dense = !signature || FLAGS_signature_dense;
  Status st;
  if (dense) st = c.RegisterTensor("W", wbuf, gw.data(), shape_w);
  if (st.ok() && dense) st = c.RegisterTensor("b", bbuf, gb.data(), {static_cast<int64_t>(nb)});
  // The counter model's row table: each step pushes -1 into row 100 + rank and the shared
  // row 7 (servers sum, lr 1), so a row counts the pushes applied to it.
  const bool counter_rows = FLAGS_model == "counter" && FLAGS_embedding_rows > 0;
  const int erows = linreg || counter_rows ? FLAGS_embedding_rows : 0;
  for (const SigTable& tb : sig_tables) {
    if (!st.ok()) break;
    shardps::EmbeddingOptions eo;
    eo.max_ids = 4;
    eo.init = shardps::EmbeddingOptions::Init::kZeros;
    eo.hashed = tb.hashed;
    eo.cache_rows = tb.cache_rows;
    // Hashed: a capacity far above the updates, so that no bucket fills (nothing is evicted).
    st = c.RegisterEmbedding(tb.name, tb.hashed ? 4096 : static_cast<int64_t>(nsig), kSigDim,
                             shardps::TensorDType::kFloat32, eo);
  }
  if (st.ok() && erows > 0) {
    shardps::EmbeddingOptions eo;
    eo.max_ids = 16;
    eo.init = shardps::EmbeddingOptions::Init::kZeros;
    eo.hashed = FLAGS_embedding_hashed;
    st = c.RegisterEmbedding("E", erows, RowTask::kDim, shardps::TensorDType::kFloat32, eo);
  }
  if (st.ok()) st = c.Start();
  if (st.ok() && FLAGS_dense_load && !FLAGS_resume) {
    // A pretrained dense model: rank 0 sets it, everyone waits for it, and reads it back.
    const std::vector<float> thousand(std::max(w.size(), b.size()), 1000.0f);
    if (me == 0) {
      st = c.SetStateValues("W", shardps::Client::StatePart::kWeights, thousand.data(), 0);
      if (st.ok()) {
        st = c.SetStateValues("b", shardps::Client::StatePart::kWeights, thousand.data(), 0);
      }
    }
    if (st.ok()) st = c.Barrier();
    std::vector<float> got_w(w.size()), got_b(b.size());
    if (st.ok()) st = c.GetState("W", got_w.data(), nullptr, nullptr, nullptr, nullptr, nullptr);
    if (st.ok()) st = c.GetState("b", got_b.data(), nullptr, nullptr, nullptr, nullptr, nullptr);
    if (st.ok()) {
      r.dense_loaded = 1;
      for (float v : got_w) r.dense_loaded &= v == 1000.0f ? 1 : 0;
      for (float v : got_b) r.dense_loaded &= v == 1000.0f ? 1 : 0;
    }
    // Nobody trains (SSP/ASP: its updates would show in a slower worker's read) before all read.
    if (st.ok()) st = c.Barrier();
  }
  // The counter model's loaded rows all start at this count (an integer: the rows still count).
  const float counter_base = counter_rows && FLAGS_embedding_load ? 1000.0f : 0.0f;
  if (st.ok() && erows > 0 && FLAGS_embedding_load && !FLAGS_embedding_hashed && !FLAGS_resume) {
    // A pretrained table, set by every worker (the same values: idempotent) before its first
    // step; then a barrier, so that no worker reads or updates a row before every load is in
    // (under SSP and ASP a late load would overwrite the others' first updates).
    std::vector<int64_t> all(static_cast<size_t>(erows));
    std::vector<float> values(all.size() * RowTask::kDim);
    for (int64_t id = 0; id < erows; ++id) {
      all[id] = id;
      for (int j = 0; j < RowTask::kDim; ++j) {
        values[id * RowTask::kDim + j] = counter_rows ? counter_base : RowTask::Loaded(id, j);
      }
    }
    if (me == 0 && FLAGS_load_delay_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(FLAGS_load_delay_ms));
    }
    st = c.SetRows("E", shardps::Client::StatePart::kWeights, all.data(), all.size(),
                   values.data(), 0);
    if (st.ok() && FLAGS_barrier_after_load) st = c.Barrier();
  } else if (st.ok() && FLAGS_join_open_barrier && c.barrier_generation() == 0) {
    st = c.Barrier();
  }
  if (st.ok()) st = refresh();
  if (st.ok() && linreg && FLAGS_freeze_b) {
    // A frozen tensor under a rule that would move it anyway (weight decay): only the
    // no-gradient mark keeps it as it is.
    shardps::UpdateRule decay;
    decay.kind = shardps::UpdateRule::Kind::kSgd;
    decay.lr = static_cast<float>(FLAGS_lr);
    decay.weight_decay = 0.5f;
    st = c.SetUpdateRule("b", decay);
    if (st.ok()) st = c.SetNoGradient("b", true);
  }
  if (!st.ok()) {
    fprintf(stderr, "ps_test_worker rank %d: setup failed: %s\n", me, st.ToString().c_str());
    return 4;
  }
  const ClientCounters before = c.counters();
  r.start_clock = c.clock();
  std::mt19937 rng(1000 + me);
  Progress(0);
  if (FLAGS_signature_reader_ms > 0) {
    // A worker that never pushes (its clock stays where it is): every read of every table is
    // checked against the ones before it, and the reads go on across a failover.
    // Under BSP or SSP a worker whose clock never moves would hold the others back.
    if (c.consistency() != "asp") {
      fprintf(stderr, "ps_test_worker: --signature_reader_ms needs an ASP cluster, not %s\n",
              c.consistency().c_str());
      return 2;
    }
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(FLAGS_signature_reader_ms);
    int reads = 0;  // rounds of reads of every table, written to --progress_file
    std::vector<float> rows(nsig * kSigDim), vals(nsig);
    bool all_in = false;  // every other worker's every update, in every table
    while (!all_in && std::chrono::steady_clock::now() < until) {
      all_in = true;
      for (size_t i = 0; i < sig_tables.size(); ++i) {
        const SigTable& tb = sig_tables[i];
        st = c.PullRows(tb.name, tb.ids.data(), nsig, rows.data());
        if (!st.ok()) {
          fprintf(stderr, "ps_test_worker rank %d: reader, table %s: %s\n", me, tb.name,
                  st.ToString().c_str());
          return 5;
        }
        for (size_t u = 0; u < nsig; ++u) {
          vals[u] = rows[u * kSigDim];
          for (int j = 1; j < kSigDim; ++j) {
            if (rows[u * kSigDim + j] != vals[u] && r.violations++ < 3) {
              fprintf(stderr, "ps_test_worker rank %d: table %s row of update %zu: %g and %g\n",
                      me, tb.name, u, vals[u], rows[u * kSigDim + j]);
            }
          }
        }
        if (row_sig[i].Check(static_cast<int64_t>(c.clock()), vals) > 0 &&
            row_sig[i].violations() <= 3) {
          fprintf(stderr, "ps_test_worker rank %d: reader, table %s: %s\n", me, tb.name,
                  row_sig[i].last_error().c_str());
        }
        for (size_t u = 0; u < nsig; ++u) {
          all_in = all_in && (u / FLAGS_steps == static_cast<size_t>(me) || vals[u] != 0.0f);
        }
      }
      Progress(++reads);
    }
    r.steps = all_in ? 1 : 0;  // 1: it saw the others finish
    r.counters = c.counters();
    for (const auto& k : row_sig) {
      r.violations += k.violations();
      r.row_sig_pulls += k.pulls();
    }
    const int rc = WriteResult(r);
    st = c.Close();
    if (!st.ok()) LOG(WARNING) << "rank " << me << ": leave: " << st;
    return rc;
  }
  const int first_step = FLAGS_resume ? static_cast<int>(r.start_clock) : 0;
  for (int t = first_step; t < FLAGS_steps; ++t) {
    if (FLAGS_hold_at_step > 0 && t == FLAGS_hold_at_step && !AwaitHoldFile(me)) return 5;
    const uint64_t every = static_cast<uint64_t>(std::max(FLAGS_barrier_every, 1));
    const bool barrier_now =
        FLAGS_barrier_every > 0 &&
        (FLAGS_barrier_by_clock
             ? c.barrier_generation() < c.clock() / every + 1
             : t % FLAGS_barrier_every == 0);
    if (barrier_now) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 40));
      auto now_ns = [] {
        return std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now().time_since_epoch())
                                  .count());
      };
      if (FLAGS_hold_before_barrier > 0 &&
          c.barrier_generation() + 1 == static_cast<uint64_t>(FLAGS_hold_before_barrier) &&
          !AwaitHoldFile(me)) {
        return 5;
      }
      const std::string sep = r.barrier_arrive_ns.empty() ? "" : ",";
      r.barrier_arrive_ns += sep + now_ns();
      st = c.Barrier();
      r.barrier_release_ns += sep + now_ns();
      if (!st.ok()) {
        fprintf(stderr, "ps_test_worker rank %d: barrier at step %d: %s\n", me, t,
                st.ToString().c_str());
        return 5;
      }
      r.barrier_gen += sep + std::to_string(c.barrier_generation());
    }
    if (FLAGS_step_delay_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(FLAGS_step_delay_ms));
    }
    if (FLAGS_max_delay_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % FLAGS_max_delay_ms));
    }
    if (counter_rows) {
      const int64_t ids[2] = {100 + me, 7};
      const std::vector<float> minus(2 * RowTask::kDim, -1.0f);
      st = c.AddRowGradients("E", ids, 2, minus.data());
      if (!st.ok()) {
        fprintf(stderr, "ps_test_worker rank %d: rows of step %d: %s\n", me, t,
                st.ToString().c_str());
        return 5;
      }
    }
    if (linreg && erows > 0) {
      const std::vector<int64_t> ids = RowTask::Ids(t, me, erows);
      std::vector<float> rows(ids.size() * RowTask::kDim);
      st = c.PullRows("E", ids.data(), ids.size(), rows.data());
      std::vector<float> g(ids.size() * RowTask::kDim);
      for (size_t i = 0; i < ids.size(); ++i) {
        for (int j = 0; j < RowTask::kDim; ++j) {
          g[i * RowTask::kDim + j] = rows[i * RowTask::kDim + j] - RowTask::Target(ids[i], j);
        }
      }
      if (st.ok()) st = c.AddRowGradients("E", ids.data(), ids.size(), g.data());
      if (!st.ok()) {
        fprintf(stderr, "ps_test_worker rank %d: rows of step %d: %s\n", me, t,
                st.ToString().c_str());
        return 5;
      }
    }
    if (linreg) {
      m.Gradient(w, b, m.FirstSample(t, FLAGS_workers, me, FLAGS_batch), FLAGS_batch, &gw, &gb);
      if (FLAGS_freeze_b) std::fill(gb.begin(), gb.end(), 0.0f);  // no gradient: zeros
    } else if (signature) {
      shardps::testing_util::SignatureCheck::Gradient(me, t, FLAGS_steps, &gw);
      shardps::testing_util::SignatureCheck::Gradient(me, t, FLAGS_steps, &gb);
      const float minus[kSigDim] = {-1.0f, -1.0f, -1.0f, -1.0f};
      for (const SigTable& tb : sig_tables) {
        const int64_t id = tb.ids[static_cast<size_t>(me) * FLAGS_steps + t];
        st = c.AddRowGradients(tb.name, &id, 1, minus);
        if (!st.ok()) {
          fprintf(stderr, "ps_test_worker rank %d: table %s, step %d: %s\n", me, tb.name, t,
                  st.ToString().c_str());
          return 5;
        }
      }
    } else {
      std::fill(gw.begin(), gw.end(), 0.0f);
      std::fill(gb.begin(), gb.end(), 0.0f);
      if (me < static_cast<int>(nw)) gw[me] = -1.0f;
      if (FLAGS_count_in_b && me < static_cast<int>(gb.size())) gb[me] = -1.0f;
    }
    if (t == FLAGS_steps - 1) r.workers = c.num_workers();
    // Pushed by hand, awaited after Step (which leaves them out, and resends them after a
    // failover during it, as its own: they are not awaited yet).
    std::vector<shardps::Handle> by_hand;
    const int hand_every = FLAGS_signature_push_by_hand_every;
    if (signature && hand_every > 0 && t % hand_every == hand_every - 1) {
      std::vector<std::string> names;
      if (FLAGS_signature_dense) names = {"W", "b"};
      for (const SigTable& tb : sig_tables) names.push_back(tb.name);
      shardps::StatusOr<std::vector<shardps::Handle>> hs = c.PushMany(names);
      if (!hs.ok()) {
        fprintf(stderr, "ps_test_worker rank %d: pushes by hand of step %d: %s\n", me, t,
                hs.status().ToString().c_str());
        return 5;
      }
      by_hand = *hs;
      if (FLAGS_signature_wait_hand_pushes) {
        for (shardps::Handle h : by_hand) {
          st = c.Wait(h);
          if (!st.ok()) {
            fprintf(stderr, "ps_test_worker rank %d: pushes by hand of step %d: %s\n", me, t,
                    st.ToString().c_str());
            return 5;
          }
        }
        by_hand.clear();
      }
    }
    st = c.Step();
    for (shardps::Handle h : by_hand) {
      Status waited = c.Wait(h);
      if (st.ok()) st = waited;
    }
    if (st.ok()) st = refresh();
    if (!st.ok()) {
      fprintf(stderr, "ps_test_worker rank %d: step %d failed: %s\n", me, t, st.ToString().c_str());
      return 5;
    }
    if (signature) {
      const int64_t clock = static_cast<int64_t>(c.clock());
      const std::vector<float>* pulled[2] = {&w, &b};
      for (size_t i = 0; i < sig.size(); ++i) {
        if (sig[i].Check(clock, *pulled[i]) > 0 && sig[i].violations() <= 3) {
          fprintf(stderr, "ps_test_worker rank %d: tensor %s: %s\n", me, i == 0 ? "W" : "b",
                  sig[i].last_error().c_str());
        }
      }
      std::vector<float> rows(nsig * kSigDim), vals(nsig);
      for (size_t i = 0; i < sig_tables.size(); ++i) {
        const SigTable& tb = sig_tables[i];
        st = c.PullRows(tb.name, tb.ids.data(), nsig, rows.data());
        if (!st.ok()) {
          fprintf(stderr, "ps_test_worker rank %d: table %s, pull after step %d: %s\n", me,
                  tb.name, t, st.ToString().c_str());
          return 5;
        }
        for (size_t u = 0; u < nsig; ++u) {
          vals[u] = rows[u * kSigDim];
          for (int j = 1; j < kSigDim; ++j) {
            if (rows[u * kSigDim + j] != vals[u] && r.violations++ < 3) {  // one version a row
              fprintf(stderr, "ps_test_worker rank %d: table %s row of update %zu: %g and %g\n",
                      me, tb.name, u, vals[u], rows[u * kSigDim + j]);
            }
          }
        }
        if (row_sig[i].Check(clock, vals) > 0 && row_sig[i].violations() <= 3) {
          fprintf(stderr, "ps_test_worker rank %d: table %s: %s\n", me, tb.name,
                  row_sig[i].last_error().c_str());
        }
      }
    } else if (!linreg) {
      // Pushes of clocks 0 .. clock-s-1 must all be in: at least clock - s of them.
      const int64_t clock = static_cast<int64_t>(c.clock());
      for (size_t k = 0; k < nw; ++k) {
        if (w[k] < static_cast<float>(clock - FLAGS_staleness)) ++r.violations;
        r.max_lead = std::max<int64_t>(r.max_lead, clock - static_cast<int64_t>(w[k]));
      }
    }
    if (t == FLAGS_checkpoint_after_step && me == 0) {
      auto k = c.RequestCheckpoint();
      if (!k.ok()) {
        fprintf(stderr, "ps_test_worker: checkpoint request: %s\n", k.status().ToString().c_str());
        return 5;
      }
    }
    Progress(t + 1);
  }
  if (counter_rows) {
    // Its own row, once every push of its is in (SSP and ASP reads need not hold the last
    // ones yet: read until they do, bounded), then again a little later: a push applied twice
    // (a resend after a failover) would overshoot, a lost one never arrive.
    const int64_t own = 100 + me;
    std::vector<float> row(RowTask::kDim);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (;;) {
      st = c.PullRows("E", &own, 1, row.data());
      if (!st.ok() || row[0] >= counter_base + static_cast<float>(FLAGS_steps) ||
          std::chrono::steady_clock::now() > until) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (st.ok()) st = c.PullRows("E", &own, 1, row.data());
    if (!st.ok()) {
      fprintf(stderr, "ps_test_worker rank %d: own row: %s\n", me, st.ToString().c_str());
      return 5;
    }
    r.row_count = static_cast<int64_t>(row[0] - counter_base);
    for (int j = 1; j < RowTask::kDim; ++j) {
      if (row[j] != row[0]) r.row_count = -2;  // a torn or mixed row
    }
  }
  const ClientCounters after = c.counters();
  if (FLAGS_weights_view) r.view_buffer_untouched = (wreg == wreg0 && breg == breg0) ? 1 : 0;
  r.steps = FLAGS_steps;
  r.end_clock = c.clock();
  r.control_steady = after.control_messages_sent - before.control_messages_sent;
  r.counters = after;
  r.counters.pushes = after.pushes - before.pushes;
  r.counters.pulls = after.pulls - before.pulls;
  r.counters.pull_retries = after.pull_retries - before.pull_retries;
  r.counters.pull_other_buffer = after.pull_other_buffer - before.pull_other_buffer;
  r.counters.heartbeats_sent = after.heartbeats_sent - before.heartbeats_sent;
  for (const auto& k : sig) {
    r.violations += k.violations();
    r.sig_pulls += k.pulls();
    r.sig_at_bound += k.at_bound();
    r.sig_max_staleness = std::max(r.sig_max_staleness, k.max_staleness());
  }
  for (const auto& k : row_sig) {
    r.violations += k.violations();
    r.row_sig_pulls += k.pulls();
    r.sig_at_bound += k.at_bound();
    r.sig_max_staleness = std::max(r.sig_max_staleness, k.max_staleness());
  }
  r.injected_errors = faults ? faults->injected.load() : 0;
  if (dense) r.tensors = {{"W", &w}, {"b", &b}};
  std::vector<float> e;
  if (erows > 0) {
    std::vector<int64_t> all(static_cast<size_t>(erows));
    for (int i = 0; i < erows; ++i) all[i] = i;
    if (FLAGS_embedding_hashed) all = RowTask::AllKeys(FLAGS_steps, FLAGS_workers, erows);
    e.resize(all.size() * RowTask::kDim);
    st = c.PullRows("E", all.data(), all.size(), e.data());
    if (!st.ok()) {
      fprintf(stderr, "ps_test_worker rank %d: final rows: %s\n", me, st.ToString().c_str());
      return 5;
    }
    r.tensors.push_back({"E", &e});
  }
  const int rc = WriteResult(r);
  st = c.Close();
  if (!st.ok()) LOG(WARNING) << "rank " << me << ": leave: " << st;
  return rc;
}

// A result file as the key/value lines and tensors WriteResult produced.
struct Parsed {
  std::map<std::string, std::string> values;
  std::map<std::string, std::vector<float>> tensors;
};

bool ParseFile(const std::string& path, Parsed* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "tensor") {
      std::string name, tok;
      size_t n = 0;
      in >> name >> n;
      std::vector<float>& v = out->tensors[name];
      while (in >> tok) v.push_back(std::strtof(tok.c_str(), nullptr));
      if (v.size() != n) return false;
    } else {
      std::string value;
      std::getline(in >> std::ws, value);
      out->values[key] = value;
    }
  }
  return true;
}

// Tolerance (derivation in process_cluster_test.cc, BspMatchesStandaloneWithTheSameTotalBatch):
// the runs differ only in the order the servers sum the W workers' gradients, which after T
// steps is bounded by T * 2 (W-1) u lr G (u = 2^-24, G = max |gradient element|); we allow 4x
// that plus 4 ulp of the weight. The workers pulled the same final version: bit-identical.
int CompareMain() {
  Parsed ref;
  if (!ParseFile(FLAGS_reference, &ref) || ref.values["mode"] != "standalone") {
    fprintf(stderr, "ps_test_worker: --reference=%s is not a standalone result\n",
            FLAGS_reference.c_str());
    return 2;
  }
  const double u = std::ldexp(1.0, -24);
  const double steps = std::strtod(ref.values["steps"].c_str(), nullptr);
  const double workers = std::strtod(ref.values["workers"].c_str(), nullptr);
  const double lr = std::strtod(ref.values["lr"].c_str(), nullptr);
  const double g = std::strtod(ref.values["max_abs_grad"].c_str(), nullptr);
  const double abs_tol = 4.0 * steps * 2.0 * (workers - 1) * u * lr * g;
  std::vector<std::string> files;
  std::istringstream list(FLAGS_results);
  for (std::string f; std::getline(list, f, ',');) {
    if (!f.empty()) files.push_back(f);
  }
  if (files.empty()) {
    fprintf(stderr, "ps_test_worker: --results names no file\n");
    return 2;
  }
  double max_diff = 0;
  const Parsed* first = nullptr;
  std::vector<Parsed> results(files.size());
  for (size_t k = 0; k < files.size(); ++k) {
    Parsed& p = results[k];
    if (!ParseFile(files[k], &p) || p.values["mode"] != "train") {
      fprintf(stderr, "compare: %s is not a training result\n", files[k].c_str());
      return 7;
    }
    if (p.values["steps"] != ref.values["steps"]) {
      fprintf(stderr, "compare: %s ran %s steps, the reference %s\n", files[k].c_str(),
              p.values["steps"].c_str(), ref.values["steps"].c_str());
      return 7;
    }
    for (const auto& [name, want] : ref.tensors) {
      const std::vector<float>& got = p.tensors[name];
      if (got.size() != want.size()) {
        fprintf(stderr, "compare: %s: tensor %s has %zu elements, want %zu\n", files[k].c_str(),
                name.c_str(), got.size(), want.size());
        return 7;
      }
      for (size_t i = 0; i < want.size(); ++i) {
        const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
        max_diff = std::max(max_diff, d);
        if (!(d <= abs_tol + 4.0 * u * std::fabs(want[i]))) {
          fprintf(stderr, "compare: %s: %s[%zu] = %.9g, standalone %.9g (|diff| %.3g > %.3g)\n",
                  files[k].c_str(), name.c_str(), i, got[i], want[i], d, abs_tol);
          return 7;
        }
      }
      if (first != nullptr && first->tensors.at(name) != got) {
        fprintf(stderr, "compare: %s and %s pulled different final %s\n", files[0].c_str(),
                files[k].c_str(), name.c_str());
        return 7;
      }
    }
    if (first == nullptr) first = &p;
  }
  printf("compare: %zu results match the standalone run: max |diff| %.3g <= %.3g (+4 ulp)\n",
         files.size(), max_diff, abs_tol);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "ps_test_worker --mode=train|standalone|join|compare --coordinator=HOST:PORT --out=FILE");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (FLAGS_steps < 0 || FLAGS_workers < 1 || FLAGS_batch < 1 || FLAGS_dim < 1 ||
      FLAGS_outputs < 1 ||
      (FLAGS_model != "linreg" && FLAGS_model != "counter" && FLAGS_model != "signature") ||
      ((FLAGS_signature_rows || FLAGS_signature_push_by_hand_every != 0) &&
       FLAGS_model != "signature") ||
      FLAGS_signature_push_by_hand_every < 0 ||
      (!FLAGS_signature_dense && !(FLAGS_model == "signature" && FLAGS_signature_rows)) ||
      (FLAGS_signature_reader_ms > 0 && !(FLAGS_model == "signature" && FLAGS_signature_rows))) {
    fprintf(stderr, "ps_test_worker: bad flags (see --help)\n");
    return 2;
  }
  if (FLAGS_standalone) FLAGS_mode = "standalone";
  if (FLAGS_mode == "standalone") {
    if (FLAGS_model != "linreg") {
      fprintf(stderr, "ps_test_worker: --standalone trains the linreg model only\n");
      return 2;
    }
    return RunStandalone();
  }
  if (FLAGS_mode == "compare") return CompareMain();
  if (FLAGS_mode == "train" || FLAGS_mode == "join") return RunCluster();
  fprintf(stderr, "ps_test_worker: unknown --mode=%s (train, standalone, join, compare)\n",
          FLAGS_mode.c_str());
  return 2;
}
