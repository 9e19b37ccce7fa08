// common/metrics.h (the exposition text, parsed back) and common/metrics_http.h (the endpoint,
// over real loopback sockets, with strangers sending garbage, too much, or nothing).
#include "common/metrics.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/metrics_http.h"
#include "common/net.h"

namespace shardps::metrics {
namespace {

using namespace std::chrono_literals;

// --- a small parser of the text format, independent of the writer ---------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};
struct Parsed {
  std::map<std::string, std::string> help, type;
  std::vector<std::string> family_order;  // from # TYPE lines
  std::vector<Sample> samples;
  std::string error;
};

Parsed Parse(const std::string& text) {
  Parsed p;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) {
      p.error = "last line has no newline";
      return p;
    }
    std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.rfind("# HELP ", 0) == 0) {
      const size_t sp = line.find(' ', 7);
      p.help[line.substr(7, sp - 7)] = line.substr(sp + 1);
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      const size_t sp = line.find(' ', 7);
      const std::string name = line.substr(7, sp - 7);
      if (p.type.count(name)) p.error = "family " + name + " typed twice";
      p.type[name] = line.substr(sp + 1);
      p.family_order.push_back(name);
      continue;
    }
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (line[i] != '}') {
        const size_t eq = line.find('=', i);
        const std::string key = line.substr(i, eq - i);
        i = eq + 1;
        if (line[i] != '"') {
          p.error = "unquoted label value in: " + line;
          return p;
        }
        ++i;
        std::string v;
        while (line[i] != '"') {
          if (line[i] == '\\') {
            ++i;
            v += line[i] == 'n' ? '\n' : line[i];
          } else {
            v += line[i];
          }
          ++i;
        }
        ++i;
        s.labels[key] = v;
        if (line[i] == ',') ++i;
      }
      ++i;
    }
    if (line[i] != ' ') {
      p.error = "no value in: " + line;
      return p;
    }
    const std::string v = line.substr(i + 1);
    s.value = v == "+Inf" ? INFINITY : std::stod(v);
    p.samples.push_back(s);
  }
  return p;
}

const Sample* Find(const Parsed& p, const std::string& name,
                   const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : p.samples) {
    if (s.name == name && s.labels == labels) return &s;
  }
  return nullptr;
}

