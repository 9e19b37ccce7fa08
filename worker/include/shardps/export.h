/* SHARDPS_EXPORT: marks the public API of libshardps.
 *
 * The library is compiled with -fvisibility=hidden (and linked with a version script), so
 * only what carries this mark is exported from libshardps.so: the C API (shardps_*), and the
 * C++ API of client.h and status.h. Everything else in the library is internal. */
#ifndef SHARDPS_EXPORT_H_
#define SHARDPS_EXPORT_H_

#if defined(__cplusplus) && (defined(__GNUC__) || defined(__clang__))
/* The C++11 spelling: it may follow [[nodiscard]] in a class head. */
#define SHARDPS_EXPORT [[gnu::visibility("default")]]
#elif defined(__GNUC__) || defined(__clang__)
#define SHARDPS_EXPORT __attribute__((visibility("default")))
#else
#define SHARDPS_EXPORT
#endif

#endif /* SHARDPS_EXPORT_H_ */
