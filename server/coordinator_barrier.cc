// The coordinator's barrier (Client::Barrier; docs/control-protocol.md, "Barrier"): workers
// arrive with a generation, and each is released once every live worker has arrived at its
// generation or later. Loop thread only, as all of the coordinator's state.
#include <algorithm>
#include <limits>

#include <glog/logging.h>

#include "server/coordinator.h"
#include "server/coordinator_conn.h"

namespace shardps::control {

void Coordinator::HandleBarrier(Conn* c, const Barrier& b) {
  // A generation counts this worker's barriers: 1, 2, ... Far beyond any job's count is a
  // protocol error, not a number to wait for.
  if (b.generation() == 0 || b.generation() >= (uint64_t{1} << 40)) {
    Close(c, "barrier generation " + std::to_string(b.generation()) + " out of range", true);
    return;
  }
  uint64_t& arrived = barrier_arrived_[c->member.member_id()];
  // An older generation is a repeat after a rejoin that this coordinator already knows of.
  if (b.generation() <= arrived) {
    // Already released from it: a repeat (after a rejoin) may have lost the release; send it
    // again (a worker ignores releases of generations it is not waiting for).
    if (b.generation() <= barrier_released_[c->member.member_id()]) {
      Envelope e;
      e.mutable_barrier_release()->set_generation(b.generation());  // workers: 0, a repeat
      Queue(c, e);
    }
    return;
  }
  arrived = b.generation();
  VLOG(1) << "coordinator: worker member " << c->member.member_id() << " at barrier "
          << arrived;
  MaybeReleaseBarriers();
}

void Coordinator::MaybeReleaseBarriers() {
  // Not before every expected worker has been there at once: a barrier called before the
  // others joined must wait for them.
  if (most_workers_ < std::max<uint32_t>(1, options_.config.num_workers())) return;
  // The lowest generation over the live workers: those connected, and those of a restarted
  // coordinator's saved state that have not rejoined yet (pending_: they count as not arrived).
  uint64_t lowest = std::numeric_limits<uint64_t>::max();
  uint32_t live = 0;
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing || c->member.role() != ROLE_WORKER) continue;
    ++live;
    auto it = barrier_arrived_.find(c->member.member_id());
    lowest = std::min(lowest, it == barrier_arrived_.end() ? 0 : it->second);
  }
  for (const auto& [id, p] : pending_) {
    if (p.member.role() == ROLE_WORKER) lowest = 0;
  }
  if (live == 0 || lowest == 0) return;
  for (auto& [fd, c] : conns_) {
    if (!c->joined || c->closing || c->member.role() != ROLE_WORKER) continue;
    const uint32_t id = c->member.member_id();
    const uint64_t arrived = barrier_arrived_[id];
    uint64_t& released = barrier_released_[id];
    if (arrived <= released || arrived > lowest) continue;
    released = arrived;
    if (arrived > barrier_generation_) {
      barrier_generation_ = arrived;
      dirty_ = true;  // saved: a worker joining after a restart counts on from it
    }
    Envelope e;
    e.mutable_barrier_release()->set_generation(arrived);
    e.mutable_barrier_release()->set_workers(live);
    Queue(c.get(), e);
    {
      MutexLock l(&mu_);
      ++counters_.barriers_released;
    }
  }
}

}  // namespace shardps::control