TEST(MetricsText, CountersGaugesAndEscaping) {
  Registry r;
  Counter* c = r.AddCounter("shardps_test_pushes_total", "Pushes.", {{"peer", "a\"b\\c\nd"}});
  Gauge* g = r.AddGauge("shardps_test_depth", "Depth with a \\ and a\nnewline.");
  c->Inc(41);
  c->Inc();
  g->Set(-2.5);
  r.AddCollector([](Exposition* x) {
    x->Counter("shardps_test_bytes_total", "Bytes.", {{"dir", "in"}}, 1234567890123);
    x->Gauge("shardps_test_ratio", "A ratio.", {}, 0.1);
  });
  const std::string text = r.Render();
  const Parsed p = Parse(text);
  ASSERT_EQ(p.error, "") << text;
  const Sample* s = Find(p, "shardps_test_pushes_total", {{"peer", "a\"b\\c\nd"}});
  ASSERT_NE(s, nullptr) << text;
  EXPECT_EQ(s->value, 42);
  // The raw text escapes the label value and the help text.
  EXPECT_NE(text.find(R"(peer="a\"b\\c\nd")"), std::string::npos) << text;
  EXPECT_NE(text.find("# HELP shardps_test_depth Depth with a \\\\ and a\\nnewline.\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(p.type.at("shardps_test_pushes_total"), "counter");
  EXPECT_EQ(p.type.at("shardps_test_depth"), "gauge");
  ASSERT_NE(Find(p, "shardps_test_depth"), nullptr);
  EXPECT_EQ(Find(p, "shardps_test_depth")->value, -2.5);
  ASSERT_NE(Find(p, "shardps_test_bytes_total", {{"dir", "in"}}), nullptr);
  EXPECT_EQ(Find(p, "shardps_test_bytes_total", {{"dir", "in"}})->value, 1234567890123.0);
  EXPECT_NE(text.find("shardps_test_bytes_total{dir=\"in\"} 1234567890123\n"), std::string::npos);
  EXPECT_DOUBLE_EQ(Find(p, "shardps_test_ratio")->value, 0.1);
  EXPECT_NE(text.find("shardps_test_ratio 0.1\n"), std::string::npos) << text;
  EXPECT_EQ(FormatValue(1e-6 * 16), "1.6e-05");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");  // 17 digits where needed
  EXPECT_EQ(FormatValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatValue(NAN), "NaN");
}

TEST(MetricsText, HistogramBucketsAreCumulative) {
  Registry r;
  Histogram* h = r.AddHistogram("shardps_test_latency_seconds", "Latency.", {1, 2, 5},
                                {{"op", "apply"}});
  for (double v : {0.5, 1.0, 2.0, 10.0, 1.5}) h->Observe(v);
  h->Observe(NAN);  // ignored
  const Parsed p = Parse(r.Render());
  ASSERT_EQ(p.error, "");
  EXPECT_EQ(p.type.at("shardps_test_latency_seconds"), "histogram");
  auto bucket = [&](const std::string& le) {
    const Sample* s = Find(p, "shardps_test_latency_seconds_bucket", {{"op", "apply"}, {"le", le}});
    return s == nullptr ? -1.0 : s->value;
  };
  EXPECT_EQ(bucket("1"), 2);  // 0.5, 1.0 (le is inclusive)
  EXPECT_EQ(bucket("2"), 4);  // + 2.0, 1.5
  EXPECT_EQ(bucket("5"), 4);
  EXPECT_EQ(bucket("+Inf"), 5);
  EXPECT_EQ(Find(p, "shardps_test_latency_seconds_count", {{"op", "apply"}})->value, 5);
  EXPECT_DOUBLE_EQ(Find(p, "shardps_test_latency_seconds_sum", {{"op", "apply"}})->value, 15.0);
}

TEST(MetricsText, FamiliesAreWrittenOnceWithTheirSamplesTogether) {
  Registry r;
  r.AddCollector([](Exposition* x) {
    x->Counter("shardps_test_errors_total", "Errors.", {{"peer", "1"}}, 1);
    x->Gauge("shardps_test_members", "Members.", {{"role", "server"}}, 2);
    x->Counter("shardps_test_errors_total", "Errors.", {{"peer", "2"}}, 3);
    x->Gauge("shardps_test_members", "Members.", {{"role", "worker"}}, 4);
    x->Counter("shardps_test_members", "wrong type", {}, 9);  // dropped (programmer error)
    x->Counter("bad name", "invalid", {}, 9);                 // dropped
  });
  const std::string text = r.Render();
  const Parsed p = Parse(text);
  ASSERT_EQ(p.error, "") << text;
  ASSERT_EQ(p.family_order,
            (std::vector<std::string>{"shardps_test_errors_total", "shardps_test_members"}));
  ASSERT_EQ(p.samples.size(), 4u) << text;
  EXPECT_EQ(p.samples[0].name, "shardps_test_errors_total");
  EXPECT_EQ(p.samples[1].name, "shardps_test_errors_total");
  EXPECT_EQ(p.samples[1].value, 3);
  EXPECT_EQ(p.samples[3].labels.at("role"), "worker");
}

TEST(MetricsText, ConcurrentObservationsAreAllCounted) {
  Histogram h(Histogram::ExponentialBounds(1, 2, 8));
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&h, t] {
      for (int i = 0; i < 100000; ++i) h.Observe(t + 1);
    });
  }
  for (auto& t : ts) t.join();
  const Histogram::Snapshot s = h.snapshot();
  EXPECT_EQ(s.count, 400000u);
  EXPECT_DOUBLE_EQ(s.sum, 100000.0 * (1 + 2 + 3 + 4));
  EXPECT_EQ(s.cumulative[0], 100000u);  // le=1
  EXPECT_EQ(s.cumulative[1], 200000u);  // le=2
  EXPECT_EQ(s.cumulative[2], 400000u);  // le=4
}

// --- the HTTP endpoint -----------------------------------------------------------------------

// Sends `request` and reads until the server closes (bounded).
std::string Fetch(const std::string& address, const std::string& request,
                  std::chrono::milliseconds timeout = 5000ms) {
  auto fd = net::ConnectTcp(address, "", timeout);
  if (!fd.ok()) return "connect failed: " + fd.status().ToString();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!request.empty()) {
    Status s = net::SendAll(fd->get(), request.data(), request.size(), deadline);
    if (!s.ok()) return "send failed: " + s.ToString();
  }
  std::string out;
  for (;;) {
    Status w = net::WaitFd(fd->get(), POLLIN, deadline, "fetch");
    if (!w.ok()) return out + "<timed out>";
    char buf[4096];
    auto n = net::RecvSome(fd->get(), buf, sizeof(buf), "fetch");
    if (!n.ok()) return out;  // closed: the whole response
    out.append(buf, *n);
  }
}

