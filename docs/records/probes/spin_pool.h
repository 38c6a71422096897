// Shared by the download probes: always-spinning worker threads, a streaming-store copy, timing.
#pragma once
#include <cuda.h>
#include <immintrin.h>
#include <atomic>
#include <thread>
#include <vector>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#define CK(x) do { CUresult r = (x); if (r) { printf("err %d at %s\n", r, #x); exit(1);} } while(0)
using clk = std::chrono::steady_clock;
static double now_us() { return std::chrono::duration<double, std::micro>(clk::now().time_since_epoch()).count(); }

struct Pool {
  int n; std::vector<std::thread> th; std::atomic<int> gen{0}; std::atomic<int> done{0};
  std::function<void(int)> job; std::atomic<bool> quit{false};
  Pool(int n): n(n) {
    for (int i = 0; i < n; i++) th.emplace_back([this, i] {
      int seen = 0;
      while (true) {
        int g; while ((g = gen.load(std::memory_order_acquire)) == seen) { if (quit) return; _mm_pause(); }
        seen = g; job(i); done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  void run(std::function<void(int)> f) { job = f; done = 0; gen.fetch_add(1, std::memory_order_acq_rel); while (done.load(std::memory_order_acquire) < n) _mm_pause(); }
  ~Pool() { quit = true; for (auto &t : th) t.join(); }
};

static void copy_nt(char* d, const char* s, size_t len) {
  size_t o = 0;
  for (; o + 64 <= len; o += 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)(s+o)), b = _mm_loadu_si128((const __m128i*)(s+o+16));
    __m128i c = _mm_loadu_si128((const __m128i*)(s+o+32)), e = _mm_loadu_si128((const __m128i*)(s+o+48));
    _mm_stream_si128((__m128i*)(d+o), a); _mm_stream_si128((__m128i*)(d+o+16), b);
    _mm_stream_si128((__m128i*)(d+o+32), c); _mm_stream_si128((__m128i*)(d+o+48), e);
  }
  _mm_sfence(); memcpy(d+o, s+o, len-o);
}

static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size()/2]; }
static void report(const char* name, std::vector<double> t) { double m = median(t); printf("%-90s %9.1f us %6.1f GiB/s\n", name, m, (8 << 20) / m / 1073.741824); fflush(stdout); }

