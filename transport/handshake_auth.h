// Data-path authentication, the same for every provider (docs/security.md): before a listener
// hands a connection anything (regions, memfds, queue-pair numbers, completions), the peer
// proves with a challenge-response that it holds the key of the identity it claims, and the
// listener proves the same key back. The transport knows nothing of what an identity means:
// it is opaque bytes; an Authenticator (the server's, from the membership credentials) maps a
// claimed identity to the key it must prove.
//
// Wire (fixed sizes, host byte order like the rest of the data-path wire; one message per send,
// so that SOCK_SEQPACKET and SOCK_STREAM sockets carry it alike):
//
//   acceptor  -> connector   Challenge { magic "SPAU", version, flags, nonce_a[32] }
//   connector -> acceptor    Response  { magic, version, identity_len, identity[64],
//                                        nonce_c[32], proof_c[32] }
//   acceptor  -> connector   Verdict   { magic, version, accepted, proof_a[32] }
//
//   proof_c = HMAC-SHA256(key, "shardps-auth-v1|connector|" flags nonce_a nonce_c identity)
//   proof_a = HMAC-SHA256(key, "shardps-auth-v1|acceptor|"  flags nonce_a nonce_c identity)
//   session = HMAC-SHA256(key, "shardps-session-v1|"        flags nonce_a nonce_c identity)
//
// flags (2 bytes, as sent) are in every MAC, so a man in the middle cannot strip what the
// acceptor asks for (e.g. kFlagTcpTls) without both proofs failing. `session` is a fresh
// per-connection secret both sides know afterwards (the tcp provider keys TLS with it).
//
// Both nonces are fresh from the CSPRNG, so neither proof can be replayed. A refusal is one
// Verdict{accepted = 0} whatever the reason (unknown identity, wrong proof, malformed), so the
// wire is no oracle; the reason is logged at the listener. A listener without an Authenticator
// sets no "required" flag, and a connector that holds a key refuses such a listener (nobody can
// pose as an authenticated server by skipping the check).
//
// The acceptor side (HandshakeGate) never blocks on a peer: it multiplexes every accepted
// connection that has not yet answered, each with its own deadline, and evicts the oldest
// when a source or the whole listener holds too many. A silent or slow stranger therefore costs
// the thread calling Listener::Accept nothing but a poll(2).
#ifndef SHARDPS_TRANSPORT_HANDSHAKE_AUTH_H_
#define SHARDPS_TRANSPORT_HANDSHAKE_AUTH_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "common/status.h"

