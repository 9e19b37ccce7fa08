// shardps plan: model and probe files, and the predictor's equations (docs/plan.md) on fixed
// costs, so every expected figure can be worked out by hand.
#include "tools/plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace shardps::plan {
namespace {

Costs FixedCosts() {
  Costs c;
  c.write.set_alpha_us(20);
  c.write.set_beta_bps(1e9);
  c.write.set_op_us(10);
  c.read.set_alpha_us(20);
  c.read.set_beta_bps(1e9);
  c.read.set_op_us(10);
  c.cores = 2;
  c.apply_Bps = 1e9;
  c.add_Bps = 4e9;
  c.spin_rtt_us = {20, 40, 60, 80, 100};       // +20 us per extra client
  c.pair_step_us = {100, 100, 150, 200, 250};  // saturated: 2 * 150/3 = 100 us CPU, etc.
  // 4 chunks: alone 100 + 16.5 x 8 us; at k = 4: CPU 2 x 662.5 / 5 = 265 = 100 + 16.5 x 10.
  c.pair_step4_us = {232, 662.5};
  return c;
}

Workload Digits(double compute_us) {
  Workload w;
  w.tensors = DigitsMlp(64, 64, 10);
  w.compute_us = compute_us;
  w.batch = 32;
  return w;
}

TEST(PlanModelFile, ParsesShapesAndComments) {
  auto m = ParseModel("# the MLP\nfc1.weight 64 64  # comment\n\nfc1.bias 64\n");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 2u);
  EXPECT_EQ((*m)[0].name, "fc1.weight");
  EXPECT_EQ((*m)[0].bytes(), 64u * 64 * 4);
  EXPECT_EQ((*m)[1].shape, std::vector<int64_t>({64}));
  EXPECT_FALSE(ParseModel("w 3 x\n").ok());
  EXPECT_FALSE(ParseModel("w\n").ok());
  EXPECT_FALSE(ParseModel("w 0\n").ok());
  EXPECT_FALSE(ParseModel("# nothing\n").ok());
}

TEST(PlanProbeFile, ReadsDoctorSchemaAndTakesMedians) {
  // doctor --probe_out's schema: no op_us, no host part, an unknown field.
  const char* json = R"({"pairs":[
    {"from":"a","to":"b","transport":"tcp","write":{"alpha_us":10,"beta_Bps":1e9},
     "read":{"alpha_us":12,"beta_Bps":2e9},"mtu":1500},
    {"from":"a","to":"c","transport":"tcp","write":{"alpha_us":30,"beta_Bps":3e9},
     "read":{"alpha_us":14,"beta_Bps":4e9}},
    {"from":"b","to":"c","transport":"tcp","write":{"alpha_us":20,"beta_Bps":2e9},
     "read":{"alpha_us":16,"beta_Bps":3e9}}]})";
  auto p = ParseProbeJson(json);
  ASSERT_TRUE(p.ok()) << p.status();
  auto c = CostsFromProbe(*p);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->write.alpha_us(), 20);
  EXPECT_DOUBLE_EQ(c->write.beta_bps(), 2e9);
  EXPECT_DOUBLE_EQ(c->write.op_us(), 20.0 / 8);  // alpha / 8 when absent
  EXPECT_DOUBLE_EQ(c->read.alpha_us(), 14);
  EXPECT_DOUBLE_EQ(c->read.beta_bps(), 3e9);
  EXPECT_FALSE(ParseProbeJson("{\"pairs\": 3}").ok());
  // doctor's own output (tools/doctor_report.cc), with a pair it could not measure.
  auto doc = ParseProbeJson(R"({"schema": "shardps-probe/1", "pairs": [
    {"from": "w0", "to": "s0", "to_host": "h", "transport": "tcp", "why": "", "ok": true,
     "error": "", "verified_bytes": 4096,
     "write": {"alpha_us": 40, "p99_us": 90, "beta_Bps": 1.5e+09, "small_bytes": 8,
               "large_bytes": 1048576, "latency_ops": 100, "bandwidth_ops": 50},
     "read": {"alpha_us": 50, "p99_us": 99, "beta_Bps": 2e+09, "small_bytes": 8,
              "large_bytes": 1048576, "latency_ops": 100, "bandwidth_ops": 50}},
    {"from": "w0", "to": "s1", "to_host": "h", "transport": "tcp", "why": "", "ok": false,
     "error": "refused", "verified_bytes": 0,
     "write": {"alpha_us": null, "p99_us": null, "beta_Bps": null, "small_bytes": 8,
               "large_bytes": 0, "latency_ops": 0, "bandwidth_ops": 0},
     "read": {"alpha_us": null, "p99_us": null, "beta_Bps": null, "small_bytes": 8,
              "large_bytes": 0, "latency_ops": 0, "bandwidth_ops": 0}}]})");
  ASSERT_TRUE(doc.ok()) << doc.status();
  auto dc = CostsFromProbe(*doc);
  ASSERT_TRUE(dc.ok()) << dc.status();
  EXPECT_DOUBLE_EQ(dc->write.alpha_us(), 40);  // the failed pair is left out
  EXPECT_DOUBLE_EQ(dc->read.beta_bps(), 2e9);
  auto bad = ParseProbeJson(R"({"pairs":[{"write":{"alpha_us":0,"beta_Bps":1},"read":{}}]})");
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(CostsFromProbe(*bad).ok());
}

