// The client's sessions with its servers: one per shard group, each the endpoint to the server
// process serving the group now, its regions and layout, and the endpoint generation (a
// reconnect or failover makes a new generation; completions of older endpoints are dropped).
// It owns the completion queue all endpoints share and the staging region (push headers,
// header reads, hello, acks and clock buffers), connects and says hello, and polls: setup and
// acks reads are accounted here, push and pull completions go to the CompletionSink.
//
// Thread safety: none. Owned by the client; called from the client's (trainer's) thread only,
// which is also the one polling thread of the completion queue (transport.h).
#ifndef SHARDPS_WORKER_SERVER_SESSIONS_H_
#define SHARDPS_WORKER_SERVER_SESSIONS_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "proto/control_client.h"
#include "shardps/client.h"
#include "transport/transport.h"
#include "wire/region_layout.h"
#include "worker/data_path.h"

namespace shardps::worker {

struct ServerSession {
  uint32_t rank = 0;       // the shard group
  uint32_t member_id = 0;  // the server process serving it now
  uint32_t server_rank = 0;
  uint32_t gen = 0;     // endpoint generation: completions of older endpoints are stale
  bool failed = false;  // its endpoint failed: waiting for a reconnect or failover
  std::string address;
  std::string peer_key;  // proves this worker to that server (ServerEntry.peer_key)
  transport::RegionDescriptor weights, inbox, acks, clocks;
  transport::RegionDescriptor outbox;  // kGetState answers
  std::unique_ptr<layout::ServerLayout> layout;
  std::unique_ptr<transport::Endpoint> ep;
  std::vector<uint32_t> chunk_of_slot;
  // The acks read posted behind a push (PostAcksAhead): in flight, and landed unread.
  bool ahead_in_flight = false;
  bool ahead_ready = false;
};

// Receives the completions of push and pull operations on current endpoints. `err` is the
// operation's error (OK when it succeeded), naming the server.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void OnPushCompletion(uint32_t chunk, uint64_t handle, const Status& err) = 0;
  virtual void OnPullCompletion(uint32_t chunk, uint64_t handle, const Status& err) = 0;
  virtual void OnRowsCompletion(uint32_t /*chunk*/, uint64_t /*handle*/, const Status& /*err*/) {}
};

class ServerSessions {
 public:
  ServerSessions(const ClientOptions& options, transport::Fabric& fabric,
                 control::ControlClient& control, uint32_t rank, CompletionSink& sink)
      : options_(options), fabric_(fabric), control_(control), rank_(rank), sink_(sink) {}

