#include "proto/etcd_client.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <utility>

#include <poll.h>

#include "common/fd.h"
#include "common/net.h"

namespace shardps::etcd {

namespace {

using Clock = std::chrono::steady_clock;

// ---- JSON: just enough for the gateway's answers (objects, arrays, strings, scalars). --------
struct Json {
  enum Type { kNull, kBool, kNumber, kString, kArray, kObject } type = kNull;
  std::string text;  // string value, or the number's literal
  bool boolean = false;
  std::vector<Json> items;
  std::map<std::string, Json> fields;
  const Json* Field(const std::string& name) const {
    auto it = fields.find(name);
    return it == fields.end() ? nullptr : &it->second;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  StatusOr<Json> Parse() {
    Json j;
    if (!Value(&j, 0)) return InvalidArgumentError("etcd: malformed JSON answer");
    Space();
    if (pos_ != s_.size()) return InvalidArgumentError("etcd: trailing bytes after the JSON answer");
    return j;
  }

 private:
  void Space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Literal(const char* w) {
    const size_t n = std::char_traits<char>::length(w);
    if (s_.compare(pos_, n, w) != 0) return false;
    pos_ += n;
    return true;
  }
  bool String(std::string* out) {
    if (pos_ >= s_.size() || s_[pos_] != '"') return false;
    ++pos_;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\\') {
        if (pos_ >= s_.size()) return false;
        c = s_[pos_++];
        switch (c) {
          case 'n': c = '\n'; break;
          case 't': c = '\t'; break;
          case 'r': c = '\r'; break;
          case 'b': c = '\b'; break;
          case 'f': c = '\f'; break;
          case 'u': {  // the gateway escapes only control characters and <>&: keep ASCII
            if (pos_ + 4 > s_.size()) return false;
            c = static_cast<char>(std::strtol(s_.substr(pos_, 4).c_str(), nullptr, 16) & 0x7f);
            pos_ += 4;
            break;
          }
          default: break;  // \" \\ \/
        }
      }
      out->push_back(c);
    }
    if (pos_ >= s_.size()) return false;
    ++pos_;
    return true;
  }
  bool Value(Json* j, int depth) {
    if (depth > 32) return false;
    Space();
    if (pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      j->type = Json::kObject;
      Space();
      if (pos_ < s_.size() && s_[pos_] == '}') return ++pos_, true;
      while (true) {
        Space();
        std::string name;
        if (!String(&name)) return false;
        Space();
        if (pos_ >= s_.size() || s_[pos_++] != ':') return false;
        if (!Value(&j->fields[name], depth + 1)) return false;
        Space();
        if (pos_ >= s_.size()) return false;
        if (s_[pos_] == ',') {
          ++pos_;
          continue;
        }
        return s_[pos_++] == '}';
      }
    }
    if (c == '[') {
      ++pos_;
      j->type = Json::kArray;
      Space();
      if (pos_ < s_.size() && s_[pos_] == ']') return ++pos_, true;
      while (true) {
        j->items.emplace_back();
        if (!Value(&j->items.back(), depth + 1)) return false;
        Space();
        if (pos_ >= s_.size()) return false;
        if (s_[pos_] == ',') {
          ++pos_;
          continue;
        }
        return s_[pos_++] == ']';
      }
    }
    if (c == '"') {
      j->type = Json::kString;
      return String(&j->text);
    }
    if (Literal("true")) return j->type = Json::kBool, j->boolean = true, true;
    if (Literal("false")) return j->type = Json::kBool, true;
    if (Literal("null")) return true;
    const size_t start = pos_;
    while (pos_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[pos_])) ||
                                s_[pos_] == '-' || s_[pos_] == '+' || s_[pos_] == '.' ||
                                s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
    }
    if (pos_ == start) return false;
    j->type = Json::kNumber;
    j->text = s_.substr(start, pos_ - start);
    return true;
  }

  const std::string& s_;
  size_t pos_ = 0;
};

// The gateway writes int64 fields as strings ("123"), and omits zero values.
int64_t Int(const Json* j) {
  if (j == nullptr || (j->type != Json::kString && j->type != Json::kNumber)) return 0;
  return std::strtoll(j->text.c_str(), nullptr, 10);
}

std::string Quote(const std::string& s) { return "\"" + s + "\""; }  // base64 / digits only