TEST(PlanProbeFile, RoundTripsThroughJson) {
  ProbeFile p;
  Pair* pr = p.add_pairs();
  pr->mutable_write()->set_alpha_us(5);
  pr->mutable_write()->set_beta_bps(7e8);
  pr->mutable_read()->set_alpha_us(6);
  pr->mutable_read()->set_beta_bps(8e8);
  p.mutable_host()->add_pair_step_us(123);
  auto j = ProbeToJson(p);
  ASSERT_TRUE(j.ok());
  EXPECT_NE(j->find("\"beta_Bps\""), std::string::npos) << *j;  // doctor's field name
  auto back = ParseProbeJson(*j);
  ASSERT_TRUE(back.ok());
  EXPECT_DOUBLE_EQ(back->pairs(0).read().beta_bps(), 8e8);
  EXPECT_DOUBLE_EQ(back->host().pair_step_us(0), 123);
}

TEST(PlanCosts, InterpolatesLoadedRoundTripAndPairCpu) {
  Costs c = FixedCosts();
  EXPECT_DOUBLE_EQ(c.Rtt(0), 20);
  EXPECT_DOUBLE_EQ(c.Rtt(1.5), 20 + 30);   // halfway between 40 and 60, minus the base 20
  EXPECT_DOUBLE_EQ(c.Rtt(6), 20 + 80 + 40);  // extrapolated at 20 us per client
  // Saturated points (clients > cores = 2): 2*150/3 = 100, 2*200/4 = 100, 2*250/5 = 100.
  EXPECT_DOUBLE_EQ(c.PairCpu(), 100);
  EXPECT_DOUBLE_EQ(c.ExchangeLatency(), 100);
  EXPECT_DOUBLE_EQ(c.OpLatency(), 8);
  EXPECT_DOUBLE_EQ(c.OpCpu(), 10);
  // Without the host part (a doctor file): from the link figures.
  Costs d;
  d.write.set_alpha_us(20);
  d.write.set_op_us(4);
  d.read.set_alpha_us(30);
  d.read.set_op_us(6);
  EXPECT_DOUBLE_EQ(d.OpLatency(), 5);
  EXPECT_DOUBLE_EQ(d.ExchangeLatency(), 1.5 * 20 + 30 + 6.5 * 5);
}

TEST(PlanPredict, OneWorkerIsTheLatencyPath) {
  Costs c = FixedCosts();
  Config cfg;  // 1 server x 1 worker, 4 MiB partitions: 4 chunks on server 0
  auto p = Predict(Digits(200), c, cfg);
  ASSERT_TRUE(p.ok()) << p.status();
  const double bytes = (64 * 64 + 64 + 10 * 64 + 10) * 4.0;
  // push: 0.6 x exchange + (2.5 * 4 + 1 - 3.5) ops x 8 us + bytes / beta;
  // pull: 0.4 x exchange + (12 - 3) ops x 8 us + bytes / beta.
  const double push = 60 + 7.5 * 8 + bytes / 1e3, pull = 40 + 9 * 8 + bytes / 1e3;
  EXPECT_NEAR(p->push_us, push, 1e-6);
  EXPECT_NEAR(p->pull_us, pull, 1e-6);
  EXPECT_DOUBLE_EQ(p->barrier_us, 0);  // one worker: nobody to wait for
  EXPECT_EQ(p->bound, "latency path");
  EXPECT_NEAR(p->step_us, 200 + push + pull, 1e-6);
  EXPECT_NEAR(p->samples_per_s, 32 / p->step_us * 1e6, 1e-6);
  EXPECT_EQ(p->chunks, 4u);
}

TEST(PlanPredict, SharedHostIsCpuBoundAndServersCostPerPair) {
  Costs c = FixedCosts();
  Config cfg;
  cfg.workers = 4;
  auto one = Predict(Digits(200), c, cfg);
  cfg.servers = 4;
  auto four = Predict(Digits(200), c, cfg);
  ASSERT_TRUE(one.ok() && four.ok());
  EXPECT_EQ(one->bound, "host cpu");
  EXPECT_EQ(four->bound, "host cpu");
  // cpu = (W compute + pairs x (c_pair + extra ops x c_op + retries x c_rt) + server bytes) / C
  // c_pair = 100, c_op = 10, c_rt = 2 x Rtt(4) / 5 = 40; server bytes: 4 adds + 1 apply of the
  // 19240-byte model = 19.24 + 19.24 us.
  // 1 server: 4 pairs, 23 ops each (16.5 beyond the probe's 6.5), one retried pull (BSP).
  EXPECT_NEAR(one->cpu_us, (4 * 200 + 4 * (100 + 16.5 * 10 + 40) + 38.48) / 2, 1e-6);
  // 4 servers: 16 pairs of 6.5 ops: more servers cost more on a shared 2-core host.
  EXPECT_NEAR(four->cpu_us, (4 * 200 + 16 * (100 + 0 + 40) + 38.48) / 2, 1e-6);
  EXPECT_DOUBLE_EQ(four->step_us, four->cpu_us);
  EXPECT_GT(four->step_us, one->step_us);
  // The busiest server: with 4 servers the 4 tensors land one per server, fc1.weight's owner
  // carries 16 KiB of the 19 KiB: imbalance > 3.
  EXPECT_GT(four->imbalance, 3.0);
}

