// Experiment: 8 MiB device-to-host download schemes on the GPU host.
#include "spin_pool.h"

int main() {
  const size_t B = 8 << 20; const int REPS = 41;
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, B)); CK(cuMemsetD32(d, 0x12345678, B/4));
  char* pin; CK(cuMemHostAlloc((void**)&pin, B, CU_MEMHOSTALLOC_PORTABLE));
  std::vector<char> out(B, 1); std::vector<char> big(512<<20, 1);
  const int MAXC = 256; CUevent ev[MAXC]; for (int i = 0; i < MAXC; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
  CUevent e0; CK(cuEventCreate(&e0, CU_EVENT_DISABLE_TIMING));
  auto evict = [&] { for (size_t i = 0; i < big.size(); i += 64) big[i]++; };
  // Raw pinned DMA + wait.
  { std::vector<double> t; for (int r = 0; r < REPS; r++) { double a = now_us(); CK(cuMemcpyDtoHAsync(pin, d, B, st)); CK(cuEventRecord(e0, st)); CK(cuEventSynchronize(e0)); t.push_back(now_us()-a);} report("raw pinned DMA + event wait", t); }
  { std::vector<double> t; for (int r = 0; r < REPS; r++) { double a = now_us(); CK(cuMemcpyDtoH(out.data(), d, B)); t.push_back(now_us()-a);} report("raw pageable cuMemcpyDtoH", t); }
  for (int T : {1, 4, 8, 12, 15}) {
    Pool p(T); char buf[128];
    auto par = [&](char* dst, const char* src, size_t len, bool nt) { size_t part = (len / T + 63) / 64 * 64; p.run([&](int i) { size_t o = i * part; if (o >= len) return; size_t l = std::min(part, len - o); if (nt) copy_nt(dst+o, src+o, l); else memcpy(dst+o, src+o, l); }); };
    { std::vector<double> t; for (int r = 0; r < REPS; r++) { double a = now_us(); par(out.data(), pin, B, false); t.push_back(now_us()-a);} snprintf(buf, 128, "T%d copy-out warm", T); report(buf, t); }
    { std::vector<double> t; for (int r = 0; r < REPS; r++) { evict(); double a = now_us(); par(out.data(), pin, B, false); t.push_back(now_us()-a);} snprintf(buf, 128, "T%d copy-out cold (evicted)", T); report(buf, t); }
    { std::vector<double> t; for (int r = 0; r < REPS; r++) { CK(cuMemcpyDtoHAsync(pin, d, B, st)); CK(cuStreamSynchronize(st)); double a = now_us(); par(out.data(), pin, B, false); t.push_back(now_us()-a);} snprintf(buf, 128, "T%d copy-out after DMA", T); report(buf, t); }
    { std::vector<double> t; for (int r = 0; r < REPS; r++) { CK(cuMemcpyDtoHAsync(pin, d, B, st)); CK(cuStreamSynchronize(st)); double a = now_us(); par(out.data(), pin, B, true); t.push_back(now_us()-a);} snprintf(buf, 128, "T%d copy-out after DMA, NT stores", T); report(buf, t); }
    if (T < 4) continue;
    for (size_t c : {64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20}) {
      int n = B / c;
      for (int mode = 0; mode < 4; mode++) {  // 0: whole chunks round-robin; 1: split each chunk over all; 2: whole, NT; 3: split, NT
        std::vector<double> t;
        for (int r = 0; r < REPS; r++) {
          std::atomic<int> ready{0};
          double a = now_us();
          for (int k = 0; k < n; k++) { CK(cuMemcpyDtoHAsync(pin + k*c, d + k*c, c, st)); CK(cuEventRecord(ev[k], st)); }
          std::thread poll; // main thread polls in order
          p.job = [&](int i) {
            if (mode % 2 == 0) {
              for (int k = i; k < n; k += T) { while (ready.load(std::memory_order_acquire) <= k) _mm_pause(); if (mode == 2) copy_nt(out.data()+k*c, pin+k*c, c); else memcpy(out.data()+k*c, pin+k*c, c); }
            } else {
              size_t part = (c / T + 63) / 64 * 64;
              for (int k = 0; k < n; k++) { while (ready.load(std::memory_order_acquire) <= k) _mm_pause(); size_t o = i*part; if (o >= c) continue; size_t l = std::min(part, c-o); if (mode == 3) copy_nt(out.data()+k*c+o, pin+k*c+o, l); else memcpy(out.data()+k*c+o, pin+k*c+o, l); }
            }
          };
          p.done = 0; p.gen.fetch_add(1, std::memory_order_acq_rel);
          for (int k = 0; k < n; k++) { while (cuEventQuery(ev[k]) == CUDA_ERROR_NOT_READY) _mm_pause(); ready.store(k+1, std::memory_order_release); }
          while (p.done.load(std::memory_order_acquire) < T) _mm_pause();
          t.push_back(now_us()-a);
        }
        const char* mn[] = {"whole", "split", "whole+NT", "split+NT"};
        snprintf(buf, 128, "T%d pipeline %zuK chunks, %s", T, c >> 10, mn[mode]); report(buf, t);
      }
    }
  }
  return 0;
}
