#include "worker/host_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include <glog/logging.h>

#include "common/crypto.h"
#include "wire/region_layout.h"
#include "worker/cuda_staging.h"

namespace shardps::worker {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

Status NotInHostMode(const char* call) {
  return UnimplementedError(std::string(call) +
                            " is not available under a host aggregator (SHARDPS_AGGREGATOR): "
                            "run this job flat, every worker joining the coordinator");
}

milliseconds Left(SteadyClock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now()));
}

// Waits up to `timeout` for the first packet, or the end, of a connection just made; true when
// the connection was reset without ever being accepted: a listener that closes drops the
// connections in its backlog with ECONNRESET (an accepted connection that is closed reads EOF,
// or the error its peer sent, instead).
bool ResetBeforeAccept(int sock, milliseconds timeout) {
  const auto deadline = SteadyClock::now() + timeout;
  struct pollfd p = {sock, POLLIN, 0};
  for (;;) {
    const int r = poll(&p, 1, static_cast<int>(Left(deadline).count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0 || (p.revents & POLLERR) == 0) return false;
    int err = 0;
    socklen_t len = sizeof(err);
    // SO_ERROR reads and clears the error: a reset socket is dropped by the caller; any other
    // goes on to ReceiveLocal, which reports its end.
    return getsockopt(sock, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == ECONNRESET;
  }
}

}  // namespace

StatusOr<std::unique_ptr<Client>> HostClient::Connect(const ClientOptions& options) {
  if (options.local_rank < 0) {
    return InvalidArgumentError(
        "a worker under a host aggregator needs its local rank: set ClientOptions.local_rank, "
        "SHARDPS_LOCAL_RANK or LOCAL_RANK");
  }
  std::unique_ptr<HostClient> c(new HostClient(options, static_cast<uint32_t>(options.local_rank)));
  RETURN_IF_ERROR(c->ConnectSocket(options.setup_timeout));
  if (c->local_rank_ >= c->local_workers_) {
    return InvalidArgumentError("local rank " + std::to_string(c->local_rank_) +
                                " is outside the host's " + std::to_string(c->local_workers_) +
                                " local workers (shardps_aggregator --local_workers)");
  }
  LOG(INFO) << "shardps: local rank " << options.local_rank << " joins the host aggregator at "
            << options.aggregator << " (gradients and weights through shared memory)";
  return std::unique_ptr<Client>(std::move(c));
}

HostClient::~HostClient() { Close().IgnoreError(); }

Status HostClient::ConnectSocket(milliseconds timeout) {
  struct sockaddr_un addr;
  socklen_t len;
  RETURN_IF_ERROR(host::MakeUnixAddress(options_.aggregator, &addr, &len));
  const auto deadline = SteadyClock::now() + timeout;
  std::string last = "not tried";
  // The aggregator may start after its workers (a launcher starts them together): retry a
  // missing or refusing socket until the deadline.
  do {
    UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError("host client: socket", errno);
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      // The aggregator greets with the cluster's facts (rank, mode) before anything else.
      const milliseconds wait = std::max(Left(deadline), milliseconds(1000));
      if (ResetBeforeAccept(fd.get(), wait)) {
        // The listening socket of an aggregator that is exiting: the kernel can close a dying
        // process's connections before its listening socket, so a worker that just saw EOF on
        // its connection (Rejoin) can still connect to the dead aggregator's name, and is
        // reset when the listener goes. As good as refused: retry.
        last = "a dying aggregator's socket dropped the connection before accepting it";
        std::this_thread::sleep_for(milliseconds(20));
        continue;
      }
      auto hello = host::ReceiveLocal(fd.get(), milliseconds(0));
      if (!hello.ok()) return hello.status();
      if (hello->has_error()) {
        return FailedPreconditionError("host aggregator refused: " + hello->error().message());
      }
      if (!hello->has_started()) return InvalidArgumentError("host aggregator: expected its greeting");
      TakeFacts(hello->started());
      sock_ = std::move(fd);
      return Status::OK();
    }
    const int err = errno;
    last = std::strerror(err);
    if (err != ENOENT && err != ECONNREFUSED && err != EAGAIN) break;
    std::this_thread::sleep_for(milliseconds(20));
  } while (SteadyClock::now() < deadline);
  return UnavailableError("no host aggregator at " + options_.aggregator + ": " + last +
                          " (start shardps_aggregator --socket=" + options_.aggregator +
                          " on this host)");
}

