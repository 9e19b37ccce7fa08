// JSON string literals for the tools' JSON output, from protobuf's JSON support (already
// linked) rather than a hand-written escaper: the bytes of `s` as one quoted, escaped JSON
// string. Bytes that are not valid UTF-8 are replaced by U+FFFD first (JSON text is UTF-8).
//
// Thread safety: a pure function.
#ifndef SHARDPS_PROTO_JSON_STRING_H_
#define SHARDPS_PROTO_JSON_STRING_H_

#include <string>
#include <string_view>

namespace shardps::control {

std::string JsonQuote(std::string_view s);

}  // namespace shardps::control

#endif  // SHARDPS_PROTO_JSON_STRING_H_
