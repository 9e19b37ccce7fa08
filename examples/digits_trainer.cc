// digits_trainer: trains a classifier on scikit-learn's digits through libshardps.
//
// Each worker computes gradients on its shard of every global minibatch and calls Step(): the
// gradients go into the servers' memory with one-sided writes, the servers apply the optimizer
// (their --optimizer and --lr), and the new weights come back with one-sided reads. The trainer
// never applies an update itself, except in --standalone, which runs the same math in one
// process (plain SGD on the same global batches) so that a BSP run can be compared with it.
//
// Data sharding: every worker draws the same per-epoch permutation (seeded); global step t uses
// positions [t*W*B, (t+1)*W*B) of it, and worker rank r takes every W-th of those, starting at r.
// The coordinator assigns ranks; MPI's rank variables are only logged.
//
// Usage: docs/operations.md. Single-threaded: the Client belongs to main().
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "common/version.h"
#include "examples/digits_model.h"
#include "shardps/client.h"

DEFINE_string(coordinator, "127.0.0.1:7070", "shardps_coordinator address (host:port)");
DEFINE_string(cluster_token, "", "Cluster secret; empty reads $SHARDPS_CLUSTER_TOKEN");
// The data-path flags carry the same names as the servers' (transport/flags.cc), but this
// binary uses only the public client API, so it defines the ones ClientOptions takes.
DEFINE_string(transport, "auto", "Data path: verbs, tcp, shm or auto (must match the servers')");
DEFINE_string(bind_ip, "", "Local IP for the data path (verbs: selects the NIC)");
DEFINE_string(rdma_device, "", "verbs: RDMA device name (empty: by --bind_ip, else first active)");
DEFINE_int32(rdma_gid_index, -1, "verbs: GID index (-1: automatic RoCEv2 GID)");
DEFINE_int32(rank, -1, "Requested worker rank (-1: the coordinator picks)");
DEFINE_int32(setup_timeout_s, 60, "Bound on joining and on waiting for the other workers");
DEFINE_int32(wait_timeout_s, 30, "Bound on one pull waiting for the consistency condition");

DEFINE_string(data, "build/data/digits_train.bin",
              "Training data (scripts/export_digits.py); the test set is found by replacing "
              "'train' with 'test' in the name unless --test_data is given");
DEFINE_string(test_data, "", "Held-out data (default: derived from --data)");
DEFINE_string(model, "mlp", "mlp (features-hidden-classes, ReLU) or logreg");
DEFINE_int32(hidden, 64, "Hidden units of the MLP");
DEFINE_int32(epochs, 15, "Passes over the training set");
DEFINE_int32(batch_size, 32, "Samples per worker per step (global batch = workers x this)");
DEFINE_uint64(seed, 1, "Seed of the initial weights and of the per-epoch shuffles");
DEFINE_int32(log_every, 20, "Print a progress line every this many steps (0: per epoch only)");
DEFINE_string(dump_weights, "",
              "Write the final weights here (format: docs/operations.md); {rank} in the path "
              "becomes this worker's rank");
DEFINE_double(min_accuracy, 0.0, "Exit 3 if the final test accuracy is below this");
DEFINE_int32(eval_every, 0,
             "Every this many steps, and before the first and after the last, print "
             "'eval: rank R step S t=SECONDS unix=SECONDS acc=X' on every worker: the test "
             "accuracy of the weights this worker holds (those its last Step() pulled); t counts "
             "from this worker's first step, unix is the wall clock (0: off)");

// Heterogeneity for studies (scripts/bench-staleness.py). The compute phase of a step is the
// gradient computation (measured wall time c) plus --compute_delay_ms d, slept. With --slowdown
// F the worker then sleeps (F - 1) * (c + d) more, so its compute phase takes F times as long.
DEFINE_double(compute_delay_ms, 0.0,
              "Simulated extra compute per step, slept after computing gradients (models a "
              "heavier model; counts as compute for --slowdown)");
DEFINE_double(slowdown, 1.0,
              "Make this worker's compute F times slower: after computing gradients (wall time c, "
              "plus --compute_delay_ms d) sleep (F - 1) * (c + d) each step (>= 1)");
DEFINE_int32(slowdown_rank, -1,
             "Apply --slowdown only on the worker the coordinator assigns this rank, so one "
             "launcher command can slow one worker (-1: on every worker given --slowdown)");

DEFINE_bool(standalone, false, "No cluster: local SGD with the same math and global batch");
DEFINE_int32(workers, 1, "--standalone: the number of workers W whose global batch to use");
DEFINE_double(lr, 0.2, "--standalone: learning rate (in a cluster the servers' --lr rules)");
DEFINE_string(optimizer, "momentum",
              "--standalone: sgd or momentum, as the servers apply them (cluster: servers' flag)");
