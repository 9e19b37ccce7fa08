// EndpointTable: the data-path endpoints a server accepted (workers, and on a backup its
// primary's replication stream) by endpoint id, the listener they arrive on, and the worker
// rank that said hello on each. Endpoint ids are never reused, so a worker's entry outlives its
// endpoint: immediates of a failed endpoint still queued in the CQ are pushes that arrived and
// are applied like any other. What a failure means is the membership's business, not this
// table's: DropFailed() reports, the server decides.
//
// Thread safety: not thread-safe. Owned by the server's apply thread, which polls the CQ the
// endpoints complete on.
#ifndef SHARDPS_SERVER_ENDPOINT_TABLE_H_
#define SHARDPS_SERVER_ENDPOINT_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "transport/transport.h"

namespace shardps::server {

class EndpointTable {
 public:
  explicit EndpointTable(std::unique_ptr<transport::Listener> listener)
      : listener_(std::move(listener)) {}

  std::string address() const { return listener_->address(); }
  // Accepts every connection already waiting (never blocks), attaching it to `cq` under the next
  // endpoint id. Returns how many; an accept failure other than "none waiting" goes to *error.
  // Peers the listener refused (a wrong or missing credential, another uid) are counted in
  // *refused and the latest reason kept in *error; they never stop the loop.
  int AcceptPending(transport::CompletionQueue* cq, int send_depth, int recv_depth, Status* error,
                    int* refused);
  // The identity endpoint `id`'s peer proved at accept ("" if none or unknown id).
  std::string IdentityOf(uint64_t id) const;
  // The listener's authentication counters.
  transport::HandshakeGate::Stats gate_stats() const {
    return listener_ ? listener_->gate_stats() : transport::HandshakeGate::Stats{};
  }
  size_t size() const { return endpoints_.size(); }
  // Whether endpoint `id` is open and healthy.
  bool Healthy(uint64_t id) const;
  // Endpoint `id`, to post on (nullptr if closed or unknown). Valid until the table changes.
  transport::Endpoint* Find(uint64_t id) const {
    auto it = endpoints_.find(id);
    return it == endpoints_.end() ? nullptr : it->second.get();
  }
  // Closes endpoint `id` (the peer sees it fail). Its worker binding stays.
  void Close(uint64_t id) { endpoints_.erase(id); }
  // Whether any endpoint has failed (DropFailed would close it).
  bool AnyFailed() const;
  // Closes every failed endpoint; returns their ids and why they failed.
  std::vector<std::pair<uint64_t, Status>> DropFailed();
  // Tears everything down, the listener included (as a process exit would).
  void CloseAll();

  void BindWorker(uint64_t id, uint32_t rank) { worker_of_[id] = rank; }
  // Closes every open endpoint bound to worker `rank` (a departed worker: if it is in fact
  // alive, a stopped process declared dead, its later writes fail instead of landing).
  // Returns how many.
  int CloseWorker(uint32_t rank);
  std::optional<uint32_t> WorkerOf(uint64_t id) const;

 private:
  std::unique_ptr<transport::Listener> listener_;
  std::map<uint64_t, std::unique_ptr<transport::Endpoint>> endpoints_;  // by endpoint id
  std::map<uint64_t, uint32_t> worker_of_;                              // endpoint id -> rank
  uint64_t next_id_ = 1;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_ENDPOINT_TABLE_H_
