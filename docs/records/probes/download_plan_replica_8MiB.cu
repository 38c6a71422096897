// Experiment: 8 MiB device-to-host download schemes on the GPU host.
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

int main() {
  const size_t B = 8 << 20; const int REPS = 101; const size_t c = 512 << 10; const int n = B / c; const int T = 11;
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, B)); CK(cuMemsetD32(d, 0x12345678, B/4));
  char* one; CK(cuMemHostAlloc((void**)&one, B, CU_MEMHOSTALLOC_PORTABLE));
  char* slot[4]; for (int i = 0; i < 4; i++) CK(cuMemHostAlloc((void**)&slot[i], 16 << 20, CU_MEMHOSTALLOC_PORTABLE));
  std::vector<char> out(B, 1);
  CUevent ev[64]; for (int i = 0; i < 64; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
  Pool p(T);
  for (int round = 0; round < 2; round++)
  for (int slots : {1, 4}) for (int copy : {0, 1}) for (int lead_wait : {0, 1}) {
    auto host = [&](int k) -> char* { if (slots == 1) return one + k * c; int chunk = k / 4; return slot[chunk] + (k % 4) * c; };
    std::vector<double> t, last;
    for (int r = 0; r < REPS; r++) {
      std::atomic<int> ready{0};
      double a = now_us();
      for (int k = 0; k < n; k++) { CK(cuMemcpyDtoHAsync(host(k), d + k*c, c, st)); CK(cuEventRecord(ev[k], st)); }
      p.job = [&](int i) {
        if (!copy) return;
        size_t part = (c / (T+0) + 63) / 64 * 64;
        for (int k = 0; k < n; k++) { while (ready.load(std::memory_order_acquire) <= k) _mm_pause(); size_t o = i*part; if (o >= c) continue; size_t l = std::min(part, c-o); memcpy(out.data()+k*c+o, host(k)+o, l); }
      };
      p.done = 0; p.gen.fetch_add(1, std::memory_order_acq_rel);
      for (int k = 0; k < n; k++) {
        if (lead_wait) CK(cuEventSynchronize(ev[k])); else while (cuEventQuery(ev[k]) == CUDA_ERROR_NOT_READY) _mm_pause();
        ready.store(k+1, std::memory_order_release);
      }
      last.push_back(now_us() - a);
      while (p.done.load(std::memory_order_acquire) < T) _mm_pause();
      t.push_back(now_us()-a);
    }
    char buf[160]; snprintf(buf, 160, "round %d slots %d copy-out %d wait by %s (last event at %.1f us)", round, slots, copy, lead_wait ? "cuEventSynchronize" : "query spin", median(last));
    report(buf, t);
  }
  return 0;
}