TEST(PlanPredict, ConsistencyOrdersBspSspAsp) {
  Config cfg;
  cfg.workers = 4;
  cfg.servers = 2;
  const std::vector<std::pair<Mode, uint32_t>> modes = {
      {Mode::kBsp, 0}, {Mode::kSsp, 1}, {Mode::kSsp, 4}, {Mode::kAsp, 0}};
  // Enough cores: each looser bound waits less.
  Costs roomy = FixedCosts();
  roomy.cores = 8;
  double prev = 1e18;
  for (auto [mode, s] : modes) {
    cfg.mode = mode;
    cfg.staleness = s;
    auto p = Predict(Digits(200), roomy, cfg);
    ASSERT_TRUE(p.ok());
    EXPECT_LT(p->step_us, prev) << cfg.Describe();
    prev = p->step_us;
  }
  // 4 workers on 2 cores: SSP's leader sits at the bound and waits every step, as under BSP
  // (docs/plan.md); only ASP saves the wait.
  std::vector<double> t;
  for (auto [mode, s] : modes) {
    cfg.mode = mode;
    cfg.staleness = s;
    auto p = Predict(Digits(200), FixedCosts(), cfg);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->bound, "host cpu");
    t.push_back(p->step_us);
  }
  EXPECT_DOUBLE_EQ(t[1], t[0]);
  EXPECT_DOUBLE_EQ(t[2], t[0]);
  // ASP: 8 exchanges x one wait (c_rt = 40 us) less CPU over 2 cores.
  EXPECT_NEAR(t[0] - t[3], 8 * 40 / 2.0, 1e-6);
}

TEST(PlanPredict, SmallerPartitionsMeanMoreChunksAndMoreOps) {
  Costs c = FixedCosts();
  Config cfg;
  cfg.workers = 2;
  cfg.partition_bytes = 4096;
  auto small = Predict(Digits(200), c, cfg);
  cfg.partition_bytes = 4u << 20;
  auto big = Predict(Digits(200), c, cfg);
  ASSERT_TRUE(small.ok() && big.ok());
  EXPECT_EQ(small->chunks, 7u);  // fc1.weight (16 KiB) in 4 chunks + 3 tensors
  EXPECT_EQ(big->chunks, 4u);
  EXPECT_GT(small->push_us, big->push_us);
}

TEST(PlanSearch, RanksEveryConfigurationBestFirst) {
  Budget b;
  b.workers = 4;
  b.max_servers = 3;
  b.partitions = {4096, 4u << 20};
  auto r = Search(Digits(200), FixedCosts(), b);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 3u * 2 * 5);  // servers x partitions x modes, one machine: colocated only
  for (size_t i = 1; i < r->size(); ++i) {
    EXPECT_GE((*r)[i - 1].samples_per_s, (*r)[i].samples_per_s);
  }
  EXPECT_EQ(r->front().config.mode, Mode::kAsp);  // nothing to wait for wins on fixed costs
  b.machines = 2;
  auto r2 = Search(Digits(200), FixedCosts(), b);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->size(), 3u * 2 * 2 * 5);  // and servers apart from workers
}

