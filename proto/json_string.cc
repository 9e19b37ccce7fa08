#include "proto/json_string.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/stubs/common.h>
#include <google/protobuf/util/json_util.h>

namespace shardps::control {
namespace {

// `s` with every byte sequence that is not valid UTF-8 replaced by U+FFFD.
std::string ValidUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = n > 0 && i + n <= s.size();
    for (size_t k = 1; ok && k < n; ++k) {
      ok = (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
    }
    if (ok && n > 1) {  // no overlong forms or surrogates: protobuf's own check decides the rest
      ok = google::protobuf::internal::IsStructurallyValidUTF8(s.data() + i, static_cast<int>(n));
    }
    if (ok) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

}  // namespace

std::string JsonQuote(std::string_view s) {
  google::protobuf::Value v;
  v.set_string_value(ValidUtf8(s));
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(v, &out).ok()) return "\"\"";
  return out;
}

}  // namespace shardps::control
