// The round trip of one cache line between two CPUs: a mark of the host's state for benchmark
// records (nvrar._C.line_round_trip_ns; benchmarks/latency_check.py prints it beside every size).
// Small-message all-reduces on one host are chains of such transfers (a flag written on one core
// and polled on another, data lines fetched from the core that wrote them), so their times follow
// it. On a 2-core AMD EPYC KVM guest (2026-12-04, latency_check's records) it took 55-150 ns at
// some times and 470-610 ns at others, each state lasting minutes.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "../common/error.h"

namespace nvrar {

// ns per round trip, one figure per rep, each the mean of `trips` round trips: a thread on cpu_a
// stores a counter into one line, a thread on cpu_b waits for it and stores it back into a second
// line, and the first waits for that (the calling thread only waits for both). Both threads are
// pinned; a CPU that cannot be taken is an error, and so is a probe that does not finish within
// `deadline_s` (a thread not scheduled: the spins never yield).
inline std::vector<double> line_round_trip_ns(int cpu_a, int cpu_b, int trips, int reps, double deadline_s) {
  NVRAR_CHECK(cpu_a >= 0 && cpu_b >= 0 && cpu_a != cpu_b && cpu_a < CPU_SETSIZE && cpu_b < CPU_SETSIZE,
              "nvrar: line_round_trip_ns needs two different CPUs, got " + std::to_string(cpu_a) + " and " +
                  std::to_string(cpu_b));
  NVRAR_CHECK(trips > 0 && reps > 0 && deadline_s > 0, "nvrar: line_round_trip_ns needs trips, reps and a deadline > 0");
  struct alignas(128) Line {
    std::atomic<int64_t> v{0};
  };
  Line ping, pong;
  std::atomic<int> failed{0};  // 1: a thread could not be pinned; 2: the deadline passed
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(deadline_s));
  const int64_t total = static_cast<int64_t>(trips) * reps;
  auto pin = [&](int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
      int none = 0;
      failed.compare_exchange_strong(none, 1);
    }
  };
  // Waits until `line` holds `want`; false once the other thread failed or the deadline passed.
  auto wait = [&](Line& line, int64_t want) {
    for (uint32_t spins = 1; line.v.load(std::memory_order_acquire) != want; ++spins) {
      if ((spins & 4095) == 0 && (failed.load(std::memory_order_relaxed) != 0 || clock::now() > deadline)) {
        int none = 0;
        failed.compare_exchange_strong(none, 2);
        return false;
      }
    }
    return true;
  };
  std::vector<double> out;
  std::thread echo([&] {
    pin(cpu_b);
    for (int64_t i = 1; i <= total && failed.load(std::memory_order_relaxed) == 0; ++i) {
      if (!wait(ping, i)) break;
      pong.v.store(i, std::memory_order_release);
    }
  });
  std::thread ask([&] {  // not the calling thread: its CPU set stays as it was
    pin(cpu_a);
    int64_t i = 0;
    for (int r = 0; r < reps && failed.load() == 0; ++r) {
      const auto t0 = clock::now();
      for (int k = 0; k < trips; ++k) {
        ++i;
        ping.v.store(i, std::memory_order_release);
        if (!wait(pong, i)) break;
      }
      if (failed.load() != 0) break;
      out.push_back(std::chrono::duration<double, std::nano>(clock::now() - t0).count() / trips);
    }
  });
  ask.join();
  echo.join();
  NVRAR_CHECK(failed.load() != 1, "nvrar: line_round_trip_ns could not pin a thread to CPU " + std::to_string(cpu_a) +
                                      " or " + std::to_string(cpu_b) + " (not in this process's CPU set?)");
  NVRAR_CHECK(failed.load() != 2, "nvrar: line_round_trip_ns did not finish within " + std::to_string(deadline_s) +
                                      " s (a thread on CPU " + std::to_string(cpu_a) + " or " + std::to_string(cpu_b) +
                                      " was not scheduled)");
  return out;
}

}  // namespace nvrar
