#include <cuda.h>
#include <immintrin.h>
#include <chrono>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <cstring>
#define CK(x) do { CUresult r = (x); if (r) { printf("err %d at %s\n", r, #x); exit(1);} } while(0)
using clk = std::chrono::steady_clock;
static double now_us() { return std::chrono::duration<double, std::micro>(clk::now().time_since_epoch()).count(); }
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, 4096)); char* pin; CK(cuMemHostAlloc((void**)&pin, 4096, CU_MEMHOSTALLOC_PORTABLE));
  CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)); char src[16] = {1}; char dst[16];
  for (int round = 0; round < 3; round++)
  for (int up = 1; up >= 0; up--) {
    for (int mode = 0; mode < 7; mode++) {
      if (mode >= 4 && !up && mode != 6) continue;
      std::vector<double> t;
      for (int r = 0; r < 20001; r++) {
        double a = now_us();
        if (mode == 4) { CK(cuMemcpyHtoDAsync(d, src, 16, st)); CK(cuStreamSynchronize(st)); t.push_back(now_us() - a); continue; }
        if (mode == 5) { CK(cuMemcpyHtoDAsync(d, src, 16, st)); CK(cuEventRecord(ev, st)); CK(cuEventSynchronize(ev)); t.push_back(now_us() - a); continue; }
        if (mode == 6) { if (up) CK(cuMemcpyHtoDAsync(d, src, 16, st)); else CK(cuMemcpyDtoHAsync(dst, d, 16, st)); t.push_back(now_us() - a); continue; }
        if (up) { memcpy(pin, src, 16); CK(cuMemcpyHtoDAsync(d, pin, 16, st)); } else CK(cuMemcpyDtoHAsync(pin, d, 16, st));
        if (mode == 0) { CK(cuEventRecord(ev, st)); CK(cuEventSynchronize(ev)); }
        else if (mode == 1) CK(cuStreamSynchronize(st));
        else if (mode == 2) { CUresult q; while ((q = cuStreamQuery(st)) == CUDA_ERROR_NOT_READY) _mm_pause(); CK(q); }
        else { CK(cuEventRecord(ev, st)); CUresult q; while ((q = cuEventQuery(ev)) == CUDA_ERROR_NOT_READY) _mm_pause(); CK(q); }
        if (!up) memcpy(dst, pin, 16);
        t.push_back(now_us() - a);
      }
      std::sort(t.begin(), t.end());
      const char* mn[] = {"record+event sync", "stream sync", "stream query spin", "record+event query spin", "PAGEABLE async + stream sync", "PAGEABLE async + event sync", "PAGEABLE async alone"};
      printf("round %d %s 16B %-26s median %.2f us  p10 %.2f\n", round, up ? "up" : "down", mn[mode], t[t.size()/2], t[t.size()/10]);
    }
  }
}
