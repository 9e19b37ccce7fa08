// The timeline tracer (common/trace.h): what it writes parses back as JSON with the events,
// arguments, order, identity and clock anchor recorded; the max_events bound drops and counts;
// the file is a complete document after every flush; nothing is written when tracing is off.
#include "common/trace.h"

#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace shardps::trace {
namespace {

// A small strict JSON parser: enough to prove the file is JSON and to read it back.
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;
  const Json& operator[](const std::string& k) const {
    static const Json none;
    auto it = obj.find(k);
    return it == obj.end() ? none : it->second;
  }
  bool has(const std::string& k) const { return obj.count(k) != 0; }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  bool Parse(Json* out) {
    if (!Value(out)) return false;
    Ws();
    return i_ == s_.size();
  }

 private:
  void Ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool Lit(const char* w) {
    const std::string t(w);
    if (s_.compare(i_, t.size(), t) != 0) return false;
    i_ += t.size();
    return true;
  }
  bool String(std::string* out) {
    if (i_ >= s_.size() || s_[i_] != '"') return false;
    ++i_;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        if (i_ >= s_.size()) return false;
        const char e = s_[i_++];
        switch (e) {
          case '"': out->push_back('"'); break;
          case '\\': out->push_back('\\'); break;
          case '/': out->push_back('/'); break;
          case 'n': out->push_back('\n'); break;
          case 't': out->push_back('\t'); break;
          case 'r': out->push_back('\r'); break;
          case 'b': out->push_back('\b'); break;
          case 'f': out->push_back('\f'); break;
          case 'u': {
            if (i_ + 4 > s_.size()) return false;
            out->push_back(static_cast<char>(std::stoi(s_.substr(i_, 4), nullptr, 16)));
            i_ += 4;
            break;
          }
          default: return false;
        }
      } else {
        out->push_back(c);
      }
    }
    if (i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  bool Value(Json* v) {
    Ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') {
      v->kind = Json::kObject;
      ++i_;
      Ws();
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
      while (true) {
        Ws();
        std::string k;
        if (!String(&k)) return false;
        Ws();
        if (i_ >= s_.size() || s_[i_++] != ':') return false;
        if (v->obj.count(k)) return false;  // duplicate keys: not what we write
        if (!Value(&v->obj[k])) return false;
        Ws();
        if (i_ >= s_.size()) return false;
        if (s_[i_] == ',') { ++i_; continue; }
        if (s_[i_] == '}') return ++i_, true;
        return false;
      }
    }
    if (c == '[') {
      v->kind = Json::kArray;
      ++i_;
      Ws();
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
      while (true) {
        v->arr.emplace_back();
        if (!Value(&v->arr.back())) return false;
        Ws();
        if (i_ >= s_.size()) return false;
        if (s_[i_] == ',') { ++i_; continue; }
        if (s_[i_] == ']') return ++i_, true;
        return false;
      }
    }
    if (c == '"') {
      v->kind = Json::kString;
      return String(&v->str);
    }
    if (Lit("true")) { v->kind = Json::kBool; v->b = true; return true; }
    if (Lit("false")) { v->kind = Json::kBool; return true; }
    if (Lit("null")) return true;
    const size_t start = i_;
    if (s_[i_] == '-') ++i_;
    while (i_ < s_.size() && (isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                              s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-')) {
      ++i_;
    }
    if (i_ == start) return false;
    v->kind = Json::kNumber;
    v->num = std::strtod(s_.substr(start, i_ - start).c_str(), nullptr);
    return true;
  }
  const std::string& s_;
  size_t i_ = 0;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Json ParseFile(const std::string& path) {
  const std::string text = ReadFile(path);
  Json j;
  EXPECT_TRUE(Parser(text).Parse(&j)) << path << " is not JSON:\n" << text.substr(0, 2000);
  return j;
}

std::vector<const Json*> EventsNamed(const Json& doc, const std::string& name) {
  std::vector<const Json*> out;
  for (const Json& e : doc["traceEvents"].arr) {
    if (e["name"].str == name) out.push_back(&e);
  }
  return out;
}

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shardps-trace-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_FALSE(Enabled());
  }
  void TearDown() override {
    ASSERT_TRUE(Stop().ok());
    std::system(("rm -rf " + dir_).c_str());
  }
  std::vector<std::string> Files() const {
    std::vector<std::string> out;
    DIR* d = opendir(dir_.c_str());
    if (d == nullptr) return out;
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    closedir(d);
    return out;
  }
  std::string dir_;
};

TEST_F(TraceTest, NothingWrittenWhenOff) {
  {
    ScopedTrace off(Options{});  // no path: stays off
    EXPECT_TRUE(off.status().ok());
    EXPECT_FALSE(off.owns());
    EXPECT_FALSE(Enabled());
    Span s("push", "worker");
    s.Arg("chunk", 1);
    EXPECT_FALSE(s.active());
    Instant("failover", "worker", {{"server", 0}});
    Complete("pull", "worker", NowNs());
    EXPECT_EQ(NowNs(), 0);
    SetIdentity("worker", 1);
    NameThread("trainer");
    EXPECT_TRUE(Flush().ok());
  }
  EXPECT_TRUE(Files().empty());
  EXPECT_EQ(CurrentPath(), "");
}

