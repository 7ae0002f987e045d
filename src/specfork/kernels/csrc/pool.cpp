#include "pool.h"
#include "common.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SF_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define SF_PAUSE() __asm__ __volatile__("yield")
#else
#define SF_PAUSE() ((void)0)
#endif

namespace sf {
namespace {

using Clock = std::chrono::steady_clock;

// A worker spins this long for the next region before it sleeps: a forward's regions follow
// each other within microseconds, and plain decoding's host work between forwards takes
// ~0.3-0.5 ms (a one-row forward after 0.4 ms of host work measured ~4% faster than with a
// 0.1 ms spin; OpenMP spins about as long). A pool backing off for busy cores parks its workers.
constexpr auto kWorkerSpin = std::chrono::microseconds(1000);
// The caller spins this long for parts other threads run, then yields its core between looks.
constexpr auto kCallerSpin = std::chrono::microseconds(20);

// The ticket: which region (generation), its number of parts and the next unclaimed part, in one
// word, so that claiming a part is one compare-and-swap that fails once the region is over.
constexpr int kIndexBits = 20, kPartsBits = 20;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
constexpr uint64_t kPartsMask = (uint64_t{1} << kPartsBits) - 1;
constexpr uint64_t kGenMask = (uint64_t{1} << (64 - kIndexBits - kPartsBits)) - 1;
constexpr int64_t kMostParts = 4096;

inline uint64_t ticket_gen(uint64_t t) { return t >> (kIndexBits + kPartsBits); }
inline uint64_t ticket_parts(uint64_t t) { return (t >> kIndexBits) & kPartsMask; }
inline uint64_t ticket_index(uint64_t t) { return t & kIndexMask; }
inline uint64_t make_ticket(uint64_t gen, uint64_t parts) {
  return (gen << (kIndexBits + kPartsBits)) | (parts << kIndexBits);
}

// The time (ns) thread `tid` has spent runnable but waiting for a core, or -1 where the kernel
// does not say (/proc/<pid>/task/<tid>/schedstat: run time, run delay, time slices).
int64_t run_delay_ns(long tid) {
  const std::string path = "/proc/self/task/" + std::to_string(tid) + "/schedstat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return -1;
  unsigned long long run = 0, delay = 0;
  const int got = std::fscanf(f, "%llu %llu", &run, &delay);
  std::fclose(f);
  return got == 2 ? static_cast<int64_t>(delay) : -1;
}

long this_tid() { return static_cast<long>(syscall(SYS_gettid)); }

// One region: written by the caller before it publishes the ticket, read by a thread only after
// it claimed a part (the region cannot end before that part is done, so these stay valid).
struct Region {
  int64_t n = 0, parts = 0;
  RangeFn fn = nullptr;
  void* ctx = nullptr;
};

// Everything the workers share, on the heap: a forked child leaves its parent's state behind.
struct State {
  explicit State(int workers) : tids(workers) {}
  // the two words every part writes, each on a cache line of its own (a worker claiming a part
  // does not disturb the caller counting finished ones), apart from the read-mostly rest
  alignas(64) std::atomic<uint64_t> ticket{0};
  alignas(64) std::atomic<int64_t> done{0};
  alignas(64) std::atomic<int> sleepers{0};  // workers waiting for a region
  std::atomic<int> active{1};    // threads that run regions (worker i runs while i + 1 < active)
  std::atomic<bool> stop{false};
  Region region;
  std::vector<std::atomic<long>> tids;  // each worker's thread id (0 until it started)
  std::mutex mu;                        // guards sleeping and `error`
  std::condition_variable wake;         // a region, stop, or a lower `active`
  std::condition_variable park;         // a higher `active`, or stop
  std::exception_ptr error;
};

// Claims and runs parts of the current region until none is left.
void run_parts(State& s) {
  uint64_t t = s.ticket.load(std::memory_order_acquire);
  while (ticket_index(t) < ticket_parts(t)) {
    if (!s.ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
      continue;
    const Region& r = s.region;
    const int64_t i = static_cast<int64_t>(ticket_index(t));
    try {
      r.fn(r.ctx, r.n * i / r.parts, r.n * (i + 1) / r.parts);
    } catch (...) {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.error) s.error = std::current_exception();
    }
    s.done.fetch_add(1, std::memory_order_release);
    t = s.ticket.load(std::memory_order_acquire);
  }
}

// Waits until a region newer than `seen` is published (true) or this worker is parked or the
// pool stops (false): spins first, then sleeps.
bool wait_for_region(State& s, int index, uint64_t seen) {
  const auto runs = [&] { return index + 1 < s.active.load(std::memory_order_relaxed); };
  const auto until = Clock::now() + kWorkerSpin;
  for (int i = 0;; ++i) {
    if (s.stop.load(std::memory_order_relaxed) || !runs()) return false;
    if (ticket_gen(s.ticket.load(std::memory_order_acquire)) != seen) return true;
    SF_PAUSE();
    if ((i & 63) == 63 && Clock::now() > until) break;
  }
  std::unique_lock<std::mutex> lock(s.mu);
  s.sleepers.fetch_add(1);  // seq_cst, read by the caller after it publishes a region
  s.wake.wait(lock, [&] { return s.stop.load() || !runs() || ticket_gen(s.ticket.load()) != seen; });
  s.sleepers.fetch_sub(1);
  return !s.stop.load() && runs();
}

void worker_loop(State* s, int index) {
  flush_denormals_for_good();  // a worker runs nothing but kernels (common.h)
  s->tids[index].store(this_tid());
  uint64_t seen = ticket_gen(s->ticket.load(std::memory_order_acquire));
  while (!s->stop.load()) {
    if (index + 1 >= s->active.load()) {  // parked: fewer threads run while the cores are busy
      std::unique_lock<std::mutex> lock(s->mu);
      s->park.wait(lock, [&] { return s->stop.load() || index + 1 < s->active.load(); });
      seen = ticket_gen(s->ticket.load(std::memory_order_acquire));
      continue;
    }
    if (!wait_for_region(*s, index, seen)) continue;
    seen = ticket_gen(s->ticket.load(std::memory_order_acquire));
    run_parts(*s);
  }
}

// How many threads an adaptive pool runs: it looks every kWindow at the share of time its
// running threads spent waiting for a core; above kBusy it runs fewer, and after kQuietWindows
// windows below kQuiet it tries twice as many again, after a pause that doubles each time a
// try fails (so a machine that stays busy is tried rarely).
class Backoff {
 public:
  static constexpr auto kWindow = std::chrono::milliseconds(25);
  static constexpr double kBusy = 0.15, kQuiet = 0.05;
  static constexpr int kQuietWindows = 2;
  // a short disturbance (a process starting) costs at most this long on fewer threads
  static constexpr auto kFirstPause = std::chrono::milliseconds(200);
  static constexpr auto kLongestPause = std::chrono::seconds(16);

