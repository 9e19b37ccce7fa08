// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html):
// what each mutex guards, checked at compile time by clang's -Wthread-safety (the CI build
// `scripts/test.sh` runs with clang, SHARDPS_THREAD_SAFETY=ON). Under other compilers they
// expand to nothing.
//
// Use shardps::Mutex / shardps::MutexLock (annotated wrappers of std::mutex) for members that
// carry GUARDED_BY: std::mutex itself is annotated only under libc++.
#ifndef SHARDPS_COMMON_THREAD_ANNOTATIONS_H_
#define SHARDPS_COMMON_THREAD_ANNOTATIONS_H_

#include <mutex>

#if defined(__clang__)
#define SHARDPS_TSA(x) __attribute__((x))
#else
#define SHARDPS_TSA(x)
#endif

#define CAPABILITY(x) SHARDPS_TSA(capability(x))
#define SCOPED_CAPABILITY SHARDPS_TSA(scoped_lockable)
#define GUARDED_BY(x) SHARDPS_TSA(guarded_by(x))
#define PT_GUARDED_BY(x) SHARDPS_TSA(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) SHARDPS_TSA(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) SHARDPS_TSA(acquired_after(__VA_ARGS__))
#define REQUIRES(...) SHARDPS_TSA(requires_capability(__VA_ARGS__))
#define EXCLUSIVE_LOCKS_REQUIRED(...) SHARDPS_TSA(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) SHARDPS_TSA(acquire_capability(__VA_ARGS__))
#define RELEASE(...) SHARDPS_TSA(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) SHARDPS_TSA(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) SHARDPS_TSA(locks_excluded(__VA_ARGS__))
#define LOCKS_EXCLUDED(...) SHARDPS_TSA(locks_excluded(__VA_ARGS__))
#define RETURN_CAPABILITY(x) SHARDPS_TSA(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS SHARDPS_TSA(no_thread_safety_analysis)

namespace shardps {

// std::mutex with the capability annotation. Thread-safe, as std::mutex.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // For std::condition_variable_any and std::unique_lock interop.
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_THREAD_ANNOTATIONS_H_
