// The download plan of download_tensor_into at 8 MiB written raw: 16 parts of 512 KiB, each with an event.
#include "spin_pool.h"

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
