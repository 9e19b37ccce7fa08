// Writes the seed corpora of the control-plane fuzz targets:
//   fuzz_corpus_gen OUT_DIR   ->  OUT_DIR/{fuzz_framing,fuzz_descriptor,fuzz_coordinator}/*
// Valid frames of every Envelope body, a few streams of several frames, real region
// descriptors, and crafted edge cases (zero and oversized lengths, truncation, a frame with no
// body, a descriptor whose region wraps around). Deterministic: the same files on every run.
// The output is committed under tests/fuzz/corpus/ (scripts/fuzz.sh --regen-corpus).
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "proto/framing.h"
#include "transport/transport.h"

namespace {

using namespace shardps::control;  // NOLINT
using shardps::transport::Access;
using shardps::transport::RegionDescriptor;

std::string Descriptor(const std::string& provider, uint64_t addr, uint64_t len, Access a,
                       const std::string& extra) {
  RegionDescriptor d;
  d.provider = provider;
  d.addr = addr;
  d.length = len;
  d.rkey = 0x1234;
  d.access = a;
  d.provider_data = extra;
  return d.Encode();
}

void AddRegion(google::protobuf::RepeatedPtrField<Region>* regions, const char* name,
               const std::string& desc) {
  Region* r = regions->Add();
  r->set_name(name);
  r->set_encoded_descriptor(desc);
}

std::vector<std::pair<std::string, Envelope>> Bodies() {
  std::vector<std::pair<std::string, Envelope>> v;
  Envelope e;
  JoinRequest* j = e.mutable_join();
  j->set_cluster_token("fuzz-token");
  j->set_role(ROLE_SERVER);
  j->set_hostname("host-a");
  j->set_pid(4242);
  j->set_data_address("127.0.0.1:7000");
  j->set_transport("tcp");
  j->set_requested_rank(0);
  AddRegion(j->mutable_regions(), "weights",
            Descriptor("tcp", 0x7f0000001000, 65536, Access::kRemoteRead, ""));
  v.emplace_back("join", e);

  e.Clear();
  JoinReply* jr = e.mutable_join_reply();
  jr->set_accepted(true);
  jr->set_member_id(3);
  jr->set_rank(1);
  jr->set_epoch(7);
  jr->mutable_config()->set_mode(SSP);
  jr->mutable_config()->set_staleness(2);
  jr->mutable_config()->set_num_servers(2);
  jr->mutable_config()->set_num_workers(4);
  jr->mutable_config()->set_heartbeat_interval_ms(500);
  jr->mutable_config()->set_heartbeat_timeout_ms(2500);
  jr->mutable_config()->set_partition_bytes(4096);
  jr->mutable_config()->set_transport("tcp");
  jr->mutable_config()->set_optimizer("adam");
  v.emplace_back("join_reply", e);

  e.Clear();
  e.mutable_heartbeat()->set_member_id(1);
  e.mutable_heartbeat()->set_epoch(9);
  v.emplace_back("heartbeat", e);

  e.Clear();
  e.mutable_leave()->set_member_id(1);
  e.mutable_leave()->set_reason("done");
  v.emplace_back("leave", e);

  e.Clear();
  Membership* m = e.mutable_membership();
  m->set_epoch(4);
  for (uint32_t i = 1; i <= 2; ++i) {
    Member* mem = m->add_members();
    mem->set_member_id(i);
    mem->set_role(i == 1 ? ROLE_SERVER : ROLE_WORKER);
    mem->set_rank(0);
    mem->set_hostname("h");
    mem->set_pid(100 + i);
    mem->set_transport("shm");
  }
  m->add_departed(3);
  m->set_reason("member 3 departed");
  v.emplace_back("membership", e);

  e.Clear();
  e.mutable_error()->set_message("model refused");
  v.emplace_back("error", e);

  e.Clear();
  RegisterModel* rm = e.mutable_register_model();
  TensorSpecProto* t = rm->add_tensors();
  t->set_name("fc1.weight");
  t->add_shape(64);
  t->add_shape(32);
  t = rm->add_tensors();
  t->set_name("fc1.bias");
  t->add_shape(32);
  const TensorSpecProto first_tensor = rm->tensors(0);
  v.emplace_back("register_model", e);

  e.Clear();
  AssignShards* as = e.mutable_assign_shards();
  as->add_chunk_ids(0);
  as->add_chunk_ids(2);
  as->add_chunk_bytes(4096);
  as->add_chunk_bytes(128);
  as->set_max_workers(4);
  as->set_plan_fingerprint("4096|fc1.weight:0x64x32;|0@0+4096>0,");
  v.emplace_back("assign_shards", e);

  e.Clear();
  ShardsReady* sr = e.mutable_shards_ready();
  AddRegion(sr->mutable_regions(), "weights",
            Descriptor("tcp", 0x1000, 8192, Access::kRemoteRead, ""));
  AddRegion(sr->mutable_regions(), "inbox",
            Descriptor("verbs", 0x20000, 8192, Access::kRemoteWrite, std::string(16, 'g')));
  sr->set_plan_fingerprint("4096|fc1.weight:0x64x32;|0@0+4096>0,");
  v.emplace_back("shards_ready", e);

  e.Clear();
  ShardMap* sm = e.mutable_shard_map();
  sm->set_epoch(5);
  *sm->add_tensors() = first_tensor;
  ChunkEntry* ce = sm->add_chunks();
  ce->set_chunk_id(0);
  ce->set_tensor(0);
  ce->set_offset(0);
  ce->set_bytes(8192);
  ce->set_server_rank(0);
  ce->set_slot(0);
  ServerEntry* se = sm->add_servers();
  se->set_rank(0);
  se->set_member_id(1);
  se->set_data_address("127.0.0.1:7000");
  AddRegion(se->mutable_regions(), "weights",
            Descriptor("shm", 0, 16384, Access::kRemoteRead, "memfd"));
  sm->set_max_workers(4);
  sm->set_partition_bytes(8192);
  v.emplace_back("shard_map", e);

  // `shardps status`: a request with the fuzz coordinator's token (answered), and a member's
  // heartbeat carrying its counters.
  e.Clear();
  e.mutable_status_request()->set_cluster_token("fuzz-token");
  v.emplace_back("status_request", e);

  e.Clear();
  e.mutable_heartbeat()->set_member_id(1);
  e.mutable_heartbeat()->set_epoch(9);
  e.mutable_heartbeat()->set_seq(1);
  e.mutable_heartbeat()->mutable_stats()->set_clock(12);
  e.mutable_heartbeat()->mutable_stats()->set_bytes_pushed(4096);
  e.mutable_heartbeat()->mutable_stats()->set_bytes_pulled(4096);
  v.emplace_back("heartbeat_stats", e);
  return v;
}

std::string Frame(const Envelope& e) {
  auto f = EncodeFrame(e);
  if (!f.ok()) {
    fprintf(stderr, "encode: %s\n", f.status().ToString().c_str());
    exit(1);
  }
  return *f;
}

std::string Le32(uint32_t n) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

bool Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream f(dir + "/" + name, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string out = argv[1];
  const std::string fr = out + "/fuzz_framing", de = out + "/fuzz_descriptor",
                    co = out + "/fuzz_coordinator";
  for (const auto& d : {out, fr, de, co}) mkdir(d.c_str(), 0755);
  bool ok = true;
  const auto bodies = Bodies();
  std::string all;
  for (const auto& [name, env] : bodies) {
    const std::string f = Frame(env);
    all += f;
    // fuzz_framing: byte 0 = 0 (one piece, 16 MiB limit), then the frame.
    ok &= Write(fr, "body_" + name, std::string(1, '\0') + f);
    // fuzz_coordinator: the body right after the magic, and after a (prefixed) worker join.
    ok &= Write(co, "raw_" + name, std::string(1, '\0') + std::string(kMagic) + f);
    ok &= Write(co, "worker_" + name, std::string(1, '\1') + f);
    if (name == "shards_ready" || name == "heartbeat" || name == "heartbeat_stats") {
      ok &= Write(co, "server_" + name, std::string(1, '\3') + f);
    }
  }
  // Every body in one stream, fed in 5 pieces of 3, 17, 1, 256 and 100 bytes; 1 KiB limit.
  ok &= Write(fr, "stream_pieces", std::string("\x25\x02\x10\x00\xff\x63", 6) + all);
  // Byte by byte (15 one-byte pieces), then the rest.
  ok &= Write(fr, "stream_bytes", std::string(1, '\x0f') + std::string(15, '\0') + all);
  // Edge cases.
  ok &= Write(fr, "zero_length", std::string(1, '\0') + Le32(0));
  ok &= Write(fr, "over_limit", std::string(1, '\0') + Le32((16u << 20) + 1));
  ok &= Write(fr, "over_small_limit", std::string(1, '\x10') + Le32(65) + std::string(65, 'x'));
  const std::string hb = Frame(bodies[2].second);
  ok &= Write(fr, "truncated", std::string(1, '\0') + hb.substr(0, hb.size() - 1));
  ok &= Write(fr, "no_body", std::string(1, '\0') + Le32(2) + std::string("\x58\x01", 2));
  ok &= Write(fr, "garbage", std::string(1, '\0') + Le32(8) + std::string(8, '\xff'));

  // fuzz_coordinator edge cases: bad magic, half a magic, a worker's model of huge tensors
  // (regression: it ran the coordinator out of memory before shard plans were bounded), a
  // server's shards_ready for a plan never assigned, a heartbeat naming another member.
  ok &= Write(co, "bad_magic", std::string(1, '\0') + "SHPSCTL2" + hb);
  ok &= Write(co, "half_magic", std::string(1, '\0') + "SHPS");
  Envelope big;
  TensorSpecProto* t = big.mutable_register_model()->add_tensors();
  t->set_name("huge");
  t->add_shape(int64_t{1} << 40);
  ok &= Write(co, "worker_huge_model", std::string(1, '\1') + Frame(big));
  // Regression: a shape whose element count wraps to 0 (a division by zero in the plan).
  Envelope wrap;
  t = wrap.mutable_register_model()->add_tensors();
  t->set_name("wrap");
  t->add_shape(int64_t{1} << 62);
  t->add_shape(4);
  ok &= Write(co, "worker_wrapping_model", std::string(1, '\1') + Frame(wrap));
  Envelope other;
  other.mutable_heartbeat()->set_member_id(999999);
  ok &= Write(co, "worker_foreign_heartbeat", std::string(1, '\1') + Frame(other));
  ok &= Write(co, "worker_rank3_model", std::string(1, '\x1d') + Frame(bodies[6].second));

  // fuzz_descriptor: real descriptors and edge cases.
  ok &= Write(de, "tcp_read", Descriptor("tcp", 0x7f0000001000, 65536, Access::kRemoteRead, ""));
  ok &=
      Write(de, "verbs_rw",
            Descriptor("verbs", 0x1000, 1u << 20, Access::kRemoteReadWrite, std::string(24, 'g')));
  ok &= Write(de, "shm_local", Descriptor("shm", 0, 4096, Access::kLocalOnly, "memfd:7"));
  ok &= Write(de, "wraps", Descriptor("tcp", ~uint64_t{0} - 10, 100, Access::kRemoteRead, ""));
  const std::string good = Descriptor("tcp", 0x1000, 4096, Access::kRemoteWrite, "");
  ok &= Write(de, "truncated", good.substr(0, good.size() - 1));
  ok &= Write(de, "trailing", good + "x");
  if (!ok) {
    fprintf(stderr, "writing the corpus under %s failed\n", out.c_str());
    return 1;
  }
  printf("corpus written under %s\n", out.c_str());
  return 0;
}
