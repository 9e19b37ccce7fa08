// Populating registered memory up front, so that no page fault lands on the data path.
//
// A region that peers write (a server's inboxes, a worker's pull targets) is first touched by
// the transport: a tcp receive, a peer's memcpy over shm. Left to demand paging, each first
// touch is a page fault inside a timed step (about 1 per 4 KiB: ~250 k per GB, seen as 40 k
// faults per GB pushed on a 2x2 tcp cluster's first window). Verbs pins pages at ibv_reg_mr and
// never faulted; tcp and shm now populate at registration the same way, so memory registered
// is memory committed on every transport (what `shardps doctor`'s memlock check computes).
//
// Thread safety: free functions; safe from any thread.
#ifndef SHARDPS_TRANSPORT_POPULATE_H_
#define SHARDPS_TRANSPORT_POPULATE_H_

#include <cstddef>

#include "common/status.h"

namespace shardps::transport {

enum class PopulateFor {
  kRead,        // mapped readable
  kWrite,       // mapped writable (memory others may be writing: never rewritten by us)
  kWriteFresh,  // mapped writable; memory only this caller has seen (may be rewritten in place)
};

// Maps every page of [addr, addr + length) into this process's page tables (writable for
// kWrite*), allocating the backing pages: madvise(MADV_POPULATE_WRITE/READ) (Linux >= 5.14).
// On an older kernel: a read of one byte per page, rewritten in place for kWriteFresh only (a
// rewrite could undo another thread's concurrent store). addr need not be page aligned. Errors:
// out of memory (kResourceExhausted, naming `what` and the size), or a range that is not mapped
// that way (e.g. kWrite on PROT_READ memory: kInternal, EFAULT).
Status PopulatePages(void* addr, size_t length, PopulateFor access, const char* what);

// Private anonymous memory for a region: `bytes` (a multiple of the page size) mapped
// read-write, zero-filled and populated (kWriteFresh). From 2 MiB up the mapping is 2 MiB
// aligned and advised MADV_HUGEPAGE (best effort: transparent huge pages in "madvise" mode back
// it with 2 MiB pages, so that a gather of scattered rows does not miss the TLB on every row).
// The caller unmaps [result, result + bytes).
StatusOr<void*> MapPopulated(size_t bytes, const char* what);

}  // namespace shardps::transport

#endif  // SHARDPS_TRANSPORT_POPULATE_H_