Status HostClient::RegisterTensor(const std::string& name, float* weights, float* grads,
                                  const std::vector<int64_t>& shape) {
  return RegisterTensor(name, weights, grads, shape, TensorDType::kFloat32);
}

Status HostClient::RegisterTensor(const std::string& name, void* weights, void* grads,
                                  const std::vector<int64_t>& shape, TensorDType dtype) {
  RETURN_IF_ERROR(life_.Require("RegisterTensor()", {ClientState::kJoined}));
  if (weights == nullptr || grads == nullptr || shape.empty()) {
    return InvalidArgumentError("RegisterTensor(" + name + "): null buffer or empty shape");
  }
  if (IsCudaDevicePointer(weights) || IsCudaDevicePointer(grads)) {
    return NotInHostMode("a CUDA tensor");
  }
  if (TensorIndex(name).ok()) return AlreadyExistsError("tensor " + name + " already registered");
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d <= 0) return InvalidArgumentError("RegisterTensor(" + name + "): a dimension <= 0");
    n *= static_cast<uint64_t>(d);
  }
  Tensor t;
  t.name = name;
  t.weights = weights;
  t.grads = grads;
  t.shape = shape;
  t.dtype = static_cast<uint32_t>(dtype);
  if (t.dtype > 2) return InvalidArgumentError("RegisterTensor(" + name + "): unknown dtype");
  t.bytes = n * host::ElemBytes(t.dtype);
  tensors_.push_back(std::move(t));
  return Status::OK();
}

Status HostClient::RegisterEmbedding(const std::string&, int64_t, int64_t, TensorDType,
                                     const EmbeddingOptions&) {
  return NotInHostMode("RegisterEmbedding()");
}
Status HostClient::PullRows(const std::string&, const int64_t*, size_t, void*) {
  return NotInHostMode("PullRows()");
}
Status HostClient::AddRowGradients(const std::string&, const int64_t*, size_t, const void*) {
  return NotInHostMode("AddRowGradients()");
}
StatusOr<uint64_t> HostClient::RequestCheckpoint(const std::string&) {
  return NotInHostMode("RequestCheckpoint()");
}

uint64_t HostClient::barrier_generation() const {
  uint32_t passed = barrier_waiting_ ? barrier_ - 1 : barrier_;
  if (rw_.data() != nullptr) {
    passed = std::max(passed, header()->barrier_released.load(std::memory_order_acquire));
  }
  return passed;
}

void HostClient::ArriveAtBarrier() {
  my_slot()->barrier_arrived.store(barrier_, std::memory_order_release);
  host::FutexWakeAll(&header()->agg_bell);
}

Status HostClient::Barrier(std::chrono::milliseconds timeout) {
  // The host's barrier: this learner arrives in its slot at the cluster's next generation;
  // once every live learner of the host has, the aggregator passes that generation of the
  // cluster's barrier (Client::Barrier, as one worker of the cluster) and publishes it passed.
  // Host barriers are numbered as the cluster's, so a restarted aggregator (whose group starts
  // at the generation the cluster had released when it joined) continues the count.
  RETURN_IF_ERROR(life_.Require("Barrier()", {ClientState::kRunning}));
  if (timeout.count() <= 0) timeout = options_.setup_timeout;
  timeout = std::min<milliseconds>(timeout, std::chrono::hours(24));
  // A call after a timeout waits for the same barrier again (this learner stays arrived).
  if (!barrier_waiting_) {
    barrier_ = std::max(barrier_, header()->barrier_released.load(std::memory_order_acquire)) + 1;
    barrier_waiting_ = true;
    ArriveAtBarrier();
  }
  const auto deadline = SteadyClock::now() + timeout;
  for (uint32_t spins = 0;; ++spins) {
    host::GroupHeader* h = header();
    const uint32_t bell = h->worker_bell.load(std::memory_order_acquire);
    if (h->barrier_released.load(std::memory_order_acquire) >= barrier_) {
      barrier_waiting_ = false;
      return Status::OK();
    }
    // A restarted aggregator has a fresh group; Rejoin arrives there at the same generation
    // (released at once if the cluster released it meanwhile).
    ASSIGN_OR_RETURN(const bool rejoined, RejoinIfGone(spins));
    if (rejoined) continue;
    const milliseconds left = Left(deadline);
    if (left.count() <= 0) {
      return DeadlineExceededError("barrier " + std::to_string(barrier_) +
                                   ": not every worker arrived within " +
                                   std::to_string(timeout.count()) +
                                   " ms (call Barrier again to keep waiting for it)");
    }
    if (spins < 256) continue;
    host::FutexWait(&h->worker_bell, bell, std::min(left, milliseconds(20)));
  }
}
Status HostClient::SetState(const std::string&, StatePart, uint64_t) {
  return NotInHostMode("SetState()");
}

