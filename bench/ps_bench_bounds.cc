// shardps_bench's bounds (class Bounds in ps_bench.h): per point, raw TCP streams or a raw TCP
// ping-pong on the same addresses (tcp), memcpy (shm), or perftest numbers from --bounds_file
// (verbs), measured right before each repetition of ours. The primitives are in bench/bounds.h.
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "bench/bounds.h"
#include "bench/ps_bench.h"

namespace shardps::bench {

Status Bounds::Init() {
  ASSIGN_OR_RETURN(external_, LoadExternalBounds(FLAGS_bounds_file));
  return Status::OK();
}

StatusOr<double> Bounds::TcpStreams(int writers, int readers, const PointParams& p) {
  const int n = writers + readers;
  RETURN_IF_ERROR(EnsureTcp(n));
  std::vector<BwResult> r(n);
  std::vector<Status> st(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i) {
    ts.emplace_back([&, i] {
      st[i] = clients_[i]->Bandwidth(i < writers ? BenchOp::kWrite : BenchOp::kRead, p, &r[i]);
    });
  }
  for (auto& t : ts) t.join();
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(st[i]);
    sum += r[i].gbps();
  }
  return sum;
}

StatusOr<double> Bounds::TcpLatencyP50(BenchOp op, const PointParams& p) {
  RETURN_IF_ERROR(EnsureTcp(1));
  LatResult r;
  RETURN_IF_ERROR(clients_[0]->Latency(op, p, &r));
  return Percentile(&r.us, 50);
}

StatusOr<BoundResult> Bounds::Measure(const ClusterSpec& spec, Mode mode, bool latency) {
  BoundResult b;
  PointParams p;
  p.size = spec.size;
  p.window = std::max(1, spec.keys);
  const size_t footprint = 256u << 20;
  p.slots = static_cast<int>(std::clamp<size_t>(footprint / spec.size, 1, spec.keys));
  p.seconds = std::max(0.1, FLAGS_seconds * 0.5);
  p.lat_seconds = std::max(0.1, FLAGS_lat_seconds * 0.5);
  p.lat_min_iters = FLAGS_lat_min_iters;
  const int W = spec.workers;
  if (spec.transport == "tcp") {
    if (latency) {
      double us = 0;
      if (mode != Mode::kPull) {
        ASSIGN_OR_RETURN(double w, TcpLatencyP50(BenchOp::kWrite, p));
        us += w;
      }
      if (mode != Mode::kPush) {
        ASSIGN_OR_RETURN(double r, TcpLatencyP50(BenchOp::kRead, p));
        us += r;
      }
      b.lat_p50 = us;
      b.name = mode == Mode::kPush   ? "raw TCP write+ack ping-pong"
               : mode == Mode::kPull ? "raw TCP read round trip"
                                     : "raw TCP write ping-pong + read round trip";
    } else if (mode == Mode::kStep) {
      // A step pushes every key and then pulls them: W streams writing the bytes, then W
      // reading them, one after the other (twice the bytes in the sum of the two times).
      ASSIGN_OR_RETURN(const double w, TcpStreams(W, 0, p));
      ASSIGN_OR_RETURN(const double r, TcpStreams(0, W, p));
      b.gbps = 2 / (1 / w + 1 / r);
      b.name = "raw TCP, " + std::to_string(W) + " writing then " + std::to_string(W) +
               " reading stream(s)";
    } else {
      const int wr = mode == Mode::kPull ? 0 : W;
      const int rd = mode == Mode::kPush ? 0 : W;
      ASSIGN_OR_RETURN(b.gbps, TcpStreams(wr, rd, p));
      b.name = "raw TCP, " + std::to_string(wr) + " writing + " + std::to_string(rd) +
               " reading stream(s)";
    }
  } else if (spec.transport == "shm") {
    if (latency) {
      LatResult r;
      RETURN_IF_ERROR(MemcpyLatency(p, &r));
      b.lat_p50 = Percentile(&r.us, 50) * (mode == Mode::kPushPull ? 2 : 1);
      b.name = mode == Mode::kPushPull ? "2 x memcpy" : "memcpy";
    } else {
      BwResult r;
      RETURN_IF_ERROR(MemcpyBandwidth(p, &r));
      b.gbps = r.gbps();
      b.name = "memcpy, 1 thread";
    }
  } else if (spec.transport == "verbs") {
    auto get = [&](const char* op, const char* kind) {
      auto it = external_.find({"verbs", op, kind, spec.size});
      return it == external_.end() ? std::pair<double, double>{NAN, NAN} : it->second;
    };
    if (latency) {
      double us = 0;
      if (mode != Mode::kPull) us += get("write", "lat").first;
      if (mode != Mode::kPush) us += get("read", "lat").first;
      b.lat_p50 = us;
    } else if (mode == Mode::kStep) {
      b.gbps = 2 / (1 / get("write", "bw").first + 1 / get("read", "bw").first);  // one, then the other
    } else {
      double g = 0;
      if (mode != Mode::kPull) g += get("write", "bw").first;
      if (mode != Mode::kPush) g += get("read", "bw").first;
      b.gbps = g;
    }
    b.name = "perftest (ib_write/ib_read" + std::string(latency ? "_lat)" : "_bw)");
  }
  return b;
}

Status Bounds::EnsureTcp(int n) {
  while (static_cast<int>(clients_.size()) < n) {
    ASSIGN_OR_RETURN(auto s, RawTcpServer::Start(FLAGS_server_bind_ip));
    ASSIGN_OR_RETURN(auto c, RawTcpClient::Connect(s->address(), FLAGS_worker_bind_ip));
    servers_.push_back(std::move(s));
    clients_.push_back(std::move(c));
  }
  return Status::OK();
}

}  // namespace shardps::bench