  // Start: one session per server of the shard map, with the slots of `chunks`; then the
  // staging region with `extra_bytes` at the end for the caller (returns their offset).
  Status Configure(const control::ShardMap& map, const std::vector<ChunkPlacement>& chunks);
  StatusOr<uint64_t> AllocateStaging(uint64_t extra_bytes);
  // Start: connects to every server (hello with `clock`). A server that cannot be reached
  // leaves its session failed (AnyFailed()) for the caller to recover.
  Status ConnectAll(uint64_t clock);
  // Connects (a new endpoint generation) and says hello, within `timeout` (0: the setup bound).
  // A refused connection fails at once (transport::EndpointOptions::retry_refused = false):
  // every server in a shard map was listening before the map was published, so refused means
  // it died, and its group's failover (or loss) is the coordinator's to say.
  Status Connect(uint32_t server, uint64_t clock,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Takes the shard map's entry of a session's group (a failover names another server).
  Status ApplyEntry(const control::ServerEntry& se, uint32_t server);

  size_t size() const { return servers_.size(); }
  ServerSession& at(uint32_t server) { return servers_[server]; }
  const ServerSession& at(uint32_t server) const { return servers_[server]; }
  uint64_t map_epoch() const { return map_epoch_; }
  void set_map_epoch(uint64_t e) { map_epoch_ = e; }
  // Marks the sessions whose endpoint is in the error state failed; true if any is failed.
  bool MarkFailed();
  bool AnyFailed() const;
  // Marks failed every session whose server process is not in `m` any more (declared dead: a
  // stopped or cut-off server's endpoint may look healthy for ever). True if any is failed.
  bool MarkDeparted(const control::Membership& m);
  // UNAVAILABLE naming the server, `what` and its endpoint's error.
  Status ServerError(uint32_t server, const std::string& what) const;

  // Staging: which = 0, 1: push headers of parity 0, 1; 2, 3: the two header reads of a pull.
  transport::MemoryRegion* staging() const { return staging_.get(); }
  char* StagingAt(uint64_t offset) const { return static_cast<char*>(staging_->data()) + offset; }
  uint64_t ChunkStagingOffset(uint32_t chunk, int which) const {
    return static_cast<uint64_t>(chunk) * kStagingPerChunk + which * kStagingSlot;
  }
  char* ChunkStaging(uint32_t chunk, int which) const {
    return StagingAt(ChunkStagingOffset(chunk, which));
  }
  // This worker's acks of a server, as last read by ReadAcks.
  const uint64_t* Acks(uint32_t server) const {
    return reinterpret_cast<const uint64_t*>(StagingAt(AcksOffset(server)));
  }

  // This worker's acks of a server as read by the last PostAcksAhead read, once it has landed
  // and if nothing has been posted into its staging since: null otherwise. The caller takes it
  // (the next call returns null until another read lands).
  const uint64_t* TakeAcksAhead(uint32_t server);
  // Reads this worker's acks of a server behind the operations just posted to it (in order on
  // the endpoint: it executes after them), into a staging of its own, with `flags` (kMore: sent
  // with the next post or poll), unless one is in flight. A push's inbox slot needs the push two
  // before it acknowledged; read behind the previous push, that answer is usually there when the
  // next push asks (PushPipeline::EnsureAcked), instead of a round trip of its own. Best
  // effort: no credit, no read.
  void PostAcksAhead(uint32_t server, uint32_t flags);
  bool acks_ahead_in_flight(uint32_t server) const { return servers_[server].ahead_in_flight; }

  // Posts, retrying while the send queue is full (polling returns credits), within the wait
  // bound.
  Status PostWithCredit(const std::function<Status()>& post);
  // Polls the completion queue once and dispatches what it finds.
  Status Progress();
  // One pass of a waiting loop: Progress when `max_sleep` is 0, else a sleep of at most
  // `max_sleep` on the completion queue's event, dispatching what wakes it (IdleClock says
  // which).
  Status ProgressOrSleep(std::chrono::microseconds max_sleep);
  // Setup operations (context kOpSetup): BeginSetupOps() before the first of a batch is
  // posted, then WaitSetupOps(count) polls until `count` of them completed (their first
  // error), within `timeout`. Completions reaped while posting (PostWithCredit waiting for a
  // credit) count: a batch larger than the send depth has them. Post them with
  // setup_context(): a completion of an earlier batch (one that WaitSetupOps left on its first
  // error, still in flight on a healthy server) is then not counted in this one.
  void BeginSetupOps();
  uint64_t setup_context(uint32_t chunk) const { return MakeContext(kOpSetup, chunk, setup_gen_); }
  Status WaitSetupOps(int count, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Reads this worker's acks from a server into Acks(server) (context: chunk) and waits for
  // the read until `deadline` (then returns timeout_error()). With stop_if_failed, returns OK early
  // when the session fails meanwhile: the caller checks at(server).failed.
  Status ReadAcks(uint32_t server, uint32_t chunk, std::chrono::steady_clock::time_point deadline,
                  const std::function<Status()>& timeout_error, bool stop_if_failed);
  // Reads this worker's acks from several servers at once (one read each, all in flight
  // together) and waits for all of them until `deadline`. Returns OK early once any of them
  // fails meanwhile (an error completion, or the membership declaring it departed: a stopped
  // server answers never); the caller checks at(server).failed first and recovers. The reads
  // still in flight then are abandoned: their completions are not counted in a later wait.
  Status ReadAcks(const std::vector<uint32_t>& servers,
                  std::chrono::steady_clock::time_point deadline,
                  const std::function<Status()>& timeout_error);
  // Reads chunk header `slot` of a server into ChunkStaging(chunk, 2) and waits for it.
  Status ReadHeader(uint32_t server, uint32_t slot, uint32_t chunk,
                    std::chrono::steady_clock::time_point deadline,
                    const std::function<Status()>& timeout_error);
  // Reads `bytes` at `offset` of a server's outbox into `local` and waits for it.
  Status ReadOutbox(uint32_t server, uint64_t offset, uint64_t bytes,
                    const transport::LocalSlice& local,
                    std::chrono::steady_clock::time_point deadline,
                    const std::function<Status()>& timeout_error);
  // Writes `clock` into this worker's clock slot on a server (unsignaled, with an immediate).
  Status SendClock(uint32_t server, uint64_t clock);
  // Close: drops every endpoint.
  void Disconnect();

  // What the waits on one-sided reads (acks, headers) run at most every 50 ms: it marks failed
  // the servers the membership says departed while their endpoints still look healthy (a
  // stopped or cut-off server answers nothing and closes nothing). Set by the client
  // (Recovery::NoteDepartures); a wait whose server it fails returns for the caller to recover.
  void set_departure_check(std::function<void()> check) { departure_check_ = std::move(check); }
  // Runs the check if 50 ms have passed since it last ran.
  void CheckDepartures();

 private:
  uint64_t AcksOffset(uint32_t server) const;
  void OnCompletion(const transport::Completion& wc);
  // Starts a wait on one-sided reads (ReadAcks, ReadHeader, ReadOutbox): `reads` of them,
  // posted with AcksContext(). A completion of an earlier wait (one that returned early on a
  // failed server, its other reads still in flight) is then not counted in this one.
  void BeginReads(int reads);
  uint64_t AcksContext(uint32_t chunk) const { return MakeContext(kOpAcks, chunk, acks_gen_); }
  // Waits for the reads of the current wait (acks_pending_): their first error, OK, or
  // timeout_error() past `deadline`. With `stop` set, the membership is checked every 50 ms
  // (CheckDepartures) and the wait returns OK once stop() is true. Returning with reads still
  // in flight (stopped, timed out), it retires the wait's generation.
  Status AwaitRead(std::chrono::steady_clock::time_point deadline,
                   const std::function<Status()>& timeout_error,
                   const std::function<bool()>& stop);

  const ClientOptions& options_;
  transport::Fabric& fabric_;
  control::ControlClient& control_;
  const uint32_t rank_;
  CompletionSink& sink_;
  // In dependency order: the endpoints (in servers_) are destroyed before the completion queue
  // they post to and the staging region they read from.
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<transport::MemoryRegion> staging_;
  std::vector<ServerSession> servers_;
  size_t num_chunks_ = 0;
  uint64_t map_epoch_ = 0;
  uint64_t acks_staging_offset_ = 0;
  uint64_t acks_area_bytes_ = 0;  // every server's acks buffer; the acks-ahead copies follow
  uint64_t clock_staging_offset_ = 0;  // one u64 per server: the clock value written
  int setup_done_ = 0;
  uint32_t setup_gen_ = 0;  // the batch BeginSetupOps began (context handle of its posts)
  Status setup_error_;
  int acks_pending_ = 0;
  uint32_t acks_gen_ = 0;  // the wait BeginReads began (context handle of its reads)
  Status read_error_;      // the first error of the current read wait
  std::function<void()> departure_check_;
  std::chrono::steady_clock::time_point next_departure_check_{};
};

// The busy-poll budget of one waiting loop (ClientOptions::busy_poll): the loop polls until it
// has gone busy_poll without progress of its own (its handle's chunks, its row lists: not the
// header re-reads it makes while it waits), then may sleep. Thread safety: the loop's thread.
class IdleClock {
 public:
  explicit IdleClock(std::chrono::microseconds busy_poll)
      : busy_poll_(busy_poll), last_(std::chrono::steady_clock::now()) {}
  // The loop's own progress: poll again for busy_poll before sleeping.
  void Progressed() { last_ = std::chrono::steady_clock::now(); }
  // Whether the loop may sleep now: busy_poll has passed since its last progress (never when
  // busy_poll is negative).
  bool Idle() const {
    return busy_poll_.count() >= 0 && std::chrono::steady_clock::now() - last_ >= busy_poll_;
  }

 private:
  const std::chrono::microseconds busy_poll_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_SERVER_SESSIONS_H_