Status HostClient::SetStateValues(const std::string&, StatePart, const float*, uint64_t) {
  return NotInHostMode("SetStateValues()");
}
Status HostClient::SetRows(const std::string&, StatePart, const int64_t*, size_t, const float*,
                           uint64_t) {
  return NotInHostMode("SetRows()");
}
Status HostClient::GetRows(const std::string&, const int64_t*, size_t, float*, float*, float*,
                           RowStateInfo*) {
  return NotInHostMode("GetRows()");
}
StatusOr<std::vector<int64_t>> HostClient::TableKeys(const std::string&) {
  return NotInHostMode("TableKeys()");
}
Status HostClient::GetState(const std::string&, float*, float*, float*, uint64_t*, bool*, bool*) {
  return NotInHostMode("GetState()");
}

Status HostClient::Join(milliseconds timeout, bool initial) {
  const auto deadline = SteadyClock::now() + timeout;
  control::LocalMessage m;
  auto* j = m.mutable_join();
  j->set_local_rank(local_rank_);
  j->set_pid(static_cast<uint32_t>(getpid()));
  j->set_proof(crypto::HmacSha256(options_.cluster_token, host::kJoinProofMessage));
  for (const Tensor& t : tensors_) {
    auto* s = j->add_tensors();
    s->set_name(t.name);
    s->set_dtype(t.dtype);
    for (int64_t d : t.shape) s->add_shape(d);
  }
  RETURN_IF_ERROR(host::SendLocal(sock_.get(), m));
  UniqueFd memfd, weights_fd;
  ASSIGN_OR_RETURN(control::LocalMessage w,
                   host::ReceiveLocal(sock_.get(), Left(deadline), &memfd, &weights_fd));
  if (w.has_error()) return FailedPreconditionError("host aggregator refused: " + w.error().message());
  if (!w.has_welcome() || !memfd.valid() || !weights_fd.valid()) {
    return InvalidArgumentError("host aggregator: expected its welcome and shared memory");
  }
  ASSIGN_OR_RETURN(layout_, host::GroupLayout::FromWelcome(w.welcome(),
                                                           static_cast<uint32_t>(tensors_.size())));
  if (local_rank_ >= layout_.local_workers) {
    return InvalidArgumentError("local rank " + std::to_string(local_rank_) +
                                " is outside the host's " + std::to_string(layout_.local_workers));
  }
  for (size_t t = 0; t < tensors_.size(); ++t) {
    if (layout_.tensor_bytes[t] != tensors_[t].bytes) {
      return InvalidArgumentError("host aggregator: tensor " + tensors_[t].name + " size differs");
    }
  }
  struct stat st, wst;
  const uint64_t weights_bytes = layout_.region_bytes - layout_.weights_offset;
  if (fstat(memfd.get(), &st) != 0 || fstat(weights_fd.get(), &wst) != 0 ||
      static_cast<uint64_t>(st.st_size) < layout_.weights_offset ||
      static_cast<uint64_t>(wst.st_size) < weights_bytes) {
    return InvalidArgumentError("host aggregator: the shared region is smaller than its layout");
  }
  ASSIGN_OR_RETURN(rw_, host::Mapping::Map(memfd.get(), 0, layout_.weights_offset, true));
  ASSIGN_OR_RETURN(ro_, host::Mapping::Map(weights_fd.get(), 0, weights_bytes, false));
  if (header()->magic != host::kGroupMagic || header()->generation != w.welcome().generation()) {
    return InvalidArgumentError("host aggregator: the shared region's header does not match");
  }
  generation_ = header()->generation;
  if (local_rank_ == 0 && initial) {
    // The host's initial weights are local rank 0's (the aggregator takes them from here).
    for (size_t t = 0; t < tensors_.size(); ++t) {
      std::memcpy(rw_.data() + layout_.grad_offset(0, static_cast<uint32_t>(t)),
                  tensors_[t].weights, tensors_[t].bytes);
    }
  }
  control::LocalMessage r;
  r.mutable_ready();
  RETURN_IF_ERROR(host::SendLocal(sock_.get(), r));
  ASSIGN_OR_RETURN(control::LocalMessage s, host::ReceiveLocal(sock_.get(), Left(deadline)));
  if (s.has_error()) return UnavailableError("host aggregator failed to start: " + s.error().message());
  if (!s.has_started()) return InvalidArgumentError("host aggregator: expected started");
  TakeFacts(s.started());
  clock_ = s.started().clock();
  if (header()->weights_clock.load(std::memory_order_acquire) < clock_) {
    return InternalError("host aggregator: started before its weights were pulled");
  }
  if (!options_.host_weights_in_place) {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      std::memcpy(tensors_[t].weights, ro_.data() + layout_.tensor_offset[t], tensors_[t].bytes);
    }
  }
  return Status::OK();
}

