#include "transport/handshake_auth.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <glog/logging.h>

#include "common/crypto.h"
#include "common/net.h"

namespace shardps::transport {
namespace auth {
namespace {

std::string Transcript(std::string_view label, uint16_t flags, std::string_view nonce_a,
                       std::string_view nonce_c, std::string_view identity) {
  std::string m(label);
  m.push_back('|');
  m.append(reinterpret_cast<const char*>(&flags), sizeof(flags));
  m.append(nonce_a);
  m.append(nonce_c);
  m.append(identity);
  return m;
}

}  // namespace

std::string ConnectorProof(std::string_view key, uint16_t flags, std::string_view nonce_a,
                           std::string_view nonce_c, std::string_view identity) {
  return crypto::HmacSha256(
      key, Transcript("shardps-auth-v1|connector", flags, nonce_a, nonce_c, identity));
}

std::string AcceptorProof(std::string_view key, uint16_t flags, std::string_view nonce_a,
                          std::string_view nonce_c, std::string_view identity) {
  return crypto::HmacSha256(
      key, Transcript("shardps-auth-v1|acceptor", flags, nonce_a, nonce_c, identity));
}

std::string SessionSecret(std::string_view key, uint16_t flags, std::string_view nonce_a,
                          std::string_view nonce_c, std::string_view identity) {
  return crypto::HmacSha256(key,
                            Transcript("shardps-session-v1", flags, nonce_a, nonce_c, identity));
}

Status ConnectorHandshake(int fd, std::string_view identity, std::string_view key,
                          std::chrono::steady_clock::time_point deadline, Outcome* outcome) {
  if (identity.size() > kMaxIdentity) {
    return InvalidArgumentError("authentication: identity longer than " +
                                std::to_string(kMaxIdentity) + " bytes");
  }
  Challenge c{};
  RETURN_IF_ERROR(net::RecvAll(fd, &c, sizeof(c), deadline, "authentication: the challenge"));
  if (c.magic != kMagic || c.version != kVersion) {
    return FailedPreconditionError(
        "authentication: the listener sent no ShardPS challenge (a foreign or older peer)");
  }
  const bool required = (c.flags & kFlagRequired) != 0;
  if (!key.empty() && !required) {
    return PermissionDeniedError(
        "authentication: the listener does not authenticate itself, but this side holds a key "
        "for it; refusing (something other than the named server may be listening there)");
  }
  ASSIGN_OR_RETURN(std::string nonce_c, crypto::RandomBytes(kNonceBytes));
  const std::string nonce_a(reinterpret_cast<const char*>(c.nonce), kNonceBytes);
  Response r{};
  r.magic = kMagic;
  r.version = kVersion;
  r.identity_len = static_cast<uint16_t>(identity.size());
  std::memcpy(r.identity, identity.data(), identity.size());
  std::memcpy(r.nonce, nonce_c.data(), kNonceBytes);
  if (!key.empty()) {
    const std::string proof = ConnectorProof(key, c.flags, nonce_a, nonce_c, identity);
    std::memcpy(r.proof, proof.data(), kProofBytes);
  }
  RETURN_IF_ERROR(net::SendAll(fd, &r, sizeof(r), deadline, "authentication: the answer"));
  Verdict v{};
  RETURN_IF_ERROR(net::RecvAll(fd, &v, sizeof(v), deadline, "authentication: the verdict"));
  if (v.magic != kMagic || v.version != kVersion) {
    return FailedPreconditionError("authentication: malformed verdict from the listener");
  }
  if (v.accepted != 1) {
    return PermissionDeniedError(
        key.empty() ? "authentication: the listener requires a credential and this side has "
                      "none (a worker needs the peer keys of the coordinator's shard map)"
                    : "authentication: the listener refused this side's credential");
  }
  if (!key.empty()) {
    const std::string want = AcceptorProof(key, c.flags, nonce_a, nonce_c, identity);
    if (!crypto::ConstantTimeEquals(
            want, std::string_view(reinterpret_cast<const char*>(v.proof), kProofBytes))) {
      return PermissionDeniedError(
          "authentication: the listener could not prove the shared key: it is not the server "
          "the coordinator named");
    }
  }
  if (outcome != nullptr) {
    outcome->flags = c.flags;
    outcome->session_secret =
        key.empty() ? std::string() : SessionSecret(key, c.flags, nonce_a, nonce_c, identity);
  }
  return Status::OK();
}

}  // namespace auth

namespace {

// An identity for a log line: printable ASCII kept, anything else as '?'.
std::string Printable(std::string_view s) {
  std::string out(s);
  for (char& ch : out) {
    if (ch < 0x20 || ch > 0x7e) ch = '?';
  }
  return out;
}

// Logs are rate-limited to the first event and then each power of two.
bool CrossedPowerOfTwo(uint64_t before, uint64_t after) {
  for (uint64_t p = 1; p != 0 && p <= after; p <<= 1) {
    if (p > before) return true;
  }
  return false;
}

}  // namespace

HandshakeGate::HandshakeGate(std::string where, Limits limits, uint16_t extra_flags)
    : where_(std::move(where)), limits_(limits), extra_flags_(extra_flags) {}

void HandshakeGate::Admit(Accepted a, const Authenticator* auth) {
  // Room first: the oldest pending connection of this source, else the oldest of all, goes.
  // Before one goes it is read once more: a member whose answer has arrived passes instead of
  // being evicted, so a flood must evict a member in the microseconds between its challenge
  // and its answer, not in the time until the next Accept.
  const uint64_t evicted_before = stats_.evicted;
  for (;;) {
    size_t from_source = 0;
    for (const Pending& p : pending_) from_source += p.source == a.source ? 1 : 0;
    std::deque<Pending>::iterator victim;
    if (from_source >= limits_.max_pending_per_source) {
      victim = std::find_if(pending_.begin(), pending_.end(),
                            [&](const Pending& p) { return p.source == a.source; });
    } else if (pending_.size() >= limits_.max_pending) {
      victim = pending_.begin();
    } else {
      break;
    }
    StatusOr<Passed> out = DeadlineExceededError("");
    if (Advance(&*victim, auth, &out)) {
      if (out.ok() || out.status().code() == StatusCode::kPermissionDenied) {
        ready_.push_back(std::move(out));
      }
    } else {
      ++stats_.evicted;
    }
    pending_.erase(victim);
  }
  if (CrossedPowerOfTwo(evicted_before, stats_.evicted)) {
    LOG(WARNING) << where_ << ": " << stats_.evicted
                 << " unauthenticated connection(s) evicted so far (limits: "
                 << limits_.max_pending_per_source << " per source, " << limits_.max_pending
                 << " in total); the latest for room for one from " << a.source;
  }
  auto nonce = crypto::RandomBytes(auth::kNonceBytes);
  if (!nonce.ok()) {
    LOG(ERROR) << where_ << ": no randomness for a challenge: " << nonce.status();
    return;
  }
  auth::Challenge c{};
  c.magic = auth::kMagic;
  c.version = auth::kVersion;
  c.flags = static_cast<uint16_t>((auth != nullptr ? auth::kFlagRequired : 0) | extra_flags_);
  std::memcpy(c.nonce, nonce->data(), auth::kNonceBytes);
  // A fresh socket's send buffer always has room for 40 bytes; anything else is a dead peer.
  if (send(a.fd.get(), &c, sizeof(c), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(c))) {
    ++stats_.closed;
    return;
  }
  Pending p;
  p.fd = std::move(a.fd);
  p.source = std::move(a.source);
  p.nonce = std::move(*nonce);
  p.flags = c.flags;
  p.expires = std::chrono::steady_clock::now() + limits_.timeout;
  pending_.push_back(std::move(p));
}

bool HandshakeGate::Advance(Pending* p, const Authenticator* auth, StatusOr<Passed>* out) {
  for (;;) {
    char* into = reinterpret_cast<char*>(&p->response) + p->have;
    const ssize_t n = recv(p->fd.get(), into, sizeof(p->response) - p->have, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n <= 0) {
      ++stats_.closed;
      return true;
    }
    p->have += static_cast<size_t>(n);
    if (p->have == sizeof(p->response)) break;
  }
  const auth::Response& r = p->response;
  std::string why;
  std::string identity;
  std::string key;
  if (r.magic != auth::kMagic || r.version != auth::kVersion ||
      r.identity_len > auth::kMaxIdentity) {
    why = "a malformed answer to the challenge";
  } else {
    identity.assign(r.identity, r.identity_len);
    if (auth != nullptr) {
      auto k = auth->KeyFor(identity);
      if (!k.ok()) {
        why = "identity '" + Printable(identity) + "': " + std::string(k.status().message());
      } else {
        key = std::move(*k);
        const std::string nonce_c(reinterpret_cast<const char*>(r.nonce), auth::kNonceBytes);
        const std::string want = auth::ConnectorProof(key, p->flags, p->nonce, nonce_c, identity);
        if (!crypto::ConstantTimeEquals(
                want, std::string_view(reinterpret_cast<const char*>(r.proof), auth::kProofBytes))) {
          why = "identity '" + Printable(identity) + "': the proof does not verify";
        }
      }
    }
  }
  auth::Verdict v{};
  v.magic = auth::kMagic;
  v.version = auth::kVersion;
  v.accepted = why.empty() ? 1 : 0;
  if (why.empty() && auth != nullptr) {
    const std::string nonce_c(reinterpret_cast<const char*>(r.nonce), auth::kNonceBytes);
    const std::string proof = auth::AcceptorProof(key, p->flags, p->nonce, nonce_c, identity);
    std::memcpy(v.proof, proof.data(), auth::kProofBytes);
  }
  const bool sent =
      send(p->fd.get(), &v, sizeof(v), MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(v));
  if (!why.empty()) {
    ++stats_.refused;
    *out = PermissionDeniedError(where_ + ": refused a connection from " + p->source + ": " + why);
    return true;
  }
  if (!sent) {
    ++stats_.closed;
    return true;
  }
  ++stats_.passed;
  std::string session;
  if (auth != nullptr) {
    const std::string nonce_c(reinterpret_cast<const char*>(r.nonce), auth::kNonceBytes);
    session = auth::SessionSecret(key, p->flags, p->nonce, nonce_c, identity);
  }
  *out = Passed{std::move(p->fd), auth != nullptr ? std::move(identity) : std::string(),
                std::move(p->source), std::move(session)};
  return true;
}

void HandshakeGate::Expire(std::chrono::steady_clock::time_point now) {
  const size_t before = pending_.size();
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](const Pending& p) { return p.expires <= now; }),
                 pending_.end());
  if (pending_.size() != before) {
    const uint64_t was = stats_.timed_out;
    stats_.timed_out += before - pending_.size();
    if (CrossedPowerOfTwo(was, stats_.timed_out)) {  // the first, then at powers of two
      LOG(WARNING) << where_ << ": " << stats_.timed_out
                   << " connection(s) so far closed for not answering the challenge within "
                   << limits_.timeout.count() << " ms";
    }
  }
}

