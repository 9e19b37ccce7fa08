// shardps plan --probe: measures the costs the predictor needs on this host (docs/plan.md).
//
//  * link: two fabrics of the chosen provider in this process (a target with one remote
//    read/write region, an initiator that busy-polls like a worker), connected over loopback.
//    alpha = mean time of one 8-byte operation alone; op_us = mean time per 64-byte operation
//    with 64 in flight; beta = bytes/s of 1 MiB operations with 8 in flight.
//  * spin_rtt_us[k]: the mean 8-byte read round trip when k + 1 clients, each a pair of fabrics
//    with a busy-polling thread (like a worker and its server), run at once on this host:
//    what a round trip costs in a local cluster of k + 1 workers (CPU contention, measured).
//  * pair_step_us[k]: k + 1 client processes, each doing the exchange of one worker with one
//    server in a training step (PairStep) against its own server process; mean time per
//    exchange.
//  * apply_Bps / add_Bps: ChunkOptimizer::Apply (momentum) and a gradient accumulation loop
//    over a 256 KiB chunk, bytes of weights per second.
//  * mem_copy_Bps / mem_add_Bps: memcpy and dst += src over 64 MiB buffers (far beyond the
//    caches), one thread: the host memory throughput of the hierarchical local reduction.
//  * local_hop_us: half the round trip of a ping-pong between two processes through a
//    process-shared futex (how a host's local workers and its aggregator hand a step over).
//
// Thread safety: RunProbe owns every thread it starts (target server, spinners) and joins them.
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <cerrno>

#include "common/fd.h"
#include "server/optimizer.h"
#include "tools/plan.h"
#include "transport/transport.h"

namespace shardps::plan {
namespace {

using Clock = std::chrono::steady_clock;
double Now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr size_t kRegionBytes = 8u << 20;
constexpr int kWindow = 64;

// The pair of endpoints. Target side: its own thread accepts then waits on its CQ (tcp and shm
// serve one-sided operations without it; it only keeps the endpoint alive and drained).
class LoopbackPair {
 public:
  ~LoopbackPair() {
    stop_ = true;
    if (target_thread_.joinable()) target_thread_.join();
  }

