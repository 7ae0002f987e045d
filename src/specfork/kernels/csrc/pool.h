// The kernels' own threads: a parallel region that never waits for a thread that is not running,
// and that uses fewer threads while other jobs keep the cores busy.
//
// OpenMP (what at::parallel_for runs on) splits a region statically and ends it at a barrier, so
// a region lasts as long as its slowest thread. When another job shares the cores, one of our
// threads is often descheduled for a whole time slice (milliseconds) and every one of a step's
// ~150 regions waits for it: decoding measured 4.9 tok/s instead of 260 on two shared cores.
//
// Here a region is cut into parts that the calling thread and the pool's workers claim one at a
// time. The caller works too, so a worker that is asleep or descheduled simply gets no part: the
// caller only ever waits for a part some worker has already started. Workers spin briefly for
// the next region (regions of one forward follow each other within microseconds), then sleep, so
// they give their cores back between forwards. A part's result never depends on which thread ran
// it, so this split keeps the kernels batch-invariant.
//
// Adaptive pools also watch how long their threads wait for a core (the kernel's run delay,
// /proc/<tid>/schedstat): when other jobs keep the cores busy, fewer of our threads run (each
// one then gets a core's share instead of time slices), and more again, tried now and then,
// once the cores are free.
#pragma once

#include <cstdint>
#include <vector>

namespace sf {

// fn(ctx, begin, end): one part of a region.
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);

// The most threads that run a region: the caller and threads - 1 workers (1 = the caller alone).
int pool_threads();

// Threads that run regions now (fewer than pool_threads() while an adaptive pool backs off).
int pool_active();

// Sets the number of threads (>= 1) and whether the pool backs off while the cores are busy.
// Waits for a region in flight to end.
void set_pool_threads(int threads, bool adaptive);

// Since the process started: regions run, and how many ran on fewer threads than the most;
// windows of ~50 ms in which the pool's running threads were measured, and how many were busy
// (the threads waited for a core more than 15% of the time: other jobs shared the cores).
struct PoolCounts {
  int64_t regions = 0, reduced = 0, windows = 0, busy = 0;
};
PoolCounts pool_counts();

// The adaptive rule alone, for tests: the thread counts a fresh pool of `most` threads chooses
// after windows `window_seconds` apart in which its threads waited for a core `shares` of the time.
std::vector<int> backoff_trace(int most, const std::vector<double>& shares, double window_seconds);

// Runs fn over [0, n), cut into min(n, per_thread * active threads) contiguous parts, each
// claimed by the first free thread. A region started while another runs (a nested region, or a
// second thread calling the kernels) runs on its calling thread alone.
void pool_run(int64_t n, int64_t per_thread, RangeFn fn, void* ctx);

}  // namespace sf