DEFINE_double(momentum, 0.9, "--standalone: momentum of --optimizer=momentum");

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string MpiRankForLogging() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* s = getenv(v)) return std::string(" (") + v + "=" + s + ")";
  }
  return "";
}

shardps::Status DumpWeights(const std::string& path, const digits::Model& model) {
  std::ofstream f(path + ".tmp", std::ios::binary);
  if (!f) return shardps::NotFoundError("cannot write " + path);
  const uint32_t hdr[2] = {0x57445053u /* "SPDW" */, static_cast<uint32_t>(model.tensors().size())};
  f.write(reinterpret_cast<const char*>(hdr), sizeof(hdr));
  for (const digits::Tensor& t : model.tensors()) {
    const uint32_t n = static_cast<uint32_t>(t.w.size());
    f.write(reinterpret_cast<const char*>(&n), sizeof(n));
    f.write(reinterpret_cast<const char*>(t.w.data()), static_cast<std::streamsize>(n * 4));
  }
  f.close();
  if (!f) return shardps::DataLossError("short write to " + path);
  if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    return shardps::ErrnoError("rename " + path, errno);
  }
  return shardps::Status::OK();
}

// What a training run needs from its environment: a cluster client, or none (standalone).
struct Run {
  std::unique_ptr<shardps::Client> client;  // null in --standalone
  uint32_t rank = 0;
  uint32_t workers = 1;
  std::string transport = "none";
  std::string consistency = "local sgd";
};

shardps::StatusOr<Run> Join(digits::Model& model) {
  Run run;
  if (FLAGS_standalone) {
    if (FLAGS_workers < 1) return shardps::InvalidArgumentError("--workers must be >= 1");
    run.workers = static_cast<uint32_t>(FLAGS_workers);
    if (FLAGS_optimizer != "sgd" && FLAGS_optimizer != "momentum") {
      return shardps::InvalidArgumentError("--standalone supports --optimizer=sgd|momentum");
    }
    char what[96];
    std::snprintf(what, sizeof(what), "local %s lr %g", FLAGS_optimizer.c_str(), FLAGS_lr);
    run.consistency = what;
    return run;
  }
  shardps::ClientOptions o;
  o.coordinator = FLAGS_coordinator;
  o.cluster_token = FLAGS_cluster_token;
  if (o.cluster_token.empty() && getenv("SHARDPS_CLUSTER_TOKEN") != nullptr) {
    o.cluster_token = getenv("SHARDPS_CLUSTER_TOKEN");
  }
  o.requested_rank = FLAGS_rank;
  o.transport = FLAGS_transport;
  o.bind_ip = FLAGS_bind_ip;
  o.rdma_device = FLAGS_rdma_device;
  o.rdma_gid_index = FLAGS_rdma_gid_index;
  o.setup_timeout = std::chrono::seconds(FLAGS_setup_timeout_s);
  o.wait_timeout = std::chrono::seconds(FLAGS_wait_timeout_s);
  ASSIGN_OR_RETURN(run.client, shardps::Client::Connect(o));
  for (digits::Tensor& t : model.tensors()) {
    RETURN_IF_ERROR(run.client->RegisterTensor(t.name, t.w.data(), t.g.data(), t.shape));
  }
  // Rank 0's initial weights become everyone's; all ranks seed identically anyway.
  RETURN_IF_ERROR(run.client->Start());
  run.rank = run.client->rank();
  run.workers = run.client->num_workers();
  run.transport = run.client->transport_name();
  run.consistency = run.client->consistency();
  if (run.workers == 0) return shardps::InternalError("the cluster reports no workers");
  return run;
}

