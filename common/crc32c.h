// CRC32C (Castagnoli, polynomial 0x1EDC6F41, reflected 0x82F63B78), as used by iSCSI (RFC 3720),
// ext4 and LevelDB. Used to checksum checkpoint files (docs/checkpoints.md).
//
// Crc32c() picks the SSE4.2 crc32 instruction when the CPU has it (checked once, at first use),
// else a slicing-by-8 table. Both give identical results; tests check both against RFC 3720.
//
// Thread safety: pure functions; callable from any thread.
#ifndef SHARDPS_COMMON_CRC32C_H_
#define SHARDPS_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace shardps::crc32c {

// The CRC32C of data[0, n) appended to a stream whose CRC32C so far is `crc` (0 for an empty
// stream): Extend(Extend(0, a), b) == Value(a ++ b).
uint32_t Extend(uint32_t crc, const void* data, size_t n);
inline uint32_t Value(const void* data, size_t n) { return Extend(0, data, n); }

// Extends `lanes` independent CRCs at once: crc[i] = Extend(crc[i], data[i], n) for i < lanes.
// The hardware path interleaves up to four lanes, so it runs near the crc32 instruction's
// throughput rather than its latency (about 3x a single stream on short records: row tables
// verify many 288-byte records per pull). Any lanes count; results equal Extend's.
void ExtendLanes(uint32_t* crc, const void* const* data, size_t lanes, size_t n);

// The two implementations, exposed for tests and benchmarks.
uint32_t ExtendPortable(uint32_t crc, const void* data, size_t n);
// Requires HardwareAvailable(); falls back to ExtendPortable otherwise.
uint32_t ExtendHardware(uint32_t crc, const void* data, size_t n);
bool HardwareAvailable();

}  // namespace shardps::crc32c

#endif  // SHARDPS_COMMON_CRC32C_H_
