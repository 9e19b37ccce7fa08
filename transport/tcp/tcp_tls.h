// Optional TLS for the tcp data path (FabricOptions::tcp_tls, docs/security.md): TLS 1.3 over
// OpenSSL, keyed by an external pre-shared key, the per-connection session secret of the
// data-path authentication (transport/handshake_auth.h), with an (EC)DHE exchange on top
// (psk_dhe_ke: forward secrecy). No certificates: the PSK is what both sides already proved.
// Cipher suite TLS_AES_128_GCM_SHA256 (AES-NI), no session tickets, no renegotiation.
//
// Thread safety: one session per endpoint. Writev and Readv may be called from different
// threads (the endpoint's senders and its progress thread); an internal mutex serialises every
// call into OpenSSL, whose SSL objects are not safe for concurrent use.
#ifndef SHARDPS_TRANSPORT_TCP_TCP_TLS_H_
#define SHARDPS_TRANSPORT_TCP_TCP_TLS_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/thread_annotations.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace shardps::transport::tcp {

class TlsSession {
 public:
  // Runs the handshake on the non-blocking socket fd until the deadline; `psk` is 32 bytes.
  static StatusOr<std::unique_ptr<TlsSession>> Handshake(
      int fd, bool server, std::string_view psk, std::chrono::steady_clock::time_point deadline);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Like writev(2)/readv(2) on the non-blocking socket: the bytes moved (a short count when the
  // socket is full/empty), or -1 with errno (EAGAIN: would block; EPROTO: a TLS error, logged),
  // and 0 from Readv at the peer's close. A Readv that returns less than asked leaves nothing
  // buffered inside TLS (it read until the socket had no more of a record), so an
  // edge-triggered reader may wait for the next edge.
  ssize_t Writev(const iovec* iov, int count) EXCLUDES(mu_);
  ssize_t Readv(const iovec* iov, int count) EXCLUDES(mu_);

  // "TLSv1.3 TLS_AES_128_GCM_SHA256" for logs.
  std::string Describe() const;

 private:
  TlsSession() = default;

  Mutex mu_;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  std::string psk_;
};

}  // namespace shardps::transport::tcp

#endif  // SHARDPS_TRANSPORT_TCP_TCP_TLS_H_