StatusOr<HandshakeGate::Passed> HandshakeGate::Next(
    int listen_fd, const AcceptFn& accept_one, const Authenticator* auth,
    std::chrono::steady_clock::time_point deadline) {
  std::vector<pollfd> fds;
  for (;;) {
    // 1. What has already answered, before anything new is let in (nothing new can push an
    //    answered member out, and refusals of newcomers never starve it).
    if (!ready_.empty()) {
      StatusOr<Passed> out = std::move(ready_.front());
      ready_.pop_front();
      return out;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      StatusOr<Passed> out = DeadlineExceededError("");
      if (!Advance(&*it, auth, &out)) {
        ++it;
        continue;
      }
      it = pending_.erase(it);
      if (out.ok() || out.status().code() == StatusCode::kPermissionDenied) {
        ready_.push_back(std::move(out));
      }
    }
    if (!ready_.empty()) continue;
    const auto now = std::chrono::steady_clock::now();
    Expire(now);
    // 2. Newcomers, a bounded number per call (a connect flood cannot hold the caller here).
    Status refused;
    for (int n = 0; n < kMaxAcceptsPerCall; ++n) {
      StatusOr<Accepted> a = accept_one();
      if (!a.ok()) {
        if (a.status().code() == StatusCode::kPermissionDenied) {  // e.g. shm: another uid
          ++stats_.refused;
          refused = a.status();
          continue;
        }
        if (a.status().code() == StatusCode::kResourceExhausted) {  // EMFILE and kin
          ++stats_.accept_errors;
          if (CrossedPowerOfTwo(stats_.accept_errors - 1, stats_.accept_errors)) {
            LOG(WARNING) << where_ << ": " << stats_.accept_errors
                         << " accept(s) failed for lack of resources so far (" << a.status()
                         << "); pending connections are still served and expire";
          }
          break;
        }
        return a.status();
      }
      if (!a->fd.valid()) break;
      Admit(std::move(*a), auth);
    }
    if (!ready_.empty()) continue;
    if (!refused.ok()) return refused;
    if (now >= deadline) {
      return DeadlineExceededError(where_ + ": no authenticated peer yet (" +
                                   std::to_string(pending_.size()) + " pending)");
    }
    auto wake = deadline;
    fds.clear();
    fds.push_back(pollfd{listen_fd, POLLIN, 0});
    for (const Pending& p : pending_) {
      fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
      wake = std::min(wake, p.expires);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        wake - std::chrono::steady_clock::now())
                        .count();
    const int r =
        poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(ms + 1, 0, 1 << 30)));
    if (r < 0 && errno != EINTR) return ErrnoError(where_ + ": poll", errno);
  }
}

}  // namespace shardps::transport