  // The number of threads to run from now on (`active` now, of at most `most`; `adaptive`: may
  // it change). Counts measured and busy windows in `counts`.
  int next(const State& s, int active, int most, bool adaptive, Clock::time_point now,
           PoolCounts& counts) {
    if (now - window_start_ < kWindow) return active;
    const long caller = this_tid();
    const int64_t delay = delay_of(s, active);
    const bool comparable = delay >= 0 && caller == caller_ && active == measured_;
    const double wall = std::chrono::duration<double, std::nano>(now - window_start_).count();
    int chosen = active;
    if (comparable) {
      const double share = (delay - delay_) / (wall * active);
      ++counts.windows;
      if (share > kBusy) ++counts.busy;
      if (adaptive) chosen = decide(active, most, share, now);
    }
    window_start_ = now;
    caller_ = caller;
    measured_ = chosen;
    delay_ = chosen == active ? delay : delay_of(s, chosen);
    return chosen;
  }

  // The rule itself, given the share of the last window that the threads waited for a core.
  int decide(int active, int most, double share, Clock::time_point now) {
    quiet_ = share < kQuiet ? quiet_ + 1 : 0;
    if (share > kBusy && active > 1) {
      if (trying_) pause_ = std::min<Clock::duration>(2 * pause_, kLongestPause);
      trying_ = false;
      try_at_ = now + pause_;
      return std::max(1, active - std::max(1, static_cast<int>(std::lround(active * share))));
    }
    if (trying_ && share <= kBusy) {  // the try held: the cores are free again
      trying_ = false;
      pause_ = kFirstPause;
    }
    if (active < most && quiet_ >= kQuietWindows && now >= try_at_) {
      trying_ = true;
      quiet_ = 0;
      return std::min(most, 2 * active);
    }
    return active;
  }

 private:
  // The run delay of the caller and the workers that run with `active` threads (-1: unknown).
  static int64_t delay_of(const State& s, int active) {
    int64_t delay = run_delay_ns(this_tid());
    for (int i = 0; i + 1 < active && delay >= 0; ++i) {
      const int64_t d = run_delay_ns(s.tids[i].load());
      delay = d < 0 ? -1 : delay + d;
    }
    return delay;
  }

  Clock::time_point window_start_{}, try_at_{};
  Clock::duration pause_ = kFirstPause;
  bool trying_ = false;
  int quiet_ = 0;
  long caller_ = 0;
  int64_t delay_ = 0;
  int measured_ = 0;
};

class Pool {
 public:
  Pool() { pthread_atfork(nullptr, nullptr, [] { instance().forget_after_fork(); }); }
  ~Pool() { stop_workers(); }

  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  int threads() {
    const int n = threads_.load(std::memory_order_acquire);
    return n > 0 ? n : start_default();
  }

  int active() {
    threads();
    return state_ == nullptr ? 1 : state_->active.load();
  }

  PoolCounts counts() const {
    return PoolCounts{regions_.load(std::memory_order_relaxed),
                      reduced_.load(std::memory_order_relaxed),
                      windows_.load(std::memory_order_relaxed),
                      busy_windows_.load(std::memory_order_relaxed)};
  }