namespace shardps::transport {

// Maps the identity a connecting peer claims to the key it must prove. Thread-safe: a listener
// calls it from the thread that calls Accept.
class Authenticator {
 public:
  virtual ~Authenticator() = default;
  // The key for `identity`, or an error saying why such a peer is refused (logged locally,
  // never sent).
  virtual StatusOr<std::string> KeyFor(std::string_view identity) const = 0;
};

namespace auth {

inline constexpr uint32_t kMagic = 0x55415053;  // "SPAU" on the wire
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;
inline constexpr size_t kMaxIdentity = 64;
inline constexpr uint16_t kFlagRequired = 1;  // the acceptor requires a proof
inline constexpr uint16_t kFlagTcpTls = 2;    // the tcp acceptor requires TLS after this

struct Challenge {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
  uint8_t nonce[kNonceBytes];
};
struct Response {
  uint32_t magic;
  uint16_t version;
  uint16_t identity_len;
  char identity[kMaxIdentity];
  uint8_t nonce[kNonceBytes];
  uint8_t proof[kProofBytes];
};
struct Verdict {
  uint32_t magic;
  uint16_t version;
  uint16_t accepted;
  uint8_t proof[kProofBytes];
};
static_assert(sizeof(Challenge) == 40 && sizeof(Response) == 136 && sizeof(Verdict) == 40);

// The two proofs and the session secret of the transcript above.
std::string ConnectorProof(std::string_view key, uint16_t flags, std::string_view nonce_a,
                           std::string_view nonce_c, std::string_view identity);
std::string AcceptorProof(std::string_view key, uint16_t flags, std::string_view nonce_a,
                          std::string_view nonce_c, std::string_view identity);
std::string SessionSecret(std::string_view key, uint16_t flags, std::string_view nonce_a,
                          std::string_view nonce_c, std::string_view identity);

// What the connector learned.
struct Outcome {
  uint16_t flags = 0;          // the acceptor's challenge flags (authenticated when keyed)
  std::string session_secret;  // "" without a key
};

// The connector's side, blocking until the deadline: reads the challenge, answers as
// `identity` with `key`, reads the verdict and checks the acceptor's proof. An empty key
// connects only to a listener that requires nothing. Errors: PERMISSION_DENIED when either side
// refuses the other, DEADLINE_EXCEEDED / UNAVAILABLE from the socket.
Status ConnectorHandshake(int fd, std::string_view identity, std::string_view key,
                          std::chrono::steady_clock::time_point deadline,
                          Outcome* outcome = nullptr);

}  // namespace auth

// The acceptor's side: the connections a listener accepted that have not yet proved who they
// are. Owned by the listener, hence by the one thread that calls its Accept.
class HandshakeGate {
 public:
  struct Limits {
    size_t max_pending = 64;             // unauthenticated connections held, in total
    size_t max_pending_per_source = 8;   // ... from one source (an IP, or a uid for shm)
    std::chrono::milliseconds timeout{5000};  // to answer the challenge
  };
  // A connection the provider accepted: the socket (non-blocking) and who it comes from.
  struct Accepted {
    UniqueFd fd;  // invalid: nothing is waiting
    std::string source;
  };
  // A connection that proved its identity ("" when the listener has no Authenticator).
  struct Passed {
    UniqueFd fd;
    std::string identity;
    std::string source;
    std::string session_secret;  // auth::SessionSecret; "" without an Authenticator
  };
  struct Stats {
    uint64_t passed = 0;
    uint64_t refused = 0;    // a wrong or unknown credential, or a malformed answer
    uint64_t evicted = 0;    // dropped to make room (per-source or total limit)
    uint64_t timed_out = 0;  // silent past Limits::timeout
    uint64_t closed = 0;     // the peer hung up before answering
    uint64_t accept_errors = 0;  // accept(2) out of resources (EMFILE, ENFILE, ENOBUFS...)
  };
  // Newcomers accepted per Next call at most (a connect flood cannot hold the caller).
  static constexpr int kMaxAcceptsPerCall = 16;
  // Accepts one waiting connection without blocking; an invalid fd when none waits. Errors:
  // PERMISSION_DENIED refuses that connection (e.g. shm's uid check; counted, and returned by
  // Next when nothing passed), RESOURCE_EXHAUSTED is a transient accept(2) failure (EMFILE:
  // counted, logged sparingly, pending connections go on), anything else a broken listener.
  using AcceptFn = std::function<StatusOr<Accepted>()>;

  // extra_flags: provider bits the challenge carries (auth::kFlagTcpTls).
  HandshakeGate(std::string where, Limits limits, uint16_t extra_flags = 0);
  HandshakeGate(const HandshakeGate&) = delete;
  HandshakeGate& operator=(const HandshakeGate&) = delete;

  // Advances every pending handshake first, then accepts up to kMaxAcceptsPerCall newcomers,
  // and returns the first connection that passes, or an error: DEADLINE_EXCEEDED when none
  // passed by the deadline, PERMISSION_DENIED for a refused peer (the caller may simply call
  // again). Never waits on a single peer: poll(2) over all of them until the deadline.
  StatusOr<Passed> Next(int listen_fd, const AcceptFn& accept_one, const Authenticator* auth,
                        std::chrono::steady_clock::time_point deadline);

  const Stats& stats() const { return stats_; }
  size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    UniqueFd fd;
    std::string source;
    std::string nonce;
    std::chrono::steady_clock::time_point expires;
    uint16_t flags = 0;  // as sent in the challenge
    size_t have = 0;
    auth::Response response;
  };
  void Admit(Accepted a, const Authenticator* auth);
  // Reads what p's peer sent. Returns true when p is finished (passed, refused or dropped);
  // *out holds the result for passed or refused ones.
  bool Advance(Pending* p, const Authenticator* auth, StatusOr<Passed>* out);
  void Expire(std::chrono::steady_clock::time_point now);

  const std::string where_;
  const Limits limits_;
  const uint16_t extra_flags_;
  std::deque<Pending> pending_;           // oldest first
  std::deque<StatusOr<Passed>> ready_;    // finished (passed or refused), not yet returned
  Stats stats_;
};

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_HANDSHAKE_AUTH_H_
