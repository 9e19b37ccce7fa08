#include "tests/integration/fault_injecting_fabric.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <glog/logging.h>

namespace shardps::test {

using transport::Endpoint;
using transport::LocalSlice;
using transport::RemoteSlice;

namespace {

constexpr uint32_t kWrongRkeyMask = 0x5a5a5a5au;

// Forwards to the real endpoint; fails the eligible posts chosen by the shared counter.
// Owned by the polling thread of its completion queue, as every Endpoint.
class FaultInjectingEndpoint final : public Endpoint {
 public:
  FaultInjectingEndpoint(std::unique_ptr<Endpoint> inner, const FaultOptions& options,
                         std::shared_ptr<FaultCounters> counters,
                         std::unique_ptr<transport::MemoryRegion> kept)
      : Endpoint(inner->endpoint_id(), inner->fabric_identity(), inner->max_operation_bytes()),
        inner_(std::move(inner)),
        options_(options),
        counters_(std::move(counters)),
        kept_(std::move(kept)) {}

  Status status() const override { return inner_->status(); }
  int outstanding() const override { return inner_->outstanding(); }
  std::string DebugString() const override { return "fault(" + inner_->DebugString() + ")"; }
  // What the provider underneath does, so that the client takes the paths it takes there.
  bool gathers_read_lists() const override { return inner_->gathers_read_lists(); }
  bool reads_are_local_copies() const override { return inner_->reads_are_local_copies(); }

 private:
  bool Choose(uint32_t flags) {
    const bool first = ++posts_ <= static_cast<uint64_t>(options_.skip_first_posts);
    if (options_.error_every == 0 || first || injected_ || (flags & transport::kUnsignaled) ||
        !inner_->status().ok()) {
      return false;
    }
    return (counters_->eligible.fetch_add(1) + 1) % options_.error_every == 0;
  }

  // The posts passed the contract's checks (the inner endpoint checks them again).
  Status PostChecked(transport::OpType type, const LocalSlice& local, const RemoteSlice& remote,
                     uint32_t imm, uint64_t context, uint32_t flags) override {
    switch (type) {
      case transport::OpType::kWrite:
        ++posts_;
        return inner_->PostWrite(local, remote, context, flags);
      case transport::OpType::kRead:
        ++posts_;
        if (kept_length_ != 0 && options_.rewrite_now && options_.rewrite_now()) {
          char* bytes = static_cast<char*>(kept_->data());
          if (options_.change) options_.change(bytes, kept_length_);
          Status s = inner_->PostWrite({kept_.get(), 0, kept_length_}, kept_target_, 0,
                                       transport::kUnsignaled);
          kept_length_ = 0;
          if (!s.ok()) return s;
        }
        return inner_->PostRead(local, remote, context, flags);
      case transport::OpType::kWriteImm: {
        if (options_.refuse && local.region != nullptr &&
            options_.refuse(static_cast<const char*>(local.region->data()) + local.offset,
                            local.length, imm)) {
          return UnavailableError("fault injection: a write-with-immediate refused, not posted");
        }
        if (options_.rewrite && local.region != nullptr) {
          options_.rewrite(static_cast<char*>(local.region->data()) + local.offset, local.length,
                           imm);
        }
        if (kept_ != nullptr && options_.keep && local.region != nullptr &&
            options_.keep(static_cast<const char*>(local.region->data()) + local.offset,
                          local.length, imm)) {
          kept_length_ = std::min<uint64_t>(local.length, FaultOptions::kKeptBytes);
          std::memcpy(kept_->data(),
                      static_cast<const char*>(local.region->data()) + local.offset,
                      kept_length_);
          kept_target_ = remote;
        }
        const bool inject = Choose(flags);
        RemoteSlice target = remote;
        if (inject) target.rkey ^= kWrongRkeyMask;
        Status s = inner_->PostWriteImm(local, target, imm, context, flags);
        if (inject && s.ok()) {
          injected_ = true;
          const uint64_t n = counters_->injected.fetch_add(1) + 1;
          LOG(WARNING) << "fault injection: " << inner_->DebugString()
                       << ": a write-with-immediate names a wrong rkey (injected error " << n
                       << ")";
        }
        return s;
      }
      default:
        return InvalidArgumentError("fault injection: unexpected post type");
    }
  }

  const std::unique_ptr<Endpoint> inner_;
  const FaultOptions options_;
  const std::shared_ptr<FaultCounters> counters_;
  uint64_t posts_ = 0;
  bool injected_ = false;  // one injected error per endpoint
  // FaultOptions::keep: the kept bytes (registered, to post from) and where they went.
  const std::unique_ptr<transport::MemoryRegion> kept_;
  uint64_t kept_length_ = 0;
  RemoteSlice kept_target_;
};

}  // namespace

FaultInjectingFabric::FaultInjectingFabric(std::unique_ptr<transport::Fabric> inner,
                                           const FaultOptions& options)
    : inner_(std::move(inner)), options_(options) {
  LOG(WARNING) << "fault injection over " << inner_->name() << ": every " << options_.error_every
               << "th eligible write-with-immediate fails (testing only)";
}

std::string FaultInjectingFabric::DebugString() const {
  return "fault-injecting(" + inner_->DebugString() + ")";
}

StatusOr<std::unique_ptr<Endpoint>> FaultInjectingFabric::Connect(
    const std::string& address, transport::CompletionQueue* cq,
    const transport::EndpointOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Endpoint> ep, inner_->Connect(address, cq, options));
  std::unique_ptr<transport::MemoryRegion> kept;
  if (options_.keep) {
    ASSIGN_OR_RETURN(kept, inner_->AllocateMemory(FaultOptions::kKeptBytes,
                                                  transport::Access::kLocalOnly));
  }
  return std::unique_ptr<Endpoint>(std::make_unique<FaultInjectingEndpoint>(
      std::move(ep), options_, counters_, std::move(kept)));
}

}  // namespace shardps::test
