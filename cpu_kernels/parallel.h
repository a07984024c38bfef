// Work items spread over XLA's intra-op thread pool, shared by the CPU kernels.
#ifndef JAXINFER_CPU_KERNELS_PARALLEL_H_
#define JAXINFER_CPU_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Below this much work (the caller's estimate, in multiply-adds: a few microseconds) a call
// runs on the calling thread alone, since waking a pool thread costs more. Above it the items are
// spread: on an idle machine even a single-row projection (~2^19 multiply-adds) gains from the
// second core (a single-row SmolLM2 step: ~12 ms on one thread per call, ~10 ms spread).
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

// How long a caller busy-waits for its helpers before it sleeps on a condition variable.
constexpr std::chrono::microseconds kSpinWait{100};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Calls fn(i) for every i in [0, num_items). With `work` (the whole call's estimated cost)
// below kMinParallelWork, on the calling thread; above, on it and on up to (pool threads - 1)
// helper tasks scheduled on the pool, which take items from a shared counter. The caller
// never waits for a helper that has not started: XLA may run two custom calls at once, each on
// a pool thread, and if each waited for a task queued behind the other neither would finish. So
// the caller drains the items itself and then waits only for helpers that claimed one; a helper
// that starts later finds no item and leaves without touching `fn` (the state it reads is
// shared, owned by every task).
template <class Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_items, int64_t work, Fn&& fn) {
  if (work < kMinParallelWork) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};  // helpers inside the drain loop
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  using FnType = std::remove_reference_t<Fn>;
  FnType* fn_ptr = &fn;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::max<int64_t>(0, std::min(threads, num_items) - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([state, fn_ptr, num_items]() {
      state->active.fetch_add(1);
      for (int64_t i = state->next.fetch_add(1); i < num_items; i = state->next.fetch_add(1)) {
        (*fn_ptr)(i);
      }
      if (state->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    });
  }
  for (int64_t i = state->next.fetch_add(1); i < num_items; i = state->next.fetch_add(1)) fn(i);
  // Every item is claimed; wait for the helpers still working on one. That is rarely more than a
  // few microseconds, less than a sleep and wake-up on the condition variable costs (which, paid
  // by each of a single-row step's ~120 calls, was a fifth of the step), so the caller spins
  // first and sleeps only if a helper outlasts kSpinWait (a loaded machine that descheduled it).
  const auto spin_end = std::chrono::steady_clock::now() + kSpinWait;
  for (int spins = 1; state->active.load() != 0; ++spins) {
    CpuRelax();
    if (spins % 64 == 0 && std::chrono::steady_clock::now() > spin_end) {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&]() { return state->active.load() == 0; });
      break;
    }
  }
}

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_PARALLEL_H_
