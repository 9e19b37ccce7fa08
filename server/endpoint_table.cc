#include "server/endpoint_table.h"

#include <chrono>

namespace shardps::server {

int EndpointTable::AcceptPending(transport::CompletionQueue* cq, int send_depth, int recv_depth,
                                 Status* error, int* refused) {
  int accepted = 0;
  // Bounded, so that a flood of refused peers cannot keep the caller here.
  for (int round = 0; listener_ && round < 64; ++round) {
    transport::EndpointOptions eo;
    eo.endpoint_id = next_id_;
    eo.send_depth = send_depth;
    eo.recv_depth = recv_depth;
    auto ep = listener_->Accept(cq, eo, std::chrono::milliseconds(0));
    if (!ep.ok()) {
      if (ep.status().code() == StatusCode::kPermissionDenied) {
        ++*refused;
        *error = ep.status();
        continue;
      }
      if (ep.status().code() != StatusCode::kDeadlineExceeded) *error = ep.status();
      break;
    }
    endpoints_[next_id_++] = std::move(*ep);
    ++accepted;
  }
  return accepted;
}

std::string EndpointTable::IdentityOf(uint64_t id) const {
  auto it = endpoints_.find(id);
  return it == endpoints_.end() ? std::string() : it->second->peer_identity();
}

bool EndpointTable::Healthy(uint64_t id) const {
  auto it = endpoints_.find(id);
  return it != endpoints_.end() && it->second->status().ok();
}

bool EndpointTable::AnyFailed() const {
  for (const auto& [id, ep] : endpoints_) {
    if (!ep->status().ok()) return true;
  }
  return false;
}

std::vector<std::pair<uint64_t, Status>> EndpointTable::DropFailed() {
  std::vector<std::pair<uint64_t, Status>> dropped;
  for (auto it = endpoints_.begin(); it != endpoints_.end();) {
    if (it->second->status().ok()) {
      ++it;
      continue;
    }
    dropped.emplace_back(it->first, it->second->status());
    it = endpoints_.erase(it);
  }
  return dropped;
}

void EndpointTable::CloseAll() {
  endpoints_.clear();
  worker_of_.clear();
  listener_.reset();
}

std::optional<uint32_t> EndpointTable::WorkerOf(uint64_t id) const {
  auto it = worker_of_.find(id);
  if (it == worker_of_.end()) return std::nullopt;
  return it->second;
}

int EndpointTable::CloseWorker(uint32_t rank) {
  int n = 0;
  for (const auto& [id, r] : worker_of_) {
    if (r != rank) continue;
    n += static_cast<int>(endpoints_.erase(id));
  }
  return n;
}

}  // namespace shardps::server