std::string HttpRequest(const std::string& host, const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: " + host +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// The body of a complete HTTP/1.1 answer (Content-Length, chunked, or up to EOF).
StatusOr<std::pair<int, std::string>> ParseHttp(const std::string& raw) {
  const size_t head_end = raw.find("\r\n\r\n");
  if (head_end == std::string::npos || raw.compare(0, 5, "HTTP/") != 0) {
    return UnavailableError("etcd: not an HTTP answer");
  }
  const size_t sp = raw.find(' ');
  const int code = sp == std::string::npos ? 0 : std::atoi(raw.c_str() + sp + 1);
  std::string head = raw.substr(0, head_end);
  std::transform(head.begin(), head.end(), head.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string body = raw.substr(head_end + 4);
  if (head.find("transfer-encoding: chunked") != std::string::npos) {
    std::string out;
    size_t p = 0;
    while (p < body.size()) {
      const size_t eol = body.find("\r\n", p);
      if (eol == std::string::npos) return UnavailableError("etcd: truncated chunked answer");
      const size_t n = std::strtoul(body.substr(p, eol - p).c_str(), nullptr, 16);
      if (n == 0) break;
      if (eol + 2 + n > body.size()) return UnavailableError("etcd: truncated chunk");
      out.append(body, eol + 2, n);
      p = eol + 2 + n + 2;
    }
    body = std::move(out);
  }
  return std::make_pair(code, body);
}

}  // namespace

std::string Base64Encode(const std::string& in) {
  static const char* kTable = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8) |
                       static_cast<uint8_t>(in[i + 2]);
    out += kTable[v >> 18];
    out += kTable[(v >> 12) & 63];
    out += kTable[(v >> 6) & 63];
    out += kTable[v & 63];
  }
  if (i < in.size()) {
    uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    if (i + 1 < in.size()) v |= static_cast<uint8_t>(in[i + 1]) << 8;
    out += kTable[v >> 18];
    out += kTable[(v >> 12) & 63];
    out += i + 1 < in.size() ? kTable[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

StatusOr<std::string> Base64Decode(const std::string& in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = val(c);
    if (v < 0) return InvalidArgumentError("etcd: bad base64");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

StatusOr<Client> Client::Create(const std::string& endpoints, std::chrono::milliseconds timeout) {
  Options o;
  o.timeout = timeout;
  size_t p = 0;
  while (p <= endpoints.size()) {
    size_t comma = endpoints.find(',', p);
    if (comma == std::string::npos) comma = endpoints.size();
    std::string e = endpoints.substr(p, comma - p);
    if (e.rfind("https://", 0) == 0) {
      return InvalidArgumentError("etcd endpoint '" + e + "': https is not supported");
    }
    if (e.rfind("http://", 0) == 0) e = e.substr(7);
    while (!e.empty() && e.back() == '/') e.pop_back();
    if (!e.empty()) {
      RETURN_IF_ERROR(net::ParseHostPort(e).status());
      o.endpoints.push_back(e);
    }
    p = comma + 1;
  }
  if (o.endpoints.empty()) return InvalidArgumentError("no etcd endpoint given");
  return Client(std::move(o));
}

StatusOr<std::string> Client::Call(const std::string& path, const std::string& json) {
  const auto deadline = Clock::now() + options_.timeout;
  Status last = UnavailableError("etcd: no endpoint tried");
  const size_t n = options_.endpoints.size();
  for (size_t k = 0; k < n && Clock::now() < deadline; ++k) {
    const size_t i = (preferred_ + k) % n;
    const std::string& ep = options_.endpoints[i];
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    auto fd = net::ConnectTcp(ep, "", std::max(left, std::chrono::milliseconds(1)));
    if (!fd.ok()) {
      last = fd.status().WithContext("etcd " + ep);
      continue;
    }
    const std::string req = HttpRequest(ep, path, json);
    Status st = net::SendAll(fd->get(), req.data(), req.size(), deadline, "etcd request");
    std::string raw;
    while (st.ok()) {
      st = net::WaitFd(fd->get(), POLLIN, deadline, "etcd answer");
      if (!st.ok()) break;
      char buf[16 << 10];
      auto got = net::RecvSome(fd->get(), buf, sizeof(buf), "etcd answer");
      if (!got.ok()) break;  // EOF: the answer is complete (Connection: close)
      raw.append(buf, *got);
      if (raw.size() > (64u << 20)) {
        st = ResourceExhaustedError("etcd: answer larger than 64 MiB");
      }
    }
    if (raw.empty()) {
      last = (st.ok() ? UnavailableError("empty answer") : st).WithContext("etcd " + ep);
      continue;
    }
    ASSIGN_OR_RETURN(auto answer, ParseHttp(raw));
    preferred_ = i;
    if (answer.first != 200) {
      return FailedPreconditionError("etcd " + ep + path + ": HTTP " +
                                     std::to_string(answer.first) + ": " +
                                     answer.second.substr(0, 300));
    }
    return std::move(answer.second);
  }
  return last;
}

StatusOr<std::optional<KeyValue>> Client::Get(const std::string& key) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/kv/range", "{\"key\":" + Quote(Base64Encode(key)) + "}"));
  ASSIGN_OR_RETURN(Json j, JsonParser(body).Parse());
  const Json* kvs = j.Field("kvs");
  if (kvs == nullptr || kvs->type != Json::kArray || kvs->items.empty()) {
    return std::optional<KeyValue>();
  }
  const Json& kv = kvs->items[0];
  KeyValue out;
  if (const Json* v = kv.Field("value")) {
    ASSIGN_OR_RETURN(out.value, Base64Decode(v->text));
  }
  out.create_revision = Int(kv.Field("create_revision"));
  out.mod_revision = Int(kv.Field("mod_revision"));
  out.lease = Int(kv.Field("lease"));
  return std::optional<KeyValue>(std::move(out));
}

Status Client::Put(const std::string& key, const std::string& value, int64_t lease) {
  std::string req = "{\"key\":" + Quote(Base64Encode(key)) +
                    ",\"value\":" + Quote(Base64Encode(value));
  if (lease != 0) req += ",\"lease\":" + Quote(std::to_string(lease));
  return Call("/v3/kv/put", req + "}").status();
}

Status Client::Delete(const std::string& key) {
  return Call("/v3/kv/deleterange", "{\"key\":" + Quote(Base64Encode(key)) + "}").status();
}

StatusOr<int64_t> Client::GrantLease(int64_t ttl_seconds) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/lease/grant", "{\"TTL\":" + Quote(std::to_string(ttl_seconds)) + "}"));
  ASSIGN_OR_RETURN(Json j, JsonParser(body).Parse());
  const int64_t id = Int(j.Field("ID"));
  if (id == 0) return UnavailableError("etcd: lease grant without an id: " + body.substr(0, 200));
  return id;
}

