// EtcdClient: a small etcd v3 client for the coordinator's optional high-availability backend
// (docs/control-protocol.md, "HA coordinator"): keys and values, leases, and the two
// transactions an election and a guarded write need. It speaks etcd's JSON gateway (HTTP/1.1
// POST /v3/..., keys and values base64, as every etcd >= 3.4 serves on its client port), so it
// needs no gRPC stack. Each call tries the endpoints in turn, starting with the last one that
// answered, within the call's timeout; an etcd error answer is returned, not retried.
//
// Thread safety: not thread-safe; give each thread its own client (they are cheap: no
// connection is kept between calls).
#ifndef SHARDPS_PROTO_ETCD_CLIENT_H_
#define SHARDPS_PROTO_ETCD_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace shardps::etcd {

struct Options {
  std::vector<std::string> endpoints;  // "host:port" of the etcd members' client URLs
  std::chrono::milliseconds timeout{3000};
};

struct KeyValue {
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

class Client {
 public:
  // "host:port,host:port" or "http://host:port,..." (https is not supported: put etcd on a
  // private network or loopback).
  static StatusOr<Client> Create(const std::string& endpoints,
                                 std::chrono::milliseconds timeout = std::chrono::milliseconds(3000));
  explicit Client(Options options) : options_(std::move(options)) {}

  StatusOr<std::optional<KeyValue>> Get(const std::string& key);
  Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status Delete(const std::string& key);
  // A lease of ttl seconds; its id.
  StatusOr<int64_t> GrantLease(int64_t ttl_seconds);
  // Renews `lease`; the TTL it has again, or NOT_FOUND once it has expired.
  StatusOr<int64_t> KeepAlive(int64_t lease);
  Status Revoke(int64_t lease);
  // Creates key = value (attached to `lease`, 0: none) only if the key does not exist: an
  // election. True if this call created it.
  StatusOr<bool> CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease);
  // Puts key = value only while guard_key holds guard_value (a leader's guarded write). True if
  // it was put.
  StatusOr<bool> PutIf(const std::string& guard_key, const std::string& guard_value,
                       const std::string& key, const std::string& value);

  const Options& options() const { return options_; }

 private:
  // POSTs `json` to `path` on the endpoints in turn; the body of the first 200 answer.
  StatusOr<std::string> Call(const std::string& path, const std::string& json);

  Options options_;
  size_t preferred_ = 0;  // the endpoint that answered last
};

// Exposed for tests.
std::string Base64Encode(const std::string& in);
StatusOr<std::string> Base64Decode(const std::string& in);

}  // namespace shardps::etcd

#endif  // SHARDPS_PROTO_ETCD_CLIENT_H_