Status HostClient::Start() {
  RETURN_IF_ERROR(life_.Require("Start()", {ClientState::kJoined}));
  if (tensors_.empty()) return FailedPreconditionError("Start() before any RegisterTensor()");
  life_.BeginStart();
  Status s = Join(options_.setup_timeout, true);
  if (s.ok()) {
    started_ = true;
    LOG(INFO) << "shardps: worker " << rank() << " of " << num_workers() << " (host "
              << cluster_rank_ << ", local rank " << local_rank_ << " of " << local_workers_
              << ") started at clock " << clock_ << ", " << consistency_ << ", transport "
              << transport_name();
  }
  return life_.FinishStart(std::move(s));
}

StatusOr<bool> HostClient::RejoinIfGone(uint32_t spins) {
  host::GroupHeader* h = header();
  const auto state = static_cast<host::GroupState>(h->state.load(std::memory_order_acquire));
  if (state == host::GroupState::kFailed) {
    return life_.Break(UnavailableError(std::string("the host aggregator failed: ") +
                                        std::string(h->error, strnlen(h->error, sizeof(h->error)))));
  }
  if (state == host::GroupState::kClosed || (spins % 8 == 7 && host::PeerGone(sock_.get()))) {
    RETURN_IF_ERROR(Rejoin());
    return true;
  }
  return false;
}