StatusOr<int64_t> Client::KeepAlive(int64_t lease) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/lease/keepalive", "{\"ID\":" + Quote(std::to_string(lease)) + "}"));
  // One streamed message: {"result": {...,"ID":..,"TTL":..}} (possibly followed by a newline).
  while (!body.empty() && std::isspace(static_cast<unsigned char>(body.back()))) body.pop_back();
  const size_t nl = body.find('\n');
  if (nl != std::string::npos) body = body.substr(0, nl);
  ASSIGN_OR_RETURN(Json j, JsonParser(body).Parse());
  const Json* r = j.Field("result");
  const int64_t ttl = Int(r != nullptr ? r->Field("TTL") : j.Field("TTL"));
  if (ttl <= 0) return NotFoundError("etcd lease " + std::to_string(lease) + " has expired");
  return ttl;
}

Status Client::Revoke(int64_t lease) {
  return Call("/v3/lease/revoke", "{\"ID\":" + Quote(std::to_string(lease)) + "}").status();
}

StatusOr<bool> Client::CreateIfAbsent(const std::string& key, const std::string& value,
                                      int64_t lease) {
  const std::string k = Quote(Base64Encode(key));
  std::string put = "{\"request_put\":{\"key\":" + k + ",\"value\":" + Quote(Base64Encode(value));
  if (lease != 0) put += ",\"lease\":" + Quote(std::to_string(lease));
  put += "}}";
  const std::string req = "{\"compare\":[{\"key\":" + k +
                          ",\"result\":\"EQUAL\",\"target\":\"CREATE\",\"create_revision\":\"0\"}],"
                          "\"success\":[" + put + "]}";
  ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/txn", req));
  ASSIGN_OR_RETURN(Json j, JsonParser(body).Parse());
  const Json* ok = j.Field("succeeded");
  return ok != nullptr && ok->boolean;
}

StatusOr<bool> Client::PutIf(const std::string& guard_key, const std::string& guard_value,
                             const std::string& key, const std::string& value) {
  const std::string req =
      "{\"compare\":[{\"key\":" + Quote(Base64Encode(guard_key)) +
      ",\"result\":\"EQUAL\",\"target\":\"VALUE\",\"value\":" + Quote(Base64Encode(guard_value)) +
      "}],\"success\":[{\"request_put\":{\"key\":" + Quote(Base64Encode(key)) +
      ",\"value\":" + Quote(Base64Encode(value)) + "}}]}";
  ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/txn", req));
  ASSIGN_OR_RETURN(Json j, JsonParser(body).Parse());
  const Json* ok = j.Field("succeeded");
  return ok != nullptr && ok->boolean;
}

}  // namespace shardps::etcd
