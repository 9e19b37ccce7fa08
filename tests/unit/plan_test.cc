// shardps plan: model and probe files, and the predictor's equations (docs/plan.md) on fixed
// costs, so every expected figure can be worked out by hand.
#include "tools/plan.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace shardps::plan
