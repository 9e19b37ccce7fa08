#include "worker/aggregator.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <random>

#include <glog/logging.h>

#include "common/crypto.h"
#include "common/half.h"
#include "transport/populate.h"
#include "wire/region_layout.h"
#include "worker/client_internal.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;

namespace {

std::string SpecString(const control::TensorSpecProto& s) {
  std::string out = s.name() + " dtype " + std::to_string(s.dtype()) + " [";
  for (int i = 0; i < s.shape_size(); ++i) out += (i ? "," : "") + std::to_string(s.shape(i));
  return out + "]";
}

uint64_t SpecBytes(const control::TensorSpecProto& s) {
  uint64_t n = 1;
  for (int64_t d : s.shape()) n *= static_cast<uint64_t>(d);
  return n * host::ElemBytes(s.dtype());
}

bool SameRule(const UpdateRule& a, const UpdateRule& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

}  // namespace

StatusOr<std::unique_ptr<Aggregator>> Aggregator::Create(const AggregatorOptions& options) {
  if (options.local_workers == 0 || options.local_workers > 1024) {
    return InvalidArgumentError("shardps_aggregator: --local_workers must be 1..1024");
  }
  std::unique_ptr<Aggregator> a(new Aggregator(options));
  RETURN_IF_ERROR(a->Bind());
  ClientOptions co = options.client;
  co.aggregator.clear();  // the aggregator itself is a cluster worker
  ASSIGN_OR_RETURN(a->client_, Client::Connect(co));
  a->locals_.resize(options.local_workers);
  LOG(INFO) << "host aggregator: cluster worker rank " << a->client_->rank() << ", "
            << options.local_workers << " local workers on " << options.socket_path
            << ", transport " << a->client_->transport_name();
  return a;
}

Aggregator::~Aggregator() {
  if (region_.data() != nullptr && header()->state.load() != static_cast<uint32_t>(host::GroupState::kFailed)) {
    header()->state.store(static_cast<uint32_t>(host::GroupState::kClosed), std::memory_order_release);
    host::FutexWakeAll(&header()->worker_bell);
  }
  if (client_) client_->Close().IgnoreError();
  if (!options_.socket_path.empty() && options_.socket_path[0] != '@' && listen_.valid()) {
    unlink(options_.socket_path.c_str());
  }
}

Status Aggregator::Bind() {
  struct sockaddr_un addr;
  socklen_t len;
  RETURN_IF_ERROR(host::MakeUnixAddress(options_.socket_path, &addr, &len));
  if (options_.socket_path[0] != '@') {
    // A socket file left by a dead aggregator is replaced; a live one is not.
    UniqueFd probe(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (probe.valid() && connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      return AlreadyExistsError("shardps_aggregator: another aggregator is serving " +
                                options_.socket_path);
    }
    struct stat st;
    if (lstat(options_.socket_path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return FailedPreconditionError("shardps_aggregator: " + options_.socket_path +
                                       " exists and is not a socket");
      }
      unlink(options_.socket_path.c_str());
    }
  }
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoError("shardps_aggregator: socket", errno);
  // Only this user may connect (checked again per connection with SO_PEERCRED).
  const mode_t old = umask(0177);
  const int b = bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len);
  const int err = errno;
  umask(old);
  if (b != 0) return ErrnoError("shardps_aggregator: bind " + options_.socket_path, err);
  if (listen(fd.get(), 64) != 0) return ErrnoError("shardps_aggregator: listen", errno);
  listen_ = std::move(fd);
  return Status::OK();
}

void Aggregator::PollPending() {
  for (;;) {
    UniqueFd c(accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c.valid()) break;
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    if (getsockopt(c.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
        (cred.uid != geteuid() && cred.uid != 0)) {
      LOG(WARNING) << "host aggregator: refused a local connection from uid " << cred.uid
                   << " (only uid " << geteuid() << " may join)";
      continue;
    }
    // Greeted with the cluster's facts at once: a worker knows its rank after Connect.
    control::LocalMessage hello;
    FillStarted(hello.mutable_started());
    if (!host::SendLocal(c.get(), hello).ok()) continue;
    pending_.push_back({std::move(c), SteadyClock::now(), false, {}});
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!it->joined) {
      struct pollfd p = {it->sock.get(), POLLIN, 0};
      if (poll(&p, 1, 0) > 0) {
        auto m = host::ReceiveLocal(it->sock.get(), std::chrono::milliseconds(0));
        if (!m.ok() || !m->has_join()) {
          LOG(WARNING) << "host aggregator: a local connection left or sent no join: "
                       << (m.ok() ? std::string("unexpected message") : m.status().ToString());
          it = pending_.erase(it);
          continue;
        }
        it->join = m->join();
        it->joined = true;
      }
    } else if (host::PeerGone(it->sock.get())) {
      it = pending_.erase(it);
      continue;
    }
    ++it;
  }
}

void Aggregator::FillStarted(control::LocalStarted* st) const {
  st->set_clock(client_->clock());
  st->set_cluster_rank(client_->rank());
  st->set_hosts(client_->num_workers());
  st->set_consistency(client_->consistency());
  st->set_transport(client_->transport_name());
  st->set_local_workers(options_.local_workers);
}

Status Aggregator::CheckJoin(const control::LocalJoin& j) {
  if (!crypto::ConstantTimeEquals(
          j.proof(), crypto::HmacSha256(options_.client.cluster_token, host::kJoinProofMessage))) {
    return PermissionDeniedError("a local worker without the cluster's token (set "
                                 "SHARDPS_CLUSTER_TOKEN as for the aggregator)");
  }
  if (j.local_rank() >= options_.local_workers) {
    return InvalidArgumentError("local rank " + std::to_string(j.local_rank()) +
                                " is outside this host's " +
                                std::to_string(options_.local_workers) + " local workers");
  }
  if (locals_[j.local_rank()].live) {
    return AlreadyExistsError("local rank " + std::to_string(j.local_rank()) +
                              " is already in the group");
  }
  for (const auto& t : j.tensors()) {
    if (t.embedding()) {
      return UnimplementedError("row table " + t.name() +
                                ": row tables are not aggregated per host; run this job flat "
                                "(without SHARDPS_AGGREGATOR)");
    }
    if (t.dtype() > 2) return InvalidArgumentError("tensor " + t.name() + ": unknown dtype");
  }
  if (tensors_.empty()) return Status::OK();
  if (static_cast<size_t>(j.tensors_size()) != tensors_.size()) {
    return InvalidArgumentError("local rank " + std::to_string(j.local_rank()) + " registered " +
                                std::to_string(j.tensors_size()) + " tensors, the group has " +
                                std::to_string(tensors_.size()));
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (SpecString(j.tensors(static_cast<int>(i))) != SpecString(tensors_[i])) {
      return InvalidArgumentError("local rank " + std::to_string(j.local_rank()) + " tensor " +
                                  std::to_string(i) + " is " +
                                  SpecString(j.tensors(static_cast<int>(i))) +
                                  ", the group's is " + SpecString(tensors_[i]));
    }
  }
  return Status::OK();
}

Status Aggregator::SetupRegion() {
  std::vector<uint64_t> bytes;
  for (const auto& t : tensors_) bytes.push_back(SpecBytes(t));
  layout_ = host::GroupLayout::Make(options_.local_workers, bytes);
  // Sealed against resizing (a worker that shrank it would SIGBUS the aggregator) and against
  // further seals; the weights' memfd also against new writable mappings once mapped here.
  constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;
  memfd_ = UniqueFd(static_cast<int>(memfd_create("shardps-host-group", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  weights_fd_ = UniqueFd(static_cast<int>(memfd_create("shardps-host-weights", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!memfd_.valid() || !weights_fd_.valid()) return ErrnoError("host aggregator: memfd_create", errno);
  const uint64_t weights_bytes = layout_.region_bytes - layout_.weights_offset;
  if (ftruncate(memfd_.get(), static_cast<off_t>(layout_.weights_offset)) != 0 ||
      ftruncate(weights_fd_.get(), static_cast<off_t>(weights_bytes)) != 0) {
    return ErrnoError("host aggregator: ftruncate of the shared region", errno);
  }
  ASSIGN_OR_RETURN(region_, host::Mapping::Map(memfd_.get(), 0, layout_.weights_offset, true));
  ASSIGN_OR_RETURN(weights_, host::Mapping::Map(weights_fd_.get(), 0, weights_bytes, true));
  if (fcntl(memfd_.get(), F_ADD_SEALS, kSizeSeals | F_SEAL_SEAL) != 0 ||
      fcntl(weights_fd_.get(), F_ADD_SEALS, kSizeSeals | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    return ErrnoError("host aggregator: sealing the shared region", errno);
  }
  RETURN_IF_ERROR(transport::PopulatePages(region_.data(), region_.size(),
                                           transport::PopulateFor::kWriteFresh,
                                           "host aggregation region"));
  RETURN_IF_ERROR(transport::PopulatePages(weights_.data(), weights_.size(),
                                           transport::PopulateFor::kWriteFresh,
                                           "host aggregation weights"));
  std::random_device rd;
  generation_ = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  host::GroupHeader* h = header();
  h->magic = host::kGroupMagic;
  h->generation = generation_;
  h->local_workers = options_.local_workers;
  h->tensors = layout_.tensors;
  h->state.store(static_cast<uint32_t>(host::GroupState::kSetup));
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const uint64_t b = host::PageUp(std::max<uint64_t>(1, layout_.tensor_bytes[t]));
    // Private to the aggregator (the client's registered gradient memory).
    sums_.emplace_back();
    UniqueFd anon(static_cast<int>(memfd_create("shardps-host-sum", MFD_CLOEXEC)));
    if (!anon.valid() || ftruncate(anon.get(), static_cast<off_t>(b)) != 0) {
      return ErrnoError("host aggregator: sum buffer", errno);
    }
    ASSIGN_OR_RETURN(sums_.back(), host::Mapping::Map(anon.get(), 0, b, true));
    RETURN_IF_ERROR(transport::PopulatePages(sums_.back().data(), b,
                                             transport::PopulateFor::kWriteFresh,
                                             "host aggregation sum"));
  }
  lr_.assign(tensors_.size(), 0.0f);
  rule_.assign(tensors_.size(), UpdateRule{});
  has_rule_.assign(tensors_.size(), false);
  return Status::OK();
}

Status Aggregator::Admit(Pending p, bool initial) {
  const uint32_t l = p.join.local_rank();
  // A slot reused by a new process starts clean (its old owner is gone).
  std::memset(static_cast<void*>(slot(l)), 0, layout_.slot_stride);
  control::LocalMessage w;
  *w.mutable_welcome() = layout_.ToWelcome(generation_);
  RETURN_IF_ERROR(host::SendLocal(p.sock.get(), w, memfd_.get(), weights_fd_.get()));
  auto ready = host::ReceiveLocal(p.sock.get(), options_.setup_timeout);
  if (!ready.ok() || !ready->has_ready()) {
    return UnavailableError("local rank " + std::to_string(l) + " did not map the group: " +
                            (ready.ok() ? std::string("unexpected message")
                                        : ready.status().ToString()));
  }
  Local& local = locals_[l];
  local.sock = std::move(p.sock);
  local.pid = p.join.pid();
  local.live = true;
  local.joined_at = initial ? 0 : client_->clock();
  if (!initial) {
    control::LocalMessage s;
    FillStarted(s.mutable_started());
    RETURN_IF_ERROR(host::SendLocal(local.sock.get(), s));
    LOG(INFO) << "host aggregator: local rank " << l << " (pid " << local.pid
              << ") joined at clock " << local.joined_at;
  }
  return Status::OK();
}

Status Aggregator::StartCluster() {
  // Local rank 0's initial weights (in its gradient area) become the host's; cluster rank 0's
  // host's become everybody's (Client::Start).
  for (uint32_t t = 0; t < layout_.tensors; ++t) {
    std::memcpy(weights_.data() + layout_.tensor_offset[t], region_.data() + layout_.grad_offset(0, t),
                layout_.tensor_bytes[t]);
    std::vector<int64_t> shape(tensors_[t].shape().begin(), tensors_[t].shape().end());
    RETURN_IF_ERROR(client_->RegisterTensor(tensors_[t].name(),
                                            weights_.data() + layout_.tensor_offset[t],
                                            sums_[t].data(), shape,
                                            static_cast<TensorDType>(tensors_[t].dtype())));
  }
  RETURN_IF_ERROR(client_->Start());
  host::GroupHeader* h = header();
  h->hosts.store(client_->num_workers(), std::memory_order_relaxed);
  // Host barriers are numbered as the cluster's: a restarted aggregator starts at the
  // generation the cluster had released when it joined, so a learner that was waiting at one
  // released meanwhile passes it, and the next arrives at the cluster's next.
  h->barrier_released.store(static_cast<uint32_t>(client_->barrier_generation()),
                            std::memory_order_release);
  h->weights_clock.store(client_->clock(), std::memory_order_release);
  h->state.store(static_cast<uint32_t>(host::GroupState::kRunning), std::memory_order_release);
  host::FutexWakeAll(&h->worker_bell);
  control::LocalMessage s;
  FillStarted(s.mutable_started());
  for (uint32_t l = 0; l < locals_.size(); ++l) {
    locals_[l].joined_at = client_->clock();
    RETURN_IF_ERROR(host::SendLocal(locals_[l].sock.get(), s));
  }
  LOG(INFO) << "host aggregator: started at clock " << client_->clock() << ", "
            << client_->consistency() << ", " << layout_.tensors << " tensors, shared region "
            << layout_.region_bytes << " bytes";
  return Status::OK();
}

void Aggregator::DropGone() {
  for (uint32_t l = 0; l < locals_.size(); ++l) {
    Local& local = locals_[l];
    if (local.live && host::PeerGone(local.sock.get())) {
      local.live = false;
      local.sock.reset();
      LOG(WARNING) << "host aggregator: local rank " << l << " (pid " << local.pid
                   << ") left at host clock " << client_->clock();
    }
  }
}

void Aggregator::Fail(const Status& s) {
  if (region_.data() == nullptr) return;
  host::GroupHeader* h = header();
  const std::string msg = s.ToString();
  std::snprintf(h->error, sizeof(h->error), "%s", msg.c_str());
  h->state.store(static_cast<uint32_t>(host::GroupState::kFailed), std::memory_order_release);
  host::FutexWakeAll(&h->worker_bell);
}

Status Aggregator::MaybePassBarrier() {
  host::GroupHeader* h = header();
  const uint32_t released = h->barrier_released.load(std::memory_order_relaxed);
  uint32_t lowest = std::numeric_limits<uint32_t>::max();
  bool any = false;
  for (uint32_t l = 0; l < locals_.size(); ++l) {
    if (!locals_[l].live) continue;
    any = true;
    lowest = std::min(lowest, slot(l)->barrier_arrived.load(std::memory_order_acquire));
  }
  if (!any || lowest <= released) return Status::OK();
  // A learner arrives only at the generation after the one released (the slot is learner-
  // writable shared memory: anything higher is not believed).
  const uint64_t target = static_cast<uint64_t>(released) + 1;
  while (client_->barrier_generation() < target) {
    // The cluster's barrier, retried in short waits (the same generation each time) so that a
    // stop is seen and new local learners' joins are read meanwhile (admitted between steps).
    const Status st = client_->Barrier(std::chrono::milliseconds(200));
    if (st.ok()) break;
    if (st.code() != StatusCode::kDeadlineExceeded) return st;
    if (stop_.load(std::memory_order_relaxed)) return CancelledError("stopped");
    PollPending();
  }
  h->barrier_released.store(static_cast<uint32_t>(target), std::memory_order_release);
  host::FutexWakeAll(&h->worker_bell);
  return Status::OK();
}

Status Aggregator::WaitForLocals(uint64_t c) {
  host::GroupHeader* h = header();
  for (uint32_t spins = 0;; ++spins) {
    const uint32_t bell = h->agg_bell.load(std::memory_order_acquire);
    RETURN_IF_ERROR(MaybePassBarrier());
    bool all = true;
    for (uint32_t l = 0; l < locals_.size(); ++l) {
      const Local& local = locals_[l];
      if (!local.live || local.joined_at > c) continue;
      if (slot(l)->clock_done.load(std::memory_order_acquire) < c + 1) all = false;
    }
    if (all) return Status::OK();
    if (stop_.load(std::memory_order_relaxed)) return CancelledError("stopped");
    if (spins < 64) continue;
    // A local worker is waited for as long as it lives: no timeout (a busy host deschedules).
    host::FutexWait(&h->agg_bell, bell, std::chrono::milliseconds(20));
    if (spins % 4 == 0) {
      DropGone();
      PollPending();
    }
  }
}

Status Aggregator::StepOnce(bool* done) {
  const uint64_t c = client_->clock();
  DropGone();
  RETURN_IF_ERROR(WaitForLocals(c));
  // The clock's contributors: every local worker that finished clock c (alive or not since).
  std::vector<uint32_t> finished;
  for (uint32_t l = 0; l < locals_.size(); ++l) {
    if (locals_[l].joined_at > c) continue;
    if (slot(l)->clock_done.load(std::memory_order_acquire) >= c + 1 &&
        (locals_[l].live || locals_[l].pid != 0)) {
      finished.push_back(l);
    }
  }
  if (std::none_of(locals_.begin(), locals_.end(), [](const Local& x) { return x.live; }) &&
      finished.empty()) {
    *done = true;
    return Status::OK();
  }
  if (options_.crash_at_clock != 0 && c + 1 == options_.crash_at_clock && !options_.crash_after_push) {
    LOG(ERROR) << "host aggregator: crash point before the push of clock " << c;
    _exit(9);
  }
  std::vector<Handle> handles;
  for (uint32_t t = 0; t < layout_.tensors; ++t) {
    uint32_t n = 0;
    bool non_finite = false;
    bool no_gradient = true;  // every contributor's push carries the mark
    const host::TensorControl* first = nullptr;
    const uint64_t bytes = layout_.tensor_bytes[t];
    const uint32_t dtype = tensors_[t].dtype();
    const uint64_t elems = bytes / host::ElemBytes(dtype);
    char* sum = sums_[t].data();
    if (dtype != 0 && scratch_.size() < elems) scratch_.resize(elems);
    // Fixed order: local rank 0, 1, ... (a host's sum is bit-reproducible).
    for (uint32_t l : finished) {
      const host::TensorControl* tc = control(l, t);
      if (tc->pushed_clock != c + 1) continue;
      const char* g = region_.data() + layout_.grad_offset(l, t);
      if (dtype == 0) {
        float* s = reinterpret_cast<float*>(sum);
        const float* x = reinterpret_cast<const float*>(g);
        if (n == 0) {
          std::memcpy(s, x, bytes);
        } else {
          for (uint64_t i = 0; i < elems; ++i) s[i] += x[i];
        }
      } else {
        const auto* x = reinterpret_cast<const uint16_t*>(g);
        if (n == 0) {
          DecodeHalf(dtype, x, scratch_.data(), elems);
        } else {
          AddDecodedHalf(dtype, x, scratch_.data(), elems);
        }
      }
      if (first == nullptr) first = tc;
      non_finite |= (slot(l)->flags & layout::kPushNonFinite) != 0;
      no_gradient = no_gradient && tc->no_gradient != 0;
      ++n;
    }
    if (n == 0) continue;  // nobody pushed this tensor at this clock
    if (dtype != 0) EncodeHalf(dtype, scratch_.data(), reinterpret_cast<uint16_t*>(sum), elems);
    // The clock's rate and rule: its lowest contributing local rank's (as BSP takes the
    // lowest worker rank's).
    if (first->lr != lr_[t]) {
      RETURN_IF_ERROR(client_->SetLearningRate(tensors_[t].name(), first->lr));
      lr_[t] = first->lr;
    }
    if (first->has_rule != 0 && (!has_rule_[t] || !SameRule(first->rule, rule_[t]))) {
      RETURN_IF_ERROR(client_->SetUpdateRule(tensors_[t].name(), first->rule));
      rule_[t] = first->rule;
      has_rule_[t] = true;
    }
    client_->MarkNonFinite(non_finite);
    // The host's sum carries no gradient only when none of its learners' pushes did (then the
    // servers leave the chunk as it is if every host's push is marked, as for flat workers).
    RETURN_IF_ERROR(client_->SetNoGradient(tensors_[t].name(), no_gradient));
    SetPushWeight(client_.get(), n);
    ASSIGN_OR_RETURN(Handle hd, client_->Push(tensors_[t].name()));
    handles.push_back(hd);
  }
  for (Handle hd : handles) RETURN_IF_ERROR(client_->Wait(hd));
  if (options_.crash_at_clock != 0 && c + 1 == options_.crash_at_clock && options_.crash_after_push) {
    LOG(ERROR) << "host aggregator: crash point after the push of clock " << c << " was acknowledged";
    _exit(9);
  }
  RETURN_IF_ERROR(client_->Clock());
  handles.clear();
  for (uint32_t t = 0; t < layout_.tensors; ++t) {
    ASSIGN_OR_RETURN(Handle hd, client_->Pull(tensors_[t].name()));
    handles.push_back(hd);
  }
  for (Handle hd : handles) RETURN_IF_ERROR(client_->Wait(hd));
  host::GroupHeader* h = header();
  h->hosts.store(client_->num_workers(), std::memory_order_relaxed);
  h->weights_clock.store(client_->clock(), std::memory_order_release);
  host::FutexWakeAll(&h->worker_bell);
  ++steps_;
  // Departed local ranks no longer count once their last clock is summed.
  for (Local& local : locals_) {
    if (!local.live) local.pid = 0;
  }
  return Status::OK();
}

Status Aggregator::Run() {
  // 1. Every local worker joins (their tensors must agree).
  const auto deadline = SteadyClock::now() + options_.setup_timeout;
  uint32_t admitted = 0;
  while (admitted < options_.local_workers) {
    if (stop_.load()) return CancelledError("stopped before the local workers joined");
    if (SteadyClock::now() > deadline) {
      return DeadlineExceededError("host aggregator: " + std::to_string(admitted) + " of " +
                                   std::to_string(options_.local_workers) +
                                   " local workers joined within the setup timeout");
    }
    PollPending();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!it->joined) {
        ++it;
        continue;
      }
      Status s = CheckJoin(it->join);
      if (s.ok() && tensors_.empty()) {
        tensors_.assign(it->join.tensors().begin(), it->join.tensors().end());
        if (tensors_.empty()) s = InvalidArgumentError("a local worker registered no tensors");
      }
      if (!s.ok()) {
        LOG(ERROR) << "host aggregator: refused a join: " << s.ToString();
        control::LocalMessage e;
        e.mutable_error()->set_message(s.ToString());
        host::SendLocal(it->sock.get(), e).IgnoreError();
        it = pending_.erase(it);
        continue;
      }
      // Admitted once the region exists (after the last join).
      locals_[it->join.local_rank()].live = true;
      locals_[it->join.local_rank()].pid = it->join.pid();
      locals_[it->join.local_rank()].sock = std::move(it->sock);
      ++admitted;
      it = pending_.erase(it);
    }
    if (admitted < options_.local_workers) {
      struct pollfd p = {listen_.get(), POLLIN, 0};
      poll(&p, 1, 10);
    }
  }
  RETURN_IF_ERROR(SetupRegion());
  for (uint32_t l = 0; l < locals_.size(); ++l) {
    Pending p;
    p.sock = std::move(locals_[l].sock);
    p.join.set_local_rank(l);
    p.join.set_pid(locals_[l].pid);
    locals_[l].live = false;
    Status s = Admit(std::move(p), true);
    if (!s.ok()) {
      Fail(s);
      return s;
    }
  }
  Status s = StartCluster();
  if (!s.ok()) {
    Fail(s);
    return s;
  }
  // 2. Steps, until every local worker has left.
  for (;;) {
    if (stop_.load(std::memory_order_relaxed)) break;
    bool done = false;
    s = StepOnce(&done);
    if (s.code() == StatusCode::kCancelled) break;
    if (!s.ok()) {
      LOG(ERROR) << "host aggregator: " << s.ToString();
      Fail(s);
      return s;
    }
    if (done) break;
    // Local workers that (re)joined are admitted at this clock boundary.
    PollPending();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!it->joined) {
        ++it;
        continue;
      }
      Status c = CheckJoin(it->join);
      if (c.ok()) c = Admit(std::move(*it), false);
      if (!c.ok()) {
        LOG(WARNING) << "host aggregator: refused a join: " << c.ToString();
        control::LocalMessage e;
        e.mutable_error()->set_message(c.ToString());
        if (it->sock.valid()) host::SendLocal(it->sock.get(), e).IgnoreError();
      }
      it = pending_.erase(it);
    }
  }
  LOG(INFO) << "host aggregator: every local worker left after " << steps_ << " steps at clock "
            << client_->clock();
  header()->state.store(static_cast<uint32_t>(host::GroupState::kClosed), std::memory_order_release);
  host::FutexWakeAll(&header()->worker_bell);
  return client_->Close();
}

}  // namespace shardps::worker