// Least-squares calibration recovers the knobs that generated the steps, and with noisy steps
// lands on the least-squares solution, not on any single run.
TEST(PlanCalibrate, LeastSquaresRecoversExchangeAndWaitCpu) {
  Costs truth = FixedCosts();
  truth.pair_cpu_us = 150;
  truth.wait_cpu_us = 60;
  std::vector<MeasuredRun> runs;
  for (auto [s, part, mode] : std::vector<std::tuple<uint32_t, uint64_t, Mode>>{
           {2, 4u << 20, Mode::kAsp}, {2, 4u << 20, Mode::kBsp}, {3, 4096, Mode::kAsp},
           {3, 4096, Mode::kBsp}}) {
    MeasuredRun r;
    r.config.servers = s;
    r.config.workers = 4;
    r.config.partition_bytes = part;
    r.config.mode = mode;
    auto p = Predict(Digits(200), truth, r.config);
    ASSERT_TRUE(p.ok());
    ASSERT_EQ(p->bound, "host cpu");
    r.step_us = p->cpu_us;
    runs.push_back(r);
  }
  auto cal = CalibrateLeastSquares(Digits(200), FixedCosts(), runs);
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_TRUE(cal->wait_fitted);
  EXPECT_NEAR(cal->pair_cpu_us, 150, 1e-6);
  EXPECT_NEAR(cal->wait_cpu_us, 60, 1e-6);
  EXPECT_TRUE(cal->op_fitted);
  EXPECT_NEAR(cal->op_cpu_us, 10, 1e-6);  // FixedCosts' per-op CPU, from pair_step4_us
  EXPECT_NEAR(cal->rms_rel_residual, 0, 1e-9);

  // A per-op CPU unlike the probe's is recovered too (1 server x 4 KiB: 33 further ops a worker).
  Costs truth_op = truth;
  truth_op.op_cpu_us = 25;
  std::vector<MeasuredRun> runs_op = runs;
  MeasuredRun one_server;
  one_server.config.workers = 4;
  one_server.config.partition_bytes = 4096;
  one_server.config.mode = Mode::kAsp;
  runs_op.push_back(one_server);
  for (MeasuredRun& r : runs_op) {
    auto p = Predict(Digits(200), truth_op, r.config);
    ASSERT_TRUE(p.ok());
    r.step_us = p->cpu_us;
  }
  auto cal_op = CalibrateLeastSquares(Digits(200), FixedCosts(), runs_op);
  ASSERT_TRUE(cal_op.ok()) << cal_op.status();
  EXPECT_TRUE(cal_op->op_fitted);
  EXPECT_NEAR(cal_op->op_cpu_us, 25, 1e-6);
  EXPECT_NEAR(cal_op->pair_cpu_us, 150, 1e-6);
  EXPECT_NEAR(cal_op->wait_cpu_us, 60, 1e-6);

  // ASP runs only: the wait CPU is not identifiable and stays as given; one run: the per-op CPU
  // is not either, and stays the probe's.
  std::vector<MeasuredRun> single_asp = {runs[0]};
  auto cal_single = CalibrateLeastSquares(Digits(200), FixedCosts(), single_asp);
  ASSERT_TRUE(cal_single.ok()) << cal_single.status();
  EXPECT_FALSE(cal_single->op_fitted);
  EXPECT_FALSE(cal_single->wait_fitted);
  EXPECT_NEAR(cal_single->pair_cpu_us, 150, 1e-6);
  std::vector<MeasuredRun> asp = {runs[0], runs[2]};
  auto cal_asp = CalibrateLeastSquares(Digits(200), FixedCosts(), asp);
  ASSERT_TRUE(cal_asp.ok());
  EXPECT_FALSE(cal_asp->wait_fitted);
  EXPECT_NEAR(cal_asp->pair_cpu_us, 150, 1e-6);

  // One run of five 20% slow: the fit is a compromise: that run's prediction moves towards its
  // measurement but not all the way (a single-run solve would match it exactly), and the
  // residual says so.
  std::vector<MeasuredRun> noisy = runs_op;
  const double clean = noisy[0].step_us;
  noisy[0].step_us *= 1.2;
  auto cal_noisy = CalibrateLeastSquares(Digits(200), FixedCosts(), noisy);
  ASSERT_TRUE(cal_noisy.ok()) << cal_noisy.status();
  Costs fitted = FixedCosts();
  fitted.pair_cpu_us = cal_noisy->pair_cpu_us;
  fitted.wait_cpu_us = cal_noisy->wait_cpu_us;
  fitted.op_cpu_us = cal_noisy->op_cpu_us;
  auto p0 = Predict(Digits(200), fitted, noisy[0].config);
  ASSERT_TRUE(p0.ok());
  EXPECT_GT(p0->cpu_us, clean * 1.001);
  EXPECT_LT(p0->cpu_us, noisy[0].step_us * 0.999);
  EXPECT_GT(cal_noisy->rms_rel_residual, 0.01);

  // Not CPU-bound (2 workers on 2 cores), and no runs: errors, not a guess.
  std::vector<MeasuredRun> idle = {runs[0]};
  idle[0].config.workers = 2;
  EXPECT_FALSE(CalibrateLeastSquares(Digits(200), FixedCosts(), idle).ok());
  EXPECT_FALSE(CalibrateLeastSquares(Digits(200), FixedCosts(), {}).ok());
}

TEST(PlanPredict, RejectsBadConfigurations) {
  Config cfg;
  cfg.servers = 0;
  EXPECT_FALSE(Predict(Digits(1), FixedCosts(), cfg).ok());
  cfg.servers = 1;
  cfg.colocated = false;  // apart needs a second machine
  EXPECT_FALSE(Predict(Digits(1), FixedCosts(), cfg).ok());
}

// ---- hosts, links and hierarchical aggregation (issue 18; docs/plan.md) ----------------------

// One 1 MiB tensor: one chunk (4 MiB partitions) on one server.
Workload OneMiB(double compute_us) {
  Workload w;
  TensorSpec t;
  t.name = "w";
  t.shape = {262144};
  w.tensors = {t};
  w.compute_us = compute_us;
  return w;
}
constexpr double kB = 1048576;
// Transport bytes of one client with one server holding one chunk of b bytes (docs/plan.md):
// push out b + 40 + 40 + 128 + 20 + 40 + 8, push in 40 + 52 + 40, pull out 120, pull in
// b + 120 + 128.
constexpr double kPushOut = 276, kPushIn = 132, kPullOut = 120, kPullIn = 248;
constexpr double kPairOverhead = kPushOut + kPushIn + kPullOut + kPullIn;  // 776

Config TwoHostsFourLocal(bool hier, double link_Bps) {
  Config cfg;
  cfg.workers = 8;
  cfg.hosts = 2;
  cfg.local_workers = 4;
  cfg.hierarchical = hier;
  cfg.servers_dedicated = true;  // the server on host 2
  cfg.link_Bps = link_Bps;
  cfg.wire_overhead = 0;  // transport bytes only, so the figures can be checked by hand
  cfg.mode = Mode::kAsp;  // no barrier term
  return cfg;
}

