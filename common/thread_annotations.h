// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html):
// what each mutex guards, checked at compile time by clang's -Wthread-safety (the CI build
// `scripts/test.sh` runs with clang, SHARDPS_THREAD_SAFETY=ON). Under other compilers they
// expand to nothing.
//
// Use shardps::Mutex / shardps::MutexLock (annotated wrappers of std::mutex) and
// shardps::CondVar for members that carry GUARDED_BY: std::mutex itself is annotated only under
// libc++.
#ifndef SHARDPS_COMMON_THREAD_ANNOTATIONS_H_
#define SHARDPS_COMMON_THREAD_ANNOTATIONS_H_

#include <chrono>
#include <condition_variable>
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
#define ASSERT_CAPABILITY(x) SHARDPS_TSA(assert_capability(x))
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
  // Tells the analysis that the caller holds this mutex where it cannot follow the lock (a
  // capability reached through another object, a callback run under the lock). A promise, not
  // checked at run time: say in a comment who holds it.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

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

// std::condition_variable for a Mutex the caller holds (REQUIRES: the analysis sees the lock
// held across the wait, as it is on return). A predicate reading guarded members says so:
//   cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return done_; });
// Thread-safe, as std::condition_variable.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    cv_.wait(l);
    l.release();
  }
  template <typename Pred>
  void Wait(Mutex* mu, Pred pred) REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    cv_.wait(l, pred);
    l.release();
  }
  // False on timeout with pred still false.
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout, Pred pred)
      REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    const bool ok = cv_.wait_for(l, timeout, pred);
    l.release();
    return ok;
  }
  template <typename Rep, typename Period>
  std::cv_status WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout)
      REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    const std::cv_status st = cv_.wait_for(l, timeout);
    l.release();
    return st;
  }
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline, Pred pred)
      REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    const bool ok = cv_.wait_until(l, deadline, pred);
    l.release();
    return ok;
  }
  template <typename Clock, typename Duration>
  std::cv_status WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> l(mu->native(), std::adopt_lock);
    const std::cv_status st = cv_.wait_until(l, deadline);
    l.release();
    return st;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace shardps

#endif  // SHARDPS_COMMON_THREAD_ANNOTATIONS_H_
