// libFuzzer target: transport::RegionDescriptor::Decode on arbitrary bytes (a peer's region
// descriptor arrives through the control plane, inside a Region message).
//
// Checks, on data: what decodes re-encodes to exactly the input bytes (the layout is fixed and
// every field is checked, so there is one encoding per descriptor); decoding that again gives
// equal fields; the decoded region does not wrap around the address space; DebugString works.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/transport.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  fprintf(stderr, "fuzz_descriptor: check failed: %s\n", what);
  abort();
}
#define FUZZ_CHECK(cond)      \
  do {                        \
    if (!(cond)) Fail(#cond); \
  } while (0)

bool Same(const shardps::transport::RegionDescriptor& a,
          const shardps::transport::RegionDescriptor& b) {
  return a.provider == b.provider && a.addr == b.addr && a.length == b.length && a.rkey == b.rkey &&
         a.access == b.access && a.provider_data == b.provider_data;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using shardps::transport::RegionDescriptor;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto d = RegionDescriptor::Decode(in);
  if (!d.ok()) {
    FUZZ_CHECK(d.status().code() == shardps::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(!d->provider.empty());
  FUZZ_CHECK(d->addr + d->length >= d->addr);
  FUZZ_CHECK(static_cast<uint32_t>(d->access) <= 3);
  const std::string enc = d->Encode();
  FUZZ_CHECK(enc == in);
  auto again = RegionDescriptor::Decode(enc);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(Same(*d, *again));
  FUZZ_CHECK(!d->DebugString().empty());
  return 0;
}