  Status Open(const std::string& provider) {
    RETURN_IF_ERROR(OpenTarget(provider));
    std::thread t([this] { ServeTarget([this] { return stop_.load(); }); });
    Status connected = Connect(provider, address(), remote_);
    while (!ready_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    target_thread_ = std::move(t);
    RETURN_IF_ERROR(accepted_);
    return connected;
  }

  // Target half: a fabric with one remote read/write region, listening.
  Status OpenTarget(const std::string& provider) {
    transport::FabricOptions fo;
    fo.provider = provider;
    fo.bind_ip = provider == "shm" ? "" : "127.0.0.1";
    ASSIGN_OR_RETURN(tfab_, transport::Fabric::Open(fo));
    ASSIGN_OR_RETURN(tregion_,
                     tfab_->AllocateMemory(kRegionBytes, transport::Access::kRemoteReadWrite));
    std::memset(tregion_->data(), 1, kRegionBytes);
    ASSIGN_OR_RETURN(tcq_, tfab_->CreateCompletionQueue(256));
    ASSIGN_OR_RETURN(listener_, tfab_->Listen(provider == "shm" ? "" : "127.0.0.1:0"));
    remote_ = tregion_->descriptor();
    return Status::OK();
  }
  std::string address() const { return listener_->address(); }
  const transport::RegionDescriptor& remote() const { return remote_; }

  // Accepts one initiator, then drains the target's CQ (immediates wake this thread, as they
  // wake a server's apply thread) until stop() says so.
  template <typename Stop>
  void ServeTarget(Stop stop) {
    transport::EndpointOptions eo;
    eo.endpoint_id = 1;
    eo.send_depth = 16;
    eo.recv_depth = 64;
    auto ep = listener_->Accept(tcq_.get(), eo, std::chrono::milliseconds(10000));
    accepted_ = ep.status();
    ready_ = true;
    if (!ep.ok()) return;
    transport::Completion wc[64];
    while (!stop()) tcq_->Wait(wc, 64, std::chrono::microseconds(20000));
    ep->reset();
  }

  // Initiator half: its own fabric, connected to the target at addr.
  Status Connect(const std::string& provider, const std::string& addr,
                 const transport::RegionDescriptor& remote) {
    transport::FabricOptions fo;
    fo.provider = provider;
    fo.bind_ip = provider == "shm" ? "" : "127.0.0.1";
    ASSIGN_OR_RETURN(ifab_, transport::Fabric::Open(fo));
    ASSIGN_OR_RETURN(local_, ifab_->AllocateMemory(kRegionBytes, transport::Access::kLocalOnly));
    std::memset(local_->data(), 2, kRegionBytes);
    ASSIGN_OR_RETURN(cq_, ifab_->CreateCompletionQueue(4 * kWindow));
    transport::EndpointOptions eo;
    eo.endpoint_id = 2;
    eo.send_depth = kWindow + 1;
    eo.recv_depth = 16;
    ASSIGN_OR_RETURN(ep_, ifab_->Connect(addr, cq_.get(), eo));
    remote_ = remote;
    return Status::OK();
  }

  // Runs `ops` operations of `size` bytes with up to `window` in flight; returns seconds.
  StatusOr<double> Run(bool write, uint64_t size, int window, uint64_t ops) {
    uint64_t posted = 0, done = 0;
    transport::Completion wc[64];
    const double t0 = Now();
    const uint64_t slots = kRegionBytes / size;
    while (done < ops) {
      while (posted < ops && posted - done < static_cast<uint64_t>(window)) {
        const uint64_t off = (posted % slots) * size;
        transport::LocalSlice l{local_.get(), off, size};
        auto r = transport::AtOffset(remote_, off);
        RETURN_IF_ERROR(write ? ep_->PostWrite(l, r, posted) : ep_->PostRead(l, r, posted));
        ++posted;
      }
      const int n = cq_->Poll(wc, 64);  // spin, as a worker does
      if (n < 0) return InternalError("completion queue poll failed");
      for (int i = 0; i < n; ++i) {
        if (!wc[i].ok())
          return InternalError("probe operation failed: " + ep_->status().ToString());
        ++done;
      }
      if (Now() - t0 > 30) return DeadlineExceededError("probe: no progress for 30 s");
    }
    return Now() - t0;
  }

  // One worker-server exchange of a training step with one chunk of 64 B, as the client does
  // it (worker/client_impl.h): data write + header write-with-immediate (the target's thread is
  // woken, like a server's apply thread), an ack read every other step, a clock
  // write-with-immediate, then three reads; waits for each phase. Returns seconds.
  StatusOr<double> PairStep(uint64_t step, int chunks) {
    const double t0 = Now();
    transport::LocalSlice l{local_.get(), 0, 64};
    auto wait = [&](int n) -> Status {
      transport::Completion wc[16];
      const double deadline = Now() + 30;
      while (n > 0) {
        const int got = cq_->Poll(wc, 16);
        if (got < 0) return InternalError("completion queue poll failed");
        for (int i = 0; i < got; ++i) {
          if (!wc[i].ok()) return InternalError("probe step failed: " + ep_->status().ToString());
        }
        n -= got;
        if (Now() > deadline) return DeadlineExceededError("probe step: no progress for 30 s");
      }
      return Status::OK();
    };
    for (int c = 0; c < chunks; ++c) {
      const uint64_t off = 32768u * (c + 1);
      RETURN_IF_ERROR(
          ep_->PostWrite(l, transport::AtOffset(remote_, off), 1, transport::kUnsignaled));
      RETURN_IF_ERROR(ep_->PostWriteImm(l, transport::AtOffset(remote_, off + 4096), 7, 2));
    }
    RETURN_IF_ERROR(wait(chunks));
    if (step % 2 == 1) {
      RETURN_IF_ERROR(ep_->PostRead({local_.get(), 128, 8}, transport::AtOffset(remote_, 8192), 3));
      RETURN_IF_ERROR(wait(1));
    }
    RETURN_IF_ERROR(ep_->PostWriteImm({local_.get(), 256, 8}, transport::AtOffset(remote_, 12288),
                                      9, 4, transport::kUnsignaled));
    for (int i = 0; i < 3 * chunks; ++i) {
      RETURN_IF_ERROR(ep_->PostRead({local_.get(), 512 + 64u * i, 64},
                                    transport::AtOffset(remote_, 16384 + 64u * i), 5 + i));
    }
    RETURN_IF_ERROR(wait(3 * chunks));
    return Now() - t0;
  }

  // Repeats Run in batches until `seconds` have passed; returns the median over batches of
  // seconds per operation (robust to the other tenants of a shared host).
  StatusOr<double> PerOp(bool write, uint64_t size, int window, double seconds) {
    uint64_t batch = 8;
    ASSIGN_OR_RETURN(double warm, Run(write, size, window, batch));  // warm-up, sizes the batch
    while (warm < seconds / 40 && batch < (1u << 20)) {
      batch *= 2;
      ASSIGN_OR_RETURN(warm, Run(write, size, window, batch));
    }
    std::vector<double> per_op;
    double spent = 0;
    while (spent < seconds || per_op.size() < 5) {
      ASSIGN_OR_RETURN(double t, Run(write, size, window, batch));
      spent += t;
      per_op.push_back(t / batch);
    }
    std::sort(per_op.begin(), per_op.end());
    return per_op[per_op.size() / 2];
  }

 private:
  std::unique_ptr<transport::Fabric> tfab_, ifab_;
  std::unique_ptr<transport::MemoryRegion> tregion_, local_;
  std::unique_ptr<transport::CompletionQueue> tcq_, cq_;
  std::unique_ptr<transport::Listener> listener_;
  std::unique_ptr<transport::Endpoint> ep_;
  transport::RegionDescriptor remote_;
  std::thread target_thread_;
  std::atomic<bool> stop_{false}, ready_{false};
  Status accepted_ = UnavailableError("not accepted");
};

// The pair step with k + 1 worker-like and k + 1 server-like *processes* (context switches
// between address spaces cost more than between threads). Forked before this process opens
// any fabric (no threads to lose across fork). Each client reports its exchanges and seconds.
StatusOr<std::vector<double>> PairStepProcesses(const std::string& provider,
                                                const std::vector<int>& ks, int chunks,
                                                double seconds) {
  std::vector<double> out;
  for (int k : ks) {
    const int n = k + 1;
    std::vector<pid_t> pids;
    std::vector<int> server_ctl;  // write ends: closing one stops that server
    std::vector<int> results;     // read ends of the clients' result pipes
    Status err;
    for (int i = 0; i < n && err.ok(); ++i) {
      int info[2], ctl[2];
      if (pipe(info) != 0 || pipe(ctl) != 0) return ErrnoError("pipe", errno);
      const pid_t pid = fork();
      if (pid < 0) return ErrnoError("fork", errno);
      if (pid == 0) {  // server child
        close(info[0]);
        close(ctl[1]);
        LoopbackPair t;
        if (!t.OpenTarget(provider).ok()) _exit(2);
        const std::string msg = t.address() + "\n" + t.remote().Encode();
        const uint32_t len = static_cast<uint32_t>(msg.size());
        if (!fdio::WriteAll(info[1], &len, 4).ok() ||
            !fdio::WriteAll(info[1], msg.data(), len).ok()) {
          _exit(2);
        }
        close(info[1]);
        t.ServeTarget([&] {
          struct pollfd pf {
            ctl[0], POLLIN, 0
          };
          return ::poll(&pf, 1, 0) > 0;  // readable = EOF: the parent closed it
        });
        _exit(0);
      }
      close(info[1]);
      close(ctl[0]);
      pids.push_back(pid);
      server_ctl.push_back(ctl[1]);
      uint32_t len = 0;
      std::string msg;
      if (fdio::ReadFull(info[0], &len, 4).ok() && len < 4096) {
        msg.resize(len);
        if (!fdio::ReadFull(info[0], msg.data(), len).ok()) msg.clear();
      }
      close(info[0]);
      const size_t nl = msg.find('\n');
      if (nl == std::string::npos) {
        err = InternalError("probe: a server process did not start");
        break;
      }
      auto desc = transport::RegionDescriptor::Decode(std::string_view(msg).substr(nl + 1));
      if (!desc.ok()) {
        err = desc.status();
        break;
      }
      int res[2];
      if (pipe(res) != 0) return ErrnoError("pipe", errno);
      const pid_t cpid = fork();
      if (cpid < 0) return ErrnoError("fork", errno);
      if (cpid == 0) {  // client child
        close(res[0]);
        LoopbackPair c;
        double r[2] = {0, 0};
        if (c.Connect(provider, msg.substr(0, nl), *desc).ok()) {
          const double t0 = Now();
          uint64_t steps = 0;
          while (Now() - t0 < seconds) {
            if (!c.PairStep(steps, chunks).ok()) break;
            ++steps;
          }
          r[0] = static_cast<double>(steps);
          r[1] = Now() - t0;
        }
        if (!fdio::WriteAll(res[1], r, sizeof(r)).ok()) _exit(2);
        _exit(0);
      }
      close(res[1]);
      pids.push_back(cpid);
      results.push_back(res[0]);
    }
    // Aggregate: n clients over their mean duration / all their exchanges (a client starved
    // by the scheduler then weighs by its exchanges, not by its own slow mean).
    double total_steps = 0, total_s = 0;
    int reported = 0;
    for (int fd : results) {
      double r[2] = {0, 0};
      if (fdio::ReadFull(fd, r, sizeof(r)).ok() && r[0] > 0) {
        total_steps += r[0];
        total_s += r[1];
        ++reported;
      }
      close(fd);
    }
    for (int fd : server_ctl) close(fd);
    for (pid_t p : pids) {
      int st = 0;
      for (int i = 0; i < 200 && waitpid(p, &st, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (waitpid(p, &st, WNOHANG) == 0) {
        kill(p, SIGKILL);
        waitpid(p, &st, 0);
      }
    }
    RETURN_IF_ERROR(err);
    if (reported != n) return InternalError("probe: a pair-step client failed");
    out.push_back(total_s / total_steps * 1e6);
  }
  return out;
}

void MeasureApply(HostProbe* h) {
  constexpr size_t kElems = 64 * 1024;  // 256 KiB chunk
  std::vector<float> w(kElems, 0.5f), g(kElems, 0.01f), dst(kElems), acc(kElems, 0.f);
  server::OptimizerConfig oc;
  oc.kind = server::OptimizerKind::kMomentum;
  server::ChunkOptimizer opt(oc, kElems);
  int reps = 0;
  double t0 = Now();
  while (Now() - t0 < 0.15 || reps < 8) {
    opt.Apply(w.data(), g.data(), 0.25f, 1.0f, dst.data());
    w.swap(dst);
    ++reps;
  }
  h->set_apply_bps(reps * kElems * 4.0 / (Now() - t0));
  reps = 0;
  t0 = Now();
  while (Now() - t0 < 0.15 || reps < 8) {
    for (size_t i = 0; i < kElems; ++i) acc[i] += g[i];
    ++reps;
  }
  // Keep the loop from being optimized away.
  if (acc[kElems / 2] == -1.f) h->set_add_bps(0);
  h->set_add_bps(reps * kElems * 4.0 / (Now() - t0));
}

// Host memory throughput (docs/plan.md, the local reduction): memcpy of 64 MiB, bytes copied
// per second; dst += src over 64 MiB of floats, bytes of dst per second. The best of the
// repetitions over at least `seconds` (a shared host's other tenants only slow it down: on the
// 2-core development host under a load of 14 a best of 4 came out 10x low).
void MeasureMemory(HostProbe* h, double seconds) {
  constexpr size_t kElems = 16u << 20;  // 64 MiB of floats
  std::vector<float> a(kElems, 0.25f), b(kElems, 0.f);
  double best_copy = 0, best_add = 0;
  const double start = Now();
  for (int rep = 0; rep < 4 || Now() - start < seconds; ++rep) {
    double t0 = Now();
    std::memcpy(b.data(), a.data(), kElems * sizeof(float));
    best_copy = std::max(best_copy, kElems * sizeof(float) / (Now() - t0));
    t0 = Now();
    for (size_t i = 0; i < kElems; ++i) b[i] += a[i];
    best_add = std::max(best_add, kElems * sizeof(float) / (Now() - t0));
  }
  // Keep the loops from being optimized away.
  if (b[kElems / 2] == -1.f) best_add = 0;
  h->set_mem_copy_bps(best_copy);
  h->set_mem_add_bps(best_add);
}

// The hand-off of a hierarchical step (worker/host_group.h: futex bells in shared memory): a
// parent and a forked child ping-pong through one process-shared futex word for `seconds`;
// returns half the mean round trip, microseconds. Forked before any fabric or thread exists.
StatusOr<double> MeasureLocalHop(double seconds) {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return ErrnoError("mmap", errno);
  auto* word = new (mem) std::atomic<uint32_t>(0);
  auto wait_for = [word](uint32_t want, double deadline) {
    for (;;) {
      const uint32_t v = word->load(std::memory_order_acquire);
      if (v == want || v == UINT32_MAX) return v == want;
      if (Now() > deadline) return false;
      struct timespec ts = {0, 100 * 1000 * 1000};  // re-check the deadline every 100 ms
      syscall(SYS_futex, word, FUTEX_WAIT, v, &ts, nullptr, 0);
    }
  };
  auto post = [word](uint32_t v) {
    word->store(v, std::memory_order_release);
    syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
  };
  const pid_t pid = fork();
  if (pid < 0) {
    munmap(mem, 4096);
    return ErrnoError("fork", errno);
  }
  if (pid == 0) {  // child: answers 2i + 1 with 2i + 2 until the parent posts UINT32_MAX
    const double deadline = Now() + seconds + 30;
    for (uint32_t i = 0;; ++i) {
      if (!wait_for(2 * i + 1, deadline)) _exit(0);
      post(2 * i + 2);
    }
  }
  const double t0 = Now(), deadline = t0 + seconds + 30;
  uint32_t trips = 0;
  bool ok = true;
  while (Now() - t0 < seconds || trips < 100) {
    post(2 * trips + 1);
    if (!wait_for(2 * trips + 2, deadline)) {
      ok = false;
      break;
    }
    ++trips;
  }
  const double elapsed = Now() - t0;
  post(UINT32_MAX);
  int st = 0;
  waitpid(pid, &st, 0);
  munmap(mem, 4096);
  if (!ok) return DeadlineExceededError("probe: the futex ping-pong child did not answer");
  return elapsed / trips / 2 * 1e6;
}

}  // namespace

StatusOr<ProbeFile> RunProbe(const ProbeOptions& o) {
  ProbeFile pf;
  // First, while this process has no fabric (and so no threads): the multi-process pair step.
  // Three sweeps, the median per point: the host is shared and single sweeps differ a lot.
  // Then 4 chunks per exchange (23 operations instead of 6.5) alone and at the last k: the
  // marginal cost of an operation, in wall time and in CPU.
  std::vector<int> all_k, ends = {0, o.max_spinners};
  for (int k = 0; k <= o.max_spinners; ++k) all_k.push_back(k);
  std::vector<std::vector<double>> sweeps, sweeps4;
  const double secs = std::max(0.2, o.seconds_per_point);
  for (int rep = 0; rep < 3; ++rep) {
    ASSIGN_OR_RETURN(std::vector<double> steps, PairStepProcesses(o.transport, all_k, 1, secs));
    sweeps.push_back(std::move(steps));
    ASSIGN_OR_RETURN(std::vector<double> steps4, PairStepProcesses(o.transport, ends, 4, secs));
    sweeps4.push_back(std::move(steps4));
  }
  auto median3 = [](double a, double b, double c) {
    return std::max(std::min(a, b), std::min(std::max(a, b), c));
  };
  for (int k = 0; k <= o.max_spinners; ++k) {
    pf.mutable_host()->add_pair_step_us(median3(sweeps[0][k], sweeps[1][k], sweeps[2][k]));
  }
  for (int i = 0; i < 2; ++i) {
    pf.mutable_host()->add_pair_step4_us(median3(sweeps4[0][i], sweeps4[1][i], sweeps4[2][i]));
  }
  ASSIGN_OR_RETURN(double hop, MeasureLocalHop(std::max(0.2, o.seconds_per_point)));
  pf.mutable_host()->set_local_hop_us(hop);
  LoopbackPair pair;
  RETURN_IF_ERROR(pair.Open(o.transport));
  Pair* p = pf.add_pairs();
  p->set_from("local");
  p->set_to("local");
  p->set_transport(o.transport);
  const double s = o.seconds_per_point;
  for (bool write : {true, false}) {
    OpCost* c = write ? p->mutable_write() : p->mutable_read();
    ASSIGN_OR_RETURN(double alpha, pair.PerOp(write, 8, 1, s));
    ASSIGN_OR_RETURN(double op, pair.PerOp(write, 64, kWindow, s));
    ASSIGN_OR_RETURN(double big, pair.PerOp(write, 1u << 20, 8, s));
    c->set_alpha_us(alpha * 1e6);
    c->set_op_us(op * 1e6);
    c->set_beta_bps((1u << 20) / big);
  }
  HostProbe* h = pf.mutable_host();
  h->set_cores(static_cast<uint32_t>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))));
  MeasureApply(h);
  MeasureMemory(h, std::max(1.0, 3 * s));
  // Loaded round trips: k + 1 client threads, each with its own pair of fabrics (like worker
  // and server processes), each spinning on 8-byte reads; the mean over all of them.
  std::vector<std::unique_ptr<LoopbackPair>> pairs;
  for (int k = 0; k <= o.max_spinners; ++k) {
    while (static_cast<int>(pairs.size()) < k + 1) {
      pairs.push_back(std::make_unique<LoopbackPair>());
      RETURN_IF_ERROR(pairs.back()->Open(o.transport));
    }
    std::atomic<bool> stop{false};
    std::vector<std::thread> clients;
    std::vector<uint64_t> ops(k + 1, 0);
    std::vector<Status> errors(k + 1);
    const double t0 = Now();
    for (int i = 0; i <= k; ++i) {
      clients.emplace_back([&, i] {
        while (!stop.load(std::memory_order_relaxed)) {
          auto t = pairs[i]->Run(false, 8, 1, 4);
          if (!t.ok()) {
            errors[i] = t.status();
            return;
          }
          ops[i] += 4;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.2, s)));
    stop = true;
    for (auto& t : clients) t.join();
    const double elapsed = Now() - t0;
    for (const Status& e : errors) RETURN_IF_ERROR(e);
    double mean_rtt = 0;  // per client: elapsed / its ops; averaged
    for (uint64_t n : ops) mean_rtt += n ? elapsed / n : elapsed;
    h->add_spin_rtt_us(mean_rtt / (k + 1) * 1e6);
  }
  return pf;
}

}  // namespace shardps::plan
