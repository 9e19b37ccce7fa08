#include "transport/populate.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace shardps::transport {
namespace {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Whether this kernel knows MADV_POPULATE_* (5.14+): probed once on a page of our own.
bool KernelPopulates() {
  static const bool supported = [] {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    const bool ok = madvise(p, page, MADV_POPULATE_WRITE) == 0;
    munmap(p, page);
    return ok;
  }();
  return supported;
}

void TouchPages(uint8_t* begin, uint8_t* end, PopulateFor access) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (uintptr_t a = reinterpret_cast<uintptr_t>(begin) & ~(page - 1);
       a < reinterpret_cast<uintptr_t>(end); a += page) {
    auto* p = reinterpret_cast<volatile uint8_t*>(
        a < reinterpret_cast<uintptr_t>(begin) ? reinterpret_cast<uintptr_t>(begin) : a);
    const uint8_t v = *p;
    if (access == PopulateFor::kWriteFresh) *p = v;
  }
}

}  // namespace

Status PopulatePages(void* addr, size_t length, PopulateFor access, const char* what) {
  if (addr == nullptr || length == 0) return Status::OK();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + length + page - 1) & ~(page - 1);
  if (KernelPopulates()) {
    const int advice = access == PopulateFor::kRead ? MADV_POPULATE_READ : MADV_POPULATE_WRITE;
    int rc;
    do {
      rc = madvise(reinterpret_cast<void*>(begin), end - begin, advice);
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) return Status::OK();
    return ErrnoError(std::string(what) + ": populating " + std::to_string(length) +
                          " bytes of registered memory",
                      errno);
  }
  TouchPages(static_cast<uint8_t*>(addr), static_cast<uint8_t*>(addr) + length, access);
  return Status::OK();
}

StatusOr<void*> MapPopulated(size_t bytes, const char* what) {
  constexpr size_t kHuge = 2u << 20;
  void* p;
  if (bytes < kHuge) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoError(std::string(what) + ": mmap of " + std::to_string(bytes) + " bytes", errno);
    }
  } else {
    // Reserve bytes + 2 MiB, keep the aligned part, give the slack back.
    void* r = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (r == MAP_FAILED) {
      return ErrnoError(std::string(what) + ": mmap of " + std::to_string(bytes) + " bytes", errno);
    }
    const uintptr_t base = reinterpret_cast<uintptr_t>(r);
    const uintptr_t aligned = (base + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
    if (aligned > base) munmap(r, aligned - base);
    const uintptr_t end = aligned + bytes;
    if (base + bytes + kHuge > end) munmap(reinterpret_cast<void*>(end), base + bytes + kHuge - end);
    p = reinterpret_cast<void*>(aligned);
    madvise(p, bytes, MADV_HUGEPAGE);  // best effort (THP off, or not built in)
  }
  Status s = PopulatePages(p, bytes, PopulateFor::kWriteFresh, what);
  if (!s.ok()) {
    munmap(p, bytes);
    return s;
  }
  return p;
}

}  // namespace shardps::transport