Status HostClient::Rejoin() {
  // A clock finished here but not published by the dead aggregator may have reached some
  // servers (never twice: the new aggregator starts at the cluster's clock).
  if (my_slot()->clock_done.load(std::memory_order_relaxed) >
      header()->weights_clock.load(std::memory_order_acquire)) {
    ++counters_.pushes_lost;
  }
  LOG(WARNING) << "shardps: local rank " << local_rank_
               << ": the host aggregator is gone; waiting for it to restart at "
               << options_.aggregator;
  rw_ = host::Mapping();
  ro_ = host::Mapping();
  sock_.reset();
  const milliseconds budget =
      options_.failover_timeout.count() > 0 ? options_.failover_timeout : milliseconds(60000);
  const auto since = SteadyClock::now();
  const auto deadline = since + budget;
  Status last;
  while (SteadyClock::now() < deadline) {
    last = ConnectSocket(Left(deadline));
    if (!last.ok()) break;
    last = Join(Left(deadline), false);
    if (last.ok()) {
      ++counters_.reconnects;
      // A barrier this learner had arrived at and not passed: arrive again in the new slot
      // (whichever call noticed the restart, Barrier or a wait for weights).
      if (barrier_waiting_) ArriveAtBarrier();
      LOG(INFO) << "shardps: local rank " << local_rank_ << " rejoined its host aggregator at clock "
                << clock_;
      return Status::OK();
    }
    rw_ = host::Mapping();
    ro_ = host::Mapping();
    sock_.reset();
    if (last.code() != StatusCode::kUnavailable) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  const auto waited = std::chrono::duration_cast<milliseconds>(SteadyClock::now() - since).count();
  return life_.Break(UnavailableError("the host aggregator at " + options_.aggregator +
                                      " died and did not come back (gave up after " +
                                      std::to_string(waited) + " of " +
                                      std::to_string(budget.count()) + " ms): " + last.ToString()));
}

Status HostClient::WaitForWeights(uint64_t c) {
  for (uint32_t spins = 0;; ++spins) {
    host::GroupHeader* h = header();
    const uint32_t bell = h->worker_bell.load(std::memory_order_acquire);
    if (h->weights_clock.load(std::memory_order_acquire) >= c) return Status::OK();
    ASSIGN_OR_RETURN(const bool rejoined, RejoinIfGone(spins));
    if (rejoined) {
      c = std::min(c, clock_);
      continue;
    }
    if (spins < 256) continue;
    // No timeout declares the aggregator dead: its socket does (a busy host deschedules).
    host::FutexWait(&h->worker_bell, bell, milliseconds(20));
  }
}

void HostClient::TakeFacts(const control::LocalStarted& s) {
  cluster_rank_ = s.cluster_rank();
  hosts_ = std::max<uint32_t>(1, s.hosts());
  local_workers_ = std::max<uint32_t>(1, s.local_workers());
  consistency_ = s.consistency();
  cluster_transport_ = s.transport();
}

StatusOr<uint32_t> HostClient::TensorIndex(const std::string& name) const {
  for (uint32_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].name == name) return i;
  }
  return NotFoundError("no tensor named " + name);
}

