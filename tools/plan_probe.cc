// shardps plan --probe: measures the costs the predictor needs on this host (docs/plan.md).
//
//  * link: two fabrics of the chosen provider in this process (a target with one remote
//    read/write region, an initiator that busy-polls like a worker), connected over loopback.
//    alpha = mean time of one 8-byte operation alone; op_us = mean time per 64-byte operation
//    with 64 in flight; beta = bytes/s of 1 MiB operations with 8 in flight.
//  * spin_rtt_us[k]: the mean 8-byte read round trip when k + 1 clients, each a pair of fabrics
//    with a busy-polling thread (like a worker and its server), run at once on this host:
//    what a round trip costs in a local cluster of k + 1 workers (CPU contention, measured).
//  * apply_Bps / add_Bps: ChunkOptimizer::Apply (momentum) and a gradient accumulation loop
//    over a 256 KiB chunk, bytes of weights per second.
//
// Thread safety: RunProbe owns every thread it starts (target server, spinners) and joins them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>
#include <unistd.h>

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
    transport::FabricOptions fo;
    fo.provider = provider;
    fo.bind_ip = provider == "shm" ? "" : "127.0.0.1";
    ASSIGN_OR_RETURN(tfab_, transport::Fabric::Open(fo));
    ASSIGN_OR_RETURN(ifab_, transport::Fabric::Open(fo));
    ASSIGN_OR_RETURN(tregion_, tfab_->AllocateMemory(kRegionBytes, transport::Access::kRemoteReadWrite));
    ASSIGN_OR_RETURN(local_, ifab_->AllocateMemory(kRegionBytes, transport::Access::kLocalOnly));
    std::memset(tregion_->data(), 1, kRegionBytes);
    std::memset(local_->data(), 2, kRegionBytes);
    ASSIGN_OR_RETURN(tcq_, tfab_->CreateCompletionQueue(256));
    ASSIGN_OR_RETURN(cq_, ifab_->CreateCompletionQueue(4 * kWindow));
    ASSIGN_OR_RETURN(listener_, tfab_->Listen(provider == "shm" ? "" : "127.0.0.1:0"));
    const std::string addr = listener_->address();
    Status accepted = UnavailableError("not accepted");
    target_thread_ = std::thread([this, &accepted] {
      transport::EndpointOptions eo;
      eo.endpoint_id = 1;
      eo.send_depth = 16;
      eo.recv_depth = 16;
      auto ep = listener_->Accept(tcq_.get(), eo, std::chrono::milliseconds(10000));
      accepted = ep.status();
      ready_ = true;
      if (!ep.ok()) return;
      transport::Completion wc[16];
      while (!stop_) tcq_->Wait(wc, 16, std::chrono::microseconds(20000));
      ep->reset();
    });
    transport::EndpointOptions eo;
    eo.endpoint_id = 2;
    eo.send_depth = kWindow + 1;
    eo.recv_depth = 16;
    auto ep = ifab_->Connect(addr, cq_.get(), eo);
    while (!ready_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    RETURN_IF_ERROR(accepted);
    if (!ep.ok()) return ep.status();
    ep_ = std::move(*ep);
    remote_ = tregion_->descriptor();
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
        if (!wc[i].ok()) return InternalError("probe operation failed: " + ep_->status().ToString());
        ++done;
      }
      if (Now() - t0 > 30) return DeadlineExceededError("probe: no progress for 30 s");
    }
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
};

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

}  // namespace

StatusOr<ProbeFile> RunProbe(const ProbeOptions& o) {
  ProbeFile pf;
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