int Main() {
  digits::ModelKind kind;
  if (FLAGS_model == "mlp") {
    kind = digits::ModelKind::kMlp;
  } else if (FLAGS_model == "logreg") {
    kind = digits::ModelKind::kLogReg;
  } else {
    LOG(ERROR) << "--model must be mlp or logreg, not '" << FLAGS_model << "'";
    return 2;
  }
  if (FLAGS_batch_size < 1 || FLAGS_epochs < 1) {
    LOG(ERROR) << "--batch_size and --epochs must be >= 1";
    return 2;
  }
  if (!(FLAGS_slowdown >= 1.0) || !(FLAGS_compute_delay_ms >= 0.0) || FLAGS_eval_every < 0) {
    LOG(ERROR) << "--slowdown must be >= 1, --compute_delay_ms and --eval_every >= 0";
    return 2;
  }
  std::string test_path = FLAGS_test_data;
  if (test_path.empty()) {
    test_path = FLAGS_data;
    const size_t at = test_path.rfind("train");
    if (at == std::string::npos) {
      LOG(ERROR) << "--data has no 'train' in its name; give --test_data";
      return 2;
    }
    test_path.replace(at, 5, "test");
  }
  auto train = digits::LoadDataset(FLAGS_data);
  auto test = digits::LoadDataset(test_path);
  if (!train.ok() || !test.ok()) {
    LOG(ERROR) << (train.ok() ? test.status() : train.status())
               << " (export it with: /usr/bin/python3 scripts/export_digits.py)";
    return 2;
  }
  if (test->features != train->features || test->classes != train->classes) {
    LOG(ERROR) << "train and test files disagree on features/classes";
    return 2;
  }
  auto model = digits::Model::Create(kind, train->features, static_cast<uint32_t>(FLAGS_hidden),
                                     train->classes, FLAGS_seed);
  if (!model.ok()) {
    LOG(ERROR) << model.status();
    return 2;
  }
  auto joined = Join(*model);
  if (!joined.ok()) {
    LOG(ERROR) << "joining the cluster at " << FLAGS_coordinator << ": " << joined.status();
    return 1;
  }
  Run& run = *joined;
  const uint32_t W = run.workers;
  const uint32_t B = static_cast<uint32_t>(FLAGS_batch_size);
  const uint32_t shard = run.rank % W;
  const uint32_t steps_per_epoch = train->n / (W * B);
  char tag[64];
  std::snprintf(tag, sizeof(tag), "[worker %u/%u]", run.rank, W);
  if (steps_per_epoch == 0) {
    LOG(ERROR) << tag << " global batch " << W * B << " exceeds the " << train->n
               << " training samples";
    return 2;
  }
  std::printf(
      "%s %s: %s (%zu parameters), %u train / %u test samples, batch %u per worker "
      "(global %u), %u steps/epoch, transport %s, consistency %s%s\n",
      tag, FLAGS_standalone ? "standalone" : "joined", model->Describe().c_str(),
      model->num_parameters(), train->n, test->n, B, W * B, steps_per_epoch, run.transport.c_str(),
      run.consistency.c_str(), MpiRankForLogging().c_str());
  std::fflush(stdout);

  const bool slowed =
      FLAGS_slowdown > 1.0 && (FLAGS_slowdown_rank < 0 ||
                               static_cast<uint32_t>(FLAGS_slowdown_rank) == run.rank);
  const double slowdown = slowed ? FLAGS_slowdown : 1.0;
  const auto compute_delay = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(FLAGS_compute_delay_ms));
  Clock::duration in_compute{0}, in_delay{0}, in_slowdown{0}, in_eval{0};

  const uint64_t control_before = run.client ? run.client->counters().control_messages_sent : 0;
  std::vector<uint32_t> idx(static_cast<size_t>(FLAGS_standalone ? W * B : B));
  uint64_t step = 0;
  double loss_sum = 0.0;
  uint32_t loss_count = 0;
  Clock::duration in_step{0};
  const auto t0 = Clock::now();
  auto window_start = t0;
  uint64_t window_steps = 0;
  // Evaluation time is kept out of the compute phase that --slowdown scales.
  auto eval = [&](uint64_t at_step) {
    const auto e0 = Clock::now();
    const double acc = model->Accuracy(*test);
    std::printf("eval: rank %u step %" PRIu64 " t=%.4f unix=%.4f acc=%.4f\n", run.rank, at_step,
                Seconds(e0 - t0), UnixSeconds(), acc);
    std::fflush(stdout);
    in_eval += Clock::now() - e0;
  };
  if (FLAGS_eval_every > 0) eval(0);
  for (uint32_t epoch = 0; epoch < static_cast<uint32_t>(FLAGS_epochs); ++epoch) {
    const std::vector<uint32_t> perm = digits::EpochPermutation(train->n, FLAGS_seed, epoch);
    for (uint32_t s = 0; s < steps_per_epoch; ++s) {
      const uint32_t* global = perm.data() + static_cast<size_t>(s) * W * B;
      if (FLAGS_standalone) {
        std::copy(global, global + W * B, idx.begin());
      } else {
        for (uint32_t j = 0; j < B; ++j) idx[j] = global[shard + W * j];
      }
      const auto c0 = Clock::now();
      loss_sum += model->ComputeGradients(*train, idx.data(), idx.size());
      ++loss_count;
      const auto c1 = Clock::now();
      in_compute += c1 - c0;
      if (compute_delay.count() > 0) {
        std::this_thread::sleep_for(compute_delay);
        in_delay += Clock::now() - c1;
      }
      if (slowed) {
        const auto c2 = Clock::now();
        std::this_thread::sleep_until(
            c2 + std::chrono::duration_cast<Clock::duration>((slowdown - 1.0) *
                                                             ((c1 - c0) + compute_delay)));
        in_slowdown += Clock::now() - c2;
      }
      const auto s0 = Clock::now();
      if (run.client) {
        shardps::Status st = run.client->Step();
        if (!st.ok()) {
          LOG(ERROR) << tag << " step " << step << ": " << st;
          return 1;
        }
      } else {
        model->LocalUpdate(static_cast<float>(FLAGS_lr),
                           FLAGS_optimizer == "momentum" ? static_cast<float>(FLAGS_momentum) : 0);
      }
      in_step += Clock::now() - s0;
      ++step;
      ++window_steps;
      const bool epoch_end = s + 1 == steps_per_epoch;
      const bool last = epoch_end && epoch + 1 == static_cast<uint32_t>(FLAGS_epochs);
      if (FLAGS_eval_every > 0 && (step % FLAGS_eval_every == 0 || last)) eval(step);
      const bool log_now = FLAGS_log_every > 0 ? step % FLAGS_log_every == 0 : epoch_end;
      if (run.rank == 0 &&
          (log_now || (epoch_end && epoch + 1 == static_cast<uint32_t>(FLAGS_epochs)))) {
        const double dt = Seconds(Clock::now() - window_start);
        const double mine = dt > 0 ? window_steps * B * (FLAGS_standalone ? W : 1) / dt : 0;
        std::printf("%s step %" PRIu64
                    " epoch %u/%d loss %.4f | %.0f samples/s this worker, "
                    "~%.0f cluster-wide | %.2f ms/step | %s, %s\n",
                    tag, step, epoch + 1, FLAGS_epochs, loss_sum / loss_count, mine,
                    FLAGS_standalone ? mine : mine * W, dt * 1e3 / window_steps,
                    run.transport.c_str(), run.consistency.c_str());
        std::fflush(stdout);
        loss_sum = 0;
        loss_count = 0;
        window_start = Clock::now();
        window_steps = 0;
      }
    }
  }
  const double elapsed = Seconds(Clock::now() - t0);
  const double control_per_step =
      run.client
          ? static_cast<double>(run.client->counters().control_messages_sent - control_before) /
                static_cast<double>(step)
          : 0.0;
  const double accuracy = model->Accuracy(*test);
  const double cluster_rate = static_cast<double>(step) * W * B / elapsed;
  std::printf("%s test accuracy %.4f (%u samples), train accuracy %.4f\n", tag, accuracy, test->n,
              model->Accuracy(*train));
  if (FLAGS_eval_every > 0 || slowed || compute_delay.count() > 0) {
    // Per-step means of each phase, for checking the heterogeneity flags and for steps/s;
    // pull_retries per step counts the header re-reads of pulls that waited for the bound.
    std::printf("timing: rank %u steps %" PRIu64
                " elapsed %.4f s compute %.4f ms delay %.4f ms slowdown %.4f ms (factor %g) "
                "step %.4f ms eval %.4f s pull_retries %.2f\n",
                run.rank, step, elapsed, Seconds(in_compute) * 1e3 / step,
                Seconds(in_delay) * 1e3 / step, Seconds(in_slowdown) * 1e3 / step, slowdown,
                Seconds(in_step) * 1e3 / step, Seconds(in_eval),
                run.client ? static_cast<double>(run.client->counters().pull_retries) / step : 0.0);
  }
  if (run.rank == 0) {
    std::printf("final: test accuracy %.4f after %" PRIu64
                " steps, %.0f samples/s, transport %s, "
                "control messages per step %g, step %.2f ms (in Step() %.2f ms), "
                "consistency %s, %u workers\n",
                accuracy, step, cluster_rate, run.transport.c_str(), control_per_step,
                elapsed * 1e3 / step, Seconds(in_step) * 1e3 / step, run.consistency.c_str(), W);
  }
  std::fflush(stdout);
  if (!FLAGS_dump_weights.empty()) {
    std::string path = FLAGS_dump_weights;
    const size_t at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(run.rank));
    shardps::Status st = DumpWeights(path, *model);
    if (!st.ok()) {
      LOG(ERROR) << st;
      return 1;
    }
  }
  if (run.client) {
    shardps::Status st = run.client->Close();
    if (!st.ok()) LOG(WARNING) << tag << " leaving the cluster: " << st;
  }
  if (accuracy < FLAGS_min_accuracy) {
    std::fprintf(stderr, "%s test accuracy %.4f is below --min_accuracy %.4f\n", tag, accuracy,
                 FLAGS_min_accuracy);
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shardps::ParseCommandLine(
      &argc, &argv,
      "digits_trainer --coordinator=HOST:PORT --transport=tcp --data=build/data/digits_train.bin"
      "  |  digits_trainer --standalone --workers=W",
      __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  return Main();
}