TEST(PlanHosts, BytesPerLinkFlatVersusHierarchical) {
  auto flat = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(false, 0));
  auto hier = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(true, 0));
  ASSERT_TRUE(flat.ok()) << flat.status();
  ASSERT_TRUE(hier.ok()) << hier.status();
  ASSERT_EQ(flat->link_bytes.size(), 3u);  // 2 worker hosts, 1 server host
  EXPECT_DOUBLE_EQ(flat->model_bytes, kB);
  // Flat: each worker host carries its 4 workers' push and pull; the server host all 8.
  EXPECT_DOUBLE_EQ(flat->link_bytes[0], 4 * (2 * kB + kPairOverhead));
  EXPECT_DOUBLE_EQ(flat->link_bytes[1], 4 * (2 * kB + kPairOverhead));
  EXPECT_DOUBLE_EQ(flat->link_bytes[2], 8 * (2 * kB + kPairOverhead));
  // Hierarchical: one aggregator per host: 2x model bytes per worker host, 2 x 2x at the server.
  EXPECT_DOUBLE_EQ(hier->link_bytes[0], 2 * kB + kPairOverhead);
  EXPECT_DOUBLE_EQ(hier->link_bytes[1], 2 * kB + kPairOverhead);
  EXPECT_DOUBLE_EQ(hier->link_bytes[2], 2 * (2 * kB + kPairOverhead));
  EXPECT_NEAR(hier->WorkerLinkBytes() / kB, 2.0, 0.001);
  EXPECT_NEAR(flat->WorkerLinkBytes() / kB, 8.0, 0.003);
  // No link rate: no link time, no link bound.
  EXPECT_DOUBLE_EQ(flat->link_push_us, 0);
  EXPECT_NE(flat->bound, "link");

  // The wire overhead below the transport scales every byte (MTU 1500: (66 + 33) / 1448); the
  // default is none.
  EXPECT_DOUBLE_EQ(Config().wire_overhead, 0);
  Config with_wire = TwoHostsFourLocal(true, 0);
  with_wire.wire_overhead = Config::kMtu1500WireOverhead;
  auto w = Predict(OneMiB(200), FixedCosts(), with_wire);
  ASSERT_TRUE(w.ok());
  EXPECT_DOUBLE_EQ(w->link_bytes[0], (2 * kB + kPairOverhead) * (1 + 99.0 / 1448));

  // Colocated servers: 2 hosts x 2 local workers, 2 servers, two equal tensors (one each;
  // server s on host s). Host 0's link carries its clients' traffic to server 1 and the other
  // host's clients' traffic to server 0; nothing to its own server.
  Workload two;
  two.compute_us = 200;
  for (const char* n : {"a", "b"}) {
    TensorSpec t;
    t.name = n;
    t.shape = {131072};  // 512 KiB
    two.tensors.push_back(t);
  }
  Config colo;
  colo.servers = 2;
  colo.workers = 4;
  colo.hosts = 2;
  colo.local_workers = 2;
  colo.servers_dedicated = false;
  colo.wire_overhead = 0;
  colo.mode = Mode::kAsp;  // no second reads (below)
  auto cf = Predict(two, FixedCosts(), colo);
  colo.hierarchical = true;
  auto ch = Predict(two, FixedCosts(), colo);
  ASSERT_TRUE(cf.ok() && ch.ok());
  ASSERT_EQ(cf->link_bytes.size(), 2u);
  const double pair = kB + kPairOverhead;  // one client with one 512 KiB server: 2 x 512 KiB
  EXPECT_DOUBLE_EQ(cf->link_bytes[0], (2 + 2) * pair);  // 2 own workers out + 2 remote in
  EXPECT_DOUBLE_EQ(ch->link_bytes[0], (1 + 1) * pair);  // the aggregators: 2x model bytes
  EXPECT_DOUBLE_EQ(ch->link_bytes[1], (1 + 1) * pair);

  // BSP: a client's first pull comes before the last of the K pushes is applied; it reads the
  // header alone first when its last pull found the chunk not ready, so the data is read again
  // (with a header: 2 more requests out, 2 frames + 64 B in) only when the last pusher changes:
  // (1/K)(1 - 1/K) of the pulls. 2 x 4 dedicated: flat K = 8, 7/64; hierarchical K = 2, 1/4.
  Config bsp = TwoHostsFourLocal(false, 0);
  bsp.mode = Mode::kBsp;
  auto fb = Predict(OneMiB(200), FixedCosts(), bsp);
  bsp.hierarchical = true;
  auto hb = Predict(OneMiB(200), FixedCosts(), bsp);
  ASSERT_TRUE(fb.ok() && hb.ok());
  auto second = [](double w) { return w * (kB + 80 + 144); };
  EXPECT_DOUBLE_EQ(fb->link_bytes[0], 4 * (2 * kB + kPairOverhead + second(7.0 / 64)));
  EXPECT_DOUBLE_EQ(hb->link_bytes[0], 2 * kB + kPairOverhead + second(0.25));
  EXPECT_NEAR(hb->link_bytes[0] / kB, 2.25, 0.001);  // not 2
}