TEST_F(TraceTest, EventsParseBackWithArgsOrderAndIdentity) {
  Options o;
  o.path = dir_ + "/worker-{rank}.json";
  timespec wall;
  clock_gettime(CLOCK_REALTIME, &wall);
  {
    ScopedTrace t(o);
    ASSERT_TRUE(t.status().ok()) << t.status();
    ASSERT_TRUE(t.owns());
    ASSERT_TRUE(Enabled());
    SetIdentity("worker", 3);
    NameThread("trainer");
    {
      Span step("step", "worker");
      step.Arg("step", 7).Arg("clock", uint64_t{6});
      for (int chunk = 0; chunk < 3; ++chunk) {
        Span push("push", "worker");
        push.Arg("chunk", chunk).Arg("bytes", uint64_t{4096}).Arg("server", chunk % 2);
      }
      Instant("failover", "worker", {{"server", 1}, {"why", "a \"quoted\"\\ reason\n"}});
      const int64_t t0 = NowNs();
      Complete("pull", "worker", t0, {{"chunk", 2}, {"version", uint64_t{9}}});
    }
  }  // stops: flushed and closed
  EXPECT_FALSE(Enabled());
  const std::string expect = "worker-3-" + std::to_string(getpid()) + ".json";
  ASSERT_EQ(Files(), std::vector<std::string>{expect});
  const Json doc = ParseFile(dir_ + "/" + expect);
  ASSERT_EQ(doc["traceEvents"].kind, Json::kArray);

  // Identity and the clock anchor.
  const Json& meta = doc["shardps"];
  EXPECT_EQ(meta["role"].str, "worker");
  EXPECT_EQ(meta["rank"].num, 3);
  EXPECT_EQ(meta["pid"].num, getpid());
  EXPECT_EQ(meta["events"].num, 6);  // step, 3 pushes, failover, pull
  EXPECT_EQ(meta["dropped_events"].num, 0);
  const double real_us = meta["clock_anchor"]["realtime_us"].num;
  EXPECT_NEAR(real_us, wall.tv_sec * 1e6 + wall.tv_nsec / 1e3, 60e6);
  EXPECT_GT(meta["clock_anchor"]["monotonic_us"].num, 0);
  EXPECT_EQ(doc["shardps_header"]["clock_anchor"]["realtime_us"].num, real_us);
  auto pname = EventsNamed(doc, "process_name");
  ASSERT_EQ(pname.size(), 1u);
  EXPECT_EQ((*pname[0])["ph"].str, "M");
  EXPECT_EQ((*pname[0])["args"]["name"].str.rfind("worker r3 (", 0), 0u);
  auto tname = EventsNamed(doc, "thread_name");
  ASSERT_EQ(tname.size(), 1u);
  EXPECT_EQ((*tname[0])["args"]["name"].str, "trainer");

  // Spans: names, categories, args; pushes in order, inside the step.
  auto steps = EventsNamed(doc, "step");
  ASSERT_EQ(steps.size(), 1u);
  const Json& step = *steps[0];
  EXPECT_EQ(step["ph"].str, "X");
  EXPECT_EQ(step["cat"].str, "worker");
  EXPECT_EQ(step["args"]["step"].num, 7);
  EXPECT_EQ(step["args"]["clock"].num, 6);
  EXPECT_EQ(step["pid"].num, getpid());
  EXPECT_EQ(step["tid"].num, (*tname[0])["tid"].num);
  auto pushes = EventsNamed(doc, "push");
  ASSERT_EQ(pushes.size(), 3u);
  double last_end = step["ts"].num;
  for (int chunk = 0; chunk < 3; ++chunk) {
    const Json& p = *pushes[chunk];
    EXPECT_EQ(p["args"]["chunk"].num, chunk);
    EXPECT_EQ(p["args"]["bytes"].num, 4096);
    EXPECT_EQ(p["args"]["server"].num, chunk % 2);
    EXPECT_GE(p["ts"].num, last_end);  // one after the other
    EXPECT_GE(p["dur"].num, 0);
    last_end = p["ts"].num + p["dur"].num;
  }
  EXPECT_LE(last_end, step["ts"].num + step["dur"].num + 0.001);
  auto fo = EventsNamed(doc, "failover");
  ASSERT_EQ(fo.size(), 1u);
  EXPECT_EQ((*fo[0])["ph"].str, "i");
  EXPECT_EQ((*fo[0])["args"]["server"].num, 1);
  EXPECT_EQ((*fo[0])["args"]["why"].str, "a \"quoted\"\\ reason\n");
  EXPECT_GE((*fo[0])["ts"].num, last_end);
  auto pulls = EventsNamed(doc, "pull");
  ASSERT_EQ(pulls.size(), 1u);
  EXPECT_EQ((*pulls[0])["args"]["version"].num, 9);
  EXPECT_GE((*pulls[0])["ts"].num, (*fo[0])["ts"].num);
}