  // A new setting (the same one again changes nothing: an adaptive pool keeps what it learnt).
  void set_threads(int threads, bool adaptive) {
    std::lock_guard<std::mutex> lock(config_);
    if (threads == threads_.load() && adaptive == adaptive_) return;
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
    if (threads != threads_.load()) {
      stop_workers();
      start(threads);
    }
    adaptive_ = adaptive;
    backoff_ = Backoff();
    set_active(threads);
    busy_.store(false, std::memory_order_release);
  }

  void run(int64_t n, int64_t per_thread, RangeFn fn, void* ctx) {
    const int most = threads();  // starts the pool on first use (before taking it)
    if (busy_.exchange(true, std::memory_order_acquire)) {  // nested, or another caller's
      fn(ctx, 0, n);
      return;
    }
    State& s = *state_;
    const int active = look(s, most);
    const int64_t parts = std::min<int64_t>({n, per_thread * active, kMostParts});
    if (active <= 1 || parts <= 1) {
      busy_.store(false, std::memory_order_release);
      fn(ctx, 0, n);
      return;
    }
    s.region = Region{n, parts, fn, ctx};
    s.done.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & kGenMask;
    s.ticket.store(make_ticket(gen_, static_cast<uint64_t>(parts)));  // seq_cst: see sleepers
    if (s.sleepers.load() > 0) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.wake.notify_all();
    }
    run_parts(s);
    const auto until = Clock::now() + kCallerSpin;
    for (int i = 0; s.done.load(std::memory_order_acquire) < parts; ++i) {
      if ((i & 63) == 63 && Clock::now() > until)
        sched_yield();
      else
        SF_PAUSE();
    }
    std::exception_ptr error;
    std::swap(error, s.error);
    busy_.store(false, std::memory_order_release);
    if (error) std::rethrow_exception(error);
  }

 private:
  // The number of threads this region runs on (the caller owns the pool): every 64 regions
  // the clock is read, and every Backoff::kWindow the run delay, which may change it.
  int look(State& s, int most) {
    int active = s.active.load(std::memory_order_relaxed);
    if ((++since_look_ & 63) == 0) {
      PoolCounts seen;
      const int chosen = backoff_.next(s, active, most, adaptive_, Clock::now(), seen);
      if (chosen != active) set_active(chosen);
      active = chosen;
      bump(windows_, seen.windows);
      bump(busy_windows_, seen.busy);
    }
    bump(regions_, 1);
    if (active < most) bump(reduced_, 1);
    return active;
  }

  // Counters only the pool's owner writes (others read them): a plain add, no locked one.
  static void bump(std::atomic<int64_t>& counter, int64_t by) {
    if (by != 0) counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }

  int start_default() {
    std::lock_guard<std::mutex> lock(config_);
    if (threads_.load() == 0) start(at::get_num_threads());
    return threads_.load();
  }

  void start(int threads) {
    threads = std::max(1, threads);
    state_ = new State(threads - 1);  // owned until stop_workers (a forked child leaks it)
    state_->active.store(threads);
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back(worker_loop, state_, i);
    threads_.store(threads, std::memory_order_release);
  }

  void set_active(int active) {
    State& s = *state_;
    std::lock_guard<std::mutex> lock(s.mu);
    s.active.store(active);
    s.wake.notify_all();
    s.park.notify_all();
  }

  void stop_workers() {
    if (state_ == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->stop.store(true);
      state_->wake.notify_all();
      state_->park.notify_all();
    }
    for (std::thread& w : workers_) w.join();
    workers_.clear();
    delete state_;
    state_ = nullptr;
    threads_.store(0);
  }

  // In a forked child the workers do not exist: start afresh on the next use (the parent's
  // thread handles and state are left behind unreleased; joining or destroying them is undefined).
  void forget_after_fork() {
    new (&workers_) std::vector<std::thread>();
    new (&config_) std::mutex();
    state_ = nullptr;
    threads_.store(0);
    busy_.store(false);
  }

  std::mutex config_;  // guards starting and stopping
  std::atomic<int> threads_{0};
  State* state_ = nullptr;
  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};  // a region runs (its caller owns everything below)
  bool adaptive_ = false;
  Backoff backoff_;
  uint64_t gen_ = 0, since_look_ = 0;
  std::atomic<int64_t> regions_{0}, reduced_{0}, windows_{0}, busy_windows_{0};  // PoolCounts
};

}  // namespace

int pool_threads() { return Pool::instance().threads(); }

int pool_active() { return Pool::instance().active(); }

void set_pool_threads(int threads, bool adaptive) {
  Pool::instance().set_threads(std::max(1, threads), adaptive);
}

PoolCounts pool_counts() { return Pool::instance().counts(); }

std::vector<int> backoff_trace(int most, const std::vector<double>& shares, double window_seconds) {
  Backoff rule;
  std::vector<int> chosen;
  int active = most;
  auto now = Clock::now();
  for (double share : shares) {
    now += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(window_seconds));
    active = rule.decide(active, most, share, now);
    chosen.push_back(active);
  }
  return chosen;
}

void pool_run(int64_t n, int64_t per_thread, RangeFn fn, void* ctx) {
  if (n <= 0) return;
  Pool::instance().run(n, std::max<int64_t>(1, per_thread), fn, ctx);
}

}  // namespace sf