StatusOr<Handle> HostClient::Push(const std::string& name) {
  RETURN_IF_ERROR(life_.Require("Push()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(uint32_t t, TensorIndex(name));
  // The gradient area of this clock is free once the aggregator summed the clock before.
  RETURN_IF_ERROR(WaitForWeights(clock_));
  const Tensor& x = tensors_[t];
  std::memcpy(rw_.data() + layout_.grad_offset(local_rank_, t), x.grads, x.bytes);
  host::TensorControl* tc = my_control(t);
  tc->lr = x.lr;
  tc->has_rule = x.has_rule ? 1 : 0;
  tc->rule = x.rule;
  tc->no_gradient = x.no_gradient ? 1 : 0;
  tc->pushed_clock = clock_ + 1;
  ++counters_.pushes;
  counters_.bytes_pushed += x.bytes;
  return Handle{next_handle_++};  // done: the gradient is in shared memory
}

StatusOr<Handle> HostClient::Pull(const std::string& name) {
  RETURN_IF_ERROR(life_.Require("Pull()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(uint32_t t, TensorIndex(name));
  const uint64_t h = next_handle_++;
  pending_[h] = Pending{true, t};
  return Handle{h};
}

Status HostClient::Wait(Handle handle) {
  RETURN_IF_ERROR(life_.Require("Wait()", {ClientState::kRunning}));
  auto it = pending_.find(handle.id);
  if (it == pending_.end()) {
    if (handle.id != 0 && handle.id < next_handle_) return Status::OK();  // a push: done
    return NotFoundError("unknown handle " + std::to_string(handle.id));
  }
  const Pending p = it->second;
  pending_.erase(it);
  RETURN_IF_ERROR(WaitForWeights(clock_));
  const Tensor& x = tensors_[p.tensor];
  if (!options_.host_weights_in_place) {
    std::memcpy(x.weights, ro_.data() + layout_.tensor_offset[p.tensor], x.bytes);
  }
  ++counters_.pulls;
  counters_.bytes_pulled += x.bytes;
  return Status::OK();
}

Status HostClient::Clock() {
  RETURN_IF_ERROR(life_.Require("Clock()", {ClientState::kRunning}));
  RETURN_IF_ERROR(WaitForWeights(clock_));
  host::LocalSlot* s = my_slot();
  s->flags = non_finite_ ? layout::kPushNonFinite : 0;
  s->clock_done.store(clock_ + 1, std::memory_order_release);
  host::FutexWakeAll(&header()->agg_bell);
  ++clock_;
  return Status::OK();
}

Status HostClient::Step() {
  RETURN_IF_ERROR(life_.Require("Step()", {ClientState::kRunning}));
  // What Push() sent in this clock is not copied again (Client::Step): the trainer may have
  // reused its gradient buffer since.
  for (uint32_t i = 0; i < tensors_.size(); ++i) {
    if (my_control(i)->pushed_clock == clock_ + 1) continue;
    RETURN_IF_ERROR(Push(tensors_[i].name).status());
  }
  RETURN_IF_ERROR(Clock());
  RETURN_IF_ERROR(WaitForWeights(clock_));
  for (Tensor& t : tensors_) {
    const uint32_t i = static_cast<uint32_t>(&t - tensors_.data());
    if (!options_.host_weights_in_place) {
      std::memcpy(t.weights, ro_.data() + layout_.tensor_offset[i], t.bytes);
    }
    ++counters_.pulls;
    counters_.bytes_pulled += t.bytes;
  }
  return Status::OK();
}

Status HostClient::SetNoGradient(const std::string& tensor, bool no_gradient) {
  // The aggregator marks the host's push when every learner's push of the clock carries it
  // (as a server does for the workers' pushes).
  ASSIGN_OR_RETURN(const uint32_t t, TensorIndex(tensor));
  tensors_[t].no_gradient = no_gradient;
  return Status::OK();
}

Status HostClient::SetLearningRate(const std::string& tensor, float lr) {
  if (!(lr >= 0.0f && lr < 1e6f)) return InvalidArgumentError("SetLearningRate: lr outside [0, 1e6)");
  if (tensor.empty()) {
    for (Tensor& t : tensors_) t.lr = lr;
    return Status::OK();
  }
  ASSIGN_OR_RETURN(uint32_t t, TensorIndex(tensor));
  tensors_[t].lr = lr;
  return Status::OK();
}

Status HostClient::SetUpdateRule(const std::string& tensor, const UpdateRule& rule) {
  if (tensor.empty()) {
    for (Tensor& t : tensors_) t.rule = rule, t.has_rule = true;
    return Status::OK();
  }
  ASSIGN_OR_RETURN(uint32_t t, TensorIndex(tensor));
  tensors_[t].rule = rule;
  tensors_[t].has_rule = true;
  return Status::OK();
}

uint32_t HostClient::rank() const { return cluster_rank_ * local_workers_ + local_rank_; }

uint32_t HostClient::num_workers() const {
  uint32_t hosts = hosts_;
  if (rw_.data() != nullptr) hosts = std::max<uint32_t>(1, header()->hosts.load(std::memory_order_relaxed));
  return hosts * local_workers_;
}

std::string HostClient::transport_name() const {
  return cluster_transport_.empty() ? "host" : "host+" + cluster_transport_;
}

StatusOr<TensorPath> HostClient::tensor_path(const std::string& name) const {
  RETURN_IF_ERROR(TensorIndex(name).status());
  return TensorPath::kHost;
}

StatusOr<const void*> HostClient::WeightsView(const std::string& name) const {
  RETURN_IF_ERROR(life_.Require("WeightsView()", {ClientState::kRunning}));
  ASSIGN_OR_RETURN(uint32_t t, TensorIndex(name));
  return static_cast<const void*>(ro_.data() + layout_.tensor_offset[t]);
}

Status HostClient::Close() {
  if (!life_.Close()) return Status::OK();
  sock_.reset();  // the aggregator sees EOF: this worker left
  rw_ = host::Mapping();
  ro_ = host::Mapping();
  pending_.clear();
  return Status::OK();
}

}  // namespace shardps::worker