TEST(PlanHosts, LinkBoundStepTimeFlatVersusHierarchical) {
  const double R = 125e6;  // 1 Gbit/s
  auto flat = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(false, R));
  auto hier = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(true, R));
  ASSERT_TRUE(flat.ok() && hier.ok());
  // Full duplex, phases in turn: the push phase's busiest direction is the server host's
  // inbound (8 clients' push out), the pull phase's its outbound (8 clients' pull in).
  const double flat_push = 8 * (kB + kPushOut) / R * 1e6;  // 67126.5 us
  const double flat_pull = 8 * (kB + kPullIn) / R * 1e6;   // 67124.7 us
  EXPECT_NEAR(flat->link_push_us, flat_push, 1e-6);
  EXPECT_NEAR(flat->link_pull_us, flat_pull, 1e-6);
  EXPECT_EQ(flat->bound, "link");
  EXPECT_NEAR(flat->step_us, 200 + flat_push + flat_pull, 1e-6);
  // Hierarchical: 2 aggregators reach the server; plus the local reduction through memory:
  // 4 copies in, 1 into the sum, 4 out (2 x 4 + 1 copies of 1 MiB at 4e9 B/s) and 3 adds at
  // 2e9 B/s (Costs' defaults), and two hand-offs of 10 us (the default local hop).
  const double reduce = (9 * kB / 4e9 + 3 * kB / 2e9) * 1e6;  // 3932.16 us
  EXPECT_NEAR(hier->reduce_us, reduce, 1e-6);
  const double hier_push = 2 * (kB + kPushOut) / R * 1e6, hier_pull = 2 * (kB + kPullIn) / R * 1e6;
  EXPECT_EQ(hier->bound, "link");
  EXPECT_DOUBLE_EQ(hier->hop_us, 20);
  // The server's link (2 aggregators) carries twice a worker host's: it serves the aggregators
  // one after another, so one host's 4 workers compute at a time on the emulated hosts' one
  // 2-core machine: 200 us x 4 / 2.
  EXPECT_DOUBLE_EQ(hier->compute_us, 400);
  EXPECT_DOUBLE_EQ(flat->compute_us, 200);
  EXPECT_NEAR(hier->step_us, 400 + reduce + 20 + hier_push + hier_pull, 1e-6);
  EXPECT_NEAR(flat->step_us / hier->step_us, 134451.264 / 37914.976, 1e-6);  // 3.55x
  // With a server per host (2 dedicated servers, 2 hosts) no link is shared by more
  // aggregators than a worker host's: the aggregators pull together and all 8 workers compute
  // at once: 200 us x 8 / 2.
  Config two_servers = TwoHostsFourLocal(true, R);
  two_servers.servers = 2;
  auto hs = Predict(OneMiB(200), FixedCosts(), two_servers);
  ASSERT_TRUE(hs.ok());
  EXPECT_DOUBLE_EQ(hs->compute_us, 800);

  // Half duplex: a link's rate is shared by both directions: a phase takes its in + out.
  Config half = TwoHostsFourLocal(false, R);
  half.link_full_duplex = false;
  auto h = Predict(OneMiB(200), FixedCosts(), half);
  ASSERT_TRUE(h.ok());
  EXPECT_NEAR(h->link_push_us, 8 * (kB + kPushOut + kPushIn) / R * 1e6, 1e-6);
  EXPECT_NEAR(h->link_pull_us, 8 * (kB + kPullIn + kPullOut) / R * 1e6, 1e-6);

  // The straggler wait: hierarchical workers wait for their host's 4 in every mode (ASP here):
  // cv x compute x sqrt(2 ln 4); flat ASP waits for nobody.
  Config cv = TwoHostsFourLocal(true, R);
  cv.compute_cv = 0.1;
  auto s = Predict(OneMiB(200), FixedCosts(), cv);
  cv.hierarchical = false;
  auto sf = Predict(OneMiB(200), FixedCosts(), cv);
  ASSERT_TRUE(s.ok() && sf.ok());
  EXPECT_NEAR(s->straggler_us, 0.1 * 200 * std::sqrt(2 * std::log(4.0)), 1e-9);
  EXPECT_DOUBLE_EQ(sf->straggler_us, 0);
  EXPECT_NEAR(s->step_us - hier->step_us, s->straggler_us, 1e-6);
}

TEST(PlanHosts, MachinesSayWhetherHostsShareCores) {
  // 2 hosts x 4 workers, flat, ASP, a dedicated server. Per exchange c_pair = 100 us (one chunk:
  // no further operations, no wait), half on each side; the server accumulates 8 gradients of
  // 1 MiB at 4e9 B/s and applies once at 1e9 B/s.
  const double server_side = 0.5 * 8 * 100 + 8 * kB / 4e9 * 1e6 + kB / 1e9 * 1e6;  // 3545.728
  Config emulated = TwoHostsFourLocal(false, 0);  // machines = 1: all share 2 cores
  auto e = Predict(OneMiB(200), FixedCosts(), emulated);
  ASSERT_TRUE(e.ok());
  EXPECT_NEAR(e->cpu_us, (8 * (200 + 0.5 * 100) + server_side) / 2, 1e-6);
  Config real = emulated;
  real.machines = 3;  // each host a machine: a worker host's 4 workers, the server's machine
  auto r = Predict(OneMiB(200), FixedCosts(), real);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->cpu_us, std::max(4 * (200 + 0.5 * 100), server_side) / 2, 1e-6);
  // Hierarchical on real hosts: per host 4 x compute + the reduction + 2 x 4 hand-offs of 10 us
  // + the aggregator's half exchange; the server serves 2 aggregators.
  real.hierarchical = true;
  auto h = Predict(OneMiB(200), FixedCosts(), real);
  ASSERT_TRUE(h.ok());
  const double reduce = (9 * kB / 4e9 + 3 * kB / 2e9) * 1e6;
  const double hier_server = 0.5 * 2 * 100 + 2 * kB / 4e9 * 1e6 + kB / 1e9 * 1e6;
  EXPECT_NEAR(h->cpu_us, std::max(4 * 200 + reduce + 8 * 10 + 0.5 * 100, hier_server) / 2, 1e-6);
}

