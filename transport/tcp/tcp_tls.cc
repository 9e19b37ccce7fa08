#include "transport/tcp/tcp_tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>

#include <cerrno>
#include <cstring>

#include <glog/logging.h>

#include "common/net.h"

namespace shardps::transport::tcp {
namespace {

// The PSK identity on the wire: fixed, since the key itself is per connection.
constexpr unsigned char kPskIdentity[] = "shardps-session-v1";
constexpr size_t kPskIdentityLen = sizeof(kPskIdentity) - 1;

std::string OpenSslErrors() {
  std::string out;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "no OpenSSL error queued" : out;
}

SSL_SESSION* MakeSession(SSL* ssl, const std::string& psk) {
  static const unsigned char kAes128GcmSha256[] = {0x13, 0x01};
  const SSL_CIPHER* cipher = SSL_CIPHER_find(ssl, kAes128GcmSha256);
  if (cipher == nullptr) return nullptr;
  SSL_SESSION* s = SSL_SESSION_new();
  if (s == nullptr ||
      SSL_SESSION_set1_master_key(s, reinterpret_cast<const unsigned char*>(psk.data()),
                                  psk.size()) != 1 ||
      SSL_SESSION_set_cipher(s, cipher) != 1 ||
      SSL_SESSION_set_protocol_version(s, TLS1_3_VERSION) != 1) {
    SSL_SESSION_free(s);
    return nullptr;
  }
  return s;
}

const std::string& PskOf(SSL* ssl) {
  return *static_cast<const std::string*>(SSL_get_ex_data(ssl, 0));
}

// Client: offer the session PSK.
int UsePsk(SSL* ssl, const EVP_MD* md, const unsigned char** id, size_t* idlen,
           SSL_SESSION** sess) {
  SSL_SESSION* s = MakeSession(ssl, PskOf(ssl));
  if (s == nullptr) return 0;
  if (md != nullptr && md != SSL_CIPHER_get_handshake_digest(SSL_SESSION_get0_cipher(s))) {
    SSL_SESSION_free(s);
    *sess = nullptr;
    *id = nullptr;
    *idlen = 0;
    return 1;
  }
  *sess = s;
  *id = kPskIdentity;
  *idlen = kPskIdentityLen;
  return 1;
}

// Server: the one identity there is; anything else finds no PSK (and, with no certificate,
// the handshake fails).
int FindPsk(SSL* ssl, const unsigned char* identity, size_t len, SSL_SESSION** sess) {
  *sess = nullptr;
  if (len != kPskIdentityLen || std::memcmp(identity, kPskIdentity, len) != 0) return 1;
  *sess = MakeSession(ssl, PskOf(ssl));
  return *sess != nullptr ? 1 : 0;
}

}  // namespace

StatusOr<std::unique_ptr<TlsSession>> TlsSession::Handshake(
    int fd, bool server, std::string_view psk, std::chrono::steady_clock::time_point deadline) {
  if (psk.size() != 32) {
    return FailedPreconditionError(
        "tcp: TLS needs the 32-byte session secret of an authenticated connection (members "
        "with credentials only)");
  }
  std::unique_ptr<TlsSession> t(new TlsSession());
  t->psk_ = std::string(psk);
  t->ctx_ = SSL_CTX_new(TLS_method());
  if (t->ctx_ == nullptr) return InternalError("tcp: SSL_CTX_new: " + OpenSslErrors());
  SSL_CTX_set_min_proto_version(t->ctx_, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(t->ctx_, TLS1_3_VERSION);
  if (SSL_CTX_set_ciphersuites(t->ctx_, "TLS_AES_128_GCM_SHA256") != 1) {
    return InternalError("tcp: TLS cipher suite: " + OpenSslErrors());
  }
  SSL_CTX_set_num_tickets(t->ctx_, 0);
  SSL_CTX_set_options(t->ctx_, SSL_OP_NO_TICKET | SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_mode(t->ctx_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  t->ssl_ = SSL_new(t->ctx_);
  if (t->ssl_ == nullptr) return InternalError("tcp: SSL_new: " + OpenSslErrors());
  SSL_set_ex_data(t->ssl_, 0, &t->psk_);
  if (server) {
    SSL_set_psk_find_session_callback(t->ssl_, FindPsk);
    SSL_set_accept_state(t->ssl_);
  } else {
    SSL_set_psk_use_session_callback(t->ssl_, UsePsk);
    SSL_set_connect_state(t->ssl_);
  }
  if (SSL_set_fd(t->ssl_, fd) != 1) return InternalError("tcp: SSL_set_fd: " + OpenSslErrors());
  for (;;) {
    ERR_clear_error();
    const int r = SSL_do_handshake(t->ssl_);
    if (r == 1) break;
    const int e = SSL_get_error(t->ssl_, r);
    if (e == SSL_ERROR_WANT_READ) {
      RETURN_IF_ERROR(net::WaitFd(fd, POLLIN, deadline, "tcp: TLS handshake"));
    } else if (e == SSL_ERROR_WANT_WRITE) {
      RETURN_IF_ERROR(net::WaitFd(fd, POLLOUT, deadline, "tcp: TLS handshake"));
    } else {
      return PermissionDeniedError("tcp: TLS handshake failed: " + OpenSslErrors());
    }
  }
  return t;
}

TlsSession::~TlsSession() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  if (ctx_ != nullptr) SSL_CTX_free(ctx_);
}

std::string TlsSession::Describe() const {
  return std::string(SSL_get_version(ssl_)) + " " + SSL_get_cipher_name(ssl_);
}

ssize_t TlsSession::Writev(const iovec* iov, int count) {
  MutexLock l(&mu_);
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    const char* base = static_cast<const char*>(iov[i].iov_base);
    size_t off = 0;
    while (off < iov[i].iov_len) {
      size_t written = 0;
      ERR_clear_error();
      if (SSL_write_ex(ssl_, base + off, iov[i].iov_len - off, &written) == 1) {
        off += written;
        total += written;
        continue;
      }
      const int e = SSL_get_error(ssl_, 0);
      if (e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ) {
        if (total > 0) return static_cast<ssize_t>(total);
        errno = EAGAIN;
        return -1;
      }
      if (e == SSL_ERROR_SYSCALL && errno != 0) return -1;
      LOG(WARNING) << "tcp: TLS write failed: " << OpenSslErrors();
      errno = e == SSL_ERROR_SYSCALL ? EPIPE : EPROTO;
      return -1;
    }
  }
  return static_cast<ssize_t>(total);
}

ssize_t TlsSession::Readv(const iovec* iov, int count) {
  MutexLock l(&mu_);
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    char* base = static_cast<char*>(iov[i].iov_base);
    size_t off = 0;
    while (off < iov[i].iov_len) {
      size_t got = 0;
      ERR_clear_error();
      if (SSL_read_ex(ssl_, base + off, iov[i].iov_len - off, &got) == 1) {
        off += got;
        total += got;
        continue;
      }
      const int e = SSL_get_error(ssl_, 0);
      if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        if (total > 0) return static_cast<ssize_t>(total);
        errno = EAGAIN;
        return -1;
      }
      if (e == SSL_ERROR_ZERO_RETURN) return static_cast<ssize_t>(total);  // clean close
      if (e == SSL_ERROR_SYSCALL) {
        if (total > 0) return static_cast<ssize_t>(total);
        if (errno == 0) return 0;  // EOF without close_notify: the peer died
        return -1;
      }
      LOG(WARNING) << "tcp: TLS read failed (a tampered or foreign record?): " << OpenSslErrors();
      if (total > 0) return static_cast<ssize_t>(total);
      errno = EPROTO;
      return -1;
    }
  }
  return static_cast<ssize_t>(total);
}

}  // namespace shardps::transport::tcp
