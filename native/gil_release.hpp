// The GIL released around a native call, safe at interpreter exit. For the bindings files
// only (it needs Python's headers); the core in native/ stays plain C++.
//
// Python ends a daemon thread that takes the GIL back after finalization began with
// pthread_exit (Python 3.11-3.13). That unwinds the thread's stack, and unwinding out of a
// destructor (nanobind's gil_scoped_release restores the GIL in one; destructors are
// noexcept) calls std::terminate: "terminate called without an active exception", exit 134,
// from a process that was ending normally with a loader batch still being read. So a call
// returning after `prepare_exit()` (run from an atexit hook, before finalization) parks its
// thread for good instead: the process is ending, and its threads end with it.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace fastload_py {
namespace {  // one per bindings file: each module is a shared library of its own

std::atomic<bool> exiting{false};
std::thread::id exit_thread;  // the thread running the exit hooks: never parked; set first
// Threads inside a call with the GIL released, and those of them between deciding to take
// the GIL back and having it.
std::atomic<int> released{0};
std::atomic<int> returning{0};

[[noreturn]] void park_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) { released.fetch_add(1); }
  ~GilRelease() {
    returning.fetch_add(1);
    if (exiting.load() && std::this_thread::get_id() != exit_thread) {
      returning.fetch_sub(1);
      park_forever();
    }
    PyEval_RestoreThread(state_);
    returning.fetch_sub(1);
    released.fetch_sub(1);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// From here on a call that returns parks its thread. Waits (GIL released, at most
// timeout_ms) for the calls that decided to take the GIL back before the flag was seen:
// with sequentially consistent atomics, a thread either counted itself in `returning`
// before this reads it, or reads `exiting` as true afterwards.
void prepare_exit(int timeout_ms) {
  exit_thread = std::this_thread::get_id();
  exiting.store(true);
  PyThreadState* state = PyEval_SaveThread();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (returning.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  PyEval_RestoreThread(state);
  // A thread that parks keeps what its call holds (its reader, say): not a leak to report.
  if (released.load() > 0) nanobind::set_leak_warnings(false);
}

}  // namespace
}  // namespace fastload_py