TEST(PlanHosts, BytesCostCpuOnBothEndsAndLoopbackCostsLess) {
  // 2 hosts x 4 workers, flat, ASP, a dedicated server; every client-server pair exchanges
  // 2 kB + kPairOverhead bytes a step over a link. At 1 ns a byte (both ends), half on each.
  Config cfg = TwoHostsFourLocal(false, 0);
  Costs c = FixedCosts();
  auto base = Predict(OneMiB(200), c, cfg);
  c.net_cpu_ns_per_byte = 1.0;
  auto net = Predict(OneMiB(200), c, cfg);
  ASSERT_TRUE(base.ok() && net.ok());
  const double pair_us = (2 * kB + kPairOverhead) * 1e-3;  // 2097.4 us of CPU a pair
  EXPECT_NEAR(net->net_cpu_worker_us, 8 * 0.5 * pair_us, 1e-6);
  EXPECT_NEAR(net->net_cpu_server_us, 8 * 0.5 * pair_us, 1e-6);
  // Emulated hosts on one 2-core machine: all of it on those cores.
  EXPECT_NEAR(net->cpu_us - base->cpu_us, 8 * pair_us / 2, 1e-6);
  // Each host a machine: a worker host's 4 clients' halves, the server host's 8 halves; the
  // busier side (the server's) sets the CPU term.
  cfg.machines = 3;
  auto real = Predict(OneMiB(200), c, cfg);
  ASSERT_TRUE(real.ok());
  EXPECT_NEAR(real->net_cpu_worker_us, 4 * 0.5 * pair_us, 1e-6);
  EXPECT_NEAR(real->net_cpu_server_us, 8 * 0.5 * pair_us, 1e-6);
  // Colocated servers (server s on host s): a client reaches its own host's server over
  // loopback, at loopback's cost; aggregation divides the bytes by L.
  Config colo = TwoHostsFourLocal(false, 0);
  colo.servers = 2;
  colo.servers_dedicated = false;
  c.loopback_cpu_ns_per_byte = 0.25;
  auto cl = Predict(OneMiB(200), c, colo);
  colo.hierarchical = true;
  auto ch = Predict(OneMiB(200), c, colo);
  ASSERT_TRUE(cl.ok() && ch.ok());
  ASSERT_GT(cl->net_cpu_worker_us, 0);
  // Per client: half its bytes to its own host's server (0.25 ns), half to the other (1 ns).
  EXPECT_NEAR(cl->net_cpu_worker_us / (8 * 0.5 * pair_us), (0.25 + 1.0) / 2, 0.01);
  EXPECT_NEAR(cl->net_cpu_worker_us / ch->net_cpu_worker_us, 4, 0.01);
  // Not modelled without hosts.
  Config no_hosts;
  no_hosts.servers = 1;
  no_hosts.workers = 8;
  auto nh = Predict(OneMiB(200), c, no_hosts);
  ASSERT_TRUE(nh.ok());
  EXPECT_DOUBLE_EQ(nh->net_cpu_worker_us + nh->net_cpu_server_us, 0);
}