TEST_F(TraceTest, BoundDropsAndCounts) {
  Options o;
  o.path = dir_ + "/t.json";
  o.max_events = 10;
  o.flush_events = 4;
  ASSERT_TRUE(Start(o).ok());
  SetIdentity("server", 0, 1);
  for (int i = 0; i < 25; ++i) Instant("publish", "server", {{"version", i}});
  EXPECT_EQ(DroppedEvents(), 15u);
  ASSERT_TRUE(Stop().ok());
  const Json doc = ParseFile(dir_ + "/t.json");
  auto pubs = EventsNamed(doc, "publish");
  ASSERT_EQ(pubs.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ((*pubs[i])["args"]["version"].num, i);  // the first 10
  EXPECT_EQ(doc["shardps"]["dropped_events"].num, 15);
  EXPECT_EQ(doc["shardps"]["events"].num, 10);
  EXPECT_EQ(doc["shardps"]["max_events"].num, 10);
  EXPECT_EQ(doc["shardps"]["group"].num, 1);
}

TEST_F(TraceTest, CompleteDocumentAfterEveryFlush) {
  Options o;
  o.path = dir_ + "/p.json";
  o.flush_events = 4;
  ASSERT_TRUE(Start(o).ok());
  for (int i = 0; i < 10; ++i) Instant("tick", "test", {{"i", i}});
  // Not stopped: what a process killed now would leave. 8 events were flushed (two buffers).
  {
    const Json doc = ParseFile(dir_ + "/p.json");
    EXPECT_EQ(EventsNamed(doc, "tick").size(), 8u);
    EXPECT_EQ(doc["shardps"]["events"].num, 8);
  }
  ASSERT_TRUE(Flush().ok());
  EXPECT_EQ(EventsNamed(ParseFile(dir_ + "/p.json"), "tick").size(), 10u);
  for (int i = 10; i < 13; ++i) Instant("tick", "test", {{"i", i}});
  ASSERT_TRUE(Stop().ok());
  const Json doc = ParseFile(dir_ + "/p.json");
  auto ticks = EventsNamed(doc, "tick");
  ASSERT_EQ(ticks.size(), 13u);
  for (int i = 0; i < 13; ++i) EXPECT_EQ((*ticks[i])["args"]["i"].num, i);
  // Events recorded after Stop are discarded.
  Instant("tick", "test");
  EXPECT_EQ(EventsNamed(ParseFile(dir_ + "/p.json"), "tick").size(), 13u);
}

TEST_F(TraceTest, ManyThreads) {
  Options o;
  o.path = dir_ + "/m.json";
  o.flush_events = 100;
  ASSERT_TRUE(Start(o).ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      NameThread("thread " + std::to_string(t));
      for (int i = 0; i < 1000; ++i) {
        Span s("apply", "server");
        s.Arg("thread", t).Arg("i", i);
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(Stop().ok());
  const Json doc = ParseFile(dir_ + "/m.json");
  auto spans = EventsNamed(doc, "apply");
  ASSERT_EQ(spans.size(), 4000u);
  std::map<int, int> next;  // per thread, the spans in order
  std::map<int, std::set<double>> tids;
  for (const Json* s : spans) {
    const int t = static_cast<int>((*s)["args"]["thread"].num);
    EXPECT_EQ((*s)["args"]["i"].num, next[t]++);
    tids[t].insert((*s)["tid"].num);
  }
  ASSERT_EQ(tids.size(), 4u);
  for (auto& [t, ids] : tids) EXPECT_EQ(ids.size(), 1u) << "thread " << t;
  EXPECT_EQ(EventsNamed(doc, "thread_name").size(), 4u);
}

TEST_F(TraceTest, RefusesUnwritableDirectoryAndSecondStart) {
  Options o;
  o.path = dir_ + "/no/such/dir/t.json";
  Status st = Start(o);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(Enabled());
  o.path = dir_ + "/a.json";
  ASSERT_TRUE(Start(o).ok());
  o.path = dir_ + "/b.json";
  EXPECT_EQ(Start(o).code(), StatusCode::kFailedPrecondition);
  ScopedTrace second(o);  // another owner's trace runs: left alone
  EXPECT_TRUE(second.status().ok());
  EXPECT_FALSE(second.owns());
  EXPECT_EQ(ExpandPath("/x/w-%r.json", 2, 77), "/x/w-2-77.json");
  EXPECT_EQ(ExpandPath("/x/{rank}/w-{rank}", -1, 5), "/x/x-5/w-x-5");
}

}  // namespace
}  // namespace shardps::trace