std::unique_ptr<MetricsHttpServer> StartServer(HttpServerOptions o, std::atomic<int>* renders) {
  auto s = MetricsHttpServer::Start(o, [renders] {
    const int n = ++*renders;
    return "# HELP shardps_test_scrapes_total Scrapes.\n# TYPE shardps_test_scrapes_total "
           "counter\nshardps_test_scrapes_total " +
           std::to_string(n) + "\n";
  });
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(MetricsHttp, ServesMetricsAndRefusesTheRest) {
  std::atomic<int> renders{0};
  HttpServerOptions o;
  o.min_render_interval = std::chrono::milliseconds(0);  // every GET renders (counted below)
  o.address_file = ::testing::TempDir() + "/metrics-%p.addr";
  auto s = StartServer(o, &renders);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->address().rfind("127.0.0.1:", 0), 0u) << s->address();
  EXPECT_NE(s->port(), 0);
  std::ifstream f(ExpandPid(o.address_file));
  std::string written;
  f >> written;
  EXPECT_EQ(written, s->address());

  std::string r = Fetch(s->address(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\n# HELP shardps_test_scrapes_total"), std::string::npos) << r;
  EXPECT_NE(r.find("\nshardps_test_scrapes_total 1\n"), std::string::npos) << r;
  r = Fetch(s->address(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
  EXPECT_NE(r.find("\nshardps_test_scrapes_total 2\n"), std::string::npos) << r;

  EXPECT_EQ(Fetch(s->address(), "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(Fetch(s->address(), "GET /metricsx HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  r = Fetch(s->address(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 405", 0), 0u) << r;
  EXPECT_NE(r.find("Allow: GET"), std::string::npos);
  EXPECT_EQ(Fetch(s->address(), "\x16\x03\x01garbage\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(Fetch(s->address(), std::string(300000, 'A')).rfind("HTTP/1.1 431", 0), 0u);
  // Random request heads (seeded; every one complete): each gets a 4xx, none a 200, and the
  // endpoint keeps serving.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  const std::vector<std::string> parts = {"GET", "POST", " ", "/metrics", "/", "HTTP/1.1", "\r\n",
                                          "\0", "\xff", "?", "%", "\n", "HEAD", "GET /metrics"};
  for (int i = 0; i < 100; ++i) {
    std::string req;
    const int n = 1 + static_cast<int>(x % 8);
    for (int k = 0; k < n; ++k) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      req += parts[x % parts.size()];
    }
    req += "\r\n\r\n";
    const std::string resp = Fetch(s->address(), req);
    EXPECT_EQ(resp.rfind("HTTP/1.1 4", 0), 0u) << "request " << ::testing::PrintToString(req)
                                                << " got " << resp;
  }
  EXPECT_EQ(renders.load(), 2);  // only the two GET /metrics rendered
  const auto st = s->stats();
  EXPECT_EQ(st.scrapes, 2u);
  EXPECT_EQ(st.errors_sent, 105u);
}

// The server thread itself delayed past a client's deadline (here by a slow render; on a busy
// host by the scheduler): a request that arrived meanwhile is still answered, not dropped as a
// slow client (a scrape under load failed that way: "Remote end closed connection").
TEST(MetricsHttp, ARequestWaitingWhileTheServerWasDelayedIsAnswered) {
  HttpServerOptions o;
  o.request_timeout = std::chrono::milliseconds(1000);
  o.min_render_interval = std::chrono::milliseconds(0);
  std::atomic<int> renders{0};
  std::atomic<bool> rendering{false};
  auto made = MetricsHttpServer::Start(o, [&renders, &rendering] {
    if (++renders == 1) {
      rendering = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    }
    return std::string("shardps_test_up 1\n");
  });
  ASSERT_TRUE(made.ok()) << made.status();
  auto& s = *made;
  // B connects first and waits; A's request (sent from this thread at once: no thread start
  // inside B's 1 s deadline) makes the server render for 3 s; B's request is sent once that
  // render has begun (observed, not assumed after a sleep), so it arrives during the render,
  // long before its own deadline would pass on an idle server, and the render outlasts that
  // deadline.
  const std::string req = "GET /metrics HTTP/1.1\r\n\r\n";
  auto b = net::ConnectTcp(s->address(), "", 5000ms);
  ASSERT_TRUE(b.ok()) << b.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // B accepted (else: no test, no failure)
  auto a = net::ConnectTcp(s->address(), "", 5000ms);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(net::SendAll(a->get(), req.data(), req.size(), 1000ms).ok());
  const auto render_by = std::chrono::steady_clock::now() + 10000ms;
  while (!rendering.load() && std::chrono::steady_clock::now() < render_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(rendering.load()) << "A's request was never rendered";
  ASSERT_TRUE(net::SendAll(b->get(), req.data(), req.size(), 1000ms).ok());
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + 5000ms;
  for (;;) {
    if (!net::WaitFd(b->get(), POLLIN, deadline, "fetch").ok()) break;
    char buf[4096];
    auto n = net::RecvSome(b->get(), buf, sizeof(buf), "fetch");
    if (!n.ok()) break;
    out.append(buf, *n);
  }
  EXPECT_EQ(out.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << "B got: '" << out << "'";
  EXPECT_NE(out.find("shardps_test_up 1"), std::string::npos);
  EXPECT_EQ(s->stats().timed_out, 0u);
}

TEST(MetricsHttp, AClientLoopingGetsDoesNotRenderMoreOftenThanTheInterval) {
  std::atomic<int> renders{0};
  HttpServerOptions o;
  o.min_render_interval = std::chrono::milliseconds(200);
  auto s = StartServer(o, &renders);
  ASSERT_NE(s, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  int ok = 0;
  for (int i = 0; i < 50; ++i) {
    ok += Fetch(s->address(), "GET /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 200", 0) == 0;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ok, 50);
  // One rendering per started 200 ms window, at most.
  EXPECT_LE(renders.load(), static_cast<int>(secs / 0.2) + 1) << secs << " s";
  EXPECT_GE(renders.load(), 1);
}

TEST(MetricsHttp, StrangersCannotBlockAScrape) {
  std::atomic<int> renders{0};
  HttpServerOptions o;
  o.max_connections = 4;
  o.request_timeout = 3000ms;
  auto s = StartServer(o, &renders);
  ASSERT_NE(s, nullptr);
  // Slowloris: many connections that send part of a request and then nothing, more than the
  // endpoint's connection slots; a stranger streaming garbage; one sending too much.
  std::vector<UniqueFd> held;
  for (int i = 0; i < 12; ++i) {
    auto fd = net::ConnectTcp(s->address(), "", 2000ms);
    ASSERT_TRUE(fd.ok()) << fd.status();
    const std::string part = "GET /metr";
    ASSERT_TRUE(net::SendAll(fd->get(), part.data(), part.size(), 1000ms).ok());
    held.push_back(std::move(*fd));
  }
  std::thread garbage([&] {
    auto fd = net::ConnectTcp(s->address(), "", 2000ms);
    if (!fd.ok()) return;
    const std::string junk(1000, '\x01');
    for (int i = 0; i < 20; ++i) {
      if (!net::SendAll(fd->get(), junk.data(), junk.size(), 200ms).ok()) return;
    }
  });
  // A concurrent scrape answers before any stranger's request timeout (3 s) could free a slot.
  const auto t0 = std::chrono::steady_clock::now();
  const std::string r = Fetch(s->address(), "GET /metrics HTTP/1.1\r\n\r\n", 2500ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  garbage.join();
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK", 0), 0u) << r;
  EXPECT_NE(r.find("shardps_test_scrapes_total 1\n"), std::string::npos) << r;
  EXPECT_LT(took, 2500ms);
  EXPECT_GT(s->stats().evicted, 0u);
  // The held connections are closed at their deadline (the server's side: EOF here), each
  // awaited (bounded) rather than assumed closed after a fixed sleep.
  const auto closed_by = std::chrono::steady_clock::now() + 15000ms;
  int closed = 0;
  for (const UniqueFd& fd : held) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        closed_by - std::chrono::steady_clock::now());
    pollfd p{fd.get(), POLLIN | POLLRDHUP, 0};
    (void)poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    char c;
    const ssize_t n = recv(fd.get(), &c, 1, MSG_DONTWAIT);
    closed += n == 0 || (n < 0 && errno == ECONNRESET);
  }
  EXPECT_EQ(closed, 12);
  EXPECT_EQ(Fetch(s->address(), "GET /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
  // Stopping with connections open is prompt.
  auto fd = net::ConnectTcp(s->address(), "", 2000ms);
  ASSERT_TRUE(fd.ok());
  const auto t1 = std::chrono::steady_clock::now();
  s.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 2000ms);  // not the connections' 3 s deadline
}

TEST(MetricsHttp, APortThatCannotBeBoundIsAnError) {
  std::atomic<int> renders{0};
  auto first = StartServer(HttpServerOptions{}, &renders);
  ASSERT_NE(first, nullptr);
  HttpServerOptions o;
  o.port = first->port();
  auto second = MetricsHttpServer::Start(o, [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().ToString().find(std::to_string(first->port())), std::string::npos)
      << second.status();
  o.port = 70000;
  EXPECT_FALSE(MetricsHttpServer::Start(o, [] { return std::string(); }).ok());
  o.port = 0;
  o.address_file = "/nonexistent-dir/metrics.addr";
  EXPECT_FALSE(MetricsHttpServer::Start(o, [] { return std::string(); }).ok());
}

}  // namespace
}  // namespace shardps::metrics