TEST(PlanHosts, RecommendationFlipsWithTheLinkRate) {
  // 1 Gbit/s: the links bound the step and aggregation cuts their bytes 4x.
  auto flat1 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(false, 125e6));
  auto hier1 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(true, 125e6));
  ASSERT_TRUE(flat1.ok() && hier1.ok());
  EXPECT_LT(hier1->step_us, flat1->step_us);
  const std::string at1 = CompareHierarchy(*flat1, *hier1);
  EXPECT_EQ(at1.rfind("hierarchical: ", 0), 0u) << at1;
  EXPECT_NE(at1.find("carries 4.0x model bytes per step instead of 16.0x"), std::string::npos)
      << at1;
  EXPECT_NE(at1.find("(a worker host's: 2.0x instead of 8.0x)"), std::string::npos) << at1;
  EXPECT_NE(at1.find("3.55x faster at 1 Gbit/s"), std::string::npos) << at1;
  // 100 Gbit/s: the link time (8 MiB at 12.5 GB/s: 671 us a phase) is under the latency path;
  // flat is bound by its server (8 x (6.5 ops x 5 us + 1 MiB / 4e9) + 1 MiB / 1e9 = 3406 us)
  // and hierarchical pays the 3932 us reduction and 20 us of hand-offs on top of its path
  // (6349 us, with one host's 4 workers' compute on 2 cores: 400 us): flat wins.
  auto flat100 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(false, 12.5e9));
  auto hier100 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(true, 12.5e9));
  ASSERT_TRUE(flat100.ok() && hier100.ok());
  EXPECT_EQ(flat100->bound, "busiest server");
  EXPECT_NEAR(flat100->step_us, 8 * (6.5 * 5 + kB / 4e9 * 1e6) + kB / 1e9 * 1e6, 1e-6);
  const double push_lat = 0.6 * 100 + kB / 1e9 * 1e6, pull_lat = 0.4 * 100 + kB / 1e9 * 1e6;
  EXPECT_NEAR(hier100->step_us, 400 + hier1->reduce_us + 20 + push_lat + pull_lat, 1e-6);
  EXPECT_GT(hier100->step_us, flat100->step_us);
  const std::string at100 = CompareHierarchy(*flat100, *hier100);
  EXPECT_EQ(at100.rfind("flat: links are not the bottleneck", 0), 0u) << at100;
  EXPECT_NE(at100.find("the local reduction costs 3.93 ms and the hand-offs 0.02 ms"),
            std::string::npos)
      << at100;

  // 32 Gbit/s: flat is still link-bound (8 x 1 MiB a phase at 4 GB/s: 2098 us, over its
  // server's 3406 us in all), but aggregation saves only 4195 - 2197 us of communication (its
  // phases are then set by their latency, 1109 + 1089 us) against 3952 us of reduction and
  // hand-offs: flat wins, and says so.
  auto flat32 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(false, 4e9));
  auto hier32 = Predict(OneMiB(200), FixedCosts(), TwoHostsFourLocal(true, 4e9));
  ASSERT_TRUE(flat32.ok() && hier32.ok());
  EXPECT_EQ(flat32->bound, "link");
  EXPECT_NEAR(flat32->step_us, 200 + 8 * (2 * kB + kPushOut + kPullIn) / 4e9 * 1e6, 1e-6);
  EXPECT_NEAR(hier32->step_us, 400 + hier1->reduce_us + 20 + push_lat + pull_lat, 1e-6);
  const std::string at32 = CompareHierarchy(*flat32, *hier32);
  EXPECT_EQ(at32.rfind("flat: the communication time it saves (2.00 ms) is less than what it "
                       "adds; the local reduction costs 3.93 ms",
                       0),
            0u)
      << at32;

  // The search over the same hosts says the same: its best configuration is hierarchical at
  // 1 Gbit/s and flat at 100 Gbit/s.
  Budget b;
  b.workers = 8;
  b.hosts = 2;
  b.local_workers = 4;
  b.max_servers = 1;
  b.partitions = {4u << 20};
  b.modes = {{Mode::kAsp, 0}};
  b.placements = {true};
  b.wire_overhead = 0;
  b.link_Bps = 125e6;
  auto r1 = Search(OneMiB(200), FixedCosts(), b);
  b.link_Bps = 12.5e9;
  auto r100 = Search(OneMiB(200), FixedCosts(), b);
  ASSERT_TRUE(r1.ok() && r100.ok());
  ASSERT_EQ(r1->size(), 2u);  // flat and hierarchical
  EXPECT_TRUE(r1->front().config.hierarchical);
  EXPECT_FALSE(r100->front().config.hierarchical);
}

TEST(PlanHosts, OneWorkerPerHostIsTheFlatModelAndBadHostsAreRejected) {
  // hosts = workers, one local worker, no link rate: the same prediction as without hosts.
  Config plain;
  plain.workers = 4;
  plain.servers = 2;
  Config hosts = plain;
  hosts.hosts = 4;
  auto a = Predict(Digits(200), FixedCosts(), plain);
  auto b = Predict(Digits(200), FixedCosts(), hosts);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_DOUBLE_EQ(a->step_us, b->step_us);
  EXPECT_DOUBLE_EQ(a->cpu_us, b->cpu_us);
  EXPECT_TRUE(a->link_bytes.empty());
  EXPECT_EQ(b->link_bytes.size(), 4u + 2);
  Config bad = plain;
  bad.hosts = 3;  // 4 workers are not 3 x 1
  EXPECT_FALSE(Predict(Digits(200), FixedCosts(), bad).ok());
  bad = plain;
  bad.hierarchical = true;  // needs hosts
  EXPECT_FALSE(Predict(Digits(200), FixedCosts(), bad).ok());
  bad = plain;
  bad.link_Bps = 1e9;  // needs hosts
  EXPECT_FALSE(Predict(Digits(200), FixedCosts(), bad).ok());
  // The probe file's memory figures replace the defaults.
  auto p = ParseProbeJson(R"({"pairs":[{"write":{"alpha_us":1,"beta_Bps":1e9},
    "read":{"alpha_us":1,"beta_Bps":1e9}}],"host":{"mem_copy_Bps":9e9,"mem_add_Bps":7e9}})");
  ASSERT_TRUE(p.ok()) << p.status();
  auto c = CostsFromProbe(*p);
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->mem_copy_Bps, 9e9);
  EXPECT_DOUBLE_EQ(c->mem_add_Bps, 7e9);
  EXPECT_DOUBLE_EQ(c->local_hop_us, 10);  // absent: the default
  auto d = CostsFromProbe(*ParseProbeJson(R"({"pairs":[{"write":{"alpha_us":1,"beta_Bps":1e9},
    "read":{"alpha_us":1,"beta_Bps":1e9}}]})"));
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->mem_copy_Bps, Costs::kDefaultMemCopyBps);
}

}  // namespace
}  // namespace shardps::plan
